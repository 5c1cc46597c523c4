// Chain inputs as PyTorch users hand them over — a mask or lengths, batch-first or time-first layouts, half-precision
// emissions, scores of mixed float dtypes — turned into the library's ChainPotentials, with errors that name the input
// at fault. The PyTorch operators (libtrellis_ops) and trellis::nn::CRF both go through these functions.
//
// Conventions: emissions [B,T,K] when batch_first, else [T,B,K]; a mask [B,T] (or [T,B]) of bool or uint8 is on for
// real positions and off for padding, right-padded: every sequence starts on and, once off, stays off; lengths [B] of
// an integer type. Mask and lengths are exclusive; with neither, every sequence has all T positions. The computation
// runs, and returns its scores, in float64 when any score tensor is float64, else in float32 (bfloat16 and float16
// emissions are accumulated in float32).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

#include "trellis/crf/linear_chain_crf.h"

namespace trellis {

// "[2, 3, 4]", for messages. Formatted here: c10::str of a tensor's sizes, compiled into these libraries, crashed the
// Python process raising the error on the H100 machine (torch 2.11.0+cu130, g++ 13.3; 2026-11-24).
std::string shape_string(at::IntArrayRef sizes);

// Scores of a batch of chains as given by a caller; every tensor on the emissions' device except mask and lengths.
struct ChainInputs {
  at::Tensor emissions;     // [B,T,K] or [T,B,K]; float16, bfloat16, float32 or float64
  at::Tensor transitions;   // [K,K], any float dtype
  at::Tensor start;         // [K] or undefined
  at::Tensor end;           // [K] or undefined
  at::Tensor mask;          // [B,T] or [T,B] bool/uint8, or undefined
  at::Tensor lengths;       // [B] integer, or undefined
  bool batch_first = true;  // the layout of emissions, mask and tags: [B,T,...] (true) or [T,B,...]
};

// float64 when any defined tensor given is float64, else float32. A tensor that is not float16, bfloat16, float32 or
// float64 is an error naming it (its name first in each pair) and `what`.
at::ScalarType chain_compute_type(std::initializer_list<std::pair<const char*, at::Tensor>> scores, const char* what);

// [B,T] or [T,B] (batch_first) positions → the batch size and the number of steps.
struct BatchShape {
  int64_t batch;  // B
  int64_t steps;  // T
};
// See BatchShape.
BatchShape batch_shape(const at::Tensor& sequences, bool batch_first);

// A mask's lengths and validity, on `device`: lengths [B] int64 (the on positions of each sequence) and flags [2] bool
// (flags[0]: some sequence's first position is off; flags[1]: some position is on right after an off one of its
// sequence, a hole). A right-padded mask with every first position on has both flags false. On a CUDA device of a
// build with the kernels this is one launch and does not wait for the device; else one pass over the mask on the host.
// The mask's dtype (bool or uint8) and shape ([B,T] or [T,B], as `shape` and batch_first say) are checked here; `what`
// names the caller in messages.
struct MaskSummary {
  at::Tensor lengths, flags;
};
MaskSummary summarize_mask(const at::Tensor& mask, bool batch_first, BatchShape shape, const at::Device& device,
                           const char* what);

// The lengths [B] (int64, on `device`) that a mask or lengths describe, undefined when neither is given (or B = 0). A
// mask's shape, dtype and right-padding are checked here (one transfer to the host): "mask of the first timestep must
// all be on", and a hole (on after off) is an error naming its position. Lengths are checked for shape and integer
// dtype; their values in [1, T] are checked by the library's functions. `what` names the caller in messages.
at::Tensor sequence_lengths(const at::Tensor& mask, const at::Tensor& lengths, bool batch_first, BatchShape shape,
                            const at::Device& device, const char* what);

// The library's potentials: batch-first, every score in chain_compute_type, lengths from the mask or lengths.
// Differentiable w.r.t. the caller's emissions, transitions, start and end (casts and transposes only), so gradients of
// anything computed from the result reach the caller's tensors in their own dtype and layout.
ChainPotentials chain_potentials(const ChainInputs& in, const char* what = "CRF");

// Tags [B,T] (or [T,B]) of an integer type → batch-first int64 on `device`; their values are checked by the library.
at::Tensor batch_first_tags(const at::Tensor& tags, const ChainInputs& in, const char* what = "CRF");

// Allowed transitions [K,K], starts [K] and ends [K] (bool or uint8; each optional) as library constraints on
// `device`, undefined parts allowing everything. Shapes and dtypes are checked.
TransitionConstraints allowed_constraints(const at::Tensor& allowed, const at::Tensor& allowed_start,
                                          const at::Tensor& allowed_end, int64_t num_tags, const at::Device& device,
                                          const char* what = "CRF");

// The library forms marginals (and Viterbi paths where its fused kernels do not take K) with its own autograd, which
// runs neither under torch.inference_mode / c10::InferenceMode nor below the dispatcher's autograd keys (inside an
// operator's kernel). Held around such a call, an AutogradScope lifts both; usable() copies tensors made in inference
// mode, which autograd refuses to take.
class AutogradScope {
 public:
  AutogradScope();
  // t itself, or a copy autograd can take when t was made in inference mode.
  at::Tensor usable(const at::Tensor& t) const;
  // The potentials with each tensor as usable(t) gives it.
  ChainPotentials usable(const ChainPotentials& p) const;

 private:
  std::optional<c10::InferenceMode> outside_inference_;
  std::optional<c10::impl::ForceDispatchKeyGuard> autograd_keys_;
};

// The library's log_partition, log_likelihood, marginals and viterbi, with an empty batch answered here: the fused
// CUDA kernels launch no empty grid.
at::Tensor batch_log_partition(const ChainPotentials& p);
at::Tensor batch_log_likelihood(const ChainPotentials& p, const at::Tensor& tags);  // see batch_log_partition
Marginals batch_marginals(const ChainPotentials& p, bool with_edges);               // see batch_log_partition
ViterbiResult batch_viterbi(const ChainPotentials& p);                              // see batch_log_partition

// Whether any of allowed, allowed_start, allowed_end is given.
inline bool any_constraint(const TransitionConstraints& c) {
  return c.transitions.defined() || c.start.defined() || c.end.defined();
}

// A batch-first result [B,T,...] in the caller's layout ([T,B,...] when not batch_first), contiguous.
at::Tensor caller_layout(const at::Tensor& batch_first_result, bool batch_first);

// Results in the caller's layout on `device`: paths [B,T] or [T,B] (viterbi() has set -1 where no label sequence is
// allowed); k-best paths [B,k,T] or [T,B,k]; node marginals [B,T,K] or [T,B,K], edges [B,T-1,K,K] or [T-1,B,K,K].
ViterbiResult caller_layout(const ViterbiResult& r, bool batch_first);
KBestResult caller_layout(const KBestResult& r, bool batch_first, const at::Device& device);  // see above
Marginals caller_layout(const Marginals& m, bool batch_first);                                // see above

}  // namespace trellis
