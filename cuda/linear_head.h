// Launchers for the LLM head's kernels (cuda/linear_head.cu). Called by lib/ with contiguous CUDA tensors and
// preallocated outputs; each launcher only launches (on the current stream) and checks the launch.
#pragma once
#include <ATen/core/Tensor.h>

namespace trellis::cuda {

// The gradient of the head's loss with respect to a slab of logits z [n,V] (float32 or float64), in one pass:
//   dz[r,v] = g[r]·(p·(1 + 2·z_loss·lse[r]) - ε/V - (1-ε)·[v = t[r]]) · (1 - (z/c)²  when softcap c > 0),
// p = exp(z[r,v] - lse[r]); dz [n,V] of the input type (float32, float64, bfloat16 or float16), ready for the GEMMs.
void linear_head_logit_gradient(const at::Tensor& z, const at::Tensor& lse, const at::Tensor& g,
                                const at::Tensor& targets, double label_smoothing, double z_loss, double softcap,
                                at::Tensor& dz);

}  // namespace trellis::cuda
