// Viterbi for chains with many labels (K past what cuda/chain_fused.cu keeps in shared memory), the max-semiring
// counterpart of cuda/scaled_chain_forward.cu and laid out as it is: each step reads the transitions W from memory
// once for the batch (the blocks of every group of kGroup sequences that use one tile of W run side by side and share
// it through L2), and records only the step's max-semiring messages, not which row reached each maximum.
//
// Sequences run longest first, so that at each step the ones still running are a prefix of that order and only they
// are launched (padding costs nothing). Per step t ≥ 1, two launches, programmatic dependents of each other on sm_90:
// - viterbi_step_kernel: a block takes a tile of columns and a span of rows of W for up to kGroup sequences; each
//   lane owns 16 bytes of columns and keeps, for every sequence, max_i (alpha_{t-1}[i] − max alpha_{t-1}) + W[i][j]
//   over its warp's rows (loaded asynchronously, kStages rows in flight); the warps merge in shared memory and the
//   block writes one maximum per (span, sequence, column).
// - viterbi_finish_kernel: the largest of the spans' maxima plus the emission is alpha_t, kept for every step
//   ([S,B,K]); it also writes per-block maxima that the next step reduces to max alpha_t.
// Then viterbi_backtrace_kernel adds the end scores, picks the best last label, and walks back: the label before y at
// position u is the first row i reaching max_i (alpha_{u-1}[i] − max alpha_{u-1}) + W[i][y], recomputed from the kept
// messages with the same additions as the step (so the same maximum, exactly): one column of W per position of the
// path instead of a back-pointer per (position, label) written at every step.
//
// many_label_infer runs this Viterbi beside the streamed forward (`hmm infer`: log-likelihoods and paths) with one
// step kernel for both, infer_step_kernel, which reads each row of W once for the two recursions; each step's two
// finish kernels are the forward's and the Viterbi's own.
//
// Every message is rebased by its largest entry before the next step, the offsets summed in float64, exactly as the
// CPU recursion (lib/src/crf/chain_fused.cpp, forward_cpu) does it: the same additions in the same order, so float32
// stays exact on long sequences and the paths match the CPU's, ties going to the lowest label as MaxSemiring's
// accumulator sends them.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_pipeline.h>

#include <algorithm>
#include <cstdint>
#include <vector>
#include <type_traits>

#include "cuda/chain_kernels.h"
#include "cuda/cuda_check.h"
#include "cuda/launch.cuh"
#include "cuda/streamed_chain.cuh"
#include "trellis/semiring/semiring.h"

namespace trellis::cuda {
namespace {

using namespace streamed;
constexpr int kBacktraceThreads = 1024, kBacktraceWarps = kBacktraceThreads / 32;

// step_max [B]: this step's max alpha_{t-1} per sequence (0 for an all -inf message), which the backtrace subtracts
// again; offset [B] sums them.
template <class T, int NB>
__global__ void __launch_bounds__(kThreads, 2)
    viterbi_step_kernel(const T* __restrict__ alpha, const T* __restrict__ block_max, int max_blocks,
                        const T* __restrict__ W, double* __restrict__ offset, T* __restrict__ step_max,
                        T* __restrict__ partial, int B, int running, int K, int rows, bool vector_rows, bool reverse,
                        int keep_permille, bool nonpositive) {
  constexpr int kStride = v_stride<T, NB>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* ring = reinterpret_cast<T*>(smem_raw);   // [kWarps][kStages][kCols]: each lane's 16 bytes of rows in flight,
                                              // then [kWarps][NB][kCols] for the merge
  T* v = ring + kWarps * kStages * kCols<T>;  // [rows][kStride]
  __shared__ T m[NB];
  // Sequence groups are the grid's fastest index: the blocks of every group that read one tile of W run side by side,
  // so a batch of several groups reads the tile from memory once per step and from L2 for the other groups.
  // Only the sequences still running (the first `running` of the batch, longest first) are read and written: the
  // messages of the others are not kept past their last position, and their offsets are complete.
  const int b0 = blockIdx.x * NB, nb = min(NB, running - b0);
  const int c0 = blockIdx.y * kCols<T>, k0 = blockIdx.z * rows, k1 = min(K, k0 + rows), n = k1 - k0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int col = c0 + lane * kVec<T>;
  // This warp's rows are k0 + warp + i·kWarps (in the order of `span`: backwards on every other step).
  T* slots = ring + (warp * kStages) * kCols<T> + lane * kVec<T>;
  RowStream<T> span(W, K, k0, n, warp, col, vector_rows, reverse, keep_permille, slots);
  const int my_rows = span.rows;
  const bool streamed = span.streamed();
  const auto row = [&](int i) { return reverse ? my_rows - 1 - i : i; };  // the element loads' order
  allow_next_launch();
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) span.fetch(i, i);  // in flight while the previous step finishes
  wait_for_previous();
  if (threadIdx.x < NB) {
    T mb = T(0);
    if (int(threadIdx.x) < nb) {
      const int b = b0 + threadIdx.x;
      mb = row_max(block_max, max_blocks, b);
      if (blockIdx.y == 0 && blockIdx.z == 0) {  // one block per sequence group
        offset[b] += double(mb);
        step_max[b] = mb;
      }
    }
    m[threadIdx.x] = mb;
  }
  // The rebased messages of this block's rows: a thread's NB loads of a row are in flight together.
  for (int pass = 0; pass * kThreads < n; ++pass) {
    const int k = pass * kThreads + threadIdx.x;
    T a[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) a[b] = k < n && b < nb ? alpha[int64_t(b0 + b) * K + k0 + k] : T(0);
    if (pass == 0) __syncthreads();  // m is written
    if (k < n)
#pragma unroll
      for (int b = 0; b < NB; ++b) v[k * kStride + b] = b < nb ? a[b] - m[b] : T(0);
  }
  __syncthreads();
  T best[NB][kVec<T>];
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int c = 0; c < kVec<T>; ++c) best[b][c] = neg_inf<T>();
  // The messages of row i = 0, 1, ... in turn (max_row is called in that order).
  const T* vk = v + (warp + (reverse ? my_rows - 1 : 0) * kWarps) * kStride;
  const int v_step = (reverse ? -kWarps : kWarps) * kStride;
  const auto max_row = [&](const T* p) {
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
      for (int c = 0; c < kVec<T>; ++c) best[b][c] = max(best[b][c], vr[b] + p[c]);
    vk += v_step;
  };
  if constexpr (std::is_same_v<T, float>) {
    if (streamed && nonpositive) {
      // Every term is ≤ 0 (rebased messages, transitions of log-probabilities), where the larger float is the smaller
      // bit pattern read as unsigned: one three-way unsigned minimum (an sm_90 DPX instruction) keeps the best of two
      // rows' terms, an instruction and a half per term instead of two. The maximum is the same float but for the sign
      // of a zero.
      unsigned top[NB][4];
#pragma unroll
      for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int c = 0; c < 4; ++c) top[b][c] = __float_as_uint(-INFINITY);
      for (int i0 = 0; i0 < my_rows; i0 += kStages) {
#pragma unroll
        for (int u = 0; u < kStages; u += 2) {  // rows in pairs; the ring's slots are constants
          const int i = i0 + u;
          if (i >= my_rows) break;
          span.fetch(i + kStages - 1, (u + kStages - 1) % kStages);
          __pipeline_wait_prior(kStages - 2);  // rows i and i + 1 have landed
          const bool pair = i + 1 < my_rows;   // else row i twice
          const float4 p1 = *reinterpret_cast<const float4*>(slots + u * kCols<T>);
          const float4 p2 = pair ? *reinterpret_cast<const float4*>(slots + (u + 1) * kCols<T>) : p1;
          const float* v2 = pair ? vk + v_step : vk;
#pragma unroll
          for (int q = 0; q < (NB + 3) / 4; ++q) {
            float a1[4], a2[4];
            four_messages<NB>(vk, q, a1);
            four_messages<NB>(v2, q, a2);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int b = q * 4 + e;
              if (b >= NB) break;
              top[b][0] = __vimin3_u32(top[b][0], __float_as_uint(a1[e] + p1.x), __float_as_uint(a2[e] + p2.x));
              top[b][1] = __vimin3_u32(top[b][1], __float_as_uint(a1[e] + p1.y), __float_as_uint(a2[e] + p2.y));
              top[b][2] = __vimin3_u32(top[b][2], __float_as_uint(a1[e] + p1.z), __float_as_uint(a2[e] + p2.z));
              top[b][3] = __vimin3_u32(top[b][3], __float_as_uint(a1[e] + p1.w), __float_as_uint(a2[e] + p2.w));
            }
          }
          vk += 2 * v_step;
          span.fetch(i + kStages, u);  // into row i's slot, read
        }
      }
#pragma unroll
      for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int c = 0; c < 4; ++c) best[b][c] = __uint_as_float(top[b][c]);
    }
  }
  if (streamed && !(std::is_same_v<T, float> && nonpositive)) {
    for (int i0 = 0; i0 < my_rows; i0 += kStages) {
#pragma unroll
      for (int u = 0; u < kStages; ++u) {  // unrolled over the ring: slot numbers are constants
        const int i = i0 + u;
        if (i >= my_rows) break;
        span.fetch(i + kStages - 1, (u + kStages - 1) % kStages);
        __pipeline_wait_prior(kStages - 1);  // row i has landed
        const Vec<T> p = *reinterpret_cast<const Vec<T>*>(slots + u * kCols<T>);
        max_row(reinterpret_cast<const T*>(&p));
      }
    }
  } else if (!streamed && col < K) {  // rows not 16-byte aligned: element loads
    for (int i = 0; i < my_rows; ++i) {
      const int64_t k = k0 + warp + row(i) * kWarps;
      T p[kVec<T>];
#pragma unroll
      for (int c = 0; c < kVec<T>; ++c) p[c] = col + c < K ? __ldg(W + k * K + col + c) : neg_inf<T>();
      max_row(p);
    }
  }
  __pipeline_wait_prior(0);
  __syncthreads();  // the rings are read no more: their memory takes the warps' maxima
  T* red = ring;
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int c = 0; c < kVec<T>; ++c) red[(warp * NB + b) * kCols<T> + lane * kVec<T> + c] = best[b][c];
  __syncthreads();
  for (int e = threadIdx.x; e < NB * kCols<T>; e += kThreads) {
    const int b = e / kCols<T>, j = c0 + e % kCols<T>;
    if (b >= nb || j >= K) continue;
    T s = red[e];
    for (int w = 1; w < kWarps; ++w) s = max(s, red[w * NB * kCols<T> + e]);
    partial[(int64_t(blockIdx.z) * B + b0 + b) * K + j] = s;
  }
}

// One step of `hmm infer` (log-likelihood and Viterbi) at once, for float32 over non-positive transitions read as
// 16-byte vectors: each row of W a lane streams serves both recursions, so a step reads W once instead of twice. The
// forward's term P = exp(W − colmax) is formed from the row as 2^(W·log2 e − colmax·log2 e) (one fused multiply-add
// and the hardware's base-2 exponential, about 1e-6 relative of the scaled copy's P: the step is bound by issuing
// instructions, of which an exact exponential per element would take a quarter) and summed as scaled_step_kernel
// (cuda/scaled_chain_forward.cu) sums it; the Viterbi's term is kept as viterbi_step_kernel's three-way minimum keeps
// it, so the paths are the many-label Viterbi's exactly. alpha_f [B,K] and block_max_f are the forward's previous
// messages and their per-block maxima, alpha_v and block_max_v the Viterbi's; partial_f and partial_v take the block's
// sums and maxima for scaled_finish_kernel and viterbi_finish_kernel. Groups of at most kInferGroup sequences: the two
// accumulators then fit 128 registers and two blocks share an SM (at 16 sequences one block took the register file,
// two warps per scheduler, too few to hide the latencies).
constexpr int kInferGroup = 8;
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
template <int NB>
__global__ void __launch_bounds__(kThreads, 2)
    infer_step_kernel(const float* __restrict__ alpha_f, const float* __restrict__ block_max_f,
                      const float* __restrict__ alpha_v, const float* __restrict__ block_max_v, int max_blocks,
                      const float* __restrict__ W, const float* __restrict__ colmax, double* __restrict__ offset_v,
                      float* __restrict__ step_max, float* __restrict__ partial_f, float* __restrict__ partial_v, int B,
                      int running, int K, int rows, bool reverse, int keep_permille) {
  constexpr int kStride = v_stride<float, NB>(), kC = kCols<float>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* ring = reinterpret_cast<float*>(smem_raw);  // as in viterbi_step_kernel
  float* vf = ring + kWarps * kStages * kC;          // [rows][kStride]: exp(alpha_f − max alpha_f)
  float* vv = vf + rows * kStride;                   // [rows][kStride]: alpha_v − max alpha_v
  __shared__ float mf[NB], mv[NB];
  const int b0 = blockIdx.x * NB, nb = min(NB, running - b0);
  const int c0 = blockIdx.y * kC, k0 = blockIdx.z * rows, k1 = min(K, k0 + rows), n = k1 - k0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int col = c0 + lane * 4;
  float* slots = ring + (warp * kStages) * kC + lane * 4;
  RowStream<float> span(W, K, k0, n, warp, col, /*vector_rows=*/true, reverse, keep_permille, slots);
  const int my_rows = span.rows;
  allow_next_launch();
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) span.fetch(i, i);  // in flight while the previous step finishes
  constexpr float kLog2e = 1.4426950408889634f;
  float shift[4];  // −colmax · log2 e of this lane's columns (no kernel writes colmax)
#pragma unroll
  for (int c = 0; c < 4; ++c) shift[c] = col + c < K ? -colmax[col + c] * kLog2e : 0.f;
  wait_for_previous();
  if (threadIdx.x < NB) {
    float f = 0.f, v = 0.f;
    if (int(threadIdx.x) < nb) {
      const int b = b0 + threadIdx.x;
      f = row_max(block_max_f, max_blocks, b);
      v = row_max(block_max_v, max_blocks, b);
      if (blockIdx.y == 0 && blockIdx.z == 0) {  // one block per sequence group
        offset_v[b] += double(v);
        step_max[b] = v;
      }
    }
    mf[threadIdx.x] = f;
    mv[threadIdx.x] = v;
  }
  for (int pass = 0; pass * kThreads < n; ++pass) {
    const int k = pass * kThreads + threadIdx.x;
    float a[NB], c[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const bool in = k < n && b < nb;
      a[b] = in ? alpha_f[int64_t(b0 + b) * K + k0 + k] : 0.f;
      c[b] = in ? alpha_v[int64_t(b0 + b) * K + k0 + k] : 0.f;
    }
    if (pass == 0) __syncthreads();  // mf and mv are written
    if (k < n)
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        vf[k * kStride + b] = b < nb ? exp(a[b] - mf[b]) : 0.f;
        vv[k * kStride + b] = b < nb ? c[b] - mv[b] : 0.f;
      }
  }
  __syncthreads();
  float acc[NB][4];
  unsigned top[NB][4];
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      acc[b][c] = 0.f;
      top[b][c] = __float_as_uint(-INFINITY);
    }
  const int first = (warp + (reverse ? my_rows - 1 : 0) * kWarps) * kStride;
  const float *fk = vf + first, *vk = vv + first;
  const int v_step = (reverse ? -kWarps : kWarps) * kStride;
  if (col < K) {
    for (int i0 = 0; i0 < my_rows; i0 += kStages) {
#pragma unroll
      for (int u = 0; u < kStages; u += 2) {  // rows in pairs, as viterbi_step_kernel's minimum takes them
        const int i = i0 + u;
        if (i >= my_rows) break;
        span.fetch(i + kStages - 1, (u + kStages - 1) % kStages);
        __pipeline_wait_prior(kStages - 2);  // rows i and i + 1 have landed
        const bool pair = i + 1 < my_rows;   // else row i twice: the maximum is the same, the sum adds P2 = 0
        const float4 p1 = *reinterpret_cast<const float4*>(slots + u * kC);
        const float4 p2 = pair ? *reinterpret_cast<const float4*>(slots + (u + 1) * kC) : p1;
        const float w1[4] = {p1.x, p1.y, p1.z, p1.w}, w2[4] = {p2.x, p2.y, p2.z, p2.w};
        float P1[4], P2[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          P1[c] = exp2_approx(fmaf(w1[c], kLog2e, shift[c]));
          P2[c] = pair ? exp2_approx(fmaf(w2[c], kLog2e, shift[c])) : 0.f;
        }
        const float* f2 = pair ? fk + v_step : fk;
        const float* v2 = pair ? vk + v_step : vk;
#pragma unroll
        for (int q = 0; q < (NB + 3) / 4; ++q) {
          float a1[4], a2[4], c1[4], c2[4];
          four_messages<NB>(fk, q, a1);
          four_messages<NB>(f2, q, a2);
          four_messages<NB>(vk, q, c1);
          four_messages<NB>(v2, q, c2);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int b = q * 4 + e;
            if (b >= NB) break;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              acc[b][c] += a1[e] * P1[c];
              acc[b][c] += a2[e] * P2[c];
              top[b][c] = __vimin3_u32(top[b][c], __float_as_uint(c1[e] + w1[c]), __float_as_uint(c2[e] + w2[c]));
            }
          }
        }
        fk += 2 * v_step;
        vk += 2 * v_step;
        span.fetch(i + kStages, u);  // into row i's slot, read
      }
    }
  }
  __pipeline_wait_prior(0);
  __syncthreads();  // the rings are read no more: their memory takes the warps' sums, then their maxima
  float* red = ring;
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int c = 0; c < 4; ++c) red[(warp * NB + b) * kC + lane * 4 + c] = acc[b][c];
  __syncthreads();
  for (int e = threadIdx.x; e < NB * kC; e += kThreads) {
    const int b = e / kC, j = c0 + e % kC;
    if (b >= nb || j >= K) continue;
    float s = 0.f;
    for (int w = 0; w < kWarps; ++w) s += red[w * NB * kC + e];
    partial_f[(int64_t(blockIdx.z) * B + b0 + b) * K + j] = s;
  }
  __syncthreads();
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int c = 0; c < 4; ++c) red[(warp * NB + b) * kC + lane * 4 + c] = __uint_as_float(top[b][c]);
  __syncthreads();
  for (int e = threadIdx.x; e < NB * kC; e += kThreads) {
    const int b = e / kC, j = c0 + e % kC;
    if (b >= nb || j >= K) continue;
    float s = red[e];
    for (int w = 1; w < kWarps; ++w) s = max(s, red[w * NB * kC + e]);
    partial_v[(int64_t(blockIdx.z) * B + b0 + b) * K + j] = s;
  }
}

// alpha_t [b, j] from the spans' maxima (t ≥ 1) or the start scores (t = 0); one thread per (b, j), b in the
// longest-first order (sequence order[b] of the batch).
template <class T>
__global__ void __launch_bounds__(kThreads)
    viterbi_finish_kernel(const T* __restrict__ partial, int splits, const T* __restrict__ start,
                          const T* __restrict__ E, const int64_t* __restrict__ order, T* __restrict__ alpha_next,
                          T* __restrict__ block_max_next, int B, int Tn, int K, int t) {
  __shared__ T scratch[kWarps];
  allow_next_launch();
  // What no kernel of the chain writes is read before waiting for the step kernel.
  const FinishBlock f = finish_block(K);
  const int b = f.sequence, j = f.column;
  const T e = j < K ? E[(order[b] * Tn + t) * K + j] : T(0);
  wait_for_previous();
  T a = neg_inf<T>();
  if (j < K) {
    if (t == 0) {
      a = start[j] + e;
    } else {
      T best = partial[int64_t(b) * K + j];
      for (int q = 1; q < splits; ++q) best = max(best, partial[(int64_t(q) * B + b) * K + j]);
      a = best + e;
    }
    alpha_next[int64_t(b) * K + j] = a;
  }
  write_block_max(a, scratch, block_max_next + b * f.blocks + f.tile);
}

// The better of two (value, label) candidates: the larger value, on a tie the lower label; label -1 is no candidate.
template <class T>
__device__ void keep_better(T& value, int& label, T other_value, int other_label) {
  if (other_label >= 0 && (label < 0 || other_value > value || (other_value == value && other_label < label))) {
    value = other_value;
    label = other_label;
  }
}

// The block's best (value, label) of the candidates its threads hold, in every thread. `values` and `labels` are
// [kBacktraceWarps] in shared memory, written before the call's one barrier and read after it.
template <class T>
__device__ void block_best(T& value, int& label, T* values, int* labels) {
  for (int lanes = 16; lanes > 0; lanes >>= 1) {
    const T other = __shfl_xor_sync(0xffffffffu, value, lanes);
    const int other_label = __shfl_xor_sync(0xffffffffu, label, lanes);
    keep_better(value, label, other, other_label);
  }
  if (threadIdx.x % 32 == 0) {
    values[threadIdx.x / 32] = value;
    labels[threadIdx.x / 32] = label;
  }
  __syncthreads();
  value = values[0];
  label = labels[0];
  for (int w = 1; w < kBacktraceWarps; ++w) keep_better(value, label, values[w], labels[w]);
}

// One block per sequence (longest-first order): score = offset + max alpha + max_j (alpha_j − max alpha + end_j) for
// the last alpha, then the backtrace through the kept messages alphas [S,B,K] and the steps' maxima step_max [S,B].
template <class T>
__global__ void __launch_bounds__(kBacktraceThreads)
    viterbi_backtrace_kernel(const T* __restrict__ alphas, const T* __restrict__ step_max, const T* __restrict__ W,
                             const T* __restrict__ end, const int64_t* __restrict__ order,
                             const int64_t* __restrict__ len, const double* __restrict__ offset, T* __restrict__ score,
                             int64_t* __restrict__ path, int B, int Tn, int K) {
  __shared__ T values[2][kBacktraceWarps];
  __shared__ int labels[2][kBacktraceWarps];
  const int b = blockIdx.x;
  const int64_t sequence = order[b];
  const int L = static_cast<int>(len[sequence]);
  int64_t* p = path + sequence * Tn;
  for (int u = L + threadIdx.x; u < Tn; u += kBacktraceThreads) p[u] = -1;
  // The reductions alternate two sets of shared slots, so that the one barrier in each separates a set's writes from
  // its reads and from its next writes.
  int set = 0;
  const T* alpha = alphas + (int64_t(L - 1) * B + b) * K;
  T m = neg_inf<T>();
  for (int j = threadIdx.x; j < K; j += kBacktraceThreads) m = max(m, alpha[j]);
  int unused = 0;
  block_best(m, unused, values[set], labels[set]);  // labels 0 everywhere: the largest value
  set ^= 1;
  if (isinf(m)) m = T(0);  // as the CPU's rebase of an all -inf message
  T best = neg_inf<T>();
  int y = -1;
  for (int j = threadIdx.x; j < K; j += kBacktraceThreads) {
    const T s = (alpha[j] - m) + end[j];
    if (s > best || y < 0) {
      best = s;
      y = j;
    }
  }
  block_best(best, y, values[set], labels[set]);
  set ^= 1;
  if (threadIdx.x == 0) {
    score[sequence] = static_cast<T>(offset[b] + double(m) + double(best));
    p[L - 1] = y;
  }
  // Position u's label y came from the first row i reaching the step's maximum.
  for (int u = L - 1; u >= 1; --u) {
    const T* previous = alphas + (int64_t(u - 1) * B + b) * K;
    const T mu = step_max[int64_t(u) * B + b];
    const T* column = W + y;
    T top = neg_inf<T>();
    int arg = -1;
#pragma unroll 4
    for (int i = threadIdx.x; i < K; i += kBacktraceThreads) {
      const T s = (previous[i] - mu) + column[int64_t(i) * K];
      if (s > top || arg < 0) {
        top = s;
        arg = i;
      }
    }
    block_best(top, arg, values[set], labels[set]);
    set ^= 1;
    y = arg;
    if (threadIdx.x == 0) p[u - 1] = y;
  }
}

}  // namespace

bool many_label_viterbi_supported(int64_t K) { return K >= 1 && K < (int64_t(1) << 24); }

void many_label_viterbi(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& start,
                        const at::Tensor& end, const at::Tensor& lengths, at::Tensor& path, at::Tensor& score) {
  const int64_t B = emissions.size(0), Tn = emissions.size(1), K = emissions.size(2);
  if (B == 0) return;
  const StreamedLaunch launch(emissions.device(), K, transitions.nbytes());
  // Longest first: the sequences running at step t are the first running(t) of this order.
  const auto [sorted_host, order_host] = lengths.cpu().sort(/*stable=*/true, /*dim=*/0, /*descending=*/true);
  const at::Tensor order = order_host.to(emissions.device());
  const int64_t* sorted = sorted_host.data_ptr<int64_t>();
  const int64_t steps = sorted[0];
  const auto running = [&](int64_t t) { return running_at(sorted, B, t); };
  // Every step's messages [S,B,K] (rows of sequences past their end not written) and maxima [S,B].
  const at::Tensor alphas = at::empty({steps, B, K}, emissions.options());
  const at::Tensor step_max = at::empty({steps, B}, emissions.options());
  at::Tensor block_max = at::empty({B, launch.finish_blocks}, emissions.options()),
             next_max = at::empty_like(block_max);
  const at::Tensor offset = at::zeros({B}, emissions.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "many_label_viterbi_cuda", [&] {
    using T = scalar_t;
    with_group(B, [&](auto group) {
      constexpr int NB = decltype(group)::value;
      const StepPlan plan =
          plan_step<T, NB>(viterbi_step_kernel<T, NB>, B, K, launch.sms, "many-label Viterbi step kernel");
      const at::Tensor partial = at::empty({plan.splits, B, K}, emissions.options());
      const T *W = transitions.data_ptr<T>(), *st = start.data_ptr<T>(), *E = emissions.data_ptr<T>();
      const int64_t* ord = order.data_ptr<int64_t>();
      T* kept = alphas.data_ptr<T>();
      // Rows as 16-byte vectors where each row starts on a vector boundary.
      const bool vector_rows = K % kVec<T> == 0 && reinterpret_cast<std::uintptr_t>(W) % sizeof(Vec<T>) == 0;
      // Transitions all ≤ 0 (an HMM's log-probabilities; NaN is not) let float32 steps compare terms as integers.
      const bool nonpositive = std::is_same_v<T, float> && transitions.max().item<T>() <= T(0);
      for (int64_t t = 0; t < steps; ++t) {
        const int active = static_cast<int>(running(t));
        T* current = kept + t * B * K;
        if (t > 0) {
          const dim3 grid(grid_dim(active, NB), grid_dim(K, kCols<T>), plan.splits);
          launch_dependent(viterbi_step_kernel<T, NB>, grid, plan.smem, launch.stream, launch.pdl,
                           "many-label Viterbi step kernel", current - B * K, block_max.data_ptr<T>(),
                           launch.finish_blocks, W, offset.data_ptr<double>(), step_max.data_ptr<T>() + t * B,
                           partial.data_ptr<T>(), int(B), active, int(K), plan.rows, vector_rows, t % 2 == 0,
                           launch.keep_permille, nonpositive);
        }
        launch_dependent(viterbi_finish_kernel<T>, finish_grid(K, active), 0, launch.stream, launch.pdl && t > 0,
                         "many-label Viterbi finish kernel", partial.data_ptr<T>(), plan.splits, st, E, ord, current,
                         next_max.data_ptr<T>(), int(B), int(Tn), int(K), int(t));
        std::swap(block_max, next_max);
      }
      viterbi_backtrace_kernel<T><<<B, kBacktraceThreads, 0, launch.stream>>>(
          kept, step_max.data_ptr<T>(), W, end.data_ptr<T>(), ord, lengths.data_ptr<int64_t>(),
          offset.data_ptr<double>(), score.data_ptr<T>(), path.data_ptr<int64_t>(), int(B), int(Tn), int(K));
      check_launch("many-label Viterbi backtrace");
    });
  });
}

bool many_label_infer_supported(const at::Tensor& emissions, const at::Tensor& transitions) {
  const int64_t K = emissions.size(2);
  return emissions.scalar_type() == at::kFloat && transitions.scalar_type() == at::kFloat && K % 4 == 0 &&
         many_label_viterbi_supported(K) && reinterpret_cast<std::uintptr_t>(transitions.data_ptr()) % 16 == 0;
}

void many_label_infer(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& colmax,
                      const at::Tensor& start, const at::Tensor& end, const at::Tensor& lengths, double threshold,
                      at::Tensor& log_likelihood, at::Tensor& path, at::Tensor& score) {
  const int64_t B = emissions.size(0), Tn = emissions.size(1), K = emissions.size(2);
  if (B == 0) return;
  const StreamedLaunch launch(emissions.device(), K, transitions.nbytes());
  // Longest first: the sequences running at step t are the first running(t) of this order.
  const auto [sorted_host, order_host] = lengths.cpu().sort(/*stable=*/true, /*dim=*/0, /*descending=*/true);
  const at::Tensor order = order_host.to(emissions.device()), sorted = sorted_host.to(emissions.device());
  const int64_t* sorted_lengths = sorted_host.data_ptr<int64_t>();
  const int64_t steps = sorted_lengths[0];
  const auto running = [&](int64_t t) { return running_at(sorted_lengths, B, t); };
  const auto options = emissions.options();
  // The Viterbi's messages of every step [S,B,K] and maxima [S,B]; the forward's of the previous and this step.
  const at::Tensor alphas = at::empty({steps, B, K}, options), step_max = at::empty({steps, B}, options);
  at::Tensor viterbi_max = at::empty({B, launch.finish_blocks}, options),
             viterbi_next_max = at::empty_like(viterbi_max);
  const at::Tensor viterbi_offset = at::zeros({B}, options.dtype(at::kDouble));
  at::Tensor forward = at::empty({B, K}, options), forward_next = at::empty_like(forward);
  at::Tensor forward_max = at::empty({B, launch.finish_blocks}, options),
             forward_next_max = at::empty_like(forward_max);
  const at::Tensor forward_offset = at::zeros({B}, options.dtype(at::kDouble)), last = at::empty({B, K}, options);
  with_group<kInferGroup>(B, [&](auto group) {
    constexpr int NB = decltype(group)::value;
    // Shared memory before L1 (the rows arrive by cp.async.cg, which bypasses L1), so that two blocks fit an SM.
    check(cudaFuncSetAttribute(infer_step_kernel<NB>, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared),
          "hmm infer step kernel");
    const StepPlan plan = plan_step<float, NB, 2>(infer_step_kernel<NB>, B, K, launch.sms, "hmm infer step kernel");
    const at::Tensor partial_f = at::empty({plan.splits, B, K}, options), partial_v = at::empty_like(partial_f);
    const float *W = transitions.data_ptr<float>(), *cm = colmax.data_ptr<float>(), *st = start.data_ptr<float>();
    const float* E = emissions.data_ptr<float>();
    const int64_t *ord = order.data_ptr<int64_t>(), *len = sorted.data_ptr<int64_t>();
    float* kept = alphas.data_ptr<float>();
    for (int64_t t = 0; t < steps; ++t) {
      const int active = static_cast<int>(running(t));
      float* current = kept + t * B * K;
      if (t > 0) {
        const dim3 grid(grid_dim(active, NB), grid_dim(K, kCols<float>), plan.splits);
        launch_dependent(infer_step_kernel<NB>, grid, plan.smem, launch.stream, launch.pdl, "hmm infer step kernel",
                         forward.data_ptr<float>(), forward_max.data_ptr<float>(), current - B * K,
                         viterbi_max.data_ptr<float>(), launch.finish_blocks, W, cm, viterbi_offset.data_ptr<double>(),
                         step_max.data_ptr<float>() + t * B, partial_f.data_ptr<float>(), partial_v.data_ptr<float>(),
                         int(B), active, int(K), plan.rows, t % 2 == 0, launch.keep_permille);
      }
      launch_dependent(scaled_finish_kernel<float>, finish_grid(K, active), 0, launch.stream, launch.pdl && t > 0,
                       "hmm infer forward finish kernel", partial_f.data_ptr<float>(), plan.splits,
                       forward.data_ptr<float>(), forward_max.data_ptr<float>(), W, cm, st, E, ord, len,
                       forward_next.data_ptr<float>(), forward_next_max.data_ptr<float>(),
                       forward_offset.data_ptr<double>(), last.data_ptr<float>(), int(B), int(Tn), int(K), int(t),
                       static_cast<float>(threshold));
      launch_dependent(viterbi_finish_kernel<float>, finish_grid(K, active), 0, launch.stream, launch.pdl && t > 0,
                       "hmm infer Viterbi finish kernel", partial_v.data_ptr<float>(), plan.splits, st, E, ord, current,
                       viterbi_next_max.data_ptr<float>(), int(B), int(Tn), int(K), int(t));
      std::swap(forward, forward_next);
      std::swap(forward_max, forward_next_max);
      std::swap(viterbi_max, viterbi_next_max);
    }
    viterbi_backtrace_kernel<float><<<B, kBacktraceThreads, 0, launch.stream>>>(
        kept, step_max.data_ptr<float>(), W, end.data_ptr<float>(), ord, lengths.data_ptr<int64_t>(),
        viterbi_offset.data_ptr<double>(), score.data_ptr<float>(), path.data_ptr<int64_t>(), int(B), int(Tn), int(K));
    check_launch("hmm infer Viterbi backtrace");
  });
  log_likelihood =
      at::empty({B}, options)
          .index_copy_(0, order, (at::logsumexp(last + end, -1).to(at::kDouble) + forward_offset).to(at::kFloat));
}

}  // namespace trellis::cuda
