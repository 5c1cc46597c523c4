// Viterbi for chains with many labels (K past what cuda/chain_fused.cu keeps in shared memory), the max-semiring
// counterpart of cuda/scaled_chain_forward.cu: each step reads the transitions W from memory once for the batch (the
// blocks of every group of kViterbiGroup sequences that use one tile of W run side by side and share it through L2).
//
// Sequences run longest first, so that at each step the ones still running are a prefix of that order and only they
// are launched (padding costs nothing). Per step t ≥ 1, two launches:
// - viterbi_step_kernel: a block takes kThreads·kVec columns and a span of rows of W for up to kViterbiGroup
//   sequences; each thread owns kVec columns and keeps, for every sequence, the best
//   (alpha_{t-1}[i] − max alpha_{t-1}) + W[i][j] over the span's rows i and its first row reaching it; it writes one
//   (value, row) per span, sequence and column.
// - viterbi_finish_kernel: merges the spans in row order, adds the emission, records the back-pointer [B,T,K] int32,
//   and writes per-block maxima that the next step reduces to max alpha_t; at a sequence's last position it also
//   keeps alpha apart.
// Then viterbi_end_kernel adds the end scores, picks the best last label and follows the back-pointers.
//
// Every message is rebased by its largest entry before the next step, the offsets summed in float64, exactly as the
// CPU recursion (lib/src/crf/chain_fused.cpp, forward_cpu) does it: the same additions in the same order, so float32
// stays exact on long sequences and the paths match the CPU's, ties going to the lowest label as MaxSemiring's
// accumulator sends them.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <vector>
#include <type_traits>

#include "cuda/chain_kernels.h"
#include "cuda/cuda_check.h"
#include "cuda/streamed_chain.cuh"
#include "trellis/semiring/semiring.h"

namespace trellis::cuda {
namespace {

using namespace streamed;
constexpr int kFinishCols = kThreads;

template <class T>
constexpr int kBlockCols = kThreads* kVec<T>;  // a thread's 16 bytes of each row
// Rows of W a thread loads before using them, and a chunk of the max.
template <class T>
constexpr int kRowsInFlight = 4;
// Sequences per pass over W: a thread keeps a running maximum and its chunk for each of them and kVec columns, and at
// 8 these, the two chunks of rows in flight and the rest fit 128 registers, so two blocks share an SM (16 warps to hide
// the loads' latency; at 16 sequences one block took every register). The groups of a batch share each tile of W
// through L2 (the grid's fastest index), so the smaller group costs no extra reads from memory.
constexpr int kViterbiGroup = 8;

template <class T, int NB>
__global__ void __launch_bounds__(kThreads, 2)
    viterbi_step_kernel(const T* __restrict__ alpha, const T* __restrict__ block_max, int max_blocks,
                        const T* __restrict__ W, double* __restrict__ offset, T* __restrict__ part_val,
                        int* __restrict__ part_arg, int active, int K, int rows, bool vector_rows) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* v = reinterpret_cast<T*>(smem_raw);  // [rows][NB]: alpha_{t-1} − its max, this block's rows
  __shared__ T m[NB];
  // Sequence groups are the grid's fastest index: the blocks of every group that read one tile of W run side by side,
  // so the tile comes from memory once per step and from L2 for the other groups.
  const int b0 = blockIdx.x * NB, nb = min(NB, active - b0);
  const int k0 = blockIdx.z * rows, n = min(K, k0 + rows) - k0;
  const int col = blockIdx.y * kBlockCols<T> + threadIdx.x * kVec<T>;
  if (threadIdx.x < NB) {
    T mb = T(0);
    if (int(threadIdx.x) < nb) {
      const int b = b0 + threadIdx.x;
      mb = row_max(block_max, max_blocks, b);
      if (blockIdx.y == 0 && blockIdx.z == 0) offset[b] += double(mb);  // one block per sequence group
    }
    m[threadIdx.x] = mb;
  }
  __syncthreads();
  // Consecutive threads read consecutive rows of one sequence's message (coalesced), several loads in flight each.
#pragma unroll 4
  for (int e = threadIdx.x; e < n * NB; e += kThreads) {
    const int b = e / n, k = e % n;
    v[k * NB + b] = b < nb ? alpha[int64_t(b0 + b) * K + k0 + k] - m[b] : T(0);
  }
  __syncthreads();
  if (col >= K) return;
  // Per chunk of kRowsInFlight rows, only the chunk's maximum is compared with the best so far (two instructions a
  // term instead of four); the chunk that first reached the best is kept, and its first row reaching it is found at
  // the end by recomputing the same sums. So the row is the lowest one reaching the maximum, as MaxSemiring's
  // accumulator picks it (the first term when all are -inf).
  T best[NB][kVec<T>];
  int chunk[NB][kVec<T>];
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int c = 0; c < kVec<T>; ++c) {
      best[b][c] = neg_inf<T>();
      chunk[b][c] = 0;
    }
  // Two chunks of rows in registers: the next chunk's loads are in flight while this one's terms are computed.
  const auto load = [&](T(&p)[kRowsInFlight<T>][kVec<T>], int i0) {
#pragma unroll
    for (int u = 0; u < kRowsInFlight<T>; ++u) {
      const int k = i0 + u;
      const T* row = W + int64_t(k0 + k) * K + col;
      if (k >= n) {  // past the span: no term
#pragma unroll
        for (int c = 0; c < kVec<T>; ++c) p[u][c] = neg_inf<T>();
      } else if (vector_rows) {
        *reinterpret_cast<Vec<T>*>(p[u]) = __ldg(reinterpret_cast<const Vec<T>*>(row));
      } else {
#pragma unroll
        for (int c = 0; c < kVec<T>; ++c) p[u][c] = col + c < K ? __ldg(row + c) : neg_inf<T>();
      }
    }
  };
  const auto use = [&](const T(&p)[kRowsInFlight<T>][kVec<T>], int i0) {
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      if (b >= nb) break;  // a group's last, partial share of the sequences costs only its own
      T a[kRowsInFlight<T>];
#pragma unroll
      for (int u = 0; u < kRowsInFlight<T>; ++u) a[u] = v[min(i0 + u, n - 1) * NB + b];
#pragma unroll
      for (int c = 0; c < kVec<T>; ++c) {
        T m = a[0] + p[0][c];
#pragma unroll
        for (int u = 1; u < kRowsInFlight<T>; ++u) m = max(m, a[u] + p[u][c]);
        if (m > best[b][c]) {
          best[b][c] = m;
          chunk[b][c] = i0;
        }
      }
    }
  };
  T first[kRowsInFlight<T>][kVec<T>], second[kRowsInFlight<T>][kVec<T>];
  load(first, 0);
  for (int i0 = 0; i0 < n; i0 += 2 * kRowsInFlight<T>) {
    load(second, i0 + kRowsInFlight<T>);
    use(first, i0);
    load(first, i0 + 2 * kRowsInFlight<T>);
    if (i0 + kRowsInFlight<T> < n) use(second, i0 + kRowsInFlight<T>);
  }
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    if (b >= nb) break;
    const int64_t out = (int64_t(blockIdx.z) * active + b0 + b) * K + col;
#pragma unroll
    for (int c = 0; c < kVec<T>; ++c) {
      if (col + c >= K) continue;
      const int i0 = chunk[b][c];
      int arg = k0 + i0;
      for (int k = i0; k < min(n, i0 + kRowsInFlight<T>); ++k)
        if (v[k * NB + b] + __ldg(W + int64_t(k0 + k) * K + col + c) == best[b][c]) {
          arg = k0 + k;
          break;
        }
      part_val[out + c] = best[b][c];
      part_arg[out + c] = arg;
    }
  }
}

// alpha_t [b, j] from the spans' partial maxima (t ≥ 1) or the start scores (t = 0); one thread per (b, j), b in the
// longest-first order (sequence order[b] of the batch).
template <class T>
__global__ void __launch_bounds__(kThreads)
    viterbi_finish_kernel(const T* __restrict__ part_val, const int* __restrict__ part_arg, int splits,
                          const T* __restrict__ start, const T* __restrict__ E, const int64_t* __restrict__ order,
                          const int64_t* __restrict__ len, T* __restrict__ alpha_next, T* __restrict__ block_max_next,
                          T* __restrict__ last, int* __restrict__ back, int active, int Tn, int K, int t) {
  __shared__ T scratch[kWarps];
  const int b = blockIdx.y, j = blockIdx.x * kFinishCols + threadIdx.x;
  T a = neg_inf<T>();
  if (j < K) {
    const int64_t row = int64_t(b) * K, sequence = order[b];
    const T e = E[(sequence * Tn + t) * K + j];
    if (t == 0) {
      a = start[j] + e;
    } else {
      T best = part_val[row + j];
      int arg = part_arg[row + j];
      for (int q = 1; q < splits; ++q) {  // spans in row order: a tie keeps the lower row
        const int64_t at = (int64_t(q) * active + b) * K + j;
        const T s = part_val[at];
        if (s > best) {
          best = s;
          arg = part_arg[at];
        }
      }
      a = best + e;
      back[(int64_t(b) * Tn + t) * K + j] = arg;
    }
    alpha_next[row + j] = a;
    if (t == len[sequence] - 1) last[row + j] = a;
  }
  write_block_max(a, scratch, block_max_next + b * gridDim.x + blockIdx.x);
}

// The better of two (value, label) candidates: the larger value, on a tie the lower label; label -1 is no candidate.
template <class T>
__device__ void keep_better(T& value, int& label, T other_value, int other_label) {
  if (other_label >= 0 && (label < 0 || other_value > value || (other_value == value && other_label < label))) {
    value = other_value;
    label = other_label;
  }
}

// One block per sequence (longest-first order): score = offset + max alpha + max_j (alpha_j − max alpha + end_j) for
// the last alpha, and the backtrace.
template <class T>
__global__ void __launch_bounds__(kThreads)
    viterbi_end_kernel(const T* __restrict__ last, const T* __restrict__ end, const int* __restrict__ back,
                       const int64_t* __restrict__ order, const int64_t* __restrict__ len,
                       const double* __restrict__ offset, T* __restrict__ score, int64_t* __restrict__ path, int Tn,
                       int K) {
  __shared__ T values[kWarps];
  __shared__ int labels[kWarps];
  const int b = blockIdx.x;
  const T* alpha = last + int64_t(b) * K;
  T m = neg_inf<T>();
  for (int j = threadIdx.x; j < K; j += kThreads) m = max(m, alpha[j]);
  for (int offset_lanes = 16; offset_lanes > 0; offset_lanes >>= 1)
    m = max(m, __shfl_xor_sync(0xffffffffu, m, offset_lanes));
  if (threadIdx.x % 32 == 0) values[threadIdx.x / 32] = m;
  __syncthreads();
  m = values[0];
  for (int w = 1; w < kWarps; ++w) m = max(m, values[w]);
  if (isinf(m)) m = T(0);  // as the CPU's rebase of an all -inf message
  __syncthreads();         // values is reused below
  T best = neg_inf<T>();
  int label = -1;
  for (int j = threadIdx.x; j < K; j += kThreads) {
    const T s = (alpha[j] - m) + end[j];
    if (s > best || label < 0) {
      best = s;
      label = j;
    }
  }
  for (int offset_lanes = 16; offset_lanes > 0; offset_lanes >>= 1) {
    const T other = __shfl_xor_sync(0xffffffffu, best, offset_lanes);
    const int other_label = __shfl_xor_sync(0xffffffffu, label, offset_lanes);
    keep_better(best, label, other, other_label);
  }
  if (threadIdx.x % 32 == 0) {
    values[threadIdx.x / 32] = best;
    labels[threadIdx.x / 32] = label;
  }
  __syncthreads();
  const int64_t sequence = order[b];
  const int L = static_cast<int>(len[sequence]);
  int64_t* p = path + sequence * Tn;
  for (int u = L + threadIdx.x; u < Tn; u += kThreads) p[u] = -1;
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kWarps; ++w) keep_better(best, label, values[w], labels[w]);
  score[sequence] = static_cast<T>(offset[b] + double(m) + double(best));
  int y = label;
  p[L - 1] = y;
  for (int u = L - 1; u >= 1; --u) p[u - 1] = y = back[(int64_t(b) * Tn + u) * K + y];
}

// The step grid: sequence groups × column tiles × row spans. Enough spans to give every SM a block or two, but few
// enough that the partial maxima written per step stay a small share of W's bytes, and long enough spans that the
// messages of a span fit in shared memory.
struct StepPlan {
  int rows, splits;
  std::size_t smem;
};

template <class T, int NB>
StepPlan plan_step(int64_t B, int64_t K, int sms) {
  const int64_t max_rows = (96 << 10) / (NB * sizeof(T));
  const int64_t tiles = grid_dim(K, kBlockCols<T>) * grid_dim(B, NB);
  const int64_t wanted = grid_dim(2 * sms, tiles);
  const int64_t most = std::max<int64_t>(1, K / (4 * NB));
  const int64_t splits = std::max<int64_t>(grid_dim(K, max_rows), std::min(wanted, most));
  const int rows = static_cast<int>(grid_dim(K, splits));
  return {rows, static_cast<int>(grid_dim(K, rows)), sizeof(T) * std::size_t(rows) * NB};
}

}  // namespace

bool many_label_viterbi_supported(int64_t K) { return K >= 1 && K < (int64_t(1) << 24); }

void many_label_viterbi(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& start,
                        const at::Tensor& end, const at::Tensor& lengths, at::Tensor& path, at::Tensor& score) {
  const int64_t B = emissions.size(0), Tn = emissions.size(1), K = emissions.size(2);
  if (B == 0) return;
  const c10::cuda::CUDAGuard guard(emissions.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int finish_blocks = static_cast<int>(grid_dim(K, kFinishCols));
  // Longest first: the sequences running at step t are the first running(t) of this order.
  const auto [sorted_host, order_host] = lengths.cpu().sort(/*stable=*/true, /*dim=*/0, /*descending=*/true);
  const at::Tensor order = order_host.to(emissions.device());
  const int64_t* sorted = sorted_host.data_ptr<int64_t>();
  const auto running = [&](int64_t t) {
    return std::upper_bound(sorted, sorted + B, t, [](int64_t u, int64_t length) { return length <= u; }) - sorted;
  };
  at::Tensor alpha = at::empty({B, K}, emissions.options()), next = at::empty_like(alpha);
  at::Tensor block_max = at::empty({B, finish_blocks}, emissions.options()), next_max = at::empty_like(block_max);
  const at::Tensor last = at::empty({B, K}, emissions.options());
  const at::Tensor offset = at::zeros({B}, emissions.options().dtype(at::kDouble));
  const at::Tensor back = at::empty({B, Tn, K}, emissions.options().dtype(at::kInt));
  AT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "many_label_viterbi_cuda", [&] {
    using T = scalar_t;
    with_group<kViterbiGroup>(B, [&](auto group) {
      constexpr int NB = decltype(group)::value;
      // One plan per count of running sequence groups; the partial maxima [splits, running, K] fit the largest.
      const int64_t groups = grid_dim(B, NB);
      std::vector<StepPlan> plans;
      int64_t partial_elements = 0;
      std::size_t smem = 0;
      for (int64_t g = 1; g <= groups; ++g) {
        const int64_t n = std::min(B, g * NB);
        plans.push_back(plan_step<T, NB>(n, K, sms));
        partial_elements = std::max<int64_t>(partial_elements, plans.back().splits * n * K);
        smem = std::max(smem, plans.back().smem);
      }
      check(cudaFuncSetAttribute(viterbi_step_kernel<T, NB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(smem)),
            "many-label Viterbi step: shared memory");
      const at::Tensor part_val = at::empty({partial_elements}, emissions.options());
      const at::Tensor part_arg = at::empty({partial_elements}, emissions.options().dtype(at::kInt));
      const int64_t* len = lengths.data_ptr<int64_t>();
      // Rows as 16-byte vectors where each row starts on a vector boundary.
      const bool vector_rows =
          K % kVec<T> == 0 && reinterpret_cast<std::uintptr_t>(transitions.data_ptr<T>()) % sizeof(Vec<T>) == 0;
      int splits = 1;
      for (int64_t t = 0; t < sorted[0]; ++t) {
        const int active = static_cast<int>(running(t));
        if (t > 0) {
          const StepPlan& plan = plans[grid_dim(active, NB) - 1];
          splits = plan.splits;
          viterbi_step_kernel<T, NB>
              <<<dim3(grid_dim(active, NB), grid_dim(K, kBlockCols<T>), splits), kThreads, plan.smem, stream>>>(
                  alpha.data_ptr<T>(), block_max.data_ptr<T>(), finish_blocks, transitions.data_ptr<T>(),
                  offset.data_ptr<double>(), part_val.data_ptr<T>(), part_arg.data_ptr<int>(), active, int(K),
                  plan.rows, vector_rows);
          check_launch("many-label Viterbi step");
        }
        viterbi_finish_kernel<T><<<dim3(finish_blocks, active), kThreads, 0, stream>>>(
            part_val.data_ptr<T>(), part_arg.data_ptr<int>(), splits, start.data_ptr<T>(), emissions.data_ptr<T>(),
            order.data_ptr<int64_t>(), len, next.data_ptr<T>(), next_max.data_ptr<T>(), last.data_ptr<T>(),
            back.data_ptr<int>(), active, int(Tn), int(K), int(t));
        check_launch("many-label Viterbi finish");
        std::swap(alpha, next);
        std::swap(block_max, next_max);
      }
      viterbi_end_kernel<T><<<B, kThreads, 0, stream>>>(last.data_ptr<T>(), end.data_ptr<T>(), back.data_ptr<int>(),
                                                        order.data_ptr<int64_t>(), len, offset.data_ptr<double>(),
                                                        score.data_ptr<T>(), path.data_ptr<int64_t>(), int(Tn), int(K));
      check_launch("many-label Viterbi end");
    });
  });
}

}  // namespace trellis::cuda
