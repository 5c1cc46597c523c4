// What the streamed many-label chain kernels share (cuda/scaled_chain_forward.cu, the LogSemiring forward, and
// cuda/many_label_viterbi.cu, its MaxSemiring counterpart): the block shape, the sequence group that shares one read of
// the transitions per step (and the launches' choice of a smaller group for fewer sequences), the 16-byte vectors a
// thread reads, the rings of transition rows in flight (and each lane's stream of rows into them) and the step block's
// shared memory, the finish kernels' grid, the launches' overlap and the launchers' device set-up, the count of
// sequences still running, and the per-block maxima that rebase each step's messages.
#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_pipeline.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/cuda_check.h"
#include "cuda/launch.cuh"
#include "trellis/semiring/semiring.h"

namespace trellis::cuda::streamed {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kGroup = 16;  // sequences per pass over the transitions

// 16 bytes of a row: four float32 or two float64.
template <class T>
using Vec = std::conditional_t<sizeof(T) == 4, float4, double2>;
template <class T>
constexpr int kVec = sizeof(Vec<T>) / sizeof(T);

constexpr int kFinishCols = kThreads;  // columns per block of a finish kernel (one per thread)
constexpr int kStages = 16;            // rows of the transitions in flight per lane
constexpr double kL2KeepShare = 0.3;   // of L2's size, for rows of the transitions kept there from step to step

// What a streamed launcher sets up on the emissions' device: the device made current for the launcher's lifetime, its
// current stream, its SMs, whether launches overlap (programmatic dependent launch, sm_90), the finish kernels' blocks
// for K columns, and the share (per mille) of the step's matrix of `matrix_bytes` whose rows the step kernels ask L2
// to keep across steps (kL2KeepShare of L2: at K=4096, where the matrix is somewhat larger than L2, a larger share
// took no more off a step).
struct StreamedLaunch {
  c10::cuda::CUDAGuard guard;
  cudaStream_t stream;
  int sms, finish_blocks, keep_permille;
  bool pdl;

  StreamedLaunch(const at::Device& device, int64_t K, std::size_t matrix_bytes)
      : guard(device), stream(at::cuda::getCurrentCUDAStream()) {
    const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
    sms = prop->multiProcessorCount;
    finish_blocks = static_cast<int>(grid_dim(K, kFinishCols));
    keep_permille =
        static_cast<int>(std::min(1000.0, 1000.0 * kL2KeepShare * prop->l2CacheSize / double(matrix_bytes)));
    pdl = prop->major >= 9;
  }
};

// The sequences still running at step t of a batch ordered longest first (`lengths` descending): a prefix of that
// order, as long as the lengths past t.
inline int64_t running_at(const int64_t* lengths, int64_t B, int64_t t) {
  return std::upper_bound(lengths, lengths + B, t, [](int64_t u, int64_t length) { return length <= u; }) - lengths;
}

template <class T>
constexpr int kCols = 32 * kVec<T>;  // columns of a step block: one 16-byte vector per lane

// Programmatic dependent launch (sm_90): each kernel lets the next one start as soon as all its blocks run, and waits
// for the previous one's results only where it reads them, so launches overlap and the step's first reads of the
// transitions (which no kernel writes) are in flight before the previous kernel has finished.
__device__ __forceinline__ void allow_next_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ void wait_for_previous() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A lane's rows of a step block's span, streamed into its ring slots: its warp's rows k0 + warp + i·kWarps of a
// [K,K] matrix, 16 bytes at column `col`, copied asynchronously (no registers held while in flight, and no lane reads
// another's slot) in the order i = 0, 1, ... by a running pointer rather than an address computed per row (at many
// sequences the step is issue-bound). Every other step walks the span backwards (`reverse`): it starts on the rows the
// previous step read last, which are still in L2 (a matrix somewhat larger than L2, as one of K=4096 is, then comes
// partly from L2 instead of memory). The span's first keep_permille/1000 rows are loaded with L2's evict-last policy
// and the others with evict-first, so that those rows stay in L2 for the next step while the others stream through.
template <class T>
struct RowStream {
  int rows;  // this lane's rows in the span
  // Lanes whose 16 bytes are past K, or rows not 16-byte aligned (`vector_rows` false), fetch nothing.
  __device__ RowStream(const T* matrix, int K, int k0, int n, int warp, int col, bool vector_rows, bool reverse,
                       int keep_permille, T* slots)
      : rows(n > warp ? (n - warp + kWarps - 1) / kWarps : 0), on_(vector_rows && col < K), slots_(slots) {
    const int64_t step = int64_t(kWarps) * K;
    const int keep = rows * keep_permille / 1000;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(keep_policy_));
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(stream_policy_));
    step_ = reverse ? -step : step;
    next_ = matrix + int64_t(k0 + warp) * K + col + (reverse ? rows - 1 : 0) * step;
    keep_from_ = reverse ? rows - keep : 0;
    keep_to_ = reverse ? rows : keep;
  }
  // Whether the lane streams its rows (else the caller loads them element by element).
  __device__ bool streamed() const { return on_; }
  // Starts copying row i (the next in order) into ring slot `slot`, and commits a group whether or not it copied.
  __device__ void fetch(int i, int slot) {
    if (on_ && i < rows) {
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(slots_ + slot * kCols<T>));
      const uint64_t policy = i >= keep_from_ && i < keep_to_ ? keep_policy_ : stream_policy_;
      asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst), "l"(next_), "l"(policy)
                   : "memory");
      next_ += step_;
    }
    __pipeline_commit();
  }

 private:
  bool on_;
  T* slots_;
  const T* next_;
  int64_t step_;
  int keep_from_, keep_to_;
  uint64_t keep_policy_, stream_policy_;
};

// Row stride of a step block's messages in shared memory: a row's NB values are read as 16-byte vectors, padded by one
// vector so that the transposing stores spread over the banks.
template <class T, int NB>
constexpr int v_stride() {
  return NB < kVec<T> ? NB : NB + kVec<T>;
}

// Sequences 4q .. 4q+3 of a float32 row of NB messages in shared memory (0 past NB): one 16-byte load when NB is a
// multiple of four.
template <int NB>
__device__ __forceinline__ void four_messages(const float* row, int q, float (&out)[4]) {
  if constexpr (NB % 4 == 0) {
    *reinterpret_cast<float4*>(out) = reinterpret_cast<const float4*>(row)[q];
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = q * 4 + e < NB ? row[q * 4 + e] : 0.f;
  }
}

// Shared memory of a step block, in elements: the lanes' rings of transition rows in flight, whose space the warps'
// partial results reuse for the merge, then the messages of the block's rows (`messages` sets of them: two where one
// read of the transitions serves the forward and the Viterbi).
template <class T, int NB, int messages = 1>
__host__ __device__ std::size_t step_smem_elements(int rows) {
  static_assert(NB <= kStages, "the merge reuses the rings");
  return std::size_t(kWarps) * kStages * kCols<T> + std::size_t(messages) * rows * v_stride<T, NB>();
}

// A finish kernel's block: one tile of kFinishCols columns of one sequence's message. The grid is one-dimensional,
// tiles of a sequence side by side, so that a batch may hold more sequences than a grid's y extent (65,535).
struct FinishBlock {
  int sequence, tile, blocks, column;  // blocks: tiles per sequence; column: this thread's
};
__device__ __forceinline__ FinishBlock finish_block(int K) {
  const int blocks = (K + kFinishCols - 1) / kFinishCols;
  const int sequence = static_cast<int>(blockIdx.x / blocks), tile = static_cast<int>(blockIdx.x % blocks);
  return {sequence, tile, blocks, tile * kFinishCols + static_cast<int>(threadIdx.x)};
}
inline dim3 finish_grid(int64_t K, int64_t sequences) {
  return dim3(static_cast<unsigned>(grid_dim(K, kFinishCols) * sequences));
}

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

namespace {  // a kernel per translation unit that launches it (no relocatable device code)

// The streamed forward's step, after its product: alpha' [b, j] from the partial sums (t ≥ 1) or the start scores
// (t = 0); one thread per (b, j). Sequence b's emissions are row order[b] of E, or row b without `order`. Outputs
// whose scaled sum is below `threshold` are recomputed exactly in log space; given `offset`, messages are rebased.
template <class T>
__global__ void __launch_bounds__(kThreads)
    scaled_finish_kernel(const T* __restrict__ partial, int splits, const T* __restrict__ alpha,
                         const T* __restrict__ block_max, const T* __restrict__ W, const T* __restrict__ colmax,
                         const T* __restrict__ start, const T* __restrict__ E, const int64_t* __restrict__ order,
                         const int64_t* __restrict__ len, T* __restrict__ alpha_next, T* __restrict__ block_max_next,
                         double* __restrict__ offset, T* __restrict__ last, int B, int Tn, int K, int t, T threshold) {
  __shared__ T scratch[kWarps];
  allow_next_launch();
  // What no kernel of the chain writes is read before waiting for the step kernel.
  const FinishBlock f = finish_block(K);
  const int b = f.sequence, j = f.column;
  const bool active = j < K && t < len[b];
  const T e = active ? E[((order ? order[b] : int64_t(b)) * Tn + t) * K + j] : T(0), cmax = active ? colmax[j] : T(0);
  wait_for_previous();
  T a = neg_inf<T>();
  if (j < K) {
    const int64_t row = int64_t(b) * K;
    if (t == 0) {
      a = start[j] + e;
    } else if (active) {
      T s = T(0);
      for (int q = 0; q < splits; ++q) s += partial[(int64_t(q) * B + b) * K + j];
      const T m = row_max(block_max, f.blocks, b);  // loaded alongside the partial sums
      if (offset && f.tile == 0 && threadIdx.x == 0) offset[b] += double(m);
      T pre;
      if (s < threshold) {  // terms may have underflowed: this output exactly, in log space
        pre = exact_log_dot(alpha + row, W + j, K, K);
        if (offset) pre -= m;
      } else {
        pre = offset ? log(s) + cmax : log(s) + m + cmax;
      }
      a = pre + e;
    } else {
      a = alpha[row + j];
    }
    alpha_next[row + j] = a;
    if (last && t == len[b] - 1) last[row + j] = a;
  }
  write_block_max(a, scratch, block_max_next + b * f.blocks + f.tile);
}

}  // namespace

// The step grid: sequence groups × column tiles × row spans. Row spans are as long as the messages' shared memory
// allows (fewer partial results to merge and write), and short enough that the grid fills every SM's block slots.
struct StepPlan {
  int rows, splits;
  std::size_t smem;
};

// The plan of `kernel` (a step kernel of group NB over T, with `messages` sets of messages) for B sequences of K labels
// on `sms` multiprocessors; `what` names the kernel in errors.
template <class T, int NB, int messages = 1, class Kernel>
StepPlan plan_step(Kernel kernel, int64_t B, int64_t K, int sms, const char* what) {
  const int max_rows = std::min<int>(512, static_cast<int>((32 << 10) / (NB * sizeof(T))));
  const std::size_t max_smem = sizeof(T) * step_smem_elements<T, NB, messages>(max_rows);
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(max_smem)), what);
  int per_sm = 1;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, max_smem), what);
  const int64_t tiles = grid_dim(K, kCols<T>) * grid_dim(B, NB);
  const int64_t splits = std::max<int64_t>(grid_dim(K, max_rows), std::max<int64_t>(1, per_sm * sms / tiles));
  int rows = static_cast<int>(grid_dim(K, splits));
  rows = (rows + kWarps - 1) / kWarps * kWarps;
  return {rows, static_cast<int>(grid_dim(K, rows)), sizeof(T) * step_smem_elements<T, NB, messages>(rows)};
}

// Launches kernel<<<grid, kThreads, smem, stream>>>(args...), as a programmatic dependent of the previous kernel in
// the stream where asked; `what` names it in errors.
template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, std::size_t smem, cudaStream_t stream, bool pdl,
                      const char* what, Args... args) {
  const LaunchShape shape{grid, dim3(kThreads), smem, stream, /*cluster=*/0, /*dependent=*/pdl};
  check(launch_kernel(kernel, shape, static_cast<Params>(args)...), what);
}

}  // namespace trellis::cuda::streamed
