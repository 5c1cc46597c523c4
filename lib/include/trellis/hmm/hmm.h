// Hidden Markov models with categorical or diagonal-Gaussian emissions. Inference reuses the linear-chain dynamic
// program: an HMM is a chain whose potentials are log-probabilities (start, transitions, and the log-density of each
// observation under each state). Training's E-step is the gradient of the log-likelihood with respect to those
// potentials, so no T×K×K tensor is ever built.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "trellis/crf/linear_chain_crf.h"

namespace trellis {

// Sizes checked before allocating: an Error naming `what` when `bytes` exceed this machine's physical memory, instead
// of an allocator's failure deep inside a computation.
void check_fits_in_memory(double bytes, const std::string& what);
// A model of `states` >= 1 states and `width` >= 1 symbols or features (`unit`: "symbols" or "features"), whose
// float64 parameters fit in memory `copies` times over (training holds several copies: statistics, gradients).
void check_model_shape(int64_t states, int64_t width, const std::string& unit, double copies = 1);

// M-step settings, hmmlearn's conventions (so that EM from the same start reaches the same model).
struct MStepOptions {
  double smoothing = 0.0;      // added to every expected start, transition and categorical emission count
  double covars_prior = 1e-2;  // Gaussian: variance = (covars_prior + Σγ(x-μ)²) / Σγ, keeps variances above zero
  void check() const;          // smoothing finite and >= 0, covars_prior finite and > 0
};

// Observations: int64-convertible symbol ids [B,T] in [0,V) (padding may hold anything).
struct CategoricalHMM {
  at::Tensor log_start;        // [K]   log P(s_0 = k)
  at::Tensor log_transitions;  // [K,K] log P(s_t = j | s_{t-1} = i)
  at::Tensor log_emissions;    // [K,V] log P(o_t = v | s_t = k)

  int64_t num_states() const { return log_transitions.size(0); }  // K
  int64_t num_symbols() const { return log_emissions.size(1); }   // V

  // A random model (rows drawn from a Dirichlet(1)), float64 on the CPU.
  static CategoricalHMM random(int64_t num_states, int64_t num_symbols, uint64_t seed);
  // Error naming the tensors at fault unless every tensor is there with shapes that agree.
  void check() const;
  // The same model with its tensors converted (device, dtype).
  CategoricalHMM to(const at::TensorOptions& options) const;
  // log P(o_t | s_t = k), [B,T,K]; zero at padding.
  at::Tensor emission_scores(const at::Tensor& observations, const at::Tensor& lengths = {}) const;
  // The linear-chain potentials of the sequences (emission scores, transitions, start): every chain function applies.
  ChainPotentials potentials(const at::Tensor& observations, const at::Tensor& lengths = {}) const;
  at::Tensor sample_emissions(const at::Tensor& states, at::Generator& gen) const;  // [n] -> [n]

  // Expected (or, from labels, observed) sufficient statistics, summed over sequences.
  struct Statistics {
    at::Tensor start;           // [K] first states
    at::Tensor transitions;     // [K,K] state pairs
    at::Tensor emissions;       // [K,V]
    double log_likelihood = 0;  // of the sequences accumulated (E-step only)
    // Adds another batch's (or rank's) statistics.
    Statistics& operator+=(const Statistics& other);
  };
  // Adds Σ_t posteriors[b,t,k] · [o_t = v] to stats (posteriors [B,T,K], zero at padding).
  void accumulate_emissions(Statistics& stats, const at::Tensor& posteriors, const at::Tensor& observations) const;
  // The M-step: the model that maximises the likelihood of the statistics (with options' smoothing).
  CategoricalHMM maximise(const Statistics& stats, const MStepOptions& options = {}) const;
};

// Observations: feature vectors [B,T,F] (float32/float64). Variances so small that 1/variance or mean²/variance
// overflows the computation's type (below about 1e-38 in float32, 1e-308 in float64) are an error naming the state and
// feature: they would turn every score into NaN.
struct GaussianHMM {
  at::Tensor log_start;        // [K]
  at::Tensor log_transitions;  // [K,K]
  at::Tensor means;            // [K,F]
  at::Tensor variances;        // [K,F] diagonal covariances, > 0

  int64_t num_states() const { return log_transitions.size(0); }  // K
  int64_t num_features() const { return means.size(1); }          // F

  // A random model: Dirichlet(1) start and transition rows, means ~ N(0, 3²), variances ~ U(0.5, 2).
  static GaussianHMM random(int64_t num_states, int64_t num_features, uint64_t seed);
  // Error naming the tensors at fault unless every tensor is there with shapes that agree.
  void check() const;
  // The same model with its tensors converted (device, dtype).
  GaussianHMM to(const at::TensorOptions& options) const;
  // log N(x_t; μ_k, diag(σ²_k)), [B,T,K]; zero at padding.
  at::Tensor emission_scores(const at::Tensor& observations, const at::Tensor& lengths = {}) const;
  // The linear-chain potentials of the sequences (emission scores, transitions, start): every chain function applies.
  ChainPotentials potentials(const at::Tensor& observations, const at::Tensor& lengths = {}) const;
  at::Tensor sample_emissions(const at::Tensor& states, at::Generator& gen) const;  // [n] -> [n,F]

  // Expected (or, from labels, observed) sufficient statistics, summed over sequences.
  struct Statistics {
    at::Tensor start;           // [K] first states
    at::Tensor transitions;     // [K,K] state pairs
    at::Tensor weight;          // [K]   Σ_t γ_t(k)
    at::Tensor first;           // [K,F] Σ_t γ_t(k) x_t
    at::Tensor second;          // [K,F] Σ_t γ_t(k) x_t²
    double log_likelihood = 0;  // of the sequences accumulated (E-step only)
    // Adds another batch's (or rank's) statistics.
    Statistics& operator+=(const Statistics& other);
  };
  // Adds the posterior-weighted sums of x and x² (posteriors [B,T,K], zero at padding) to stats.
  void accumulate_emissions(Statistics& stats, const at::Tensor& posteriors, const at::Tensor& observations) const;
  // The M-step: the model that maximises the likelihood of the statistics (variances with options' covars_prior).
  GaussianHMM maximise(const Statistics& stats, const MStepOptions& options = {}) const;
};

// The functions below are defined for HMM = CategoricalHMM and GaussianHMM. Sequences are [B,T] (or [B,T,F])
// padded batches with lengths [B] (undefined: all T).

// log P(observations) per sequence, [B]; differentiable w.r.t. the model's tensors.
template <class HMM>
at::Tensor log_likelihood(const HMM& hmm, const at::Tensor& observations, const at::Tensor& lengths = {});

// log P(observations) per sequence [B] from an HMM's chain potentials (HMM::potentials), without gradients: the value
// of log_partition(p). With many states on CUDA it runs the streamed forward kernel in the potentials' own dtype,
// its messages rebased each step, so float32 stays float32 (and exact to about 1e-6 relative) on long sequences.
at::Tensor chain_log_likelihood(const ChainPotentials& p);

// Node posteriors [B,T,K] (zero at padding) and log-likelihoods [B] of an HMM's chain potentials, without gradients:
// the values of marginals(p). With many states on CUDA, the streamed forward kernels run forwards and over the reversed
// sequences, messages rebased each step (float32 stays float32 on long sequences), then one kernel over the positions.
Marginals chain_posteriors(const ChainPotentials& p);

// The routes of the HMM quantities (docs/architecture.md):
// - chain: the linear-chain functions (log_partition, marginals; the E-step as the gradient of log_partition), whose
//   own routes apply: any device, gradients included;
// - streamed: the many-state CUDA kernels (cuda/scaled_chain_forward.cu, cuda/hmm_expectations.cu), two launches per
//   step and direction, messages rebased each step; CUDA potentials, no gradients.
enum class HMMRoute { chain, streamed };
// The quantities that have a route: log P(observations), node posteriors, the E-step's expected statistics.
enum class HMMQuantity { log_likelihood, posteriors, expected_statistics };

// The route `quantity` takes for these potentials: streamed for CUDA potentials of at least 128 states that want no
// gradients (the E-step never does), chain otherwise; or the route a ForcedHMMRoute on this thread names.
HMMRoute choose_route(HMMQuantity quantity, const ChainPotentials& p);
// Whether choose_route gives the streamed route to potentials of K states on `device` that want no gradients (what
// the dataset commands size their batches for).
bool streamed_route_takes(c10::Device device, int64_t K);

// For tests: while it lives, choose_route answers `route` for `quantity` on the constructing thread, at any K (so each
// route can be checked against a reference on small models). The streamed route still needs CUDA potentials: forced
// on others, choose_route throws an Error.
class ForcedHMMRoute {
 public:
  // Forces `route` for `quantity` on this thread until destroyed (then the previous forcing, if any, applies again).
  ForcedHMMRoute(HMMQuantity quantity, HMMRoute route);
  ~ForcedHMMRoute();
  ForcedHMMRoute(const ForcedHMMRoute&) = delete;
  ForcedHMMRoute& operator=(const ForcedHMMRoute&) = delete;

 private:
  HMMQuantity quantity_;
  std::optional<HMMRoute> previous_;
};

// The forward and backward messages of sequences, and their log-likelihoods.
struct ForwardBackward {
  at::Tensor log_alpha;       // [B,T,K] log P(o_0..o_t, s_t = k)
  at::Tensor log_beta;        // [B,T,K] log P(o_{t+1}.. | s_t = k)
  at::Tensor log_likelihood;  // [B]
};
// Both message passes, in log space.
template <class HMM>
ForwardBackward forward_backward(const HMM& hmm, const at::Tensor& observations, const at::Tensor& lengths = {});

// P(s_t = k | observations), [B,T,K], zero at padding.
template <class HMM>
at::Tensor posteriors(const HMM& hmm, const at::Tensor& observations, const at::Tensor& lengths = {});

// Most probable state sequence and its joint log-probability.
template <class HMM>
ViterbiResult viterbi(const HMM& hmm, const at::Tensor& observations, const at::Tensor& lengths = {});

// E-step for one batch: expected statistics and the batch's total log-likelihood.
template <class HMM>
typename HMM::Statistics expected_statistics(const HMM& hmm, const at::Tensor& observations,
                                             const at::Tensor& lengths = {});
// Observed statistics of labelled sequences (states [B,T] in [0,K)), for supervised maximum likelihood:
// hmm.maximise(labelled_statistics(...)) with MStepOptions::smoothing as additive (Laplace) smoothing.
template <class HMM>
typename HMM::Statistics labelled_statistics(const HMM& shape, const at::Tensor& observations, const at::Tensor& states,
                                             const at::Tensor& lengths = {});

// Sampled sequences and the hidden states that produced them.
struct HMMSample {
  at::Tensor states;        // [B,T] int64, -1 at padding
  at::Tensor observations;  // [B,T] int64 or [B,T,F], zero at padding
  at::Tensor lengths;       // [B]
};
// num_sequences sequences with lengths drawn uniformly from [min_length, max_length].
template <class HMM>
HMMSample sample(const HMM& hmm, int64_t num_sequences, int64_t min_length, int64_t max_length, uint64_t seed);

// Maximum-likelihood estimate of a categorical HMM from labelled sequences with additive (Laplace) smoothing.
CategoricalHMM fit_supervised(const at::Tensor& observations, const at::Tensor& states, const at::Tensor& lengths,
                              int64_t num_states, int64_t num_symbols, double smoothing = 1.0);

// Second-order (trigram) HMM taggers, run as first-order HMMs over (previous, current) label pairs: state a·K + b
// for labels a, b in [0,K), and K·K + b for a sequence's first label b. Only pair-consistent transitions
// (a,b) -> (b,c) are allowed (-inf elsewhere) and every pair emits like its current label.
struct TrigramCounts {
  at::Tensor unigrams;   // [K]
  at::Tensor bigrams;    // [K+1,K]: row K is the sequence start
  at::Tensor trigrams;   // [K+1,K,K]: [a][b][c], a = K for the sequence start
  at::Tensor emissions;  // [K,V]
  // Adds another batch's counts.
  TrigramCounts& operator+=(const TrigramCounts& other);
};
// The counts of labelled sequences (labels [B,T] in [0, num_labels), observations [B,T] in [0, num_symbols)).
TrigramCounts trigram_counts(const at::Tensor& observations, const at::Tensor& labels, const at::Tensor& lengths,
                             int64_t num_labels, int64_t num_symbols);
// Transitions interpolate trigram, bigram and unigram estimates with TnT's deleted-interpolation weights; emissions
// get additive smoothing.
CategoricalHMM second_order_hmm(const TrigramCounts& counts, double emission_smoothing);
// The current label of a second-order model's state (its pair's second label).
inline int64_t pair_label(int64_t state, int64_t num_labels) { return state % num_labels; }

// When baum_welch stops, and its M-step.
struct BaumWelchOptions {
  int max_iterations = 100;  // EM iterations at most
  double tolerance = 1e-6;   // stop when the total log-likelihood gains less than this (relative to the token count)
  MStepOptions m_step;       // each iteration's M-step
};
// What baum_welch returns.
template <class HMM>
struct BaumWelchResult {
  HMM model;                           // the model after the last update
  std::vector<double> log_likelihood;  // total log-likelihood of the data before each update
  bool converged = false;              // whether the tolerance was met before max_iterations
};
// EM from `initial` on sequences held in memory (trellis hmm fit streams batches from files with the same pieces).
template <class HMM>
BaumWelchResult<HMM> baum_welch(const HMM& initial, const at::Tensor& observations, const at::Tensor& lengths = {},
                                const BaumWelchOptions& options = {});

}  // namespace trellis
