// Gradients scaled by an upstream gradient on the device, in one CUDA launch (scaled_gradients.cu; compiled where nvcc
// is, TRELLIS_OPS_CUDA).
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

namespace trellis_ops {

// Whether scaled_in_one_launch takes these: one to four contiguous CUDA tensors of upstream's dtype (float32 or
// float64) on its device, upstream one value.
bool scales_in_one_launch(const std::vector<at::Tensor>& gradients, const at::Tensor& upstream);

// New tensors gradients[i] · (upstream / divisor), upstream read by the kernel (no transfer to the host).
std::vector<at::Tensor> scaled_in_one_launch(const std::vector<at::Tensor>& gradients, const at::Tensor& upstream,
                                             double divisor);

}  // namespace trellis_ops
