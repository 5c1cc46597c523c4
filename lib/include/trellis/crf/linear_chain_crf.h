// Linear-chain CRF over log potentials: partition function, gold score, log-likelihood, marginals, Viterbi.
//
// Every quantity is one dynamic program over trellis::semiring_matmul: LogSemiring gives the log-partition, whose
// gradient gives the marginals; MaxSemiring gives the Viterbi score, whose gradient is the indicator of the best path.
// Works on CPU and CUDA tensors (float32/float64) with autograd through everything except marginals/viterbi outputs.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace trellis {

// Scores of a batch of label sequences. Positions t >= lengths[b] are padding and never read as scores.
struct ChainPotentials {
  at::Tensor emissions;    // [B,T,K]: score of label k at position t
  at::Tensor transitions;  // [K,K]:   transitions[i][j] scores label i followed by label j
  at::Tensor start;        // [K] or undefined (zeros): score of the first label
  at::Tensor end;          // [K] or undefined (zeros): score of the last label
  at::Tensor lengths;      // [B] int64 (any device) or undefined (all T); each in [1, T]
  // Every function checks that lengths and tags lie in range, which on a GPU costs a device-to-host transfer (a
  // sync; log_likelihood checks on the device where it can, see there). A caller that built them itself, like the
  // trainer in its inner loop, may vouch for them and skip that.
  bool values_checked = false;
};

// log Z [B]: ⊕ over all label sequences of their total score (LogSemiring).
at::Tensor log_partition(const ChainPotentials& p);

// Total score [B] of the given labels tags [B,T] (int64; padding positions are ignored).
at::Tensor gold_score(const ChainPotentials& p, const at::Tensor& tags);

// log p(tags | x) = gold_score - log_partition, [B]. On CUDA, while the label count fits the shared-memory kernels
// (K up to about 1000 in float32), lengths and tags are checked by those kernels instead of on the host, so that the
// call never waits for the GPU: a sequence with a length outside [1, T] or a tag outside [0, K) gets a NaN
// log-likelihood and NaN gradients rather than an Error. Elsewhere such values are an Error naming the index.
at::Tensor log_likelihood(const ChainPotentials& p, const at::Tensor& tags);

// log_likelihood [B], its sum over the batch divided by `divisor` (1: the sum; B: the batch mean), and the gradients of
// its sum w.r.t. emissions, transitions, start and end (undefined where the potentials have no start or end), without
// building an autograd graph: one forward and one backward pass of the fused kernels where they take the input (for
// callers that want both at once, like a training step; on the shared-memory CUDA kernels the reduced value comes from
// the backward pass's last launch, with no launch of its own), autograd elsewhere. Lengths and tags are checked as by
// log_likelihood.
struct LogLikelihoodGradients {
  at::Tensor log_likelihood;  // [B]
  at::Tensor reduced;         // 0-dim: Σ_b log_likelihood[b] / divisor
  at::Tensor emissions;       // the gradient of Σ_b log_likelihood[b] for the emissions [B,T,K]
  at::Tensor transitions;     // for the transitions [K,K]
  at::Tensor start;           // for the start scores [K]; undefined without them
  at::Tensor end;             // for the end scores [K]; undefined without them
};
// See LogLikelihoodGradients.
LogLikelihoodGradients log_likelihood_with_gradients(const ChainPotentials& p, const at::Tensor& tags,
                                                     double divisor = 1.0);

// Forward and backward log-messages [B,T,K]: alpha[b,t,k] scores every prefix ending in label k at t (emission at t
// included), beta[b,t,k] every suffix after t given label k at t (end score included). Zero-filled at padding.
at::Tensor forward_log_alphas(const ChainPotentials& p);
at::Tensor backward_log_betas(const ChainPotentials& p);  // see forward_log_alphas

// What marginals returns.
struct Marginals {
  at::Tensor log_partition;  // [B]
  at::Tensor nodes;          // [B,T,K]: P(y_t = k); zero at padding
  at::Tensor edges;          // [B,T-1,K,K]: P(y_t = i, y_{t+1} = j); undefined unless requested
};
// Marginals as the gradient of the log-partition with respect to the potentials (not themselves differentiable).
Marginals marginals(const ChainPotentials& p, bool with_edges = false);

// The best label sequence of each sequence and its score.
struct ViterbiResult {
  at::Tensor path;   // [B,T] int64 best labels; -1 at padding, and everywhere when no label sequence is allowed
  at::Tensor score;  // [B] score of that path; -inf when no label sequence is allowed
};
// The best label sequence of each sequence (ties go to the lowest label), without gradients.
ViterbiResult viterbi(const ChainPotentials& p);

// The k best label sequences of each sequence, best first (ties: lower labels first). paths [B,k,T] int64 with -1 at
// padding, scores [B,k]; where fewer than k sequences exist (or are allowed), the rest have score -inf and path -1.
// Computed on the CPU (inputs on other devices are copied).
struct KBestResult {
  at::Tensor paths;   // [B,k,T] int64
  at::Tensor scores;  // [B,k]
};
// See KBestResult.
KBestResult kbest_viterbi(const ChainPotentials& p, int64_t k);

// The best path's score [B] with autograd: its gradient is the indicator of one best path (ties go to the lowest
// label), as used by structured perceptron and max-margin training.
at::Tensor viterbi_score(const ChainPotentials& p);

// Which label transitions are allowed (true) or forbidden (false).
struct TransitionConstraints {
  at::Tensor transitions;  // [K,K] bool
  at::Tensor start;        // [K] bool
  at::Tensor end;          // [K] bool
};

// Chunk tagging schemes: B(egin)/I(nside)/O(utside), and with E(nd) and S(ingle).
enum class TagScheme { BIO, BIOES };

// Constraints of a chunk tagging scheme for labels named "O", "B-X", "I-X" (and "E-X", "S-X" for BIOES).
// A label that does not fit the scheme is an error naming it.
TransitionConstraints tag_scheme_constraints(const std::vector<std::string>& labels, TagScheme scheme);

// The same potentials with forbidden transitions, starts and ends set to -inf: Viterbi on the result is constrained
// decoding, and log_partition sums over allowed sequences only.
ChainPotentials constrain(const ChainPotentials& p, const TransitionConstraints& c);

}  // namespace trellis
