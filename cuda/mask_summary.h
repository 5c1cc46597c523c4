// The lengths and validity flags of a padding mask in one CUDA launch (cuda/mask_summary.cu), so that reading a mask
// costs one kernel instead of a handful of framework operations (lib/src/crf/chain_inputs.cpp, summarize_mask).
#pragma once
#include <ATen/core/Tensor.h>

namespace trellis::cuda {

// mask: a CUDA bool or uint8 tensor [B,T] (batch_first) or [T,B], any strides, nonzero = on. Writes lengths [B] int64
// (the on positions of each sequence) and flags [2] bool (some sequence's first position is off; some position is on
// right after an off one of its sequence), both contiguous on the mask's device and preallocated. Queued on the current
// stream; nothing waits for the device.
void mask_summary(const at::Tensor& mask, bool batch_first, at::Tensor& lengths, at::Tensor& flags);

}  // namespace trellis::cuda
