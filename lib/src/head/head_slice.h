// The head over one slice of the vocabulary, for vocabulary parallelism (linear_cross_entropy_parallel.cpp): the
// rows' statistics of x·W_sliceᵀ, and the loss's gradients for the slice's logits given every row's log-sum-exp over
// the whole vocabulary. The same routes as the whole head (fused kernel, slabs, recompute_logits).
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <functional>

#include "lib/src/head/row_stats.h"
#include "trellis/head/linear_cross_entropy.h"

namespace trellis::head_slice {

// local_targets [N] int64: each row's target column within the slice, or -1 where its target lies in another slice
// or is ignored (head.ignore_index is not used). lse and target_logit always; Σ z (want_sum) and Σ p·z over the
// slice's own softmax (want_expected) when asked.
HeadRowStats statistics(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& local_targets,
                        const HeadOptions& head, bool want_sum, bool want_expected);

// Gradients of Σ_i g_i·loss_i with respect to this slice's x-share (dx summed over the slices is the whole dx), its
// weight rows and bias entries, where loss is the whole vocabulary's: lse [N] is over the whole vocabulary and label
// smoothing's ε/V uses total_vocabulary. g is 0 for ignored rows.
std::array<at::Tensor, 3> gradients(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& local_targets,
                                    const HeadOptions& head, const LossOptions& loss, const at::Tensor& lse,
                                    const at::Tensor& g, int64_t total_vocabulary, std::array<bool, 3> want);

// A slab's statistics over the slice made the whole vocabulary's (an exchange with the other slices' holders).
using Merge = std::function<HeadRowStats(const HeadRowStats&)>;

// The loss's gradients in the same pass as its statistics, for a reduced loss whose row weights g are known before
// the statistics (1 or 1/count per counted row): each slab of logits gives its rows' slice statistics (lse, target
// logit, and Σ z with label smoothing), `merge` turns them into the whole vocabulary's, and the slab's gradient
// follows from those. `merged` receives every row's merged statistics. Not for recompute_logits, which forms no slab.
std::array<at::Tensor, 3> gradients_in_one_pass(const at::Tensor& x, const at::Tensor& weight,
                                                const at::Tensor& local_targets, const HeadOptions& head,
                                                const LossOptions& loss, const at::Tensor& g, int64_t total_vocabulary,
                                                std::array<bool, 3> want, const Merge& merge, HeadRowStats& merged);

}  // namespace trellis::head_slice
