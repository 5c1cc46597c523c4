// What the streamed many-label chain kernels share (cuda/scaled_chain_forward.cu, the LogSemiring forward, and
// cuda/many_label_viterbi.cu, its MaxSemiring counterpart): the block shape, the sequence group that shares one read of
// the transitions per step (and the launches' choice of a smaller group for fewer sequences), the 16-byte vectors a
// thread reads, and the per-block maxima that rebase each step's messages.
#pragma once
#include <cstdint>
#include <type_traits>

#include "trellis/semiring/semiring.h"

namespace trellis::cuda::streamed {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kGroup = 16;  // sequences per pass over the transitions

// 16 bytes of a row: four float32 or two float64.
template <class T>
using Vec = std::conditional_t<sizeof(T) == 4, float4, double2>;
template <class T>
constexpr int kVec = sizeof(Vec<T>) / sizeof(T);

// max over alpha's row b from the finish kernel's per-block maxima, 0 where the row is all -inf (as on the CPU).
template <class T>
__device__ T row_max(const T* __restrict__ block_max, int blocks, int b) {
  T m = neg_inf<T>();
  for (int q = 0; q < blocks; ++q) m = max(m, block_max[b * blocks + q]);
  return isinf(m) ? T(0) : m;
}

// Runs f(std::integral_constant<int, NB>) with the sequence group for B: the next power of two up to Max (a power of
// two), instantiating f for those groups only.
template <int NB, int Max, class F>
void with_group_from(int64_t B, F&& f) {
  if constexpr (NB >= Max) {
    f(std::integral_constant<int, NB>());
  } else {
    if (B <= NB) f(std::integral_constant<int, NB>());
    else with_group_from<2 * NB, Max>(B, f);
  }
}
template <int Max = kGroup, class F>
void with_group(int64_t B, F&& f) {
  with_group_from<1, Max>(B, f);
}

// *out = the largest m of the block's threads (every thread calls this): shuffles within each warp, then one thread
// over the warps' maxima in scratch [kWarps] (shared memory).
template <class T>
__device__ void write_block_max(T m, T* scratch, T* out) {
  for (int lanes = 16; lanes > 0; lanes >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, lanes));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) m = max(m, scratch[w]);
    *out = m;
  }
}

}  // namespace trellis::cuda::streamed
