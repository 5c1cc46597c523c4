// See cuda/mask_summary.h. One warp per sequence: each lane reads every 32nd position, the warp counts the on ones by
// ballot and finds an off-to-on step by comparing each position with the one before it; the blocks OR their flags
// into a zeroed pair (every writer writes true, so the stores need no atomics).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_check.h"
#include "cuda/mask_summary.h"

namespace trellis::cuda {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;

__global__ void mask_summary_kernel(const uint8_t* __restrict__ mask, int64_t batch, int64_t steps, int64_t stride_b,
                                    int64_t stride_t, int64_t* __restrict__ lengths, bool* __restrict__ flags) {
  const int lane = threadIdx.x % 32;
  bool first_off = false, hole = false;
  for (int64_t b = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; b < batch; b += int64_t(gridDim.x) * kWarps) {
    const uint8_t* row = mask + b * stride_b;
    int64_t count = 0;
    for (int64_t t0 = 0; t0 < steps; t0 += 32) {
      const int64_t t = t0 + lane;
      const bool on = t < steps && row[t * stride_t] != 0;
      hole |= on && t > 0 && row[(t - 1) * stride_t] == 0;
      count += __popc(__ballot_sync(0xffffffffu, on));
    }
    if (lane == 0) {
      lengths[b] = count;
      first_off |= steps > 0 && row[0] == 0;
    }
  }
  first_off = __syncthreads_or(first_off);
  hole = __syncthreads_or(hole);
  if (threadIdx.x == 0) {
    if (first_off) flags[0] = true;
    if (hole) flags[1] = true;
  }
}

}  // namespace

void mask_summary(const at::Tensor& mask, bool batch_first, at::Tensor& lengths, at::Tensor& flags) {
  const c10::cuda::CUDAGuard guard(mask.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  check(cudaMemsetAsync(flags.data_ptr(), 0, 2 * sizeof(bool), stream), "mask_summary: clearing the flags");
  const int64_t batch = mask.size(batch_first ? 0 : 1), steps = mask.size(batch_first ? 1 : 0);
  if (batch == 0) return;
  const int64_t stride_b = mask.stride(batch_first ? 0 : 1), stride_t = mask.stride(batch_first ? 1 : 0);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(grid_dim(batch, kWarps), int64_t(sms) * 4));
  mask_summary_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const uint8_t*>(mask.const_data_ptr()), batch, steps,
                                                       stride_b, stride_t, lengths.data_ptr<int64_t>(),
                                                       flags.data_ptr<bool>());
  check_launch("mask_summary_kernel");
}

}  // namespace trellis::cuda
