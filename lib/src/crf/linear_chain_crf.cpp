#include "trellis/crf/linear_chain_crf.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <limits>

#include "lib/src/crf/chain_fused.h"
#include "lib/src/crf/chain_routes.h"
#include "lib/src/io/message.h"
#include "lib/src/semiring/scaled_log_matmul.h"
#include "trellis/error.h"
#include "trellis/semiring/semiring_ops.h"
#include "cuda/chain_kernels.h"

namespace trellis {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

struct Shape {
  int64_t B, T, K;
};

at::Tensor lengths_or_full(const ChainPotentials& p, const Shape& s) {
  const auto opts = p.emissions.options().dtype(at::kLong);
  return p.lengths.defined() ? p.lengths.to(opts) : at::full({s.B}, s.T, opts);
}

// The lengths as the fused routes take them: undefined when every sequence is T long.
at::Tensor given_lengths(const ChainPotentials& p) {
  return p.lengths.defined() ? p.lengths.to(p.emissions.options().dtype(at::kLong)) : at::Tensor();
}

// [B,1] true for a sequence whose best score is -inf: no label sequence is allowed, so it has no path.
at::Tensor no_path(const at::Tensor& best_score) { return best_score.isneginf().unsqueeze(1); }

// [B,T] true where t < length.
at::Tensor position_mask(const at::Tensor& lengths, int64_t T) {
  return at::arange(T, lengths.options()).unsqueeze(0) < lengths.unsqueeze(1);
}

[[noreturn]] void first_bad_index(const at::Tensor& bad, const std::string& what, const at::Tensor& values,
                                  const std::string& range) {
  const at::Tensor where = bad.nonzero()[0].cpu();
  std::string index;
  for (int64_t d = 0; d < where.size(0); ++d) index += "[" + std::to_string(where[d].item<int64_t>()) + "]";
  at::Tensor value = values.cpu();
  for (int64_t d = 0; d < where.size(0); ++d) value = value[where[d].item<int64_t>()];
  throw Error("CRF: " + what + index + " = " + std::to_string(value.item<int64_t>()) + " is outside " + range);
}

// Validates shapes, dtypes and devices, and the values of lengths and tags (if given, and unless the caller vouched
// for them or the kernels that will run check them on the device) with a single host transfer.
Shape check(const ChainPotentials& p, const at::Tensor* tags = nullptr, bool values_checked_on_device = false) {
  const at::Tensor& e = p.emissions;
  if (!e.defined() || e.dim() != 3) throw Error("CRF: emissions must be a [B,T,K] tensor");
  if (e.scalar_type() != at::kFloat && e.scalar_type() != at::kDouble)
    throw Error("CRF: emissions must be float32 or float64");
  const Shape s{e.size(0), e.size(1), e.size(2)};
  if (s.T < 1 || s.K < 1) throw Error("CRF: emissions need T >= 1 and K >= 1");
  auto same = [&](const at::Tensor& t, const char* name, std::vector<int64_t> shape) {
    if (!t.defined()) return;
    if (t.sizes().vec() != shape)
      throw Error(std::string("CRF: ") + name + " has shape " + message::text(t.sizes()) + ", expected " +
                  message::text(shape));
    if (t.scalar_type() != e.scalar_type() || t.device() != e.device())
      throw Error(std::string("CRF: ") + name + " must have the emissions' dtype and device");
  };
  if (!p.transitions.defined()) throw Error("CRF: transitions are required");
  same(p.transitions, "transitions", {s.K, s.K});
  same(p.start, "start", {s.K});
  same(p.end, "end", {s.K});
  if (p.lengths.defined() && (p.lengths.dim() != 1 || p.lengths.size(0) != s.B))
    throw Error("CRF: lengths must be a [B] tensor");
  if (tags && (!tags->defined() || tags->sizes() != at::IntArrayRef{s.B, s.T}))
    throw Error("CRF: tags must be a [B,T] tensor matching the emissions");
  if (p.values_checked || values_checked_on_device || (!p.lengths.defined() && !tags)) return s;
  // min and max of lengths and of the tags at valid positions, in one transfer: [len_min, len_max, tag_min, tag_max].
  std::vector<at::Tensor> stats;
  at::Tensor lengths, y;
  if (p.lengths.defined()) {
    lengths = p.lengths.to(p.emissions.device(), at::kLong);
    stats.push_back(lengths.min());
    stats.push_back(lengths.max());
  } else {
    stats.push_back(at::full({}, s.T, p.emissions.options().dtype(at::kLong)));
    stats.push_back(stats.back());
  }
  if (tags) {
    y = tags->to(p.emissions.device(), at::kLong);
    if (p.lengths.defined()) y = y.masked_fill(~position_mask(lengths.clamp(0, s.T), s.T), 0);  // padding is never read
    auto [lo, hi] = at::aminmax(y);
    stats.push_back(lo);
    stats.push_back(hi);
  }
  const at::Tensor host = at::stack(stats).cpu();
  const int64_t* h = host.data_ptr<int64_t>();
  if (h[0] < 1 || h[1] > s.T)
    first_bad_index((lengths < 1) | (lengths > s.T), "lengths", lengths, "[1, " + std::to_string(s.T) + "]");
  if (tags && (h[2] < 0 || h[3] >= s.K))
    first_bad_index((y < 0) | (y >= s.K), "tags", y, "[0, " + std::to_string(s.K) + ")");
  return s;
}

at::Tensor or_zeros(const at::Tensor& t, const ChainPotentials& p, int64_t K) {
  return t.defined() ? t : at::zeros({K}, p.emissions.options());
}

// The forward recursion alpha_t = (alpha_{t-1} ⊗ W_t) ⊗ e_t, finished with ⊕_k alpha_last(k) ⊗ end(k).
// W_t is transitions, or edge[:, t-1] when per-position edge potentials [B,T-1,K,K] are given (to read edge marginals
// off their gradient). Sequences past their length carry their alpha unchanged. Optionally records every alpha_t.
template <class S>
at::Tensor chain_forward(const ChainPotentials& p, const Shape& s, const at::Tensor& edge,
                         std::vector<at::Tensor>* alphas = nullptr) {
  const at::Tensor lengths = lengths_or_full(p, s);
  const bool ragged = p.lengths.defined();
  const at::Tensor trans = p.transitions.unsqueeze(0);
  at::Tensor alpha = p.emissions.select(1, 0) + or_zeros(p.start, p, s.K);
  if (alphas) alphas->push_back(alpha);
  for (int64_t t = 1; t < s.T; ++t) {
    // Shared transitions: one [1,B,K] ⊗ [1,K,K] product per step (the batch as rows of one matrix); per-position
    // edge potentials: B products [1,K] ⊗ [K,K].
    const at::Tensor prod = edge.defined() ? semiring_matmul<S>(alpha.unsqueeze(1), edge.select(1, t - 1)).squeeze(1)
                                           : semiring_matmul<S>(alpha.unsqueeze(0), trans).squeeze(0);
    at::Tensor next = prod + p.emissions.select(1, t);
    alpha = ragged ? at::where((lengths > t).unsqueeze(1), next, alpha) : next;
    if (alphas) alphas->push_back(next);
  }
  return semiring_sum<S>(alpha + or_zeros(p.end, p, s.K), -1);
}

// The same recursion as chain_forward, fused into one autograd node.
template <class S>
at::Tensor fused_score(const ChainPotentials& p, const Shape& s) {
  return detail::fused_chain_score<S>(p.emissions, p.transitions, or_zeros(p.start, p, s.K), or_zeros(p.end, p, s.K),
                                      given_lengths(p));
}

// The whole-chain score: fused wherever the fused passes take the label count, else composed.
template <class S>
at::Tensor chain_score(const ChainPotentials& p, const Shape& s) {
  return detail::fused_chain_supported<S>(p.emissions) ? fused_score<S>(p, s) : chain_forward<S>(p, s, at::Tensor());
}

// Total score of the given labels (tags validated by check()).
at::Tensor gold_score_unchecked(const ChainPotentials& p, const Shape& s, const at::Tensor& tags) {
  const at::Tensor lengths = lengths_or_full(p, s);
  const at::Tensor mask = position_mask(lengths, s.T);
  const at::Tensor y = tags.to(lengths.options()).masked_fill(~mask, 0);
  const at::Tensor zero = at::zeros({}, p.emissions.options());
  at::Tensor score = at::where(mask, p.emissions.gather(2, y.unsqueeze(2)).squeeze(2), zero).sum(1);
  if (s.T > 1) {
    const at::Tensor trans = p.transitions.index({y.slice(1, 0, -1), y.slice(1, 1)});
    score = score + at::where(mask.slice(1, 1), trans, zero).sum(1);
  }
  if (p.start.defined()) score = score + p.start.index_select(0, y.select(1, 0));
  if (p.end.defined()) score = score + p.end.index_select(0, y.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1));
  return score;
}

// The potentials cut from any caller's graph, with the emissions a fresh leaf: what is differentiated to read off
// marginals or a best path.
ChainPotentials detached_with_emission_leaf(const ChainPotentials& p) {
  ChainPotentials q = p;
  q.emissions = p.emissions.detach().requires_grad_();
  q.transitions = p.transitions.detach();
  if (p.start.defined()) q.start = p.start.detach();
  if (p.end.defined()) q.end = p.end.detach();
  return q;
}

// The forward recursion for many labels when no gradient is wanted (likelihoods, e.g. of large HMMs): each step is
// one scaled GEMM against the transitions, scaled once (detail::scaled_log_matmul, exact for any input range).
// On CUDA with few sequences, the whole recursion runs in cuda/scaled_chain_forward.cu, which streams the scaled
// transitions once per step (a GEMM with M = B runs well below the memory's speed); with many, in the fused chain
// kernels where they take K.
at::Tensor scaled_log_partition(const ChainPotentials& p, const Shape& s) {
  const at::Tensor lengths = lengths_or_full(p, s);
  const detail::ScaledRight w = detail::scale_right(p.transitions.unsqueeze(0));
  if (p.emissions.is_cuda() && cuda::scaled_chain_supported(s.B, s.K)) {
    const at::Tensor alpha =
        cuda::scaled_chain_forward(p.emissions.contiguous(), w.original[0], w.scaled[0], w.colmax.view({s.K}),
                                   or_zeros(p.start, p, s.K).contiguous(), lengths.contiguous(),
                                   detail::underflow_threshold(p.emissions.scalar_type(), s.K));
    return semiring_sum<LogSemiring>(alpha + or_zeros(p.end, p, s.K), -1);
  }
  // Many sequences: the fused chain kernels (one launch for all steps) where they take K.
  if (p.emissions.is_cuda() && detail::fused_chain_supported<LogSemiring>(p.emissions))
    return chain_score<LogSemiring>(p, s);
  // Each step's alpha is kept minus its largest entry, the offsets summed in float64: alphas of long sequences would
  // otherwise grow to about -T, where float32 keeps only about 1e-2 absolutely.
  const auto largest = [](const at::Tensor& a) {
    const at::Tensor m = a.amax(1, true);
    return at::where(at::isfinite(m), m, at::zeros_like(m));
  };
  at::Tensor alpha = p.emissions.select(1, 0) + or_zeros(p.start, p, s.K);
  at::Tensor offset = largest(alpha);
  alpha = alpha - offset;
  offset = offset.to(at::kDouble);
  for (int64_t t = 1; t < s.T; ++t) {
    at::Tensor next = detail::scaled_log_matmul(alpha.unsqueeze(0), w).squeeze(0) + p.emissions.select(1, t);
    at::Tensor m = largest(next);
    next = next - m;
    if (p.lengths.defined()) {
      const at::Tensor live = (lengths > t).unsqueeze(1);
      next = at::where(live, next, alpha);
      m = at::where(live, m, at::zeros_like(m));
    }
    alpha = next;
    offset = offset + m.to(at::kDouble);
  }
  const at::Tensor z = semiring_sum<LogSemiring>(alpha + or_zeros(p.end, p, s.K), -1);
  return (z.to(at::kDouble) + offset.squeeze(1)).to(z.scalar_type());
}

// The float64 copy that the widened route computes on (values already checked by the caller).
ChainPotentials widened(const ChainPotentials& p) {
  ChainPotentials q = p;
  for (at::Tensor* t : {&q.emissions, &q.transitions, &q.start, &q.end})
    if (t->defined()) *t = t->to(at::kDouble);
  q.values_checked = true;
  return q;
}

using detail::ChainQuantity;
using detail::ChainRoute;

}  // namespace

at::Tensor log_partition(const ChainPotentials& p) {
  const Shape s = check(p);
  switch (detail::choose_route(ChainQuantity::kLogPartition, p)) {
    case ChainRoute::kWidened: {
      const detail::ForcedChainRoute automatic(std::nullopt);
      return log_partition(widened(p)).to(at::kFloat);
    }
    case ChainRoute::kScaledForward: return scaled_log_partition(p, s);
    case ChainRoute::kFused: return fused_score<LogSemiring>(p, s);
    default: return chain_forward<LogSemiring>(p, s, at::Tensor());
  }
}

at::Tensor gold_score(const ChainPotentials& p, const at::Tensor& tags) {
  if (detail::float32_widened_on_gpu(p)) return gold_score(widened(p), tags).to(at::kFloat);
  const Shape s = check(p, &tags);
  return gold_score_unchecked(p, s, tags);
}

// Whether the values (lengths, tags) are left to the route: the shared-memory kernels check them on the device, where
// a host check would make the host wait for the GPU to finish the work queued so far.
namespace {
bool checked_on_device(ChainRoute route, const ChainPotentials& p) {
  return route == ChainRoute::kFused && detail::shared_chain_kernels_take(p.emissions);
}
}  // namespace

at::Tensor log_likelihood(const ChainPotentials& p, const at::Tensor& tags) {
  const ChainRoute route = detail::choose_route(ChainQuantity::kLogLikelihood, p);
  const Shape s = check(p, &tags, checked_on_device(route, p));
  switch (route) {
    case ChainRoute::kWidened: {
      const detail::ForcedChainRoute automatic(std::nullopt);
      return log_likelihood(widened(p), tags).to(at::kFloat);
    }
    case ChainRoute::kFused:  // one fused node: gold score − log Z and its gradient (gold indicators − marginals)
      return detail::fused_chain_score<LogSemiring>(p.emissions, p.transitions, or_zeros(p.start, p, s.K),
                                                    or_zeros(p.end, p, s.K), given_lengths(p),
                                                    tags.to(p.emissions.device(), at::kLong));
    default: return gold_score_unchecked(p, s, tags) - log_partition(p);
  }
}

LogLikelihoodGradients log_likelihood_with_gradients(const ChainPotentials& p, const at::Tensor& tags, double divisor) {
  const ChainRoute route = detail::choose_route(ChainQuantity::kLogLikelihood, p);
  const Shape s = check(p, &tags, checked_on_device(route, p));
  if (route == ChainRoute::kWidened) {
    const detail::ForcedChainRoute automatic(std::nullopt);
    LogLikelihoodGradients g = log_likelihood_with_gradients(widened(p), tags, divisor);
    for (at::Tensor* t : {&g.log_likelihood, &g.reduced, &g.emissions, &g.transitions, &g.start, &g.end})
      if (t->defined()) *t = t->to(at::kFloat);
    return g;
  }
  const at::Tensor y = tags.to(p.emissions.device(), at::kLong);
  if (route == ChainRoute::kFused) {
    // (Not recorded by autograd: the fused passes are called directly.)
    const auto [ll, reduced, g_em, g_trans, g_start, g_end] = detail::fused_chain_score_and_gradients<LogSemiring>(
        p.emissions, p.transitions, or_zeros(p.start, p, s.K), or_zeros(p.end, p, s.K), given_lengths(p), y, divisor);
    return {ll,      reduced, g_em, g_trans, p.start.defined() ? g_start : at::Tensor(),
            p.end.defined() ? g_end : at::Tensor()};
  }
  // The composed route, through autograd.
  c10::AutoGradMode grad_on(true);
  ChainPotentials q = p;
  std::vector<at::Tensor> leaves;
  for (at::Tensor* t : {&q.emissions, &q.transitions, &q.start, &q.end})
    if (t->defined()) leaves.push_back(*t = t->detach().requires_grad_());
  q.values_checked = true;
  const at::Tensor ll = log_likelihood(q, y);
  const auto g = torch::autograd::grad({ll.sum()}, leaves, {}, /*retain_graph=*/false, /*create_graph=*/false,
                                       /*allow_unused=*/true);
  std::size_t next = 0;
  LogLikelihoodGradients out;
  out.log_likelihood = ll.detach();
  out.reduced = divisor == 1 ? out.log_likelihood.sum() : out.log_likelihood.sum().div_(divisor);
  for (auto [t, dst] : {std::pair{&p.emissions, &out.emissions}, std::pair{&p.transitions, &out.transitions},
                        std::pair{&p.start, &out.start}, std::pair{&p.end, &out.end}})
    if (t->defined()) {
      const at::Tensor& gi = g[next++];
      *dst = gi.defined() ? gi : at::zeros_like(*t);
    }
  return out;
}

at::Tensor forward_log_alphas(const ChainPotentials& p) {
  const Shape s = check(p);
  std::vector<at::Tensor> alphas;
  chain_forward<LogSemiring>(p, s, at::Tensor(), &alphas);
  const at::Tensor mask = position_mask(lengths_or_full(p, s), s.T).unsqueeze(2);
  return at::where(mask, at::stack(alphas, 1), at::zeros({}, p.emissions.options()));
}

at::Tensor backward_log_betas(const ChainPotentials& p) {
  const Shape s = check(p);
  const at::Tensor lengths = lengths_or_full(p, s);
  // beta_t = W ⊗ (e_{t+1} ⊗ beta_{t+1}), starting from the end scores at each sequence's last position.
  const at::Tensor end = or_zeros(p.end, p, s.K).expand({s.B, s.K});
  const at::Tensor trans_t = p.transitions.t().unsqueeze(0);
  std::vector<at::Tensor> betas(s.T);
  at::Tensor beta = end;
  betas[s.T - 1] = beta;
  for (int64_t t = s.T - 2; t >= 0; --t) {
    const at::Tensor next =
        semiring_matmul<LogSemiring>((p.emissions.select(1, t + 1) + beta).unsqueeze(0), trans_t).squeeze(0);
    beta = at::where((lengths > t + 1).unsqueeze(1), next, end);
    betas[t] = beta;
  }
  const at::Tensor mask = position_mask(lengths, s.T).unsqueeze(2);
  return at::where(mask, at::stack(betas, 1), at::zeros({}, p.emissions.options()));
}

Marginals marginals(const ChainPotentials& p, bool with_edges) {
  const Shape s = check(p);
  const ChainRoute route = detail::choose_route(ChainQuantity::kMarginals, p, with_edges);
  if (route == ChainRoute::kWidened) {
    const detail::ForcedChainRoute automatic(std::nullopt);
    Marginals m = marginals(widened(p), with_edges);
    for (at::Tensor* t : {&m.log_partition, &m.nodes, &m.edges})
      if (t->defined()) *t = t->to(at::kFloat);
    return m;
  }
  c10::AutoGradMode grad_on(true);
  const ChainPotentials q = detached_with_emission_leaf(p);
  // Edge marginals need per-position transitions, which only the composed recursion takes.
  at::Tensor edge;
  if (with_edges)
    edge = q.transitions.expand({s.B, std::max<int64_t>(s.T - 1, 0), s.K, s.K}).contiguous().requires_grad_();
  const at::Tensor log_z =
      route == ChainRoute::kFused ? fused_score<LogSemiring>(q, s) : chain_forward<LogSemiring>(q, s, edge);
  torch::autograd::variable_list inputs{q.emissions};
  if (with_edges) inputs.push_back(edge);
  const auto grads = torch::autograd::grad({log_z.sum()}, inputs, {}, /*retain_graph=*/false, /*create_graph=*/false,
                                           /*allow_unused=*/true);
  Marginals m;
  m.log_partition = log_z.detach();
  m.nodes = grads[0];
  if (with_edges) m.edges = grads[1].defined() ? grads[1] : at::zeros_like(edge);
  return m;
}

ViterbiResult viterbi(const ChainPotentials& p) {
  const Shape s = check(p);
  const ChainRoute route = detail::choose_route(ChainQuantity::kViterbi, p);
  if (route == ChainRoute::kWidened) {
    const detail::ForcedChainRoute automatic(std::nullopt);
    ViterbiResult v = viterbi(widened(p));
    v.score = v.score.to(at::kFloat);
    return v;
  }
  c10::NoGradGuard no_grad;
  if (route == ChainRoute::kManyLabelViterbi) {
    // The streaming max-semiring kernels rebase each step's messages as the CPU recursion does: float32 runs as it is.
    const at::Tensor lengths = lengths_or_full(p, s).contiguous();
    ViterbiResult v{at::empty({s.B, s.T}, lengths.options()), at::empty({s.B}, p.emissions.options())};
    cuda::many_label_viterbi(p.emissions.contiguous(), p.transitions.contiguous(),
                             or_zeros(p.start, p, s.K).contiguous(), or_zeros(p.end, p, s.K).contiguous(), lengths,
                             v.path, v.score);
    v.path.masked_fill_(no_path(v.score), -1);
    return v;
  }
  if (route == ChainRoute::kFused) {
    // The fused MaxSemiring recursion records each step's argmax; the backtrace follows it (on the device).
    auto [path, score] = detail::fused_viterbi(p.emissions, p.transitions, or_zeros(p.start, p, s.K),
                                               or_zeros(p.end, p, s.K), given_lengths(p));
    return {path, score};
  }
  // Otherwise the gradient of the composed MaxSemiring recursion is the indicator of one best path.
  c10::AutoGradMode grad_on(true);
  const ChainPotentials q = detached_with_emission_leaf(p);
  const at::Tensor score = chain_forward<MaxSemiring>(q, s, at::Tensor());
  const at::Tensor onehot = torch::autograd::grad({score.sum()}, {q.emissions})[0];
  const at::Tensor mask = position_mask(lengths_or_full(p, s), s.T);
  return {onehot.argmax(2).masked_fill(~mask | no_path(score), -1), score.detach()};
}

namespace {

// One of the k best partial paths ending in a label: its score and where it came from.
template <class T>
struct Ranked {
  T score;
  int64_t prev_label, prev_rank;
};

// Per sequence: for every position and label, the k best partial paths (sorted), then the k best ends, then the
// backtrace of each. O(T·K²·k log k) per sequence.
template <class T>
void kbest_cpu(const at::Tensor& em, const at::Tensor& trans, const at::Tensor& start, const at::Tensor& end,
               const at::Tensor& lengths, int64_t k, at::Tensor& paths, at::Tensor& scores) {
  const int64_t B = em.size(0), K = em.size(2);
  const auto E = em.accessor<T, 3>();
  const auto W = trans.accessor<T, 2>();
  const auto St = start.accessor<T, 1>(), En = end.accessor<T, 1>();
  const auto L = lengths.accessor<int64_t, 1>();
  auto P = paths.accessor<int64_t, 3>();
  auto S = scores.accessor<T, 2>();
  const auto better = [](const Ranked<T>& a, const Ranked<T>& b) {
    if (a.score != b.score) return a.score > b.score;
    return a.prev_label != b.prev_label ? a.prev_label < b.prev_label : a.prev_rank < b.prev_rank;
  };
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<Ranked<T>> candidates;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t len = L[b];
      std::vector<std::vector<std::vector<Ranked<T>>>> best(len, std::vector<std::vector<Ranked<T>>>(K));
      for (int64_t j = 0; j < K; ++j) best[0][j] = {{St[j] + E[b][0][j], -1, -1}};
      for (int64_t t = 1; t < len; ++t)
        for (int64_t j = 0; j < K; ++j) {
          candidates.clear();
          for (int64_t i = 0; i < K; ++i)
            for (std::size_t r = 0; r < best[t - 1][i].size(); ++r)
              candidates.push_back({best[t - 1][i][r].score + W[i][j] + E[b][t][j], i, static_cast<int64_t>(r)});
          const auto keep = std::min<std::size_t>(k, candidates.size());
          std::partial_sort(candidates.begin(), candidates.begin() + keep, candidates.end(), better);
          best[t][j].assign(candidates.begin(), candidates.begin() + keep);
        }
      candidates.clear();
      for (int64_t j = 0; j < K; ++j)
        for (std::size_t r = 0; r < best[len - 1][j].size(); ++r)
          candidates.push_back({best[len - 1][j][r].score + En[j], j, static_cast<int64_t>(r)});
      const auto keep = std::min<std::size_t>(k, candidates.size());
      std::partial_sort(candidates.begin(), candidates.begin() + keep, candidates.end(), better);
      for (std::size_t n = 0; n < keep; ++n) {
        S[b][n] = candidates[n].score;
        int64_t label = candidates[n].prev_label, rank = candidates[n].prev_rank;
        for (int64_t t = len - 1; t >= 0; --t) {
          P[b][n][t] = label;
          const Ranked<T>& at = best[t][label][rank];
          label = at.prev_label;
          rank = at.prev_rank;
        }
      }
    }
  });
}

}  // namespace

KBestResult kbest_viterbi(const ChainPotentials& p, int64_t k) {
  const Shape s = check(p);
  if (k < 1) throw Error("kbest_viterbi: k must be at least 1, got " + std::to_string(k));
  c10::NoGradGuard no_grad;
  const auto cpu = [](const at::Tensor& t) { return t.detach().cpu().contiguous(); };
  const at::Tensor em = cpu(p.emissions), trans = cpu(p.transitions), start = cpu(or_zeros(p.start, p, s.K)),
                   end = cpu(or_zeros(p.end, p, s.K)), lengths = cpu(lengths_or_full(p, s));
  KBestResult r{at::full({s.B, k, s.T}, -1, at::kLong), at::full({s.B, k}, kNegInf, em.options())};
  AT_DISPATCH_FLOATING_TYPES(em.scalar_type(), "kbest_viterbi",
                             [&] { kbest_cpu<scalar_t>(em, trans, start, end, lengths, k, r.paths, r.scores); });
  // A path through a forbidden transition scores -inf: it is not one of the allowed sequences.
  r.paths.masked_fill_(r.scores.isinf().unsqueeze(2), -1);
  return r;
}

at::Tensor viterbi_score(const ChainPotentials& p) {
  if (detail::float32_widened_on_gpu(p)) return viterbi_score(widened(p)).to(at::kFloat);
  const Shape s = check(p);
  return chain_score<MaxSemiring>(p, s);
}

ChainPotentials constrain(const ChainPotentials& p, const TransitionConstraints& c) {
  const Shape s = check(p);
  auto mask_out = [&](const at::Tensor& scores, const at::Tensor& allowed, const char* name,
                      std::vector<int64_t> shape) {
    if (!allowed.defined()) return scores;
    if (allowed.sizes().vec() != shape || allowed.scalar_type() != at::kBool)
      throw Error(std::string("constrain: ") + name + " must be a bool tensor of shape " + message::text(shape));
    const at::Tensor base = scores.defined() ? scores : at::zeros(shape, p.emissions.options());
    return base.masked_fill(~allowed.to(base.device()), kNegInf);
  };
  ChainPotentials q = p;
  q.transitions = mask_out(p.transitions, c.transitions, "transitions", {s.K, s.K});
  q.start = mask_out(p.start, c.start, "start", {s.K});
  q.end = mask_out(p.end, c.end, "end", {s.K});
  return q;
}

}  // namespace trellis
