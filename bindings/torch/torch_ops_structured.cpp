// Structured-prediction operators for PyTorch, in libtrellis_ops beside the head's (torch_ops.cpp): semiring matrix
// products, linear-chain CRFs and HMMs. Every operator has CPU and CUDA kernels (the library's functions), a Meta
// kernel (shapes and dtypes only, with symbolic sizes, for torch.compile's fake tensors) and an Autograd kernel; the
// differentiable ones take their gradients from backward operators of their own, called through the dispatcher, so a
// compiled graph holds the backward whole.
//
//   log_matmul(Tensor a, Tensor b) -> Tensor
//   max_matmul(Tensor a, Tensor b) -> Tensor
//       C[..., i, j] = ⊕_k a[..., i, k] ⊗ b[..., k, j] for a [..., M, K] and b [..., K, N], the batch dimensions
//       broadcast (torch.matmul's rule; both at least 2-d): ⊕ = log-sum-exp or max, ⊗ = +. Exact (no exp of
//       unshifted values, -inf rows give -inf and a zero gradient); genbmm's logbmm and maxbmm. Gradients w.r.t. a and
//       b: softmax weights for log_matmul, routed to the argmax for max_matmul (_semiring_matmul_backward).
//   crf_log_partition(Tensor emissions, Tensor transitions, Tensor? start, Tensor? end, Tensor? mask, Tensor? lengths,
//                     bool batch_first=True, Tensor? allowed=None, Tensor? allowed_start=None,
//                     Tensor? allowed_end=None) -> Tensor                                     log Z [B]
//   crf_log_likelihood(Tensor emissions, Tensor tags, Tensor transitions, Tensor? start, Tensor? end, Tensor? mask,
//                      Tensor? lengths, bool batch_first=True, str reduction="none") -> Tensor
//       gold score − log Z [B], or its sum, batch mean or mean per token ("sum", "mean", "token_mean": a scalar).
//       Both differentiable w.r.t. emissions, transitions, start and end (_crf_score_backward). A reduced
//       log-likelihood of long chains of eager tensors goes through the library's own autograd (the backward kernels
//       run in the backward pass and read the upstream gradient on the device); of short chains, or traced
//       (torch.compile), it forms its gradients in the forward pass (_crf_score_and_gradients: one pass of the
//       library's chain forward and backward, whose last launch also writes the reduction) and its backward only
//       scales them (eager CUDA tensors: all in one launch, scaled_gradients.cu); unreduced, the backward forms the
//       score again.
//   crf_marginals(Tensor emissions, Tensor transitions, Tensor? start, Tensor? end, Tensor? mask, Tensor? lengths,
//                 bool batch_first=True, bool edges=False, Tensor? allowed=None, Tensor? allowed_start=None,
//                 Tensor? allowed_end=None) -> (Tensor, Tensor)
//       nodes [B,T,K] P(y_t = k); edges [B,T-1,K,K] P(y_t = i, y_{t+1} = j) when edges=True, else an empty tensor;
//       zero at padding.
//   crf_viterbi(Tensor emissions, Tensor transitions, Tensor? start, Tensor? end, Tensor? mask, Tensor? lengths,
//               bool batch_first=True, Tensor? allowed=None, Tensor? allowed_start=None,
//               Tensor? allowed_end=None) -> (Tensor, Tensor)
//       paths [B,T] int64 (-1 at padding) and their scores [B] (-inf where no label sequence is allowed).
//   crf_kbest(Tensor emissions, Tensor transitions, Tensor? start, Tensor? end, Tensor? mask, Tensor? lengths, int k,
//             bool batch_first=True, Tensor? allowed=None, Tensor? allowed_start=None,
//             Tensor? allowed_end=None) -> (Tensor, Tensor)
//       the k best paths [B,k,T] (best first, -1 at padding and for ranks beyond the sequences that exist or are
//       allowed) and scores [B,k] (-inf there); computed on the CPU, returned on the emissions' device.
//   hmm_log_likelihood(Tensor observations, Tensor log_start, Tensor log_transitions, Tensor? log_emissions=None,
//                      Tensor? means=None, Tensor? variances=None, Tensor? mask=None, Tensor? lengths=None,
//                      bool batch_first=True) -> Tensor                                       log P(o) [B]
//   hmm_posteriors(<the same arguments>) -> Tensor                                            P(s_t = k | o) [B,T,K]
//   hmm_viterbi(<the same arguments>) -> (Tensor, Tensor)          states [B,T] int64 (-1 at padding), log P(o, s) [B]
//       An HMM as trellis/hmm/hmm.h holds one, in log space: log_start [K], log_transitions [K,K] (row i: from state
//       i), and either log_emissions [K,V] with integer symbol ids observations [B,T] (categorical), or means and
//       variances [K,F] with float observations [B,T,F] (diagonal Gaussian). hmm_log_likelihood is differentiable
//       w.r.t. the parameters and Gaussian observations (_hmm_log_likelihood_backward).
//
// Conventions (trellis/crf/chain_inputs.h): batch_first=False means emissions [T,B,K], masks, tags, observations and
// every per-position result time-first: nodes [T,B,K], edges [T-1,B,K,K], paths [T,B], k-best paths [T,B,k], posteriors
// [T,B,K]. Masks are bool or uint8, right-padded, exclusive with lengths [B]. Emissions and parameters may be float16,
// bfloat16, float32 or float64, mixed: the computation and its scores are float64 when any input is, else float32.
// Gradients come back in each input's own dtype. Bad inputs are trellis::Error exceptions (RuntimeError in Python)
// whose message names the operator and the input at fault.
#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <limits>
#include <string>
#include <vector>

#include "trellis/crf/chain_inputs.h"
#include "trellis/error.h"
#include "trellis/hmm/hmm.h"
#include "trellis/crf/linear_chain_crf.h"
#include "trellis/semiring/semiring_ops.h"

#ifdef TRELLIS_OPS_CUDA
#include "bindings/torch/scaled_gradients.h"
#endif

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<at::Tensor>;
using Tensors2 = std::tuple<at::Tensor, at::Tensor>;
using Tensors4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Tensors5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Tensors6 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

at::Tensor get(const OptionalTensor& t) { return t.value_or(at::Tensor()); }
OptionalTensor optional(const at::Tensor& t) { return t.defined() ? OptionalTensor(t) : std::nullopt; }

// A gradient as the Meta kernels describe it, contiguous from the start of its own storage: the library's autograd may
// hand back a view into a buffer of its own (a CUDA kernel's packed gradients).
at::Tensor fresh(const at::Tensor& g) {
  return g.is_contiguous() && g.storage_offset() == 0 ? g : g.clone(at::MemoryFormat::Contiguous);
}

// A schema cannot return an undefined tensor: "none" is an empty one.
at::Tensor none(const at::Tensor& like) { return at::empty({0}, like.options()); }

// Gradients of Σ grad·value w.r.t. each leaf that requires grad (zeros where value does not depend on it); undefined
// for the other leaves. Each gradient has its leaf's dtype and shape, and is contiguous.
std::vector<at::Tensor> vector_jacobian(const at::Tensor& value, const at::Tensor& grad,
                                        const std::vector<at::Tensor>& leaves) {
  std::vector<at::Tensor> inputs, out(leaves.size());
  std::vector<std::size_t> index;
  for (std::size_t i = 0; i < leaves.size(); ++i)
    if (leaves[i].defined() && leaves[i].requires_grad()) {
      inputs.push_back(leaves[i]);
      index.push_back(i);
    }
  std::vector<at::Tensor> grads(inputs.size());
  if (!inputs.empty() && value.requires_grad())
    grads = torch::autograd::grad({value}, inputs, {grad.to(value.scalar_type())}, /*retain_graph=*/false,
                                  /*create_graph=*/false, /*allow_unused=*/true);
  for (std::size_t j = 0; j < inputs.size(); ++j) {
    at::Tensor g = grads[j].defined() ? grads[j].contiguous() : at::zeros_like(inputs[j], at::MemoryFormat::Contiguous);
    // The fused CUDA backward hands out several gradients as views of one buffer; an operator's outputs may not alias.
    for (std::size_t k = 0; k < j; ++k)
      if (g.is_alias_of(out[index[k]])) g = g.clone();
    out[index[j]] = g;
  }
  return out;
}

// A leaf for a backward operator's recomputation: the input cut from any graph, requiring grad where wanted.
at::Tensor leaf(const at::Tensor& t, bool wanted) {
  if (!t.defined()) return t;
  at::Tensor l = t.detach();
  if (wanted) l.requires_grad_(true);
  return l;
}

bool wants_grad(const at::Tensor& t) { return c10::GradMode::is_enabled() && t.defined() && t.requires_grad(); }
bool wants_grad(const OptionalTensor& t) { return t && wants_grad(*t); }

// Which of four inputs want a gradient, as one number for an autograd context's saved data.
int64_t want_bits(const std::array<bool, 4>& want) {
  return int64_t(want[0]) | int64_t(want[1]) << 1 | int64_t(want[2]) << 2 | int64_t(want[3]) << 3;
}
std::array<bool, 4> wanted_of(int64_t bits) {
  return {(bits & 1) != 0, (bits & 2) != 0, (bits & 4) != 0, (bits & 8) != 0};
}

template <class Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// ---- semiring matrix products ----

std::string shape(const at::Tensor& t) { return trellis::shape_string(t.sizes()); }

void check_matmul_operands(const at::Tensor& a, const at::Tensor& b, const char* what) {
  if (a.dim() < 2 || b.dim() < 2)
    throw trellis::Error(std::string(what) + ": expected a [..., M, K] and b [..., K, N] (at least 2-d), got shapes " +
                         shape(a) + " and " + shape(b));
  if (a.device() != b.device())
    throw trellis::Error(std::string(what) + ": a is on " + a.device().str() + ", b on " + b.device().str());
}

// The broadcast batch shape of a [..., M, K] and b [..., K, N].
std::vector<int64_t> matmul_batch(const at::Tensor& a, const at::Tensor& b, const char* what) {
  const at::IntArrayRef x = a.sizes().slice(0, a.dim() - 2), y = b.sizes().slice(0, b.dim() - 2);
  const std::size_t n = std::max(x.size(), y.size());
  std::vector<int64_t> batch(n);
  for (std::size_t i = 0; i < n; ++i) {
    const int64_t p = i + x.size() >= n ? x[i + x.size() - n] : 1, q = i + y.size() >= n ? y[i + y.size() - n] : 1;
    if (p != q && p != 1 && q != 1)
      throw trellis::Error(std::string(what) + ": batch dimensions of a " + shape(a) + " and b " + shape(b) +
                           " do not broadcast");
    batch[i] = p == 1 ? q : p;
  }
  return batch;
}

template <class S>
at::Tensor semiring_matmul_broadcast(const at::Tensor& a, const at::Tensor& b, const char* what) {
  check_matmul_operands(a, b, what);
  const at::ScalarType type = trellis::chain_compute_type({{"a", a}, {"b", b}}, what);
  const int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  if (b.size(-2) != K)
    throw trellis::Error(std::string(what) + ": inner sizes differ: a " + shape(a) + " has K = " + std::to_string(K) +
                         ", b " + shape(b) + " has K = " + std::to_string(b.size(-2)));
  const std::vector<int64_t> batch = matmul_batch(a, b, what);
  std::vector<int64_t> out = batch;
  out.push_back(M);
  out.push_back(N);
  const at::TensorOptions options = a.options().dtype(type);
  if (c10::multiply_integers(out) == 0) return at::empty(out, options);
  // ⊕ over nothing is the semiring's zero, -inf for both.
  if (K == 0) return at::full(out, -std::numeric_limits<double>::infinity(), options);
  // The library's product takes [batch or 1, rows, cols]: an operand whose batch is a single matrix stays one.
  const auto flat = [&](const at::Tensor& x, int64_t rows, int64_t cols) {
    std::vector<int64_t> expanded = batch;
    expanded.push_back(rows);
    expanded.push_back(cols);
    const bool single = x.numel() == rows * cols;
    return (single ? x.reshape({1, rows, cols}) : x.expand(expanded).reshape({-1, rows, cols})).to(type);
  };
  return trellis::semiring_matmul<S>(flat(a, M, K), flat(b, K, N)).reshape(out);
}

at::Tensor log_matmul(const at::Tensor& a, const at::Tensor& b) {
  return semiring_matmul_broadcast<trellis::LogSemiring>(a, b, "trellis::log_matmul");
}
at::Tensor max_matmul(const at::Tensor& a, const at::Tensor& b) {
  return semiring_matmul_broadcast<trellis::MaxSemiring>(a, b, "trellis::max_matmul");
}

// Gradients w.r.t. (a, b) of Σ grad·C, by the library's autograd on the product formed again. An entry of C that is
// -inf stays -inf whatever a and b do nearby: its gradient is zero (the max semiring would route it to an argmax).
Tensors2 semiring_matmul_backward(const at::Tensor& grad, const at::Tensor& a, const at::Tensor& b, bool max,
                                  std::array<bool, 2> want) {
  const trellis::AutogradScope scope;
  c10::AutoGradMode grad_on(true);
  const at::Tensor la = leaf(a, want[0]), lb = leaf(b, want[1]);
  const at::Tensor c = max ? max_matmul(la, lb) : log_matmul(la, lb);
  const at::Tensor nowhere = c.detach() == -std::numeric_limits<double>::infinity();
  const auto g = vector_jacobian(c, grad.masked_fill(nowhere, 0), {la, lb});
  return {want[0] ? g[0] : none(a), want[1] ? g[1] : none(b)};
}

at::Tensor semiring_matmul_meta(const at::Tensor& a, const at::Tensor& b) {
  check_matmul_operands(a, b, "trellis::semiring_matmul");
  const at::ScalarType type = trellis::chain_compute_type({{"a", a}, {"b", b}}, "trellis::semiring_matmul");
  c10::SymDimVector out =
      at::infer_size_symdimvector(a.sym_sizes().slice(0, a.dim() - 2), b.sym_sizes().slice(0, b.dim() - 2));
  out.push_back(a.sym_size(-2));
  out.push_back(b.sym_size(-1));
  return at::empty_symint(out, a.options().dtype(type));
}

Tensors2 semiring_matmul_backward_meta(const at::Tensor&, const at::Tensor& a, const at::Tensor& b, bool,
                                       std::array<bool, 2> want) {
  return {want[0] ? at::empty_symint(a.sym_sizes(), a.options()) : none(a),
          want[1] ? at::empty_symint(b.sym_sizes(), b.options()) : none(b)};
}

template <bool kMax>
struct SemiringMatmulFunction : torch::autograd::Function<SemiringMatmulFunction<kMax>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b, std::array<bool, 2> want) {
    static const auto op = find<decltype(log_matmul)>(kMax ? "trellis::max_matmul" : "trellis::log_matmul");
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({a, b});
    ctx->saved_data["want_a"] = want[0];
    ctx->saved_data["want_b"] = want[1];
    return op.call(a, b);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    static const auto op = find<decltype(semiring_matmul_backward)>("trellis::_semiring_matmul_backward");
    const auto s = ctx->get_saved_variables();
    const std::array<bool, 2> want = {ctx->saved_data.at("want_a").toBool(), ctx->saved_data.at("want_b").toBool()};
    auto [ga, gb] = op.call(grad[0], s[0], s[1], kMax, want);
    return {want[0] ? ga : at::Tensor(), want[1] ? gb : at::Tensor(), at::Tensor()};
  }
};

at::Tensor log_matmul_autograd(const at::Tensor& a, const at::Tensor& b) {
  return SemiringMatmulFunction<false>::apply(a, b, std::array<bool, 2>{wants_grad(a), wants_grad(b)});
}
at::Tensor max_matmul_autograd(const at::Tensor& a, const at::Tensor& b) {
  return SemiringMatmulFunction<true>::apply(a, b, std::array<bool, 2>{wants_grad(a), wants_grad(b)});
}

// ---- linear-chain CRF ----

using Allowed = std::array<OptionalTensor, 3>;  // allowed, allowed_start, allowed_end

trellis::ChainInputs chain_inputs(const at::Tensor& emissions, const at::Tensor& transitions,
                                  const OptionalTensor& start, const OptionalTensor& end, const OptionalTensor& mask,
                                  const OptionalTensor& lengths, bool batch_first) {
  return {emissions, transitions, get(start), get(end), get(mask), get(lengths), batch_first};
}

// The potentials with the allowed-transition masks applied (forbidden scores -inf).
trellis::ChainPotentials potentials(const trellis::ChainInputs& in, const Allowed& allowed, const char* what) {
  trellis::ChainPotentials p = trellis::chain_potentials(in, what);
  const trellis::TransitionConstraints c = trellis::allowed_constraints(
      get(allowed[0]), get(allowed[1]), get(allowed[2]), p.emissions.size(2), p.emissions.device(), what);
  return trellis::any_constraint(c) ? trellis::constrain(p, c) : p;
}

// log Z (tags undefined, constrained by `allowed`) or the log-likelihood of tags.
at::Tensor crf_score(const trellis::ChainInputs& in, const at::Tensor& tags, const Allowed& allowed) {
  if (!tags.defined()) return trellis::batch_log_partition(potentials(in, allowed, "trellis::crf_log_partition"));
  const char* what = "trellis::crf_log_likelihood";
  const trellis::ChainPotentials p = trellis::chain_potentials(in, what);
  return trellis::batch_log_likelihood(p, trellis::batch_first_tags(tags, in, what));
}

at::Tensor crf_log_partition(const at::Tensor& emissions, const at::Tensor& transitions, const OptionalTensor& start,
                             const OptionalTensor& end, const OptionalTensor& mask, const OptionalTensor& lengths,
                             bool batch_first, const OptionalTensor& allowed, const OptionalTensor& allowed_start,
                             const OptionalTensor& allowed_end) {
  return crf_score(chain_inputs(emissions, transitions, start, end, mask, lengths, batch_first), {},
                   {allowed, allowed_start, allowed_end});
}

// What a reduction divides the sum of the [B] scores by: 1 ("sum"), B ("mean"), the tokens ("token_mean": the mask's or
// the lengths' count, else B·T).
enum class Reduction { none, sum, mean, token_mean };

const char* reduction_name(Reduction r) {
  switch (r) {
    case Reduction::sum: return "sum";
    case Reduction::mean: return "mean";
    case Reduction::token_mean: return "token_mean";
    default: return "none";
  }
}

Reduction reduction_of(c10::string_view name, const char* what) {
  if (name == "none") return Reduction::none;
  if (name == "sum") return Reduction::sum;
  if (name == "mean") return Reduction::mean;
  if (name == "token_mean") return Reduction::token_mean;
  throw trellis::Error(std::string(what) + ": reduction must be none, sum, mean or token_mean, got '" +
                       std::string(name) + "'");
}

at::Tensor reduction_divisor(Reduction r, const at::Tensor& score, const at::Tensor& emissions,
                             const OptionalTensor& mask, const OptionalTensor& lengths) {
  const at::TensorOptions o = score.options();
  switch (r) {
    case Reduction::mean: return at::scalar_tensor(static_cast<double>(score.size(0)), o);
    case Reduction::token_mean:
      if (lengths) return lengths->sum().to(o);
      if (mask) return mask->sum().to(o);
      return at::scalar_tensor(static_cast<double>(emissions.size(0) * emissions.size(1)), o);
    default: return at::scalar_tensor(1.0, o);
  }
}

// The divisor where the host knows it (sum; mean: B; token_mean without a mask or lengths: B·T), so that dividing takes
// no tensor of its own; nullopt where it is a count on the device.
std::optional<double> constant_divisor(Reduction r, int64_t batch, const at::Tensor& emissions,
                                       const OptionalTensor& mask, const OptionalTensor& lengths) {
  switch (r) {
    case Reduction::sum: return 1.0;
    case Reduction::mean: return static_cast<double>(batch);
    case Reduction::token_mean:
      if (mask || lengths) return std::nullopt;
      return static_cast<double>(emissions.size(0) * emissions.size(1));
    default: return std::nullopt;
  }
}

// The reduction of the scores [B]: one kernel for a sum, two for a mean.
at::Tensor reduced(Reduction r, const at::Tensor& score, const at::Tensor& emissions, const OptionalTensor& mask,
                   const OptionalTensor& lengths) {
  const std::optional<double> count = constant_divisor(r, score.size(0), emissions, mask, lengths);
  if (!count) return score.sum() / reduction_divisor(r, score, emissions, mask, lengths);
  return *count == 1 ? score.sum() : score.sum().div_(*count);
}

at::Tensor crf_log_likelihood(const at::Tensor& emissions, const at::Tensor& tags, const at::Tensor& transitions,
                              const OptionalTensor& start, const OptionalTensor& end, const OptionalTensor& mask,
                              const OptionalTensor& lengths, bool batch_first, c10::string_view reduction) {
  const Reduction r = reduction_of(reduction, "trellis::crf_log_likelihood");
  const at::Tensor score =
      crf_score(chain_inputs(emissions, transitions, start, end, mask, lengths, batch_first), tags, {});
  return r == Reduction::none ? score : reduced(r, score, emissions, mask, lengths);
}

// The score (crf_score) and its gradients w.r.t. (emissions, transitions, start, end) of Σ grad·score (grad undefined:
// Σ score), through the library's own autograd (its fused chain kernels). With tags and a divisor (grad undefined),
// the first result is the score's sum divided by it, as the library's last launch writes it, instead of the score.
std::pair<at::Tensor, Tensors4> score_and_gradients(const at::Tensor& grad, const at::Tensor& emissions,
                                                    const OptionalTensor& tags, const at::Tensor& transitions,
                                                    const OptionalTensor& start, const OptionalTensor& end,
                                                    const OptionalTensor& mask, const OptionalTensor& lengths,
                                                    bool batch_first, const Allowed& allowed, std::array<bool, 4> want,
                                                    std::optional<double> divisor = std::nullopt) {
  const trellis::AutogradScope scope;
  if (tags && !grad.defined() && emissions.dim() == 3 && emissions.size(batch_first ? 0 : 1) > 0) {
    // The log-likelihood and the gradients of its sum: the library's forward and backward passes, no graph.
    const char* what = "trellis::crf_log_likelihood";
    const trellis::ChainInputs in{emissions, transitions, get(start), get(end), get(mask), get(lengths), batch_first};
    const trellis::LogLikelihoodGradients r = trellis::log_likelihood_with_gradients(
        scope.usable(trellis::chain_potentials(in, what)), trellis::batch_first_tags(*tags, in, what),
        divisor.value_or(1.0));
    const auto as_input = [&](std::size_t i, const at::Tensor& g, const at::Tensor& input) {
      return want[i] && g.defined() ? fresh(g.to(input.scalar_type())) : none(emissions);
    };
    return {divisor ? r.reduced : r.log_likelihood,
            {as_input(0, batch_first ? r.emissions : r.emissions.transpose(0, 1), emissions),
             as_input(1, r.transitions, transitions), as_input(2, r.start, get(start)), as_input(3, r.end, get(end))}};
  }
  c10::AutoGradMode grad_on(true);
  const std::vector<at::Tensor> leaves = {leaf(emissions, want[0]), leaf(transitions, want[1]),
                                          leaf(get(start), want[2]), leaf(get(end), want[3])};
  const trellis::ChainInputs in{leaves[0], leaves[1], leaves[2], leaves[3], get(mask), get(lengths), batch_first};
  const at::Tensor score = crf_score(in, get(tags), allowed);
  const auto g = vector_jacobian(score, grad.defined() ? grad : at::ones_like(score), leaves);
  const auto pick = [&](std::size_t i) { return want[i] && g[i].defined() ? fresh(g[i]) : none(emissions); };
  const at::Tensor value = score.detach();
  return {divisor ? (*divisor == 1 ? value.sum() : value.sum().div_(*divisor)) : value,
          {pick(0), pick(1), pick(2), pick(3)}};
}

// Gradients of Σ grad·score: the score formed again.
Tensors4 crf_score_backward(const at::Tensor& grad, const at::Tensor& emissions, const OptionalTensor& tags,
                            const at::Tensor& transitions, const OptionalTensor& start, const OptionalTensor& end,
                            const OptionalTensor& mask, const OptionalTensor& lengths, bool batch_first,
                            const OptionalTensor& allowed, const OptionalTensor& allowed_start,
                            const OptionalTensor& allowed_end, std::array<bool, 4> want) {
  return score_and_gradients(grad, emissions, tags, transitions, start, end, mask, lengths, batch_first,
                             {allowed, allowed_start, allowed_end}, want)
      .second;
}

// The score [B] or its reduction, and the gradients of its sum, in one pass.
Tensors5 crf_score_and_gradients(const at::Tensor& emissions, const OptionalTensor& tags, const at::Tensor& transitions,
                                 const OptionalTensor& start, const OptionalTensor& end, const OptionalTensor& mask,
                                 const OptionalTensor& lengths, bool batch_first, const OptionalTensor& allowed,
                                 const OptionalTensor& allowed_start, const OptionalTensor& allowed_end,
                                 std::array<bool, 4> want, c10::string_view reduction) {
  const Reduction r = reduction_of(reduction, "trellis::_crf_score_and_gradients");
  const int64_t batch = emissions.dim() == 3 ? emissions.size(batch_first ? 0 : 1) : 0;
  const std::optional<double> count =
      r == Reduction::none ? std::nullopt : constant_divisor(r, batch, emissions, mask, lengths);
  auto [score, g] = score_and_gradients({}, emissions, tags, transitions, start, end, mask, lengths, batch_first,
                                        {allowed, allowed_start, allowed_end}, want, count);
  // A count on the device (token_mean with a mask or lengths) divides the sum here.
  if (r != Reduction::none && !count) score = score.sum() / reduction_divisor(r, score, emissions, mask, lengths);
  return std::tuple_cat(std::make_tuple(score), g);
}

Tensors2 crf_marginals(const at::Tensor& emissions, const at::Tensor& transitions, const OptionalTensor& start,
                       const OptionalTensor& end, const OptionalTensor& mask, const OptionalTensor& lengths,
                       bool batch_first, bool edges, const OptionalTensor& allowed, const OptionalTensor& allowed_start,
                       const OptionalTensor& allowed_end) {
  const trellis::AutogradScope scope;
  const trellis::ChainPotentials p =
      scope.usable(potentials(chain_inputs(emissions, transitions, start, end, mask, lengths, batch_first),
                              {allowed, allowed_start, allowed_end}, "trellis::crf_marginals"));
  const trellis::Marginals m = trellis::caller_layout(trellis::batch_marginals(p, edges), batch_first);
  return {m.nodes, edges ? m.edges : none(m.nodes)};
}

Tensors2 crf_viterbi(const at::Tensor& emissions, const at::Tensor& transitions, const OptionalTensor& start,
                     const OptionalTensor& end, const OptionalTensor& mask, const OptionalTensor& lengths,
                     bool batch_first, const OptionalTensor& allowed, const OptionalTensor& allowed_start,
                     const OptionalTensor& allowed_end) {
  const trellis::AutogradScope scope;
  const trellis::ChainPotentials p =
      scope.usable(potentials(chain_inputs(emissions, transitions, start, end, mask, lengths, batch_first),
                              {allowed, allowed_start, allowed_end}, "trellis::crf_viterbi"));
  const trellis::ViterbiResult r = trellis::caller_layout(trellis::batch_viterbi(p), batch_first);
  return {r.path, r.score};
}

// A mask's lengths and validity flags (trellis::summarize_mask), for trellis.CRF: it checks the flags once the call
// the mask is for is queued.
Tensors2 crf_mask_lengths(const at::Tensor& mask, bool batch_first) {
  if (mask.dim() != 2)
    throw trellis::Error("trellis::_crf_mask_lengths: mask must be [B,T] or [T,B], got shape " +
                         trellis::shape_string(mask.sizes()));
  const trellis::MaskSummary summary =
      trellis::summarize_mask(mask, batch_first, trellis::batch_shape(mask, batch_first), mask.device(),
                              "trellis::_crf_mask_lengths");
  return {summary.lengths, summary.flags};
}

Tensors2 crf_mask_lengths_meta(const at::Tensor& mask, bool batch_first) {
  return {at::empty_symint({mask.sym_size(batch_first ? 0 : 1)}, mask.options().dtype(at::kLong)),
          at::empty({2}, mask.options().dtype(at::kBool))};
}

Tensors2 crf_kbest(const at::Tensor& emissions, const at::Tensor& transitions, const OptionalTensor& start,
                   const OptionalTensor& end, const OptionalTensor& mask, const OptionalTensor& lengths, int64_t k,
                   bool batch_first, const OptionalTensor& allowed, const OptionalTensor& allowed_start,
                   const OptionalTensor& allowed_end) {
  const trellis::ChainPotentials p =
      potentials(chain_inputs(emissions, transitions, start, end, mask, lengths, batch_first),
                 {allowed, allowed_start, allowed_end}, "trellis::crf_kbest");
  const trellis::KBestResult r = trellis::caller_layout(trellis::kbest_viterbi(p, k), batch_first, emissions.device());
  return {r.paths, r.scores};
}

// Meta kernels: B, T and K read off the emissions in the caller's layout.
at::TensorOptions score_options(const at::Tensor& emissions, const at::Tensor& transitions, const OptionalTensor& start,
                                const OptionalTensor& end, const char* what) {
  return emissions.options().dtype(trellis::chain_compute_type(
      {{"emissions", emissions}, {"transitions", transitions}, {"start", get(start)}, {"end", get(end)}}, what));
}
void check_emissions_meta(const at::Tensor& emissions, const char* what) {
  if (emissions.dim() != 3)
    throw trellis::Error(std::string(what) + ": emissions must be a 3-d tensor, got " +
                         std::to_string(emissions.dim()) + " dimensions");
}
c10::SymInt batch_size(const at::Tensor& x, bool batch_first) { return x.sym_size(batch_first ? 0 : 1); }
c10::SymInt steps(const at::Tensor& x, bool batch_first) { return x.sym_size(batch_first ? 1 : 0); }

at::Tensor crf_log_partition_meta(const at::Tensor& emissions, const at::Tensor& transitions,
                                  const OptionalTensor& start, const OptionalTensor& end, const OptionalTensor&,
                                  const OptionalTensor&, bool batch_first, const OptionalTensor&, const OptionalTensor&,
                                  const OptionalTensor&) {
  check_emissions_meta(emissions, "trellis::crf_log_partition");
  return at::empty_symint({batch_size(emissions, batch_first)},
                          score_options(emissions, transitions, start, end, "trellis::crf_log_partition"));
}

at::Tensor crf_log_likelihood_meta(const at::Tensor& emissions, const at::Tensor&, const at::Tensor& transitions,
                                   const OptionalTensor& start, const OptionalTensor& end, const OptionalTensor&,
                                   const OptionalTensor&, bool batch_first, c10::string_view reduction) {
  const char* what = "trellis::crf_log_likelihood";
  check_emissions_meta(emissions, what);
  const at::TensorOptions o = score_options(emissions, transitions, start, end, what);
  if (reduction_of(reduction, what) != Reduction::none) return at::empty({}, o);
  return at::empty_symint({batch_size(emissions, batch_first)}, o);
}

Tensors4 crf_score_backward_meta(const at::Tensor&, const at::Tensor& emissions, const OptionalTensor&,
                                 const at::Tensor& transitions, const OptionalTensor& start, const OptionalTensor& end,
                                 const OptionalTensor&, const OptionalTensor&, bool, const OptionalTensor&,
                                 const OptionalTensor&, const OptionalTensor&, std::array<bool, 4> want) {
  const auto like = [&](bool wanted, const at::Tensor& t) {
    return wanted && t.defined() ? at::empty_symint(t.sym_sizes(), t.options()) : none(emissions);
  };
  return {like(want[0], emissions), like(want[1], transitions), like(want[2], get(start)), like(want[3], get(end))};
}

Tensors5 crf_score_and_gradients_meta(const at::Tensor& emissions, const OptionalTensor& tags,
                                      const at::Tensor& transitions, const OptionalTensor& start,
                                      const OptionalTensor& end, const OptionalTensor& mask,
                                      const OptionalTensor& lengths, bool batch_first, const OptionalTensor& allowed,
                                      const OptionalTensor& allowed_start, const OptionalTensor& allowed_end,
                                      std::array<bool, 4> want, c10::string_view reduction) {
  const char* what = "trellis::_crf_score_and_gradients";
  check_emissions_meta(emissions, what);
  const at::TensorOptions o = score_options(emissions, transitions, start, end, what);
  const at::Tensor score = reduction_of(reduction, what) != Reduction::none
                               ? at::empty({}, o)
                               : at::empty_symint({batch_size(emissions, batch_first)}, o);
  return std::tuple_cat(std::make_tuple(score),
                        crf_score_backward_meta(score, emissions, tags, transitions, start, end, mask, lengths,
                                                batch_first, allowed, allowed_start, allowed_end, want));
}

Tensors2 crf_marginals_meta(const at::Tensor& emissions, const at::Tensor& transitions, const OptionalTensor& start,
                            const OptionalTensor& end, const OptionalTensor&, const OptionalTensor&, bool batch_first,
                            bool edges, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&) {
  check_emissions_meta(emissions, "trellis::crf_marginals");
  const at::TensorOptions o = score_options(emissions, transitions, start, end, "trellis::crf_marginals");
  const c10::SymInt B = batch_size(emissions, batch_first), T = steps(emissions, batch_first),
                    K = emissions.sym_size(2);
  at::Tensor edge = at::empty({0}, o);
  if (edges) edge = batch_first ? at::empty_symint({B, T - 1, K, K}, o) : at::empty_symint({T - 1, B, K, K}, o);
  return {at::empty_symint(emissions.sym_sizes(), o), edge};
}

Tensors2 crf_viterbi_meta(const at::Tensor& emissions, const at::Tensor& transitions, const OptionalTensor& start,
                          const OptionalTensor& end, const OptionalTensor&, const OptionalTensor&, bool batch_first,
                          const OptionalTensor&, const OptionalTensor&, const OptionalTensor&) {
  check_emissions_meta(emissions, "trellis::crf_viterbi");
  const at::TensorOptions o = score_options(emissions, transitions, start, end, "trellis::crf_viterbi");
  return {at::empty_symint(emissions.sym_sizes().slice(0, 2), o.dtype(at::kLong)),
          at::empty_symint({batch_size(emissions, batch_first)}, o)};
}

Tensors2 crf_kbest_meta(const at::Tensor& emissions, const at::Tensor& transitions, const OptionalTensor& start,
                        const OptionalTensor& end, const OptionalTensor&, const OptionalTensor&, int64_t k,
                        bool batch_first, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&) {
  check_emissions_meta(emissions, "trellis::crf_kbest");
  if (k < 1) throw trellis::Error("trellis::crf_kbest: k must be at least 1, got " + std::to_string(k));
  const at::TensorOptions o = score_options(emissions, transitions, start, end, "trellis::crf_kbest");
  const c10::SymInt B = batch_size(emissions, batch_first), T = steps(emissions, batch_first);
  const c10::SymInt kk(k);
  return {
      batch_first ? at::empty_symint({B, kk, T}, o.dtype(at::kLong)) : at::empty_symint({T, B, kk}, o.dtype(at::kLong)),
      at::empty_symint({B, kk}, o)};
}

// Whether these tensors are plain CPU or CUDA tensors outside any tracing: no Python dispatch mode (opcheck's) is on,
// and none is a meta tensor, has symbolic sizes or carries a key of torch.compile's fake and functional tensors, of a
// tensor subclass or of functorch's transforms.
bool eager(at::ArrayRef<at::Tensor> tensors) {
  if (c10::impl::dispatch_mode_enabled()) return false;
  const c10::DispatchKeySet traced({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                    c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
                                    c10::DispatchKey::FuncTorchGradWrapper});
  for (const at::Tensor& t : tensors)
    if (t.defined() &&
        (t.is_meta() || t.key_set().has_any(traced) || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()))
      return false;
  return true;
}

#ifdef TRELLIS_OPS_CUDA
// Whether a reduced log-likelihood's backward scales its saved gradients in one launch (scaled_gradients.cu): eager
// CUDA tensors of one floating dtype. Traced (torch.compile, opcheck), on the CPU, or in a build without nvcc it takes
// ATen's operators, which a compiled graph holds.
bool one_launch(const std::vector<at::Tensor>& gradients, const at::Tensor& grad) {
  if (!trellis_ops::scales_in_one_launch(gradients, grad)) return false;
  std::vector<at::Tensor> all = gradients;
  all.push_back(grad);
  return eager(all);
}
#endif

// log Z and the log-likelihood: the forward operator, and _crf_score_backward for the gradients.
struct CrfScoreFunction : torch::autograd::Function<CrfScoreFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& emissions, const OptionalTensor& tags,
                            const at::Tensor& transitions, const OptionalTensor& start, const OptionalTensor& end,
                            const OptionalTensor& mask, const OptionalTensor& lengths, bool batch_first,
                            const OptionalTensor& allowed, const OptionalTensor& allowed_start,
                            const OptionalTensor& allowed_end, std::array<bool, 4> want, Reduction r) {
    static const auto partition = find<decltype(crf_log_partition)>("trellis::crf_log_partition");
    static const auto likelihood = find<decltype(crf_log_likelihood)>("trellis::crf_log_likelihood");
    static const auto both = find<decltype(crf_score_and_gradients)>("trellis::_crf_score_and_gradients");
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->saved_data["want"] = want_bits(want);
    ctx->saved_data["reduced"] = r != Reduction::none;
    if (r != Reduction::none) {
      // A scalar result: its gradients are those of Σ score, scaled; formed now, in the pass that forms the score.
      // Where the host knows the divisor, the operator returns the reduction itself (on the shared-memory kernels
      // written by their last launch).
      const int64_t batch = emissions.dim() == 3 ? emissions.size(batch_first ? 0 : 1) : 0;
      const std::optional<double> count = constant_divisor(r, batch, emissions, mask, lengths);
      auto [value, de, dt, ds, dn] = both.call(emissions, tags, transitions, start, end, mask, lengths, batch_first,
                                               std::nullopt, std::nullopt, std::nullopt, want,
                                               reduction_name(count ? r : Reduction::none));
      if (count) {
        ctx->saved_data["divisor"] = *count;
        ctx->save_for_backward({de, dt, ds, dn});
        return value;
      }
      const at::Tensor divisor = reduction_divisor(r, value, emissions, mask, lengths);
      ctx->save_for_backward({de, dt, ds, dn, divisor});
      return value.sum() / divisor;
    }
    ctx->save_for_backward({emissions, get(tags), transitions, get(start), get(end), get(mask), get(lengths),
                            get(allowed), get(allowed_start), get(allowed_end)});
    ctx->saved_data["batch_first"] = batch_first;
    return tags ? likelihood.call(emissions, *tags, transitions, start, end, mask, lengths, batch_first, "none")
                : partition.call(emissions, transitions, start, end, mask, lengths, batch_first, allowed, allowed_start,
                                 allowed_end);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    static const auto op = find<decltype(crf_score_backward)>("trellis::_crf_score_backward");
    const auto s = ctx->get_saved_variables();
    const std::array<bool, 4> want = wanted_of(ctx->saved_data.at("want").toInt());
    std::array<at::Tensor, 4> out;
    if (ctx->saved_data.at("reduced").toBool()) {  // the saved gradients of Σ score, times grad / divisor
      const auto divisor = ctx->saved_data.find("divisor");
      std::vector<at::Tensor> wanted;
      for (std::size_t i = 0; i < want.size(); ++i)
        if (want[i]) wanted.push_back(s[i]);
#ifdef TRELLIS_OPS_CUDA
      const bool scaled_once = divisor != ctx->saved_data.end() && one_launch(wanted, grad[0]);
      if (scaled_once) {
        const std::vector<at::Tensor> scaled =
            trellis_ops::scaled_in_one_launch(wanted, grad[0], divisor->second.toDouble());
        for (std::size_t i = 0, next = 0; i < want.size(); ++i)
          if (want[i]) out[i] = scaled[next++];
      }
#else
      const bool scaled_once = false;
#endif
      if (!scaled_once) {
        const at::Tensor scale = divisor == ctx->saved_data.end()     ? grad[0] / s[4]
                                 : divisor->second.toDouble() == 1.0 ? grad[0]
                                                                     : grad[0] / divisor->second.toDouble();
        // The emissions' gradient (B·T·K values) by one elementwise kernel spread over the whole device; the
        // parameters' (K² + 2K) by one multi-tensor launch, whose blocks take a 64K-value chunk each (a dozen blocks
        // would carry the emissions' memory-bound pass at B,T,K = 512,64,23). A 0-dim scale keeps each gradient's
        // dtype.
        if (want[0]) out[0] = s[0] * scale;
        const std::vector<at::Tensor> parameters(wanted.begin() + (want[0] ? 1 : 0), wanted.end());
        if (!parameters.empty()) {
          const std::vector<at::Tensor> scaled = at::_foreach_mul(parameters, scale);
          for (std::size_t i = 1, next = 0; i < want.size(); ++i)
            if (want[i]) out[i] = scaled[next++];
        }
      }
    } else {
      std::tie(out[0], out[1], out[2], out[3]) =
          op.call(grad[0], s[0], optional(s[1]), s[2], optional(s[3]), optional(s[4]), optional(s[5]), optional(s[6]),
                  ctx->saved_data.at("batch_first").toBool(), optional(s[7]), optional(s[8]), optional(s[9]), want);
    }
    // One entry per forward argument: emissions, tags, transitions, start, end, then the rest.
    const auto pick = [&](std::size_t i) { return want[i] ? out[i] : at::Tensor(); };
    return {pick(0), {}, pick(1), pick(2), pick(3), {}, {}, {}, {}, {}, {}, {}, {}};
  }
};

std::array<bool, 4> score_grads_wanted(const at::Tensor& emissions, const at::Tensor& transitions,
                                       const OptionalTensor& start, const OptionalTensor& end) {
  return {wants_grad(emissions), wants_grad(transitions), wants_grad(start), wants_grad(end)};
}

at::Tensor crf_log_partition_autograd(const at::Tensor& emissions, const at::Tensor& transitions,
                                      const OptionalTensor& start, const OptionalTensor& end,
                                      const OptionalTensor& mask, const OptionalTensor& lengths, bool batch_first,
                                      const OptionalTensor& allowed, const OptionalTensor& allowed_start,
                                      const OptionalTensor& allowed_end) {
  return CrfScoreFunction::apply(emissions, OptionalTensor(), transitions, start, end, mask, lengths, batch_first,
                                 allowed, allowed_start, allowed_end,
                                 score_grads_wanted(emissions, transitions, start, end), Reduction::none);
}

// Whether a batch of chains is long enough for its backward kernels to wait for the backward pass. The GPU finishes the
// forward kernel of a short chain before the host has got from it through Python and the autograd engine to the
// fused node's backward, and would then wait for the host; from 256 steps, or from 128 labels (whose steps take
// several times longer), the forward kernel outlasts that way. A batch that is not 3-d, or empty, is left to the
// operator's own checks.
constexpr int64_t kLongChainSteps = 256, kLongChainLabels = 128;
bool long_chains(const at::Tensor& emissions, bool batch_first) {
  if (emissions.dim() != 3 || emissions.size(batch_first ? 0 : 1) == 0) return false;
  return emissions.size(batch_first ? 1 : 0) >= kLongChainSteps || emissions.size(2) >= kLongChainLabels;
}

at::Tensor crf_log_likelihood_autograd(const at::Tensor& emissions, const at::Tensor& tags,
                                       const at::Tensor& transitions, const OptionalTensor& start,
                                       const OptionalTensor& end, const OptionalTensor& mask,
                                       const OptionalTensor& lengths, bool batch_first, c10::string_view reduction) {
  const char* what = "trellis::crf_log_likelihood";
  const std::array<bool, 4> want = score_grads_wanted(emissions, transitions, start, end);
  if (!(want[0] || want[1] || want[2] || want[3])) {  // nothing to differentiate: the kernel alone
    static const auto op = find<decltype(crf_log_likelihood)>("trellis::crf_log_likelihood");
    at::AutoDispatchBelowADInplaceOrView below;
    return op.call(emissions, tags, transitions, start, end, mask, lengths, batch_first, reduction);
  }
  const Reduction r = reduction_of(reduction, what);
  if (r != Reduction::none && long_chains(emissions, batch_first) &&
      eager({emissions, tags, transitions, get(start), get(end), get(mask), get(lengths)})) {
    // A reduced log-likelihood of long chains of eager tensors: the library's own autograd, whose fused node launches
    // the backward kernels when the backward runs and has them read the upstream gradient where it lies (the
    // reduction's one value, expanded with stride 0). Nothing then scales gradients formed in the forward pass, a pass
    // over B·T·K values and launches after the kernels. Short chains and traced tensors take CrfScoreFunction, whose
    // backward kernels run with the forward one (and a compiled graph holds its backward).
    const trellis::ChainInputs in{emissions, transitions, get(start), get(end), get(mask), get(lengths), batch_first};
    const at::Tensor score =
        trellis::log_likelihood(trellis::chain_potentials(in, what), trellis::batch_first_tags(tags, in, what));
    return reduced(r, score, emissions, mask, lengths);
  }
  return CrfScoreFunction::apply(emissions, OptionalTensor(tags), transitions, start, end, mask, lengths, batch_first,
                                 OptionalTensor(), OptionalTensor(), OptionalTensor(), want, r);
}

// Operators without a gradient: their kernels below autograd, so that their outputs never require grad.
template <auto* Kernel, class... Args>
auto without_gradient(const char* name, Args... args) {
  static const auto op = find<std::remove_pointer_t<decltype(Kernel)>>(name);
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(args...);
}

Tensors2 crf_marginals_autograd(const at::Tensor& emissions, const at::Tensor& transitions, const OptionalTensor& start,
                                const OptionalTensor& end, const OptionalTensor& mask, const OptionalTensor& lengths,
                                bool batch_first, bool edges, const OptionalTensor& allowed,
                                const OptionalTensor& allowed_start, const OptionalTensor& allowed_end) {
  return without_gradient<&crf_marginals>("trellis::crf_marginals", emissions, transitions, start, end, mask, lengths,
                                          batch_first, edges, allowed, allowed_start, allowed_end);
}

Tensors2 crf_viterbi_autograd(const at::Tensor& emissions, const at::Tensor& transitions, const OptionalTensor& start,
                              const OptionalTensor& end, const OptionalTensor& mask, const OptionalTensor& lengths,
                              bool batch_first, const OptionalTensor& allowed, const OptionalTensor& allowed_start,
                              const OptionalTensor& allowed_end) {
  return without_gradient<&crf_viterbi>("trellis::crf_viterbi", emissions, transitions, start, end, mask, lengths,
                                        batch_first, allowed, allowed_start, allowed_end);
}

Tensors2 crf_kbest_autograd(const at::Tensor& emissions, const at::Tensor& transitions, const OptionalTensor& start,
                            const OptionalTensor& end, const OptionalTensor& mask, const OptionalTensor& lengths,
                            int64_t k, bool batch_first, const OptionalTensor& allowed,
                            const OptionalTensor& allowed_start, const OptionalTensor& allowed_end) {
  return without_gradient<&crf_kbest>("trellis::crf_kbest", emissions, transitions, start, end, mask, lengths, k,
                                      batch_first, allowed, allowed_start, allowed_end);
}

// ---- HMMs ----

// The arguments of the HMM operators, as one model and batch.
struct HmmArgs {
  at::Tensor observations, log_start, log_transitions, log_emissions, means, variances, mask, lengths;
  bool batch_first;
};

bool categorical(const HmmArgs& h, const char* what) {
  const bool gaussian = h.means.defined() || h.variances.defined();
  if (h.log_emissions.defined() == gaussian)
    throw trellis::Error(std::string(what) + ": give log_emissions (categorical) or means and variances (Gaussian)" +
                         (gaussian ? ", not both" : ""));
  if (gaussian && !(h.means.defined() && h.variances.defined()))
    throw trellis::Error(std::string(what) + ": a Gaussian HMM needs both means and variances");
  return !gaussian;
}

at::ScalarType hmm_compute_type(const HmmArgs& h, bool is_categorical, const char* what) {
  return trellis::chain_compute_type({{"log_start", h.log_start},
                                      {"log_transitions", h.log_transitions},
                                      {"log_emissions", h.log_emissions},
                                      {"means", h.means},
                                      {"variances", h.variances},
                                      {"observations", is_categorical ? at::Tensor() : h.observations}},
                                     what);
}

// Calls f(hmm, observations [B,T] or [B,T,F] batch-first, lengths) with the model in the computation's dtype.
template <class F>
auto with_hmm(const HmmArgs& h, const char* what, F&& f) {
  const bool is_categorical = categorical(h, what);
  const std::string prefix = std::string(what) + ": ";
  const at::Tensor& x = h.observations;
  if (!x.defined() || x.dim() != (is_categorical ? 2 : 3))
    throw trellis::Error(
        prefix + "observations must be " +
        (is_categorical ? (h.batch_first ? "[B,T]" : "[T,B]") : (h.batch_first ? "[B,T,F]" : "[T,B,F]")) + " for a " +
        (is_categorical ? "categorical" : "Gaussian") + " HMM, got shape " + shape(x));
  if (is_categorical && !at::isIntegralType(x.scalar_type(), /*includeBool=*/false))
    throw trellis::Error(prefix + "a categorical HMM's observations must be integer symbol ids, got " +
                         std::string(c10::toString(x.scalar_type())));
  const at::ScalarType type = hmm_compute_type(h, is_categorical, what);
  for (const auto& [name, t] : {std::pair<const char*, at::Tensor>{"log_start", h.log_start},
                                {"log_transitions", h.log_transitions},
                                {"log_emissions", h.log_emissions},
                                {"means", h.means},
                                {"variances", h.variances}})
    if (t.defined() && t.device() != x.device())
      throw trellis::Error(prefix + name + " is on " + t.device().str() + " but the observations are on " +
                           x.device().str());
  if (!h.log_start.defined() || !h.log_transitions.defined())
    throw trellis::Error(prefix + "log_start and log_transitions are required");
  const at::Tensor& trans = h.log_transitions;
  if (trans.dim() != 2 || trans.size(0) != trans.size(1))
    throw trellis::Error(prefix + "log_transitions must be [K,K], got shape " + shape(trans));
  const int64_t K = trans.size(0);
  const auto expect = [&](const at::Tensor& t, const char* name, std::vector<int64_t> sizes, const char* layout) {
    if (t.defined() && t.sizes().vec() != sizes)
      throw trellis::Error(prefix + name + " has shape " + shape(t) + ", expected " + layout + " = " +
                           trellis::shape_string(sizes) + " (K from log_transitions)");
  };
  expect(h.log_start, "log_start", {K}, "[K]");
  if (is_categorical) {
    if (h.log_emissions.dim() != 2 || h.log_emissions.size(0) != K)
      throw trellis::Error(prefix + "log_emissions must be [K,V] with K = " + std::to_string(K) + ", got shape " +
                           shape(h.log_emissions));
  } else {
    expect(h.means, "means", {K, x.size(2)}, "[K,F]");
    expect(h.variances, "variances", {K, x.size(2)}, "[K,F]");
  }
  const at::Tensor lengths = trellis::sequence_lengths(h.mask, h.lengths, h.batch_first,
                                                       trellis::batch_shape(x, h.batch_first), x.device(), what);
  at::Tensor obs = h.batch_first ? x : x.transpose(0, 1);
  const auto cast = [&](const at::Tensor& t) { return t.to(type); };
  if (is_categorical)
    return f(trellis::CategoricalHMM{cast(h.log_start), cast(h.log_transitions), cast(h.log_emissions)}, obs, lengths);
  return f(trellis::GaussianHMM{cast(h.log_start), cast(h.log_transitions), cast(h.means), cast(h.variances)},
           cast(obs), lengths);
}

HmmArgs hmm_args(const at::Tensor& observations, const at::Tensor& log_start, const at::Tensor& log_transitions,
                 const OptionalTensor& log_emissions, const OptionalTensor& means, const OptionalTensor& variances,
                 const OptionalTensor& mask, const OptionalTensor& lengths, bool batch_first) {
  return {observations,   log_start, log_transitions, get(log_emissions), get(means),
          get(variances), get(mask), get(lengths),    batch_first};
}

HmmArgs usable(const trellis::AutogradScope& scope, HmmArgs h) {
  for (at::Tensor* t : {&h.observations, &h.log_start, &h.log_transitions, &h.log_emissions, &h.means, &h.variances})
    *t = scope.usable(*t);
  return h;
}

at::Tensor hmm_log_likelihood(const at::Tensor& observations, const at::Tensor& log_start,
                              const at::Tensor& log_transitions, const OptionalTensor& log_emissions,
                              const OptionalTensor& means, const OptionalTensor& variances, const OptionalTensor& mask,
                              const OptionalTensor& lengths, bool batch_first) {
  return with_hmm(
      hmm_args(observations, log_start, log_transitions, log_emissions, means, variances, mask, lengths, batch_first),
      "trellis::hmm_log_likelihood", [](const auto& hmm, const at::Tensor& obs, const at::Tensor& len) {
        return trellis::batch_log_partition(hmm.potentials(obs, len));
      });
}

at::Tensor hmm_posteriors(const at::Tensor& observations, const at::Tensor& log_start,
                          const at::Tensor& log_transitions, const OptionalTensor& log_emissions,
                          const OptionalTensor& means, const OptionalTensor& variances, const OptionalTensor& mask,
                          const OptionalTensor& lengths, bool batch_first) {
  const trellis::AutogradScope scope;
  return with_hmm(usable(scope, hmm_args(observations, log_start, log_transitions, log_emissions, means, variances,
                                         mask, lengths, batch_first)),
                  "trellis::hmm_posteriors", [&](const auto& hmm, const at::Tensor& obs, const at::Tensor& len) {
                    return trellis::caller_layout(trellis::batch_marginals(hmm.potentials(obs, len), false).nodes,
                                                  batch_first);
                  });
}

Tensors2 hmm_viterbi(const at::Tensor& observations, const at::Tensor& log_start, const at::Tensor& log_transitions,
                     const OptionalTensor& log_emissions, const OptionalTensor& means, const OptionalTensor& variances,
                     const OptionalTensor& mask, const OptionalTensor& lengths, bool batch_first) {
  const trellis::AutogradScope scope;
  return with_hmm(usable(scope, hmm_args(observations, log_start, log_transitions, log_emissions, means, variances,
                                         mask, lengths, batch_first)),
                  "trellis::hmm_viterbi", [&](const auto& hmm, const at::Tensor& obs, const at::Tensor& len) {
                    const trellis::ViterbiResult r =
                        trellis::caller_layout(trellis::batch_viterbi(hmm.potentials(obs, len)), batch_first);
                    return Tensors2{r.path, r.score};
                  });
}

// Gradients w.r.t. (observations, log_start, log_transitions, log_emissions, means, variances) of Σ grad·log P(o).
Tensors6 hmm_log_likelihood_backward(const at::Tensor& grad, const at::Tensor& observations,
                                     const at::Tensor& log_start, const at::Tensor& log_transitions,
                                     const OptionalTensor& log_emissions, const OptionalTensor& means,
                                     const OptionalTensor& variances, const OptionalTensor& mask,
                                     const OptionalTensor& lengths, bool batch_first, std::array<bool, 6> want) {
  const trellis::AutogradScope scope;
  c10::AutoGradMode grad_on(true);
  const bool float_observations = observations.is_floating_point();
  const std::vector<at::Tensor> leaves = {leaf(observations, want[0] && float_observations),
                                          leaf(log_start, want[1]),
                                          leaf(log_transitions, want[2]),
                                          leaf(get(log_emissions), want[3]),
                                          leaf(get(means), want[4]),
                                          leaf(get(variances), want[5])};
  const at::Tensor value = hmm_log_likelihood(leaves[0], leaves[1], leaves[2], optional(leaves[3]), optional(leaves[4]),
                                              optional(leaves[5]), mask, lengths, batch_first);
  const auto g = vector_jacobian(value, grad, leaves);
  const auto pick = [&](std::size_t i) { return want[i] && g[i].defined() ? fresh(g[i]) : none(log_start); };
  return {pick(0), pick(1), pick(2), pick(3), pick(4), pick(5)};
}

// Meta kernels: B and T from the observations in the caller's layout, K from the transitions.
at::TensorOptions hmm_score_options(const HmmArgs& h, const char* what) {
  const bool is_categorical = categorical(h, what);
  return h.observations.options().dtype(hmm_compute_type(h, is_categorical, what));
}
void check_observations_meta(const at::Tensor& observations, const char* what) {
  if (observations.dim() < 2)
    throw trellis::Error(std::string(what) + ": observations must be [B,T] or [B,T,F], got " +
                         std::to_string(observations.dim()) + " dimensions");
}

at::Tensor hmm_log_likelihood_meta(const at::Tensor& observations, const at::Tensor& log_start,
                                   const at::Tensor& log_transitions, const OptionalTensor& log_emissions,
                                   const OptionalTensor& means, const OptionalTensor& variances,
                                   const OptionalTensor& mask, const OptionalTensor& lengths, bool batch_first) {
  const char* what = "trellis::hmm_log_likelihood";
  check_observations_meta(observations, what);
  const HmmArgs h =
      hmm_args(observations, log_start, log_transitions, log_emissions, means, variances, mask, lengths, batch_first);
  return at::empty_symint({batch_size(observations, batch_first)}, hmm_score_options(h, what));
}

at::Tensor hmm_posteriors_meta(const at::Tensor& observations, const at::Tensor& log_start,
                               const at::Tensor& log_transitions, const OptionalTensor& log_emissions,
                               const OptionalTensor& means, const OptionalTensor& variances, const OptionalTensor& mask,
                               const OptionalTensor& lengths, bool batch_first) {
  const char* what = "trellis::hmm_posteriors";
  check_observations_meta(observations, what);
  const HmmArgs h =
      hmm_args(observations, log_start, log_transitions, log_emissions, means, variances, mask, lengths, batch_first);
  return at::empty_symint({observations.sym_size(0), observations.sym_size(1), log_transitions.sym_size(0)},
                          hmm_score_options(h, what));
}

Tensors2 hmm_viterbi_meta(const at::Tensor& observations, const at::Tensor& log_start,
                          const at::Tensor& log_transitions, const OptionalTensor& log_emissions,
                          const OptionalTensor& means, const OptionalTensor& variances, const OptionalTensor& mask,
                          const OptionalTensor& lengths, bool batch_first) {
  const char* what = "trellis::hmm_viterbi";
  check_observations_meta(observations, what);
  const HmmArgs h =
      hmm_args(observations, log_start, log_transitions, log_emissions, means, variances, mask, lengths, batch_first);
  const at::TensorOptions o = hmm_score_options(h, what);
  return {at::empty_symint({observations.sym_size(0), observations.sym_size(1)}, o.dtype(at::kLong)),
          at::empty_symint({batch_size(observations, batch_first)}, o)};
}

Tensors6 hmm_log_likelihood_backward_meta(const at::Tensor&, const at::Tensor& observations,
                                          const at::Tensor& log_start, const at::Tensor& log_transitions,
                                          const OptionalTensor& log_emissions, const OptionalTensor& means,
                                          const OptionalTensor& variances, const OptionalTensor&, const OptionalTensor&,
                                          bool, std::array<bool, 6> want) {
  want[0] = want[0] && observations.is_floating_point();
  const auto like = [&](bool wanted, const at::Tensor& t) {
    return wanted && t.defined() ? at::empty_symint(t.sym_sizes(), t.options()) : none(log_start);
  };
  return {like(want[0], observations),       like(want[1], log_start),  like(want[2], log_transitions),
          like(want[3], get(log_emissions)), like(want[4], get(means)), like(want[5], get(variances))};
}

struct HmmLogLikelihoodFunction : torch::autograd::Function<HmmLogLikelihoodFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& observations, const at::Tensor& log_start,
                            const at::Tensor& log_transitions, const OptionalTensor& log_emissions,
                            const OptionalTensor& means, const OptionalTensor& variances, const OptionalTensor& mask,
                            const OptionalTensor& lengths, bool batch_first, std::array<bool, 6> want) {
    static const auto op = find<decltype(hmm_log_likelihood)>("trellis::hmm_log_likelihood");
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({observations, log_start, log_transitions, get(log_emissions), get(means), get(variances),
                            get(mask), get(lengths)});
    ctx->saved_data["batch_first"] = batch_first;
    for (std::size_t i = 0; i < want.size(); ++i) ctx->saved_data["want" + std::to_string(i)] = want[i];
    return op.call(observations, log_start, log_transitions, log_emissions, means, variances, mask, lengths,
                   batch_first);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    static const auto op = find<decltype(hmm_log_likelihood_backward)>("trellis::_hmm_log_likelihood_backward");
    const auto s = ctx->get_saved_variables();
    std::array<bool, 6> want;
    for (std::size_t i = 0; i < want.size(); ++i) want[i] = ctx->saved_data.at("want" + std::to_string(i)).toBool();
    const auto g = op.call(grad[0], s[0], s[1], s[2], optional(s[3]), optional(s[4]), optional(s[5]), optional(s[6]),
                           optional(s[7]), ctx->saved_data.at("batch_first").toBool(), want);
    const auto pick = [&](std::size_t i, const at::Tensor& t) { return want[i] ? t : at::Tensor(); };
    return {pick(0, std::get<0>(g)),
            pick(1, std::get<1>(g)),
            pick(2, std::get<2>(g)),
            pick(3, std::get<3>(g)),
            pick(4, std::get<4>(g)),
            pick(5, std::get<5>(g)),
            {},
            {},
            {},
            {}};
  }
};

at::Tensor hmm_log_likelihood_autograd(const at::Tensor& observations, const at::Tensor& log_start,
                                       const at::Tensor& log_transitions, const OptionalTensor& log_emissions,
                                       const OptionalTensor& means, const OptionalTensor& variances,
                                       const OptionalTensor& mask, const OptionalTensor& lengths, bool batch_first) {
  const std::array<bool, 6> want = {wants_grad(observations) && observations.is_floating_point(),
                                    wants_grad(log_start),
                                    wants_grad(log_transitions),
                                    wants_grad(log_emissions),
                                    wants_grad(means),
                                    wants_grad(variances)};
  return HmmLogLikelihoodFunction::apply(observations, log_start, log_transitions, log_emissions, means, variances,
                                         mask, lengths, batch_first, want);
}

at::Tensor hmm_posteriors_autograd(const at::Tensor& observations, const at::Tensor& log_start,
                                   const at::Tensor& log_transitions, const OptionalTensor& log_emissions,
                                   const OptionalTensor& means, const OptionalTensor& variances,
                                   const OptionalTensor& mask, const OptionalTensor& lengths, bool batch_first) {
  return without_gradient<&hmm_posteriors>("trellis::hmm_posteriors", observations, log_start, log_transitions,
                                           log_emissions, means, variances, mask, lengths, batch_first);
}

Tensors2 hmm_viterbi_autograd(const at::Tensor& observations, const at::Tensor& log_start,
                              const at::Tensor& log_transitions, const OptionalTensor& log_emissions,
                              const OptionalTensor& means, const OptionalTensor& variances, const OptionalTensor& mask,
                              const OptionalTensor& lengths, bool batch_first) {
  return without_gradient<&hmm_viterbi>("trellis::hmm_viterbi", observations, log_start, log_transitions, log_emissions,
                                        means, variances, mask, lengths, batch_first);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trellis, m) {
  m.def("log_matmul(Tensor a, Tensor b) -> Tensor");
  m.def("max_matmul(Tensor a, Tensor b) -> Tensor");
  m.def(
      "crf_log_partition(Tensor emissions, Tensor transitions, Tensor? start, Tensor? end, Tensor? mask, "
      "Tensor? lengths, bool batch_first=True, Tensor? allowed=None, Tensor? allowed_start=None, "
      "Tensor? allowed_end=None) -> Tensor");
  m.def(
      "crf_log_likelihood(Tensor emissions, Tensor tags, Tensor transitions, Tensor? start, Tensor? end, "
      "Tensor? mask, Tensor? lengths, bool batch_first=True, str reduction=\"none\") -> Tensor");
  m.def(
      "crf_marginals(Tensor emissions, Tensor transitions, Tensor? start, Tensor? end, Tensor? mask, "
      "Tensor? lengths, bool batch_first=True, bool edges=False, Tensor? allowed=None, Tensor? allowed_start=None, "
      "Tensor? allowed_end=None) -> (Tensor, Tensor)");
  m.def(
      "crf_viterbi(Tensor emissions, Tensor transitions, Tensor? start, Tensor? end, Tensor? mask, "
      "Tensor? lengths, bool batch_first=True, Tensor? allowed=None, Tensor? allowed_start=None, "
      "Tensor? allowed_end=None) -> (Tensor, Tensor)");
  m.def(
      "crf_kbest(Tensor emissions, Tensor transitions, Tensor? start, Tensor? end, Tensor? mask, Tensor? lengths, "
      "int k, bool batch_first=True, Tensor? allowed=None, Tensor? allowed_start=None, "
      "Tensor? allowed_end=None) -> (Tensor, Tensor)");
  // (lengths [B] int64, flags [2] bool: some first position off, some position on after an off one): see
  // trellis::summarize_mask.
  m.def("_crf_mask_lengths(Tensor mask, bool batch_first=True) -> (Tensor, Tensor)");
  m.def(
      "hmm_log_likelihood(Tensor observations, Tensor log_start, Tensor log_transitions, "
      "Tensor? log_emissions=None, Tensor? means=None, Tensor? variances=None, Tensor? mask=None, "
      "Tensor? lengths=None, bool batch_first=True) -> Tensor");
  m.def(
      "hmm_posteriors(Tensor observations, Tensor log_start, Tensor log_transitions, Tensor? log_emissions=None, "
      "Tensor? means=None, Tensor? variances=None, Tensor? mask=None, Tensor? lengths=None, "
      "bool batch_first=True) -> Tensor");
  m.def(
      "hmm_viterbi(Tensor observations, Tensor log_start, Tensor log_transitions, Tensor? log_emissions=None, "
      "Tensor? means=None, Tensor? variances=None, Tensor? mask=None, Tensor? lengths=None, "
      "bool batch_first=True) -> (Tensor, Tensor)");
  // The backward operators: gradients of Σ grad·result w.r.t. the inputs output_mask names (empty tensors elsewhere).
  m.def(
      "_semiring_matmul_backward(Tensor grad, Tensor a, Tensor b, bool max, bool[2] output_mask) -> (Tensor, Tensor)");
  // (emissions, transitions, start, end) of the log-likelihood of tags, or of the log-partition when tags is None.
  m.def(
      "_crf_score_backward(Tensor grad, Tensor emissions, Tensor? tags, Tensor transitions, Tensor? start, "
      "Tensor? end, Tensor? mask, Tensor? lengths, bool batch_first, Tensor? allowed, Tensor? allowed_start, "
      "Tensor? allowed_end, bool[4] output_mask) -> (Tensor, Tensor, Tensor, Tensor)");
  // The score [B], or its reduction ("sum", "mean", "token_mean": a scalar), and the gradients of its sum: a reduced
  // log-likelihood's forward.
  m.def(
      "_crf_score_and_gradients(Tensor emissions, Tensor? tags, Tensor transitions, Tensor? start, Tensor? end, "
      "Tensor? mask, Tensor? lengths, bool batch_first, Tensor? allowed, Tensor? allowed_start, Tensor? allowed_end, "
      "bool[4] output_mask, str reduction=\"none\") -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // (observations, log_start, log_transitions, log_emissions, means, variances).
  m.def(
      "_hmm_log_likelihood_backward(Tensor grad, Tensor observations, Tensor log_start, Tensor log_transitions, "
      "Tensor? log_emissions, Tensor? means, Tensor? variances, Tensor? mask, Tensor? lengths, bool batch_first, "
      "bool[6] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(trellis, CompositeExplicitAutograd, m) {
  m.impl("log_matmul", &log_matmul);
  m.impl("max_matmul", &max_matmul);
  m.impl("crf_log_partition", &crf_log_partition);
  m.impl("crf_log_likelihood", &crf_log_likelihood);
  m.impl("crf_marginals", &crf_marginals);
  m.impl("crf_viterbi", &crf_viterbi);
  m.impl("crf_kbest", &crf_kbest);
  m.impl("_crf_mask_lengths", &crf_mask_lengths);
  m.impl("hmm_log_likelihood", &hmm_log_likelihood);
  m.impl("hmm_posteriors", &hmm_posteriors);
  m.impl("hmm_viterbi", &hmm_viterbi);
  m.impl("_semiring_matmul_backward", &semiring_matmul_backward);
  m.impl("_crf_score_backward", &crf_score_backward);
  m.impl("_crf_score_and_gradients", &crf_score_and_gradients);
  m.impl("_hmm_log_likelihood_backward", &hmm_log_likelihood_backward);
}

TORCH_LIBRARY_IMPL(trellis, Meta, m) {
  m.impl("log_matmul", &semiring_matmul_meta);
  m.impl("max_matmul", &semiring_matmul_meta);
  m.impl("crf_log_partition", &crf_log_partition_meta);
  m.impl("crf_log_likelihood", &crf_log_likelihood_meta);
  m.impl("crf_marginals", &crf_marginals_meta);
  m.impl("crf_viterbi", &crf_viterbi_meta);
  m.impl("crf_kbest", &crf_kbest_meta);
  m.impl("_crf_mask_lengths", &crf_mask_lengths_meta);
  m.impl("hmm_log_likelihood", &hmm_log_likelihood_meta);
  m.impl("hmm_posteriors", &hmm_posteriors_meta);
  m.impl("hmm_viterbi", &hmm_viterbi_meta);
  m.impl("_semiring_matmul_backward", &semiring_matmul_backward_meta);
  m.impl("_crf_score_backward", &crf_score_backward_meta);
  m.impl("_crf_score_and_gradients", &crf_score_and_gradients_meta);
  m.impl("_hmm_log_likelihood_backward", &hmm_log_likelihood_backward_meta);
}

TORCH_LIBRARY_IMPL(trellis, Autograd, m) {
  m.impl("log_matmul", &log_matmul_autograd);
  m.impl("max_matmul", &max_matmul_autograd);
  m.impl("crf_log_partition", &crf_log_partition_autograd);
  m.impl("crf_log_likelihood", &crf_log_likelihood_autograd);
  m.impl("crf_marginals", &crf_marginals_autograd);
  m.impl("crf_viterbi", &crf_viterbi_autograd);
  m.impl("crf_kbest", &crf_kbest_autograd);
  m.impl("hmm_log_likelihood", &hmm_log_likelihood_autograd);
  m.impl("hmm_posteriors", &hmm_posteriors_autograd);
  m.impl("hmm_viterbi", &hmm_viterbi_autograd);
}
