// The forward recursion of a chain with many labels and few sequences (HMMs with thousands of states), without
// gradients. Each step is the skinny product s = v·P of the scaled messages v = exp(alpha − max alpha) [B,K] with the
// scaled transitions P = exp(W − colmax) [K,K] (see lib/src/semiring/scaled_log_matmul.h), followed by
// alpha' = log s + max alpha + colmax + emission. With B ≤ 16 rows per pass the product does 2·B flops per element of
// P it reads, so the step costs one read of P from memory: these kernels stream P once per step at the memory's
// speed, where a GEMM with M = B leaves its tensor-core tiles mostly empty and runs well below it.
//
// Two launches per step:
// - scaled_step_kernel: a block takes a tile of columns and a span of rows of P for up to kGroup sequences; each lane
//   owns 16 bytes of columns and accumulates them for every sequence, the block's warps split the rows and merge in
//   shared memory, and the block writes one partial sum per (sequence, column) (no atomics: results do not depend on
//   scheduling).
// - scaled_finish_kernel (cuda/streamed_chain.cuh): sums the partials, takes the log, and recomputes exactly in log
//   space every output whose scaled sum is below the underflow threshold (so the result is exact to rounding for any
//   input range); sequences past their length keep their message. It also writes per-block maxima that the next step
//   reduces to max alpha.
//   Given an offset per sequence, it rebases: each message is stored minus the previous one's max, which the offset
//   sums in float64, so that float32 messages stay near 0 on long sequences instead of growing to about −T.
//
// Where P is not much larger than L2 (K=4096: 64 MiB), part of it stays there from step to step: the step kernel
// loads a share of each block's rows with an evict-last hint and the rest with evict-first, and every other step
// walks its rows backwards.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_pipeline.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cuda/chain_kernels.h"
#include "cuda/cuda_check.h"
#include "cuda/launch.cuh"
#include "cuda/streamed_chain.cuh"
#include "trellis/semiring/semiring.h"

namespace trellis::cuda {
namespace {

using namespace streamed;

template <class T, int NB>
__global__ void __launch_bounds__(kThreads, 2)
    scaled_step_kernel(const T* __restrict__ alpha, const T* __restrict__ block_max, int max_blocks,
                       const T* __restrict__ P, T* __restrict__ partial, int B, int K, int rows, bool reverse,
                       int keep_permille) {
  constexpr int kStride = v_stride<T, NB>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* ring = reinterpret_cast<T*>(smem_raw);   // [kWarps][kStages][kCols]: each lane's 16 bytes of rows in flight,
                                              // then [kWarps][NB][kCols] for the merge
  T* v = ring + kWarps * kStages * kCols<T>;  // [rows][kStride]
  __shared__ T m[NB];
  // Sequence groups are the grid's fastest index: the blocks of every group that read one tile of P run side by side,
  // so a batch of several groups reads the tile from memory once per step and from L2 for the other groups.
  const int b0 = blockIdx.x * NB, nb = min(NB, B - b0);
  const int c0 = blockIdx.y * kCols<T>, k0 = blockIdx.z * rows, k1 = min(K, k0 + rows), n = k1 - k0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int col = c0 + lane * kVec<T>;
  // This warp's rows are k0 + warp + i·kWarps (in the order of `span`: backwards on every other step).
  T* slots = ring + (warp * kStages) * kCols<T> + lane * kVec<T>;
  RowStream<T> span(P, K, k0, n, warp, col, K % kVec<T> == 0, reverse, keep_permille, slots);
  const int my_rows = span.rows;
  const bool streamed = span.streamed();
  const auto row = [&](int i) { return reverse ? my_rows - 1 - i : i; };  // the element loads' order
  allow_next_launch();
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) span.fetch(i, i);  // in flight while the previous step finishes
  wait_for_previous();
  if (threadIdx.x < NB) m[threadIdx.x] = threadIdx.x < nb ? row_max(block_max, max_blocks, b0 + threadIdx.x) : T(0);
  // The messages of this block's rows: a thread's NB loads of a row are in flight together.
  for (int pass = 0; pass * kThreads < n; ++pass) {
    const int k = pass * kThreads + threadIdx.x;
    T a[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) a[b] = k < n && b < nb ? alpha[int64_t(b0 + b) * K + k0 + k] : T(0);
    if (pass == 0) __syncthreads();  // m is written
    if (k < n)
#pragma unroll
      for (int b = 0; b < NB; ++b) v[k * kStride + b] = b < nb ? exp(a[b] - m[b]) : T(0);
  }
  __syncthreads();
  T acc[NB][kVec<T>];
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int c = 0; c < kVec<T>; ++c) acc[b][c] = T(0);
  // The messages of row i = 0, 1, ... in turn (fma_row is called in that order).
  const T* vk = v + (warp + (reverse ? my_rows - 1 : 0) * kWarps) * kStride;
  const int v_step = (reverse ? -kWarps : kWarps) * kStride;
  const auto fma_row = [&](const T* p) {
    T vr[NB];
    if constexpr (NB % kVec<T> == 0) {
#pragma unroll
      for (int q = 0; q < NB / kVec<T>; ++q)
        *reinterpret_cast<Vec<T>*>(vr + q * kVec<T>) = reinterpret_cast<const Vec<T>*>(vk)[q];
    } else {
#pragma unroll
      for (int b = 0; b < NB; ++b) vr[b] = vk[b];
    }
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int c = 0; c < kVec<T>; ++c) acc[b][c] += vr[b] * p[c];
    vk += v_step;
  };
  if (streamed) {
    for (int i0 = 0; i0 < my_rows; i0 += kStages) {
#pragma unroll
      for (int u = 0; u < kStages; ++u) {  // unrolled over the ring: slot numbers are constants
        const int i = i0 + u;
        if (i >= my_rows) break;
        span.fetch(i + kStages - 1, (u + kStages - 1) % kStages);
        __pipeline_wait_prior(kStages - 1);  // row i has landed
        const Vec<T> p = *reinterpret_cast<const Vec<T>*>(slots + u * kCols<T>);
        fma_row(reinterpret_cast<const T*>(&p));
      }
    }
  } else if (col < K) {  // rows not 16-byte aligned: element loads
    for (int i = 0; i < my_rows; ++i) {
      const int64_t k = k0 + warp + row(i) * kWarps;
      T p[kVec<T>];
#pragma unroll
      for (int c = 0; c < kVec<T>; ++c) p[c] = col + c < K ? __ldg(P + k * K + col + c) : T(0);
      fma_row(p);
    }
  }
  __pipeline_wait_prior(0);
  __syncthreads();  // the rings are read no more: their memory takes the warps' partial sums
  T* red = ring;
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int c = 0; c < kVec<T>; ++c) red[(warp * NB + b) * kCols<T> + lane * kVec<T> + c] = acc[b][c];
  __syncthreads();
  for (int e = threadIdx.x; e < NB * kCols<T>; e += kThreads) {
    const int b = e / kCols<T>, j = c0 + e % kCols<T>;
    if (b >= nb || j >= K) continue;
    T s = T(0);
    for (int w = 0; w < kWarps; ++w) s += red[w * NB * kCols<T> + e];
    partial[(int64_t(blockIdx.z) * B + b0 + b) * K + j] = s;
  }
}

// The scaled messages v = exp(alpha − max alpha) [running, K] of a step that a GEMM takes, as the step kernel forms
// them; one thread per (b, j).
template <class T>
__global__ void __launch_bounds__(kThreads)
    scaled_rows_kernel(const T* __restrict__ alpha, const T* __restrict__ block_max, T* __restrict__ v, int K) {
  allow_next_launch();
  const FinishBlock f = finish_block(K);
  wait_for_previous();
  if (f.column < K) {
    const int64_t at = int64_t(f.sequence) * K + f.column;
    v[at] = exp(alpha[at] - row_max(block_max, f.blocks, f.sequence));
  }
}

// With many sequences running, a step is bound by arithmetic rather than by reading P, and cuBLAS's GEMM does the
// product faster than the step kernel: from kGemmMinRows running sequences at K ≥ kGemmMinStates (measured on an H100,
// docs/benchmarks.md). Only while LibTorch keeps float32 products in full precision (no TF32).
constexpr int64_t kGemmMinRows = 64, kGemmMinStates = 4096;
bool gemm_step(int64_t running, int64_t K) {
  return running >= kGemmMinRows && K >= kGemmMinStates && !at::globalContext().allowTF32CuBLAS();
}

template <class T, int NB>
void launch_step(const T* alpha, const T* block_max, int max_blocks, const T* P, T* partial, int B, int running, int K,
                 const StepPlan& plan, cudaStream_t stream, bool pdl, bool reverse, int keep_permille) {
  const dim3 grid(grid_dim(running, NB), grid_dim(K, kCols<T>), plan.splits);
  launch_dependent(scaled_step_kernel<T, NB>, grid, plan.smem, stream, pdl, "scaled chain step kernel", alpha,
                   block_max, max_blocks, P, partial, B, K, plan.rows, reverse, keep_permille);
}

// The forward messages at each sequence's end; with `offset` (a [B] float64 tensor of zeros) rebased each step. Given
// the lengths on the host, non-increasing (the batch longest first), each step launches only the sequences still
// running, a prefix of the batch, and every sequence's message is kept apart at its last position. Given
// `every_step` (with longest_first), the messages of step t are written to every_step[t] ([T,B,K], rows of
// sequences past their end left as they were) instead of a pair of buffers used in turn.
at::Tensor streamed_forward(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& scaled,
                            const at::Tensor& colmax, const at::Tensor& start, const at::Tensor& lengths,
                            double threshold, double* offset_data, const std::vector<int64_t>* longest_first,
                            at::Tensor* every_step = nullptr) {
  const int64_t B = emissions.size(0), Tn = emissions.size(1), K = emissions.size(2);
  const StreamedLaunch launch(emissions.device(), K, scaled.nbytes());
  at::Tensor alpha = at::empty({B, K}, emissions.options()), next = at::empty_like(alpha);
  at::Tensor block_max = at::empty({B, launch.finish_blocks}, emissions.options()),
             next_max = at::empty_like(block_max);
  const at::Tensor last = longest_first ? at::empty({B, K}, emissions.options()) : at::Tensor();
  const int64_t steps = longest_first ? std::min<int64_t>(Tn, longest_first->front()) : Tn;
  if (every_step) *every_step = at::empty({steps, B, K}, emissions.options());
  const auto running = [&](int64_t t) {
    return longest_first ? running_at(longest_first->data(), int64_t(longest_first->size()), t) : B;
  };
  AT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "scaled_chain_forward_cuda", [&] {
    using T = scalar_t;
    with_group(B, [&](auto group) {
      constexpr int NB = decltype(group)::value;
      const StepPlan plan = plan_step<T, NB>(scaled_step_kernel<T, NB>, B, K, launch.sms, "scaled chain step kernel");
      at::Tensor partial = at::empty({plan.splits, B, K}, emissions.options());
      const T *W = transitions.data_ptr<T>(), *P = scaled.data_ptr<T>(), *cmax = colmax.data_ptr<T>();
      const T *st = start.data_ptr<T>(), *E = emissions.data_ptr<T>();
      const int64_t* len = lengths.data_ptr<int64_t>();
      T* kept = last.defined() ? last.data_ptr<T>() : nullptr;
      T* kept_steps = every_step ? every_step->data_ptr<T>() : nullptr;
      const at::Tensor rows = gemm_step(B, K) ? at::empty({B, K}, emissions.options()) : at::Tensor();
      for (int t = 0; t < steps; ++t) {
        const int active = static_cast<int>(running(t));
        const T* previous = kept_steps ? kept_steps + (t > 0 ? t - 1 : 0) * B * K : alpha.data_ptr<T>();
        T* current = kept_steps ? kept_steps + t * B * K : next.data_ptr<T>();
        const bool gemm = t > 0 && gemm_step(active, K);
        if (gemm) {  // the partial sums of one span: v·P into partial[0]
          launch_dependent(scaled_rows_kernel<T>, finish_grid(K, active), 0, launch.stream, launch.pdl,
                           "scaled chain rows kernel", previous, block_max.data_ptr<T>(), rows.data_ptr<T>(), int(K));
          at::Tensor product = partial[0].narrow(0, 0, active);
          at::mm_out(product, rows.narrow(0, 0, active), scaled);
        } else if (t > 0) {
          launch_step<T, NB>(previous, block_max.data_ptr<T>(), launch.finish_blocks, P, partial.data_ptr<T>(), int(B),
                             active, int(K), plan, launch.stream, launch.pdl, t % 2 == 0, launch.keep_permille);
        }
        launch_dependent(scaled_finish_kernel<T>, finish_grid(K, active), 0, launch.stream, launch.pdl && t > 0,
                         "scaled chain finish kernel", partial.data_ptr<T>(), gemm ? 1 : plan.splits, previous,
                         block_max.data_ptr<T>(), W, cmax, st, E, static_cast<const int64_t*>(nullptr), len, current,
                         next_max.data_ptr<T>(), offset_data, kept, int(B), int(Tn), int(K), t,
                         static_cast<T>(threshold));
        std::swap(alpha, next);
        std::swap(block_max, next_max);
      }
    });
  });
  return longest_first ? last : alpha;
}

}  // namespace

bool scaled_chain_supported(int64_t B, int64_t K) { return B >= 1 && B <= 2 * kGroup && K >= 1 && K <= (1 << 20); }

at::Tensor scaled_chain_forward(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& scaled,
                                const at::Tensor& colmax, const at::Tensor& start, const at::Tensor& lengths,
                                double threshold) {
  return streamed_forward(emissions, transitions, scaled, colmax, start, lengths, threshold, nullptr, nullptr);
}

at::Tensor rebased_scaled_chain_forward(const at::Tensor& emissions, const at::Tensor& transitions,
                                        const at::Tensor& scaled, const at::Tensor& colmax, const at::Tensor& start,
                                        const at::Tensor& lengths, const std::vector<int64_t>& longest_first,
                                        double threshold, at::Tensor& offset) {
  offset = at::zeros({emissions.size(0)}, emissions.options().dtype(at::kDouble));
  return streamed_forward(emissions, transitions, scaled, colmax, start, lengths, threshold, offset.data_ptr<double>(),
                          &longest_first);
}

at::Tensor rebased_scaled_chain_messages(const at::Tensor& emissions, const at::Tensor& transitions,
                                         const at::Tensor& scaled, const at::Tensor& colmax, const at::Tensor& start,
                                         const at::Tensor& lengths, const std::vector<int64_t>& longest_first,
                                         double threshold, at::Tensor& offset, at::Tensor& last) {
  offset = at::zeros({emissions.size(0)}, emissions.options().dtype(at::kDouble));
  at::Tensor every_step;
  last = streamed_forward(emissions, transitions, scaled, colmax, start, lengths, threshold, offset.data_ptr<double>(),
                          &longest_first, &every_step);
  return every_step;
}

}  // namespace trellis::cuda
