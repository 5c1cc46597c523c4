// The fused linear log-sum-exp kernel for Hopper (cuda/linear_lse_sm90.cu, built for sm_90a): raw pointers, no ATen,
// so that its translation unit stays small. lib/ reaches it through cuda/linear_head.h.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "lib/src/head/head_maths.h"

namespace trellis::cuda::sm90 {

enum class HalfType { bfloat16, float16 };

struct LinearLseArgs {
  HalfType dtype = HalfType::bfloat16;
  const void* x = nullptr;           // [N, D] row-major, 16-byte aligned, D % 8 == 0
  const void* weight = nullptr;      // [V, D] row-major, same type
  const void* bias = nullptr;        // [V] or null
  const int64_t* targets = nullptr;  // [N] or null; a target outside [0, V) gets no target logit
  float softcap = 0.f;               // > 0: z = c·tanh(z/c)
  int64_t N = 0, V = 0, D = 0;
  int tiles_per_unit = 2;  // 256-column tiles per work unit (the load-balancing grain)
  // Outputs, initialised by the caller: per row (max, Σ e^(z−max)) packed as two floats, start (−inf, 0).
  unsigned long long* lse_pairs = nullptr;
  // Optional (both or neither): (max, Σ e^(z−max)·z) pairs, start (−inf, 0), and Σ z, start 0.
  unsigned long long* pz_pairs = nullptr;
  float* logit_sum = nullptr;
  float* target_logit = nullptr;  // [N] when targets are given; written only where the target is in range
};

// The gradient mode: instead of statistics, each tile's loss gradient (the logits' columns [0, V) of the weight rows
// given) is written to dz in x's type:
//   dz[r, v] = g[r]·(p·(1 + z_loss2·lse[r]) - smooth - target_weight·[v = targets[r] - target_offset]) · (1 - (z/c)²),
// p = e^(z - lse[r]), c the softcap when > 0 (head_maths::logit_gradient). targets are required.
struct LogitGradientArgs {
  void* dz = nullptr;  // [N, V] with row stride dz_stride (elements), unit column stride
  int64_t dz_stride = 0;
  const float* lse = nullptr;          // [N]
  const float* g = nullptr;            // [N]: the upstream weight of each row's loss, 0 for ignored rows
  int64_t target_offset = 0;           // the vocabulary column of the weight's first row
  head_maths::LossTerms<float> terms;  // ε / (whole vocabulary), 1 - ε, 2·z_loss
};

// The exponentials mode (the training slabs in x's type): the statistics as linear_lse forms them, and beside them
// each logit's exponential relative to a reference, rounded once to x's type:
//   e[r, v] = e^(z − ref[r, v / 256]),  ref[r, k] = the largest logit of row r in 256-column tiles up to k of k's work
// unit (so e ≤ 1; a tile past every finite logit, never met inside V, would give ref −inf and e 0). The row's p is then
// e·e^(ref − lse) once lse is known, one rounding away from the float32 logit's: 16-bit slabs hold the information of
// the gradient without the float32 logits.
struct ExponentialSlabArgs {
  void* e = nullptr;  // [N, V] in x's type, row stride e_stride (elements), unit column stride
  int64_t e_stride = 0;
  float* ref = nullptr;  // [N, ceil(V / 256)], row stride ref_stride
  int64_t ref_stride = 0;
};
constexpr int64_t kExponentialTileColumns = 256;  // the columns that share one reference (cuda/linear_head.h's too)

// Whether the kernel can run on this device (compute capability 9.0 and a driver with tensor maps).
bool linear_lse_available(int device);

cudaError_t linear_lse(const LinearLseArgs& args, cudaStream_t stream);
cudaError_t linear_logit_gradient(const LinearLseArgs& args, const LogitGradientArgs& grad, cudaStream_t stream);
// linear_lse's statistics (args' outputs, lse_pairs and target_logit required) and the slab of exponentials.
cudaError_t linear_lse_exponentials(const LinearLseArgs& args, const ExponentialSlabArgs& slab, cudaStream_t stream);

}  // namespace trellis::cuda::sm90
