// The LLM head's per-row statistics, one type for the CPU path, the vocabulary-parallel merge and the kernels'
// launchers (cuda/linear_head.h), so that the CPU path needs no CUDA header for it.
#pragma once
#include <ATen/core/Tensor.h>

namespace trellis {

// Per-row statistics of the logits z = x·Wᵀ + bias (soft-capped when softcap > 0), in float32: lse = log Σ_v e^z, the
// target's logit (0 where the target is outside [0, V)), and when asked Σ_v z and Σ_v softmax(z)_v·z.
struct HeadRowStats {
  at::Tensor lse, target_logit, logit_sum, expected_logit;
};

}  // namespace trellis
