// Posteriors and the E-step's pair factors of a many-state HMM batch from its forward and backward messages
// (cuda/scaled_chain_forward.cu, rebased_scaled_chain_messages): one pass over the messages after the two recursions,
// so that no framework operation runs per step.
//
// The backward recursion runs as a forward one over each sequence reversed within its length, with the transposed
// transitions and the end scores as start: its message at step s is g = e_t + beta_t for t = L − 1 − s (the emission
// included). Both are rebased each step (minus the previous message's largest entry), so for position t of a sequence
// x = alpha_t + g_t − e_t differs from the log posterior by a constant, and the node posterior is softmax(x).
//
// Expected transition counts: with M_t the largest entry of alpha_t (the shift the forward took at step t + 1), P the
// scaled transitions exp(W − colmax) and n_{t+1} = logsumexp(x_{t+1}), the pair (t, t + 1) contributes
//   xi_t(i, j) = u_t(i) P(i, j) v_t(j),  u_t = exp(alpha_t − M_t),  v_t = exp(colmax + g_{t+1} − n_{t+1}),
// because sum_i exp(alpha_t(i) − M_t + W(i, j)) = exp(alpha_{t+1}(j) − e_{t+1}(j)) is what the forward step computed.
// The kernel writes u and v rows for every pair of positions, packed, and the counts are P ∘ (Uᵀ V): one GEMM over the
// batch instead of a normalising product per position.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/cuda_check.h"
#include "cuda/hmm_expectations.h"
#include "trellis/semiring/semiring.h"

namespace trellis::cuda {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
// v's exponent is capped here: it is large only for a state that the forward messages barely reach but the backward
// ones favour, whose u·P is then tiny; the cap keeps the GEMM's sums finite in float32 in such a corner.
constexpr double kMaxPairExponent = 60;

// (max, sum of exp(x − max)) of a set of numbers, merged; an empty set is (-inf, 0).
template <class T>
struct MaxSum {
  T m, s;
};

template <class T>
__device__ MaxSum<T> merge(MaxSum<T> a, MaxSum<T> b) {
  if (b.m == neg_inf<T>()) return a;
  if (a.m == neg_inf<T>()) return b;
  return a.m >= b.m ? MaxSum<T>{a.m, a.s + b.s * exp(b.m - a.m)} : MaxSum<T>{b.m, b.s + a.s * exp(a.m - b.m)};
}

// Every thread gets the block's merged (max, sum) and the largest of `top` over the block.
template <class T>
__device__ void block_reduce(MaxSum<T>& ms, T& top) {
  __shared__ T ms_m[kWarps], ms_s[kWarps], tops[kWarps];
  for (int lanes = 16; lanes > 0; lanes >>= 1) {
    const MaxSum<T> other{__shfl_xor_sync(0xffffffffu, ms.m, lanes), __shfl_xor_sync(0xffffffffu, ms.s, lanes)};
    ms = merge(ms, other);
    top = max(top, __shfl_xor_sync(0xffffffffu, top, lanes));
  }
  if (threadIdx.x % 32 == 0) {
    ms_m[threadIdx.x / 32] = ms.m;
    ms_s[threadIdx.x / 32] = ms.s;
    tops[threadIdx.x / 32] = top;
  }
  __syncthreads();
  ms = {ms_m[0], ms_s[0]};
  top = tops[0];
  for (int w = 1; w < kWarps; ++w) {
    ms = merge(ms, MaxSum<T>{ms_m[w], ms_s[w]});
    top = max(top, tops[w]);
  }
}

// alpha_t + g_t − e_t; a zero emission probability (e = -inf, so alpha and g are -inf too) gives -inf, not NaN.
template <class T>
__device__ T joint(T a, T g, T e) {
  return e == neg_inf<T>() ? neg_inf<T>() : a + g - e;
}

// One block per (step t, sequence b) of the batch longest first, rows t·B + b; positions past a sequence's end do
// nothing (nodes there keep their zeros).
template <class T>
__global__ void __launch_bounds__(kThreads)
    posterior_rows_kernel(const T* __restrict__ forward, const T* __restrict__ backward, const T* __restrict__ E,
                          int64_t e_steps, const int64_t* __restrict__ len, const int64_t* __restrict__ order,
                          const int64_t* __restrict__ pair_start, const T* __restrict__ colmax, T* __restrict__ nodes,
                          int64_t node_steps, T* __restrict__ u, T* __restrict__ v, int B, int K) {
  const int64_t row = blockIdx.x;
  const int b = static_cast<int>(row % B), t = static_cast<int>(row / B);
  const int L = static_cast<int>(len[b]);
  if (t >= L) return;
  const T* a = forward + (int64_t(t) * B + b) * K;
  const T* g = backward + (int64_t(L - 1 - t) * B + b) * K;
  const T* e = E + (int64_t(b) * e_steps + t) * K;
  MaxSum<T> ms{neg_inf<T>(), T(0)};
  T top = neg_inf<T>();
  for (int k = threadIdx.x; k < K; k += kThreads) {
    const T ak = a[k];
    ms = merge(ms, MaxSum<T>{joint(ak, g[k], e[k]), T(1)});
    top = max(top, ak);
  }
  block_reduce(ms, top);
  const T n = ms.m + log(ms.s);  // -inf for a sequence of probability zero: its posteriors are NaN, as on the CPU
  const T shift = isinf(top) ? T(0) : top;  // as the forward's rebase of an all -inf message
  T* out = nodes + (order[b] * node_steps + t) * K;
  T* u_row = u && t + 1 < L ? u + (pair_start[b] + t) * K : nullptr;
  T* v_row = v && t > 0 ? v + (pair_start[b] + t - 1) * K : nullptr;
  for (int k = threadIdx.x; k < K; k += kThreads) {
    const T ak = a[k], gk = g[k];
    out[k] = exp(joint(ak, gk, e[k]) - n);
    if (u_row) u_row[k] = exp(ak - shift);
    if (v_row) v_row[k] = exp(min(colmax[k] + gk - n, T(kMaxPairExponent)));
  }
}

}  // namespace

void hmm_posterior_rows(const at::Tensor& forward, const at::Tensor& backward, const at::Tensor& emissions,
                        const at::Tensor& lengths, const at::Tensor& order, const at::Tensor& pair_start,
                        const at::Tensor& colmax, at::Tensor& nodes, at::Tensor* u, at::Tensor* v) {
  const int64_t steps = forward.size(0), B = forward.size(1), K = forward.size(2);
  if (B == 0 || steps == 0) return;
  const c10::cuda::CUDAGuard guard(forward.device());
  AT_DISPATCH_FLOATING_TYPES(forward.scalar_type(), "hmm_posterior_rows_cuda", [&] {
    using T = scalar_t;
    posterior_rows_kernel<T><<<steps * B, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        forward.data_ptr<T>(), backward.data_ptr<T>(), emissions.data_ptr<T>(), emissions.size(1),
        lengths.data_ptr<int64_t>(), order.data_ptr<int64_t>(), pair_start.data_ptr<int64_t>(), colmax.data_ptr<T>(),
        nodes.data_ptr<T>(), nodes.size(1), u ? u->data_ptr<T>() : nullptr, v ? v->data_ptr<T>() : nullptr, int(B),
        int(K));
  });
  check_launch("HMM posterior rows");
}

}  // namespace trellis::cuda
