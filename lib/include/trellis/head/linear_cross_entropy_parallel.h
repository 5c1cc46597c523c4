// The LLM head with its vocabulary split over the ranks of a torch.distributed process group (vocabulary
// parallelism, as under tensor parallelism): rank r holds the contiguous rows [offset_r, offset_r + V_r) of the whole
// weight (and of the bias); x and the targets (ids of the whole vocabulary) are the same on every rank. Each rank runs
// the single-device head (trellis/head/linear_cross_entropy.h: the fused kernel, slabs or recompute_logits) on its
// slice, and the rows' statistics merge across ranks the way the kernels merge them inside a GPU, (m1,s1)+(m2,s2) = (M,
// s1·e^(m1−M) + s2·e^(m2−M)): one all-gather of packed per-row statistics (log-sum-exp, target logit, and the logit sum
// or expected logit where label smoothing or the entropy needs them). Every backward (the loss's, the
// log-probabilities', the entropies', the log-sum-exps') forms the slice's gradients from the whole vocabulary's
// per-row statistics: dW and the bias need no communication, dx one all-reduce. Every rank calls the same function with
// the same x, targets and options (collectives).
//
// A group of one rank runs the single-device head itself: no collective, and the training pass reads each slab of
// logits once, where more ranks read it twice (the slice's log-sum-exp first, merged across the ranks before the
// slab's gradient). Communication per call on more ranks: the all-gather of N × (2 to 4) numbers per rank, and for
// training the all-reduce of dx (N × D).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include "trellis/head/linear_cross_entropy.h"

namespace c10d {
class ProcessGroup;
}

namespace trellis {

// This rank's part of a vocabulary split over the ranks of a process group: its weight rows are a consecutive slice.
struct VocabularySlice {
  c10::intrusive_ptr<c10d::ProcessGroup> group;  // NCCL for CUDA tensors, Gloo for CPU ones
  // This rank's first row in the whole vocabulary and the whole vocabulary's size. Left at -1 and 0, they are
  // gathered from every rank's weight.size(0) in rank order (one more small all-gather per call).
  int64_t offset = -1;
  int64_t vocabulary = 0;  // the whole vocabulary's size (see offset)
};

// log Σ_v exp(logit_v) over the whole vocabulary, per row: [...], with autograd for x (whole on every rank), this
// rank's weight slice and bias slice (head.bias).
at::Tensor linear_logsumexp(const at::Tensor& x, const at::Tensor& weight, const HeadOptions& head,
                            const VocabularySlice& slice);

// Log-probabilities of the targets (and each row's entropy) over the whole vocabulary, with autograd as
// linear_logsumexp.
TokenLogprobs token_logprobs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                             const HeadOptions& head, bool with_entropy, const VocabularySlice& slice);

// linear_logsumexp and token_logprobs in two halves, for callers that wire autograd themselves (the PyTorch
// operators). The forward's rows: [N] each, flattened.
struct ParallelHeadRows {
  at::Tensor lse;       // over the whole vocabulary
  at::Tensor logprobs;  // log p(target); undefined without targets
  at::Tensor entropy;   // each row's entropy; undefined without with_entropy
  // This rank's slice as the backward needs it: its share of each row's probability, e^(lse_slice − lse), and (with
  // the entropy) Σ q·z − Σ p·z, its own softmax q's expected logit less the whole vocabulary's p.
  at::Tensor slice_share;
  at::Tensor slice_expected_logit_excess;  // see slice_share
};
// The forward half of linear_logsumexp and token_logprobs over the slices: each row's statistics, merged across the
// ranks.
ParallelHeadRows head_statistics_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                         const HeadOptions& head, bool with_entropy, const VocabularySlice& slice);
// The gradients for x (all-reduced: the same on every rank), this rank's weight slice and bias slice (undefined
// where not wanted) of Σ_i (grad_lse_i·lse_i + grad_logprob_i·log p_i(target_i) + grad_entropy_i·H_i), each grad [N]
// or undefined (zero); forward.lse is needed for grad_logprob alone, slice_share always (on more than one rank). The
// slice's logits are formed again a slab of rows at a time, as on one device.
std::array<at::Tensor, 3> head_statistics_backward(const at::Tensor& x, const at::Tensor& weight,
                                                   const at::Tensor& targets, const HeadOptions& head,
                                                   const ParallelHeadRows& forward, const at::Tensor& grad_lse,
                                                   const at::Tensor& grad_logprob, const at::Tensor& grad_entropy,
                                                   const VocabularySlice& slice, std::array<bool, 3> want);

// The cross-entropy over the whole vocabulary (as linear_cross_entropy on one device), with autograd for x (whole on
// every rank), this rank's weight slice and bias slice.
at::Tensor linear_cross_entropy(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                const HeadOptions& head, const LossOptions& loss, const VocabularySlice& slice);

// linear_cross_entropy in its two halves, for callers that wire autograd themselves (the PyTorch operators). want:
// which of x, weight, bias need gradients. With a mean or sum reduction and gradients wanted (and not
// recompute_logits) the forward forms them in the same pass as the loss — each slab's statistics merged across the
// ranks before its gradient, dx all-reduced — and the backward scales them; otherwise the forward keeps the whole
// vocabulary's lse and the backward forms the logits again.
LinearCrossEntropyForward linear_cross_entropy_forward(const at::Tensor& x, const at::Tensor& weight,
                                                       const at::Tensor& targets, const HeadOptions& head,
                                                       const LossOptions& loss, const VocabularySlice& slice,
                                                       std::array<bool, 3> want = {false, false, false});
// The backward half: the gradients of grad·loss for x, this rank's weight slice and bias slice (undefined where not
// wanted), from the forward's results.
std::array<at::Tensor, 3> linear_cross_entropy_backward(const at::Tensor& grad, const at::Tensor& x,
                                                        const at::Tensor& weight, const at::Tensor& targets,
                                                        const HeadOptions& head, const LossOptions& loss,
                                                        const LinearCrossEntropyForward& forward,
                                                        const VocabularySlice& slice, std::array<bool, 3> want);

}  // namespace trellis
