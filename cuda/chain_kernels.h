// Launchers of the linear-chain kernels: the fused ones (cuda/chain_fused.cu, and cuda/chain_fused_scaled.cu for many
// labels), the streamed forward (cuda/scaled_chain_forward.cu) and the many-label Viterbi (cuda/many_label_viterbi.cu).
// Tensors are contiguous CUDA tensors of one dtype (lengths, tags and back-pointers int64); outputs are preallocated by
// the caller. See lib/src/crf/chain_fused.h for the semantics.
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

namespace trellis::cuda {

// A batch of linear chains: emissions [B,T,K], transitions [K,K], start [K] and end [K] of one floating dtype, lengths
// [B] int64 (undefined: every sequence T long; chain_forward, chain_backward and chain_backtrace take that, the
// many-label kernels do not) and tags [B,T] int64 (empty: none). The CPU loops of lib/src/crf/chain_fused.cpp take the
// same.
struct ChainInputs {
  at::Tensor emissions, transitions, start, end, lengths, tags;
};

// What a fused forward pass writes (preallocated by the caller) and its backward pass reads: alpha [B,T,K] (each step
// minus the largest entry of the step before) and pre [B,T,K] (the ⊕ before the emission is added, in the previous
// alpha's frame); the back-pointers arg [B,T,K] and end_arg [B] (int64; undefined where the semiring records none, see
// S::Backpointers); score [B], frame_score [B] (the score in the last alpha's frame) and loglik [B] (with tags: the
// tagged sequences' log-likelihoods; otherwise empty). path [B,T] int64, where defined (MaxSemiring, chain_forward):
// the forward pass also writes each sequence's best labels into it as chain_backtrace does, in the forward launch where a
// block's back-pointers fit its shared memory (arg and end_arg are then not written), else by chain_backtrace after it.
struct ChainRecord {
  at::Tensor alpha, pre, arg, end_arg, score, frame_score, loglik, path;
};

// The gradients of a fused backward pass: emissions [B,T,K], transitions [K,K], start [K] and end [K]. Where
// loglik_sum is defined (0-dim, preallocated, of the record's dtype), chain_backward also writes to it the sum of the
// record's loglik over the batch divided by sum_divisor (a training step's reduced log-likelihood), in the launch that
// sums the transitions' partials, in a fixed order.
struct ChainGradients {
  at::Tensor emissions, transitions, start, end;
  at::Tensor loglik_sum;
  double sum_divisor = 1;
};

// Whether the fused kernels take K labels of this dtype (their transitions and gradient partials live in shared
// memory).
bool chain_supported(int64_t K, at::ScalarType dtype);

// Fills the record (alpha and pre undefined: not written, for Viterbi alone). Lengths and tags need not have been
// checked on the host: a sequence whose length is outside [1, T] or whose tags (within its length) are outside [0, K)
// gets NaN as score, frame_score and loglik.
template <class S>
void chain_forward(const ChainInputs& in, ChainRecord& record);

// Given the gradient of the forward's output [B] (score, or loglik with tags; undefined: all ones; any stride, so that
// a sum's backward, one value expanded with stride 0, is read as it is), the inputs (all but emissions and start are
// read) and the forward's record (its frame_score is the score the gradients start from), fills grads: emissions
// (zero at padding; NaN for a sequence the forward pass scored NaN), transitions, start and end (preallocated,
// contiguous, each its own storage).
template <class S>
void chain_backward(const at::Tensor& grad_score, const ChainInputs& in, const ChainRecord& record,
                    ChainGradients& grads);

// Viterbi backtrace from MaxSemiring's forward record (arg, end_arg, score): path [B,T] int64 gets each sequence's best
// labels (following arg from end_arg at the last position) and -1 at padding; a sequence whose best score is -inf (no
// label sequence allowed) gets -1 everywhere. One thread per sequence.
void chain_backtrace(const ChainRecord& record, const at::Tensor& lengths, at::Tensor& path);

// The transitions W in scaled probability space: scaled = exp(W − colmax) [K,K], colmax [K] (0 for an all -inf column),
// and the threshold below which a column's scaled sum may have lost terms to underflow (it is then computed exactly).
struct ScaledTransitions {
  at::Tensor scaled, colmax;
  double threshold = 0;
};

// The fused LogSemiring chain for many labels (cuda/chain_fused_scaled.cu): whether it takes K labels of this dtype,
// and the same forward and backward as chain_forward / chain_backward, given also the scaled transitions (lengths
// defined). The forward writes no frame_score (its alphas are in the score's own frame): the record's frame_score is to
// be its score.
bool scaled_chain_crf_supported(int64_t K, at::ScalarType dtype);

void scaled_chain_crf_forward(const ChainInputs& in, const ScaledTransitions& w, ChainRecord& record);

// Sets grads' transitions, start and end to new tensors (fills their emissions).
void scaled_chain_crf_backward(const at::Tensor& grad_score, const ChainInputs& in, const ScaledTransitions& w,
                               const ChainRecord& record, ChainGradients& grads);

// The streamed forward (cuda/scaled_chain_forward.cu): whether scaled_chain_forward takes B sequences of K labels
// (few sequences: it streams the transitions once per step for every 16 of them, up to 32).
bool scaled_chain_supported(int64_t B, int64_t K);

// The LogSemiring forward messages at each sequence's last position, alpha [B,K], without gradients: emissions
// [B,T,K] (contiguous), transitions W [K,K], scaled = exp(W − colmax) [K,K], colmax [K] (0 for all -inf columns),
// start [K], lengths [B] int64 in [1, T]. Outputs whose scaled sum is below threshold are recomputed exactly.
at::Tensor scaled_chain_forward(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& scaled,
                                const at::Tensor& colmax, const at::Tensor& start, const at::Tensor& lengths,
                                double threshold);

// The same streamed forward (see scaled_chain_forward for the arguments) for a batch longest first (lengths
// non-increasing, and `longest_first` the same lengths on the host: each step launches only the sequences still
// running), with each step's messages rebased by the previous step's largest entry: returns alpha [B,K] and sets
// offset [B] (float64) such that the messages at each sequence's end are alpha + offset. float32 then keeps its
// precision on long sequences, whose unshifted messages would grow to about −T.
at::Tensor rebased_scaled_chain_forward(const at::Tensor& emissions, const at::Tensor& transitions,
                                        const at::Tensor& scaled, const at::Tensor& colmax, const at::Tensor& start,
                                        const at::Tensor& lengths, const std::vector<int64_t>& longest_first,
                                        double threshold, at::Tensor& offset);

// The same recursion keeping every step's messages: returns them as [S,B,K] (S the longest length; rows of sequences
// past their end are not written) and sets offset [B] and last [B,K], each sequence's messages at its end.
at::Tensor rebased_scaled_chain_messages(const at::Tensor& emissions, const at::Tensor& transitions,
                                         const at::Tensor& scaled, const at::Tensor& colmax, const at::Tensor& start,
                                         const at::Tensor& lengths, const std::vector<int64_t>& longest_first,
                                         double threshold, at::Tensor& offset, at::Tensor& last);

// Viterbi for many labels (cuda/many_label_viterbi.cu), any number of sequences: whether it takes K labels, and the
// best label sequences path [B,T] (int64, -1 at padding) with their scores [B], given emissions [B,T,K], transitions
// [K,K], start [K], end [K] (contiguous, one floating dtype) and lengths [B] int64 in [1, T]. Messages are rebased
// each step as on the CPU, so float32 is as exact on long sequences as on short ones.
bool many_label_viterbi_supported(int64_t K);

void many_label_viterbi(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& start,
                        const at::Tensor& end, const at::Tensor& lengths, at::Tensor& path, at::Tensor& score);

// `hmm infer`'s two quantities at once (cuda/many_label_viterbi.cu): the log-likelihoods log_likelihood [B] (set) and
// the Viterbi paths and scores (written into path [B,T] and score [B], as many_label_viterbi writes them) of float32
// emissions [B,T,K] and transitions W [K,K] whose entries are all ≤ 0 (an HMM's log-probabilities), with colmax [K]
// the largest entry of each column of W (0 for an all -inf column), start [K], end [K], lengths [B] int64 in [1, T].
// Each step reads W once for both recursions (the streamed forward's and the many-label Viterbi's: the same paths, and
// the forward's sums of P = exp(W − colmax) formed within about 1e-6 relative); outputs whose scaled sum is below
// threshold are recomputed exactly. many_label_infer_supported says whether it takes the dtypes and K.
bool many_label_infer_supported(const at::Tensor& emissions, const at::Tensor& transitions);
void many_label_infer(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& colmax,
                      const at::Tensor& start, const at::Tensor& end, const at::Tensor& lengths, double threshold,
                      at::Tensor& log_likelihood, at::Tensor& path, at::Tensor& score);

}  // namespace trellis::cuda
