#include "trellis/hmm/hmm.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <optional>
#include <type_traits>
#include <vector>

#include "lib/src/hmm/hmm_infer.h"
#include "lib/src/io/message.h"
#include "lib/src/semiring/scaled_log_matmul.h"
#include "trellis/error.h"
#include "cuda/chain_kernels.h"
#include "cuda/hmm_expectations.h"
#include "cuda/kernels_built.h"

namespace trellis {
namespace {

void check_chain(const at::Tensor& start, const at::Tensor& transitions, const char* what) {
  if (!start.defined() || !transitions.defined())
    throw Error(std::string(what) + ": log_start and log_transitions are required");
  const int64_t K = transitions.size(0);
  if (transitions.dim() != 2 || transitions.size(1) != K || start.dim() != 1 || start.size(0) != K)
    throw Error(std::string(what) + ": expected log_start [K] and log_transitions [K,K]; got " +
                message::text(start.sizes(), ", ", transitions.sizes()));
}

at::Tensor lengths_or_full(const at::Tensor& observations, const at::Tensor& lengths) {
  return lengths.defined()
             ? lengths.to(observations.device(), at::kLong)
             : at::full({observations.size(0)}, observations.size(1), observations.options().dtype(at::kLong));
}

at::Tensor valid_mask(const at::Tensor& observations, const at::Tensor& lengths) {
  const at::Tensor l = lengths_or_full(observations, lengths);
  return at::arange(observations.size(1), l.options()).unsqueeze(0) < l.unsqueeze(1);
}

std::string index_of(const at::Tensor& bad) {
  const at::Tensor i = bad.nonzero()[0].cpu();
  return "[" + std::to_string(i[0].item<int64_t>()) + "][" + std::to_string(i[1].item<int64_t>()) + "]";
}

// Rows of counts normalised to log-probabilities; a row with no mass keeps `fallback` (or becomes uniform).
at::Tensor normalise_rows(const at::Tensor& counts, const at::Tensor& fallback) {
  const at::Tensor total = counts.sum(-1, true);
  const at::Tensor uniform = at::full_like(counts, -std::log(static_cast<double>(counts.size(-1))));
  return at::where(total > 0, (counts / total).log(), fallback.defined() ? fallback.to(counts.dtype()) : uniform);
}

at::Tensor dirichlet_rows(int64_t rows, int64_t cols, at::Generator& gen) {
  const at::Tensor g = -at::empty({rows, cols}, at::kDouble).uniform_(1e-12, 1.0, gen).log();  // Gamma(1) = Exp(1)
  return (g / g.sum(-1, true)).log();
}

// Rows of log-probabilities [R,C] as one increasing array: row r's cumulative distribution shifted by r, so that
// draw() samples any rows' categorical distributions with one 1-d search instead of an [n,C] gather.
at::Tensor flat_cdf(const at::Tensor& log_probs) {
  at::Tensor c = log_probs.detach().cpu().to(at::kDouble).exp().cumsum(1);
  c.select(1, c.size(1) - 1).fill_(1.0);
  return (c + at::arange(c.size(0), c.options()).unsqueeze(1)).flatten();
}

at::Tensor draw(const at::Tensor& cdf, int64_t cols, const at::Tensor& rows, at::Generator& gen) {
  const at::Tensor u = at::empty({rows.size(0)}, at::kDouble).uniform_(0.0, 1.0, gen) + rows.to(at::kDouble);
  return (at::searchsorted(cdf, u, /*out_int32=*/false, /*right=*/true) - rows * cols).clamp(0, cols - 1);
}

// Start and transition counts of labelled sequences, and their one-hot posteriors [B,T,K].
struct LabelCounts {
  at::Tensor start, transitions, one_hot;
};
LabelCounts label_counts(const at::Tensor& states, const at::Tensor& lengths, int64_t K, const at::TensorOptions& opt) {
  if (!states.defined() || states.dim() != 2) throw Error("HMM: states must be a [B,T] tensor");
  const at::Tensor st = states.to(opt.device(), at::kLong);
  const at::Tensor mask = valid_mask(st, lengths);
  const at::Tensor bad = mask & ((st < 0) | (st >= K));
  if (bad.any().item<bool>()) throw Error("HMM: state " + index_of(bad) + " is outside [0, " + std::to_string(K) + ")");
  const at::Tensor ids = st.masked_fill(~mask, 0);
  const auto count = [&](const at::Tensor& x, int64_t n) { return at::bincount(x, {}, n).to(opt.dtype()); };
  const at::Tensor pairs = (ids.slice(1, 0, -1) * K + ids.slice(1, 1)).masked_select(mask.slice(1, 1));
  return {count(ids.select(1, 0), K), count(pairs, K * K).view({K, K}),
          at::one_hot(ids, K).to(opt.dtype()) * mask.unsqueeze(-1).to(opt.dtype())};
}

template <class HMM>
ChainPotentials chain(const HMM& m, const at::Tensor& observations, const at::Tensor& lengths) {
  m.check();
  ChainPotentials p;
  p.emissions = m.emission_scores(observations, lengths);
  p.transitions = m.log_transitions;
  p.start = m.log_start;
  if (lengths.defined()) p.lengths = lengths;
  return p;
}

std::string gigabytes(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f GB", bytes / 1e9);
  return text;
}

std::string number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", v);
  return text;
}

}  // namespace

void check_fits_in_memory(double bytes, const std::string& what) {
  const double memory = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  if (!(bytes <= memory))
    throw Error(what + " needs about " + gigabytes(bytes) + ", more than this machine's " + gigabytes(memory) +
                " of memory");
}

void check_model_shape(int64_t states, int64_t width, const std::string& unit, double copies) {
  if (states < 1) throw Error("a model needs at least 1 state, not " + std::to_string(states));
  if (width < 1)
    throw Error("a model needs at least 1 " + unit.substr(0, unit.size() - 1) + ", not " + std::to_string(width));
  const double K = static_cast<double>(states), W = static_cast<double>(width);
  // start, transitions and the emission parameters (a Gaussian has means and variances), float64
  const double bytes = 8 * (K + K * K + (unit == "features" ? 2 : 1) * K * W);
  check_fits_in_memory(copies * bytes, "a model of " + std::to_string(states) + " states and " + std::to_string(width) +
                                           " " + unit +
                                           (copies > 1 ? " (" + number(copies) + " copies of its parameters)" : ""));
}

void MStepOptions::check() const {
  if (!std::isfinite(smoothing) || smoothing < 0)
    throw Error("smoothing must be a finite number >= 0, not " + number(smoothing));
  if (!std::isfinite(covars_prior) || covars_prior <= 0)
    throw Error("covars_prior must be a finite number > 0 (it keeps variances above zero), not " +
                number(covars_prior));
}

// ---- categorical emissions ----

CategoricalHMM CategoricalHMM::random(int64_t num_states, int64_t num_symbols, uint64_t seed) {
  check_model_shape(num_states, num_symbols, "symbols", 2);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return {dirichlet_rows(1, num_states, gen).squeeze(0), dirichlet_rows(num_states, num_states, gen),
          dirichlet_rows(num_states, num_symbols, gen)};
}

void CategoricalHMM::check() const {
  check_chain(log_start, log_transitions, "categorical HMM");
  if (!log_emissions.defined() || log_emissions.dim() != 2 || log_emissions.size(0) != num_states())
    throw Error("categorical HMM: expected log_emissions [K,V] with K = " + std::to_string(num_states()));
}

CategoricalHMM CategoricalHMM::to(const at::TensorOptions& o) const {
  return {log_start.to(o), log_transitions.to(o), log_emissions.to(o)};
}

at::Tensor CategoricalHMM::emission_scores(const at::Tensor& observations, const at::Tensor& lengths) const {
  if (!observations.defined() || observations.dim() != 2) throw Error("HMM: observations must be a [B,T] tensor");
  const int64_t V = num_symbols();
  const at::Tensor obs = observations.to(log_emissions.device(), at::kLong);
  const at::Tensor mask = valid_mask(obs, lengths);
  const at::Tensor bad = mask & ((obs < 0) | (obs >= V));
  if (bad.any().item<bool>()) {
    const at::Tensor i = bad.nonzero()[0].cpu();
    throw Error("HMM: observation " + index_of(bad) + " = " +
                std::to_string(obs[i[0].item<int64_t>()][i[1].item<int64_t>()].item<int64_t>()) +
                " is outside the vocabulary [0, " + std::to_string(V) + ")");
  }
  const at::Tensor ids = obs.masked_fill(~mask, 0).flatten();
  // Rows of the transposed table, made contiguous first: each position then copies K consecutive scores instead of
  // gathering K scores V apart (which, once the table outgrows the cache, reads a memory sector per score).
  return log_emissions.t().contiguous().index_select(0, ids).view({obs.size(0), obs.size(1), num_states()});
}

ChainPotentials CategoricalHMM::potentials(const at::Tensor& observations, const at::Tensor& lengths) const {
  return chain(*this, observations, lengths);
}

at::Tensor CategoricalHMM::sample_emissions(const at::Tensor& states, at::Generator& gen) const {
  return draw(flat_cdf(log_emissions), num_symbols(), states, gen);
}

CategoricalHMM::Statistics& CategoricalHMM::Statistics::operator+=(const Statistics& o) {
  start = start.defined() ? start + o.start : o.start;
  transitions = transitions.defined() ? transitions + o.transitions : o.transitions;
  emissions = emissions.defined() ? emissions + o.emissions : o.emissions;
  log_likelihood += o.log_likelihood;
  return *this;
}

void CategoricalHMM::accumulate_emissions(Statistics& stats, const at::Tensor& posteriors,
                                          const at::Tensor& observations) const {
  const int64_t K = num_states(), V = num_symbols();
  const at::Tensor ids = observations.to(posteriors.device(), at::kLong).clamp(0, V - 1).flatten();
  // Padding has zero posterior, so its (clamped) id adds nothing.
  const at::Tensor counts = at::zeros({V, K}, posteriors.options()).index_add_(0, ids, posteriors.reshape({-1, K})).t();
  stats.emissions = stats.emissions.defined() ? stats.emissions + counts : counts;
}

CategoricalHMM CategoricalHMM::maximise(const Statistics& s, const MStepOptions& o) const {
  return {normalise_rows(s.start + o.smoothing, log_start.detach()),
          normalise_rows(s.transitions + o.smoothing, log_transitions.detach()),
          normalise_rows(s.emissions + o.smoothing, log_emissions.detach())};
}

// ---- diagonal-Gaussian emissions ----

GaussianHMM GaussianHMM::random(int64_t num_states, int64_t num_features, uint64_t seed) {
  check_model_shape(num_states, num_features, "features", 2);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor start = dirichlet_rows(1, num_states, gen).squeeze(0), trans = dirichlet_rows(num_states, num_states, gen);
  at::Tensor means = at::empty({num_states, num_features}, at::kDouble).normal_(0.0, 3.0, gen);
  at::Tensor vars = at::empty({num_states, num_features}, at::kDouble).uniform_(0.5, 2.0, gen);
  return {start, trans, means, vars};
}

void GaussianHMM::check() const {
  check_chain(log_start, log_transitions, "Gaussian HMM");
  const int64_t K = num_states();
  if (!means.defined() || !variances.defined() || means.dim() != 2 || means.size(0) != K ||
      variances.sizes() != means.sizes())
    throw Error("Gaussian HMM: expected means and variances [K,F] with K = " + std::to_string(K));
}

GaussianHMM GaussianHMM::to(const at::TensorOptions& o) const {
  return {log_start.to(o), log_transitions.to(o), means.to(o), variances.to(o)};
}

at::Tensor GaussianHMM::emission_scores(const at::Tensor& observations, const at::Tensor& lengths) const {
  if (!observations.defined() || observations.dim() != 3 || observations.size(2) != num_features())
    throw Error("Gaussian HMM: observations must be a [B,T,F] tensor with F = " + std::to_string(num_features()));
  const at::Tensor x = observations.to(means.options());
  // log N(x; μ, diag σ²) = -½ (F log 2π + Σ log σ² + Σ μ²/σ² - 2 x·(μ/σ²) + x²·(1/σ²)): two GEMMs, as hmmlearn.
  const at::Tensor precision = variances.reciprocal();
  const at::Tensor scaled_means = means * means * precision;
  const at::Tensor unusable = ~at::isfinite(precision) | ~at::isfinite(scaled_means);
  if (unusable.any().item<bool>()) {
    const at::Tensor i = unusable.nonzero()[0].cpu();
    const int64_t k = i[0].item<int64_t>(), f = i[1].item<int64_t>();
    throw Error("Gaussian HMM: variance [" + std::to_string(k) + "][" + std::to_string(f) +
                "] = " + number(variances[k][f].item<double>()) + " (mean " + number(means[k][f].item<double>()) +
                ") in " + (variances.scalar_type() == at::kFloat ? "float32" : "float64") +
                " is too small: 1/variance or mean²/variance overflows (compute in float64, or give the state a larger "
                "variance)");
  }
  // The expanded form cancels: data and means far from 0 (x ≈ μ ≈ 1000, σ² ≈ 0.3) leave float32 with no correct digit.
  // Both are measured from the states' average mean first, so the GEMMs see only the spread around it.
  const at::Tensor centre = means.mean(0);
  const at::Tensor centred_means = means - centre, xc = x - centre;
  const at::Tensor constant =
      num_features() * std::log(2 * M_PI) + variances.log().sum(1) + (centred_means * centred_means * precision).sum(1);
  // Formed in place (autograd keeps none of these results), so that two [B,T,K] tensors exist at most: the dataset
  // commands size their batches counting on it.
  at::Tensor scores = at::matmul(xc * xc, precision.t());
  scores.sub_(at::matmul(xc, (centred_means * precision).t()), 2).add_(constant).mul_(-0.5);
  if (!lengths.defined()) return scores;
  return scores.mul_(valid_mask(x, lengths).unsqueeze(-1).to(scores.dtype()));  // padding may hold anything finite
}

ChainPotentials GaussianHMM::potentials(const at::Tensor& observations, const at::Tensor& lengths) const {
  return chain(*this, observations, lengths);
}

at::Tensor GaussianHMM::sample_emissions(const at::Tensor& states, at::Generator& gen) const {
  const at::Tensor mu = means.detach().cpu().to(at::kDouble).index_select(0, states);
  const at::Tensor sd = variances.detach().cpu().to(at::kDouble).index_select(0, states).sqrt();
  return mu + sd * at::empty_like(mu).normal_(0.0, 1.0, gen);
}

GaussianHMM::Statistics& GaussianHMM::Statistics::operator+=(const Statistics& o) {
  const auto add = [](at::Tensor& a, const at::Tensor& b) { a = a.defined() ? a + b : b; };
  add(start, o.start);
  add(transitions, o.transitions);
  add(weight, o.weight);
  add(first, o.first);
  add(second, o.second);
  log_likelihood += o.log_likelihood;
  return *this;
}

void GaussianHMM::accumulate_emissions(Statistics& stats, const at::Tensor& posteriors,
                                       const at::Tensor& observations) const {
  const int64_t K = num_states(), F = num_features();
  const at::Tensor g = posteriors.reshape({-1, K});
  // Padding rows have zero posterior but may hold non-finite garbage: zero them so 0·x stays 0.
  const at::Tensor x = observations.to(g.options()).reshape({-1, F}).nan_to_num(0, 0, 0) * (g.sum(1, true) > 0);
  Statistics s{{}, {}, g.sum(0), at::matmul(g.t(), x), at::matmul(g.t(), x * x)};
  const auto add = [](at::Tensor& a, const at::Tensor& b) { a = a.defined() ? a + b : b; };
  add(stats.weight, s.weight);
  add(stats.first, s.first);
  add(stats.second, s.second);
}

GaussianHMM GaussianHMM::maximise(const Statistics& s, const MStepOptions& o) const {
  const at::Tensor denom = s.weight.unsqueeze(1);
  const at::Tensor mu = at::where(denom > 0, s.first / denom.clamp_min(1e-300), means.detach());
  // hmmlearn's diagonal update (means_weight = 0, covars_weight = 1).
  const at::Tensor sq = s.second - 2 * mu * s.first + mu * mu * denom;
  const at::Tensor var = (o.covars_prior + sq) / denom.clamp_min(1e-5);
  return {normalise_rows(s.start + o.smoothing, log_start.detach()),
          normalise_rows(s.transitions + o.smoothing, log_transitions.detach()), mu,
          at::where(denom > 0, var, variances.detach())};
}

// ---- generic inference and training ----

namespace {

// From this many states on, the transitions no longer fit the shared-memory chain kernels: on CUDA the streamed
// kernels take the HMM quantities (cuda/scaled_chain_forward.cu, cuda/hmm_expectations.cu).
constexpr int64_t kStreamedMinStates = 128;

bool any_requires_grad(std::initializer_list<const at::Tensor*> tensors) {
  if (!c10::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : tensors)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

// Whether the streamed CUDA kernels can take these potentials, whatever K (shapes as HMM::potentials builds them).
bool streamed_kernels_take(const ChainPotentials& p) {
  const at::Tensor& e = p.emissions;
  return cuda::kernels_built() && e.defined() && e.dim() == 3 && e.is_cuda() && e.size(0) > 0 && e.size(1) > 0 &&
         p.transitions.defined() && p.transitions.sizes() == at::IntArrayRef{e.size(2), e.size(2)} &&
         p.transitions.scalar_type() == e.scalar_type() && p.transitions.device() == e.device();
}

const char* quantity_name(HMMQuantity q) {
  switch (q) {
    case HMMQuantity::log_likelihood: return "log_likelihood";
    case HMMQuantity::posteriors: return "posteriors";
    case HMMQuantity::expected_statistics: return "expected_statistics";
  }
  return "?";
}

// The route each quantity is forced to on this thread (ForcedHMMRoute), if any.
thread_local std::array<std::optional<HMMRoute>, 3> forced_routes;

// The sequence lengths [B] on the emissions' device, checked to lie in [1, T] (one host transfer).
at::Tensor checked_lengths(const ChainPotentials& p) {
  const at::Tensor& e = p.emissions;
  const int64_t B = e.size(0), T = e.size(1);
  const auto long_opts = e.options().dtype(at::kLong);
  if (!p.lengths.defined()) return at::full({B}, T, long_opts);
  const at::Tensor lengths = p.lengths.to(long_opts).contiguous();
  const at::Tensor range = at::stack({lengths.min(), lengths.max()}).cpu();
  if (range[0].item<int64_t>() < 1 || range[1].item<int64_t>() > T)
    throw Error("HMM: sequence lengths must lie in [1, " + std::to_string(T) + "], got " +
                message::text(range[0].item<int64_t>(), " to ", range[1].item<int64_t>()));
  return lengths;
}

at::Tensor state_vector(const at::Tensor& t, const at::Tensor& emissions) {
  return t.defined() ? t.to(emissions.options()).contiguous() : at::zeros({emissions.size(2)}, emissions.options());
}

// The batch longest first: the sequences still running at step t are then the first running(t) of that order, and
// the steps past a sequence's end cost nothing.
struct LongestFirst {
  at::Tensor order;           // [B] positions in the batch, on the emissions' device
  at::Tensor sorted;          // [B] their lengths, on the device
  std::vector<int64_t> host;  // the same lengths on the host
  int64_t running(int64_t t) const {
    return std::upper_bound(host.begin(), host.end(), t, [](int64_t u, int64_t length) { return length <= u; }) -
           host.begin();
  }
};

LongestFirst longest_first(const at::Tensor& lengths) {
  const auto [sorted, order] = lengths.cpu().sort(/*stable=*/true, /*dim=*/0, /*descending=*/true);
  const int64_t* l = sorted.data_ptr<int64_t>();
  return {order.to(lengths.device()), sorted.to(lengths.device()), std::vector<int64_t>(l, l + sorted.size(0))};
}

// Posteriors, log-likelihoods and (optionally) expected start and transition counts of many-state potentials, without
// autograd and without framework operations per step: the forward messages of every step from the streamed forward
// kernels (cuda/scaled_chain_forward.cu, rebased each step, so float32 keeps its precision on long sequences), the
// backward ones from the same kernels run over each sequence reversed within its length with the transposed
// transitions, then one kernel over every position for the posteriors and the pair factors u, v
// (cuda/hmm_expectations.cu), and the expected transition counts as P ∘ (uᵀ v): one GEMM over the batch's pairs of
// positions.
struct StreamedExpectations {
  at::Tensor log_likelihood, nodes, start, transitions;
};

StreamedExpectations streamed_expectations(const ChainPotentials& p, bool with_counts) {
  c10::NoGradGuard no_grad;
  const at::Tensor& em = p.emissions;
  const int64_t B = em.size(0), K = em.size(2);
  const LongestFirst batch = longest_first(checked_lengths(p));
  const int64_t longest = batch.host[0];
  const at::Tensor start = state_vector(p.start, em), end = state_vector(p.end, em);
  const at::Tensor E = em.slice(1, 0, longest).index_select(0, batch.order).contiguous();  // [B,S,K], longest first
  // Row b of `reversed` is sequence b from its last position back to its first (then its first again, unread).
  const auto long_opts = batch.sorted.options();
  const at::Tensor back_steps =
      (batch.sorted.unsqueeze(1) - 1 - at::arange(longest, long_opts).unsqueeze(0)).clamp_min(0);
  const at::Tensor reversed =
      E.view({B * longest, K})
          .index_select(0, (back_steps + at::arange(B, long_opts).unsqueeze(1) * longest).flatten())
          .view({B, longest, K});
  const detail::ScaledRight forward = detail::scale_right(p.transitions.unsqueeze(0));
  const detail::ScaledRight backward = detail::scale_right(p.transitions.t().contiguous().unsqueeze(0));
  const double threshold = detail::underflow_threshold(em.scalar_type(), K);
  const at::Tensor colmax = forward.colmax.view({K}).contiguous();
  at::Tensor offset, last, unused_offset, unused_last;
  const at::Tensor alphas =
      cuda::rebased_scaled_chain_messages(E, forward.original[0].contiguous(), forward.scaled[0].contiguous(), colmax,
                                          start, batch.sorted, batch.host, threshold, offset, last);
  const at::Tensor betas = cuda::rebased_scaled_chain_messages(
      reversed, backward.original[0].contiguous(), backward.scaled[0].contiguous(),
      backward.colmax.view({K}).contiguous(), end, batch.sorted, batch.host, threshold, unused_offset, unused_last);
  StreamedExpectations r;
  r.log_likelihood =
      at::empty({B}, em.options())
          .index_copy_(0, batch.order, (at::logsumexp(last + end, -1).to(at::kDouble) + offset).to(em.scalar_type()));
  // Each sequence's pairs of positions (t, t + 1), packed longest first.
  std::vector<int64_t> pair_start(B);
  int64_t pairs = 0;
  for (int64_t b = 0; b < B; ++b) {
    pair_start[b] = pairs;
    pairs += batch.host[b] - 1;
  }
  const at::Tensor pair_start_device = at::tensor(pair_start, at::kLong).to(em.device());
  r.nodes = at::zeros_like(em);
  at::Tensor u, v;
  if (with_counts) {
    u = at::empty({pairs, K}, em.options());
    v = at::empty({pairs, K}, em.options());
  }
  cuda::hmm_posterior_rows(alphas, betas, E, batch.sorted, batch.order, pair_start_device, colmax, r.nodes,
                           with_counts ? &u : nullptr, with_counts ? &v : nullptr);
  if (!with_counts) return r;
  r.start = r.nodes.select(1, 0).sum(0);
  r.transitions = pairs > 0 ? forward.scaled[0] * at::mm(u.t(), v) : at::zeros({K, K}, em.options());
  return r;
}

at::Tensor streamed_log_likelihood(const ChainPotentials& p) {
  c10::NoGradGuard no_grad;
  const at::Tensor& e = p.emissions;
  const int64_t B = e.size(0), K = e.size(2);
  const LongestFirst batch = longest_first(checked_lengths(p));
  const at::Tensor start = state_vector(p.start, e), end = state_vector(p.end, e);
  const detail::ScaledRight w = detail::scale_right(p.transitions.unsqueeze(0));
  const double threshold = detail::underflow_threshold(e.scalar_type(), K);
  at::Tensor offset;
  const at::Tensor alpha = cuda::rebased_scaled_chain_forward(
      e.slice(1, 0, batch.host[0]).index_select(0, batch.order), w.original[0].contiguous(), w.scaled[0].contiguous(),
      w.colmax.view({K}), start, batch.sorted, batch.host, threshold, offset);
  return at::empty({B}, e.options())
      .index_copy_(0, batch.order, (at::logsumexp(alpha + end, -1).to(at::kDouble) + offset).to(e.scalar_type()));
}

}  // namespace

HMMRoute choose_route(HMMQuantity quantity, const ChainPotentials& p) {
  const std::optional<HMMRoute> forced = forced_routes[static_cast<std::size_t>(quantity)];
  if (forced) {
    if (*forced == HMMRoute::streamed && !streamed_kernels_take(p))
      throw Error(std::string("HMM ") + quantity_name(quantity) +
                  ": the streamed route needs potentials on a CUDA device (emissions [B,T,K] with B, T >= 1 and "
                  "transitions [K,K] of their dtype) in a build with CUDA; ForcedHMMRoute asked for it");
    return *forced;
  }
  // The E-step never differentiates; the other two keep the chain route when the potentials want gradients.
  const bool gradients = quantity != HMMQuantity::expected_statistics &&
                         any_requires_grad({&p.emissions, &p.transitions, &p.start, &p.end});
  return streamed_kernels_take(p) && p.emissions.size(2) >= kStreamedMinStates && !gradients ? HMMRoute::streamed
                                                                                             : HMMRoute::chain;
}

bool streamed_route_takes(c10::Device device, int64_t K) {
  return device.is_cuda() && cuda::kernels_built() && K >= kStreamedMinStates;
}

ForcedHMMRoute::ForcedHMMRoute(HMMQuantity quantity, HMMRoute route)
    : quantity_(quantity), previous_(forced_routes[static_cast<std::size_t>(quantity)]) {
  forced_routes[static_cast<std::size_t>(quantity)] = route;
}

ForcedHMMRoute::~ForcedHMMRoute() { forced_routes[static_cast<std::size_t>(quantity_)] = previous_; }

at::Tensor chain_log_likelihood(const ChainPotentials& p) {
  if (choose_route(HMMQuantity::log_likelihood, p) == HMMRoute::streamed) return streamed_log_likelihood(p);
  c10::NoGradGuard no_grad;
  return log_partition(p);
}

namespace detail {

std::optional<LikelihoodAndPath> likelihood_and_path(const ChainPotentials& p) {
  if (choose_route(HMMQuantity::log_likelihood, p) != HMMRoute::streamed) return std::nullopt;
  const at::Tensor& e = p.emissions;
  const int64_t B = e.size(0), T = e.size(1), K = e.size(2);
  const at::Tensor w = p.transitions.contiguous();
  if (!cuda::scaled_chain_supported(B, K) || !cuda::many_label_infer_supported(e, w)) return std::nullopt;
  if (w.max().item<float>() > 0.f) return std::nullopt;  // the Viterbi's integer comparison needs terms ≤ 0
  c10::NoGradGuard no_grad;
  const at::Tensor lengths = checked_lengths(p);
  const at::Tensor colmax = w.amax(0);
  LikelihoodAndPath r{at::Tensor(), {at::empty({B, T}, lengths.options()), at::empty({B}, e.options())}};
  cuda::many_label_infer(e.contiguous(), w, at::where(colmax.isinf(), at::zeros({}, colmax.options()), colmax),
                         state_vector(p.start, e), state_vector(p.end, e), lengths,
                         underflow_threshold(e.scalar_type(), K), r.log_likelihood, r.viterbi.path, r.viterbi.score);
  r.viterbi.path.masked_fill_(r.viterbi.score.isneginf().unsqueeze(1), -1);  // no label sequence allowed, as viterbi
  return r;
}

}  // namespace detail

Marginals chain_posteriors(const ChainPotentials& p) {
  if (choose_route(HMMQuantity::posteriors, p) == HMMRoute::streamed) {
    StreamedExpectations x = streamed_expectations(p, /*with_counts=*/false);
    Marginals m;
    m.log_partition = x.log_likelihood;
    m.nodes = x.nodes;
    return m;
  }
  return marginals(p);
}

template <class HMM>
at::Tensor log_likelihood(const HMM& hmm, const at::Tensor& observations, const at::Tensor& lengths) {
  const ChainPotentials p = hmm.potentials(observations, lengths);
  if (choose_route(HMMQuantity::log_likelihood, p) == HMMRoute::streamed) return chain_log_likelihood(p);
  return log_partition(p);
}

template <class HMM>
ForwardBackward forward_backward(const HMM& hmm, const at::Tensor& observations, const at::Tensor& lengths) {
  const ChainPotentials p = hmm.potentials(observations, lengths);
  return {forward_log_alphas(p), backward_log_betas(p), log_partition(p)};
}

template <class HMM>
at::Tensor posteriors(const HMM& hmm, const at::Tensor& observations, const at::Tensor& lengths) {
  const ChainPotentials p = hmm.potentials(observations, lengths);
  if (choose_route(HMMQuantity::posteriors, p) == HMMRoute::streamed) return chain_posteriors(p).nodes;
  return marginals(p).nodes;
}

template <class HMM>
ViterbiResult viterbi(const HMM& hmm, const at::Tensor& observations, const at::Tensor& lengths) {
  return viterbi(hmm.potentials(observations, lengths));
}

template <class HMM>
typename HMM::Statistics expected_statistics(const HMM& hmm, const at::Tensor& observations,
                                             const at::Tensor& lengths) {
  ChainPotentials p = hmm.potentials(observations, lengths);
  if (choose_route(HMMQuantity::expected_statistics, p) == HMMRoute::streamed) {
    const StreamedExpectations x = streamed_expectations(p, /*with_counts=*/true);
    typename HMM::Statistics s;
    s.start = x.start;
    s.transitions = x.transitions;
    s.log_likelihood = x.log_likelihood.sum().item<double>();
    hmm.accumulate_emissions(s, x.nodes, observations);
    return s;
  }
  c10::AutoGradMode grad_on(true);
  p.emissions = p.emissions.detach().requires_grad_();
  p.start = p.start.detach().requires_grad_();
  p.transitions = p.transitions.detach().requires_grad_();
  const at::Tensor total = log_partition(p).sum();
  // d total / d log-potential = expected number of times it is used: the E-step.
  const auto g = torch::autograd::grad({total}, {p.start, p.transitions, p.emissions});
  typename HMM::Statistics s;
  s.start = g[0];
  s.transitions = g[1];
  s.log_likelihood = total.item<double>();
  hmm.accumulate_emissions(s, g[2], observations);
  return s;
}

template <class HMM>
typename HMM::Statistics labelled_statistics(const HMM& shape, const at::Tensor& observations, const at::Tensor& states,
                                             const at::Tensor& lengths) {
  shape.check();
  const LabelCounts c = label_counts(states, lengths, shape.num_states(), shape.log_transitions.options());
  shape.emission_scores(observations, lengths);  // validates the observations (ids, shapes) with their index
  typename HMM::Statistics s;
  s.start = c.start;
  s.transitions = c.transitions;
  shape.accumulate_emissions(s, c.one_hot, observations);
  return s;
}

template <class HMM>
HMMSample sample(const HMM& hmm, int64_t num_sequences, int64_t min_length, int64_t max_length, uint64_t seed) {
  hmm.check();
  if (num_sequences < 1 || min_length < 1 || max_length < min_length)
    throw Error("HMM sample: need at least one sequence and 1 <= min_length <= max_length");
  // Per position: the state and its uniform, the emission draw's temporaries (about ten 8-byte numbers per position;
  // eight per feature for a Gaussian's), the mask and the observation (or feature vector).
  int64_t width = 1;
  if constexpr (std::is_same_v<HMM, GaussianHMM>) width = hmm.num_features();
  check_fits_in_memory(
      static_cast<double>(num_sequences) * static_cast<double>(max_length) * (128.0 + 64.0 * width),
      "sampling " + std::to_string(num_sequences) + " sequences of up to " + std::to_string(max_length) + " positions");
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor lengths = at::randint(min_length, max_length + 1, {num_sequences}, gen, at::kLong);
  const int64_t K = hmm.num_states();
  // The state chain in a plain loop (each step depends on the last, and a framework call per step would cost more
  // than the step), from one block of uniforms drawn in the order draw() would use them, step by step.
  const at::Tensor start = flat_cdf(hmm.log_start.unsqueeze(0)), trans = flat_cdf(hmm.log_transitions);
  const at::Tensor u = at::empty({max_length, num_sequences}, at::kDouble).uniform_(0.0, 1.0, gen);
  at::Tensor st = at::empty({num_sequences, max_length}, at::kLong);
  {
    const auto U = u.accessor<double, 2>();
    auto S = st.accessor<int64_t, 2>();
    const double *c0 = start.data_ptr<double>(), *c = trans.data_ptr<double>();
    // The first value of a row r's shifted distribution above u + r (draw()'s search), clamped as there.
    const auto pick = [K](const double* cdf, int64_t r, double x) {
      const double* row = cdf + r * K;
      return std::min<int64_t>(std::upper_bound(row, row + K, x + static_cast<double>(r)) - row, K - 1);
    };
    for (int64_t n = 0; n < num_sequences; ++n) S[n][0] = pick(c0, 0, U[0][n]);
    for (int64_t t = 1; t < max_length; ++t)
      for (int64_t n = 0; n < num_sequences; ++n) S[n][t] = pick(c, S[n][t - 1], U[t][n]);
  }
  const at::Tensor mask = at::arange(max_length, at::kLong).unsqueeze(0) < lengths.unsqueeze(1);
  at::Tensor obs = hmm.sample_emissions(st.flatten(), gen);
  obs = obs.view(obs.dim() == 1 ? at::IntArrayRef{num_sequences, max_length}
                                : at::IntArrayRef{num_sequences, max_length, obs.size(1)});
  obs = obs * (obs.dim() == 3 ? mask.unsqueeze(-1) : mask).to(obs.dtype());
  return {st.masked_fill(~mask, -1), obs, lengths};
}

CategoricalHMM fit_supervised(const at::Tensor& observations, const at::Tensor& states, const at::Tensor& lengths,
                              int64_t K, int64_t V, double smoothing) {
  MStepOptions{smoothing}.check();
  // Uniform rows: what a state keeps where the labels give it no counts (a label never followed by another, such as
  // sentence-final punctuation, or one that never occurs) and no smoothing gives it mass.
  const auto uniform = [](int64_t rows, int64_t cols) {
    return at::full({rows, cols}, -std::log(static_cast<double>(cols)), at::kDouble);
  };
  const CategoricalHMM shape{uniform(1, K).squeeze(0), uniform(K, K), uniform(K, V)};
  return shape.maximise(labelled_statistics(shape, observations, states, lengths), {smoothing});
}

TrigramCounts& TrigramCounts::operator+=(const TrigramCounts& o) {
  for (auto [a, b] : {std::pair{&unigrams, &o.unigrams},
                      {&bigrams, &o.bigrams},
                      {&trigrams, &o.trigrams},
                      {&emissions, &o.emissions}})
    *a = a->defined() ? *a + *b : *b;
  return *this;
}

TrigramCounts trigram_counts(const at::Tensor& observations, const at::Tensor& labels, const at::Tensor& lengths,
                             int64_t K, int64_t V) {
  // Uniform rows: what a state keeps where the labels give it no counts (a label never followed by another, such as
  // sentence-final punctuation, or one that never occurs) and no smoothing gives it mass.
  const auto uniform = [](int64_t rows, int64_t cols) {
    return at::full({rows, cols}, -std::log(static_cast<double>(cols)), at::kDouble);
  };
  const CategoricalHMM shape{uniform(1, K).squeeze(0), uniform(K, K), uniform(K, V)};
  const CategoricalHMM::Statistics s = labelled_statistics(shape, observations, labels, lengths);  // validates
  const at::Tensor l = labels.cpu().to(at::kLong);
  const at::Tensor mask = valid_mask(l, lengths.defined() ? lengths.cpu() : lengths);
  // Each sequence preceded by the start symbol K (twice, for the first trigram's context).
  const at::Tensor x = at::cat({at::full({l.size(0), 2}, K, at::kLong), l.masked_fill(~mask, 0)}, 1);
  const at::Tensor m = at::cat({at::ones({l.size(0), 2}, at::kBool), mask}, 1);
  const auto count = [](const at::Tensor& ids, int64_t n) { return at::bincount(ids, {}, n).to(at::kDouble); };
  const at::Tensor a = x.slice(1, 0, -2), b = x.slice(1, 1, -1), c = x.slice(1, 2), valid = m.slice(1, 2);
  TrigramCounts t;
  t.unigrams = s.emissions.sum(1);
  t.bigrams = count((b * K + c).masked_select(valid), (K + 1) * K).view({K + 1, K});
  // (start, start, c) is the start distribution, already in bigrams' row K: only real-context trigrams here.
  const at::Tensor tri = valid & (b < K);
  t.trigrams = count(((a * K + b) * K + c).masked_select(tri), (K + 1) * K * K).view({K + 1, K, K});
  t.emissions = s.emissions;
  return t;
}

CategoricalHMM second_order_hmm(const TrigramCounts& n, double emission_smoothing) {
  const int64_t K = n.unigrams.size(0);
  // TnT's deleted interpolation: each trigram's count goes to the estimate that best predicts it held out.
  const at::Tensor c3 = n.trigrams, c2ab = n.bigrams.unsqueeze(2);  // [K+1,K,1]
  const at::Tensor c2bc = n.bigrams.slice(0, 0, K).unsqueeze(0), c1b = n.unigrams.view({1, K, 1});
  const at::Tensor c1c = n.unigrams.view({1, 1, K});
  const double N = n.unigrams.sum().item<double>();
  const auto held_out = [](const at::Tensor& num, const at::Tensor& den) {
    return at::where(den > 1, (num - 1) / (den - 1).clamp_min(1), at::zeros_like(num));
  };
  const at::Tensor r3 = held_out(c3, c2ab.expand_as(c3)), r2 = held_out(c2bc.expand_as(c3), c1b.expand_as(c3));
  const at::Tensor r1 = (c1c.expand_as(c3) - 1) / (N - 1);
  const at::Tensor seen = c3 > 0;
  const at::Tensor w3 = seen & (r3 >= r2) & (r3 >= r1), w2 = seen & ~w3 & (r2 >= r1), w1 = seen & ~w3 & ~w2;
  at::Tensor lambda = at::stack({(c3 * w1).sum(), (c3 * w2).sum(), (c3 * w3).sum()});
  lambda = lambda / lambda.sum();
  const auto rows = [](const at::Tensor& c) { return c / c.sum(-1, true).clamp_min(1e-300); };
  const at::Tensor p3 = rows(c3), p2 = rows(n.bigrams.slice(0, 0, K)).unsqueeze(0),
                   p1 = (n.unigrams / N).view({1, 1, K});
  const at::Tensor mix = lambda[2] * p3 + lambda[1] * p2 + lambda[0] * p1;
  // [K+1,K,K]: P(c | a, b). Contexts never seen lack the trigram part (renormalised) or, with a zero unigram weight,
  // everything (uniform).
  const at::Tensor total = mix.sum(-1, true);
  const at::Tensor p = at::where(total > 0, mix / total.clamp_min(1e-300), at::full_like(mix, 1.0 / K));
  // Pair states (a,b), a in [0,K] (K: start): (a,b) -> (b,c) with probability p[a][b][c].
  const int64_t S = (K + 1) * K;
  at::Tensor trans = at::zeros({K + 1, K, K + 1, K}, at::kDouble);
  const at::Tensor bi = at::arange(K);
  trans.index_put_({at::indexing::Slice(), bi, bi}, p);  // p[a][b][c] at (a,b) -> (b,c)
  trans = trans.view({S, S});
  at::Tensor start = at::zeros({K + 1, K}, at::kDouble);
  start[K] = (lambda[2] + lambda[1]) * rows(n.bigrams[K]) + lambda[0] * n.unigrams / N;  // P(b | start)
  const at::Tensor emit = normalise_rows(n.emissions + emission_smoothing, {});
  return {start.flatten().log(), trans.log(), emit.repeat({K + 1, 1})};
}

template <class HMM>
BaumWelchResult<HMM> baum_welch(const HMM& initial, const at::Tensor& observations, const at::Tensor& lengths,
                                const BaumWelchOptions& options) {
  initial.check();
  options.m_step.check();
  if (options.max_iterations < 0) throw Error("Baum-Welch: max_iterations must be >= 0");
  if (!std::isfinite(options.tolerance) || options.tolerance < 0)
    throw Error("Baum-Welch: tolerance must be a finite number >= 0, not " + number(options.tolerance));
  const double tokens = valid_mask(observations, lengths).sum().item<double>();
  BaumWelchResult<HMM> result{initial, {}, false};
  for (int it = 0; it < options.max_iterations; ++it) {
    const typename HMM::Statistics s = expected_statistics(result.model, observations, lengths);
    const double ll = s.log_likelihood;
    const bool converged =
        !result.log_likelihood.empty() && ll - result.log_likelihood.back() < options.tolerance * tokens;
    result.log_likelihood.push_back(ll);
    if (converged) {
      result.converged = true;
      break;
    }
    result.model = result.model.maximise(s, options.m_step);
  }
  return result;
}

#define TRELLIS_INSTANTIATE_HMM(HMM)                                                                   \
  template at::Tensor log_likelihood<HMM>(const HMM&, const at::Tensor&, const at::Tensor&);           \
  template ForwardBackward forward_backward<HMM>(const HMM&, const at::Tensor&, const at::Tensor&);    \
  template at::Tensor posteriors<HMM>(const HMM&, const at::Tensor&, const at::Tensor&);               \
  template ViterbiResult viterbi<HMM>(const HMM&, const at::Tensor&, const at::Tensor&);               \
  template HMM::Statistics expected_statistics<HMM>(const HMM&, const at::Tensor&, const at::Tensor&); \
  template HMM::Statistics labelled_statistics<HMM>(const HMM&, const at::Tensor&, const at::Tensor&,  \
                                                    const at::Tensor&);                                \
  template HMMSample sample<HMM>(const HMM&, int64_t, int64_t, int64_t, uint64_t);                     \
  template BaumWelchResult<HMM> baum_welch<HMM>(const HMM&, const at::Tensor&, const at::Tensor&,      \
                                                const BaumWelchOptions&);
TRELLIS_INSTANTIATE_HMM(CategoricalHMM)
TRELLIS_INSTANTIATE_HMM(GaussianHMM)
#undef TRELLIS_INSTANTIATE_HMM

}  // namespace trellis
