// The fused linear-chain kernels for many labels (LogSemiring, K past what cuda/chain_fused.cu keeps in shared
// memory): the forward recursion with its messages in ONE launch for the whole batch and every position, and its exact
// reverse mode in one more, in scaled probability space like the CPU path (lib/src/crf/chain_fused.cpp, ScaledLogStep):
//   forward  s = v·P, v = exp(alpha − max alpha), P = exp(W − colmax);  pre = log s + max alpha + colmax
//   backward q = adj / s (per column), adj' = v ⊙ (P·q), and the transitions' gradient Σ v·qᵀ ⊙ P
// where every column whose scaled sum is below the underflow threshold is done exactly in log space instead, in both
// directions. So each step is two K×K products with K exponentials, not K² of them.
//
// Layout: a cluster of C blocks takes kSeq sequences; each block keeps its K/C columns of P (forward) or rows of P
// (backward, stored transposed) in shared memory for the whole launch, computes those outputs of every step, and
// writes them into the message buffer of every block of the cluster (distributed shared memory); one cluster barrier
// per step. The message buffers alternate between steps, so a block never overwrites what another still reads.
// The backward kernel writes v and q of every step; the transitions' gradient is then one GEMM over them
// (scaled_chain_crf_backward), plus the rare exact columns, which the kernel adds with atomics.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>

#include "cuda/chain_kernels.h"
#include "cuda/cuda_check.h"
#include "cuda/launch.cuh"
#include "lib/src/semiring/backpointers.h"
#include "trellis/semiring/semiring.h"

namespace trellis::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kSeq = 4;  // sequences per cluster: one row of a thread's 4×4 register tile each
constexpr int kMaxCluster = 8;

template <class T>
struct alignas(4 * sizeof(T)) Quad {
  T v[4];
};

// How a chain of K labels is split: C blocks of Kc columns each (Kc a multiple of 4), `splits` groups of threads
// that each take a share of the K terms of every product, and the shared memory that needs.
struct Plan {
  int C = 0, Kc = 0, pairs = 0, splits = 0;
  std::size_t smem = 0;
};

template <class T>
std::size_t smem_bytes(int K, int Kc, int splits) {
  const std::size_t elements = std::size_t(K) * Kc                // P's columns (forward) or rows (backward)
                               + std::size_t(K) * kSeq            // the product's scaled input, [k][sequence]
                               + 2 * std::size_t(kSeq) * K        // messages of this step and the next
                               + 2 * std::size_t(kSeq) * K        // backward: alpha_{t-1} and pre_t rows
                               + std::size_t(splits) * kSeq * Kc  // partial products
                               + K;                               // colmax
  return elements * sizeof(T) + std::size_t(kSeq) * K /* exact-column flags */;
}

template <class T>
Plan make_plan(int64_t K) {
  int optin = 0, device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "shared memory limit");
  for (int C = 1; C <= kMaxCluster; C *= 2) {
    Plan p;
    p.C = C;
    p.Kc = static_cast<int>((K + C - 1) / C + 3) / 4 * 4;
    p.pairs = p.Kc / 4;
    if (p.pairs > kThreads) continue;
    p.splits = std::min<int>(kThreads / p.pairs, static_cast<int>(K));
    p.smem = smem_bytes<T>(static_cast<int>(K), p.Kc, p.splits);
    if (p.smem + 1024 <= static_cast<std::size_t>(optin)) return p;  // (the kernels' static shared memory)
  }
  return {};
}

// The shared memory of a block, carved in the order of smem_bytes.
template <class T>
struct Smem {
  T *M, *x, *msg0, *msg1, *al, *pr, *red, *cmax;
  unsigned char* exact;
  __device__ Smem(unsigned char* raw, int K, int Kc, int splits) {
    M = reinterpret_cast<T*>(raw);
    x = M + K * Kc;
    msg0 = x + K * kSeq;
    msg1 = msg0 + kSeq * K;
    al = msg1 + kSeq * K;
    pr = al + kSeq * K;
    red = pr + kSeq * K;
    cmax = red + splits * kSeq * Kc;
    exact = reinterpret_cast<unsigned char*>(cmax + K);
  }
};

struct Chain {
  int B, Tn, K, Kc, pairs, splits;
  float log_threshold;  // log of the underflow threshold (lib/src/semiring/scaled_log_matmul.h)
};

// Loads this block's share of P: forward, columns c0.. of P as [k][o]; backward, rows c0.. of P transposed, so that
// both directions compute out[o] = Σ_k x[k]·M[k][o]. Columns past K are zero.
template <class T, bool Backward>
__device__ void load_share(const T* __restrict__ P, T* M, int K, int Kc, int c0) {
  for (int e = threadIdx.x; e < K * Kc; e += blockDim.x) {
    const int k = e / Kc, o = e % Kc, col = c0 + o;
    M[e] = col < K ? (Backward ? P[int64_t(col) * K + k] : P[int64_t(k) * K + col]) : T(0);
  }
}

// What a block keeps for the whole launch: its share of P (columns c0.. forward, rows c0.. backward), colmax, and the
// lengths of its cluster's sequences b0.. (0 past B).
template <class T, bool Backward>
__device__ void load_block(const T* __restrict__ P, const T* __restrict__ colmax, const int64_t* __restrict__ len,
                           const Smem<T>& sm, const Chain& c, int c0, int b0, int* lens) {
  load_share<T, Backward>(P, sm.M, c.K, c.Kc, c0);
  for (int k = threadIdx.x; k < c.K; k += blockDim.x) sm.cmax[k] = colmax[k];
  if (threadIdx.x < kSeq) lens[threadIdx.x] = b0 + threadIdx.x < c.B ? static_cast<int>(len[b0 + threadIdx.x]) : 0;
}

// red[s][g][o] = Σ_{k in split s} x[k][g]·M[k][o] for this block's Kc outputs and kSeq sequences: each thread a 4×4
// register tile (4 sequences × 4 neighbouring columns), so a step of k is two 16-byte shared loads for 16 FMAs.
template <class T>
__device__ void product(const Smem<T>& sm, const Chain& c) {
  const int s = threadIdx.x / c.pairs, o0 = threadIdx.x % c.pairs * 4;
  if (s >= c.splits) return;
  const int k0 = s * c.K / c.splits, k1 = (s + 1) * c.K / c.splits;
  T acc[kSeq][4] = {};
  for (int k = k0; k < k1; ++k) {
    const Quad<T> xq = *reinterpret_cast<const Quad<T>*>(sm.x + k * kSeq);
    const Quad<T> mq = *reinterpret_cast<const Quad<T>*>(sm.M + k * c.Kc + o0);
#pragma unroll
    for (int g = 0; g < kSeq; ++g)
#pragma unroll
      for (int u = 0; u < 4; ++u) acc[g][u] = fma(xq.v[g], mq.v[u], acc[g][u]);
  }
#pragma unroll
  for (int g = 0; g < kSeq; ++g) {
    Quad<T> out;
#pragma unroll
    for (int u = 0; u < 4; ++u) out.v[u] = acc[g][u];
    *reinterpret_cast<Quad<T>*>(sm.red + (s * kSeq + g) * c.Kc + o0) = out;
  }
}

template <class T>
__device__ T summed(const Smem<T>& sm, const Chain& c, int g, int o) {
  T s = T(0);
  for (int q = 0; q < c.splits; ++q) s += sm.red[(q * kSeq + g) * c.Kc + o];
  return s;
}

// mx[g] = max_k row[g][k] over kSeq rows of K, one warp each; 0 for an all -inf row (as on the CPU).
template <class T>
__device__ void row_maxima(const T* rows, int K, T* mx) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (w >= kSeq) return;
  T m = neg_inf<T>();
  for (int k = lane; k < K; k += 32) m = max(m, rows[w * K + k]);
  for (int offset = 16; offset > 0; offset >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if (lane == 0) mx[w] = isinf(m) ? T(0) : m;
}

// Writes one output of this step into the next message buffer of every block of the cluster.
template <class T>
__device__ void broadcast(cg::cluster_group& cluster, T* next, int index, T value) {
  for (unsigned r = 0; r < cluster.num_blocks(); ++r) cluster.map_shared_rank(next, r)[index] = value;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    scaled_chain_forward_kernel(const T* __restrict__ E, const T* __restrict__ W, const T* __restrict__ P,
                                const T* __restrict__ colmax, const T* __restrict__ start, const T* __restrict__ end,
                                const int64_t* __restrict__ len, const int64_t* __restrict__ tags,
                                T* __restrict__ alpha, T* __restrict__ pre, T* __restrict__ score,
                                T* __restrict__ loglik, Chain c) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ T mx[kSeq];
  __shared__ int lens[kSeq];
  cg::cluster_group cluster = cg::this_cluster();
  const Smem<T> sm(smem_raw, c.K, c.Kc, c.splits);
  const int K = c.K, c0 = static_cast<int>(cluster.block_rank()) * c.Kc, b0 = blockIdx.x / cluster.num_blocks() * kSeq;
  load_block<T, false>(P, colmax, len, sm, c, c0, b0, lens);
  // alpha_0 = start + e_0, whole rows in every block; each block stores its own columns.
  for (int e = threadIdx.x; e < kSeq * K; e += blockDim.x) {
    const int g = e / K, k = e % K, b = b0 + g;
    T a = neg_inf<T>();
    if (b < c.B) {
      const int64_t o = int64_t(b) * c.Tn * K + k;
      a = start[k] + E[o];
      if (k >= c0 && k < c0 + c.Kc) alpha[o] = a, pre[o] = start[k];
    }
    sm.msg0[e] = a;
  }
  cluster.sync();  // every block runs (its shared memory may be written) and has its first message
  int Lmax = 0;
  for (int g = 0; g < kSeq; ++g) Lmax = max(Lmax, lens[g]);
  for (int t = 1; t < Lmax; ++t) {
    T* cur = t % 2 ? sm.msg0 : sm.msg1;
    T* next = t % 2 ? sm.msg1 : sm.msg0;
    row_maxima(cur, K, mx);
    __syncthreads();
    for (int e = threadIdx.x; e < kSeq * K; e += blockDim.x) {
      const int k = e / kSeq, g = e % kSeq;
      sm.x[e] = exp(cur[g * K + k] - mx[g]);
    }
    __syncthreads();
    product(sm, c);
    __syncthreads();
    for (int e = threadIdx.x; e < kSeq * c.Kc; e += blockDim.x) {
      const int g = e / c.Kc, col = c0 + e % c.Kc, b = b0 + g;
      if (col >= K) continue;
      T a = cur[g * K + col];  // past its length a sequence keeps its message (and a missing one its -inf)
      if (t < lens[g]) {
        const T lp = log(summed(sm, c, g, e % c.Kc));
        const T p = lp >= T(c.log_threshold) ? lp + mx[g] + sm.cmax[col] : exact_log_dot(cur + g * K, W + col, K, K);
        const int64_t o = (int64_t(b) * c.Tn + t) * K + col;
        a = p + E[o];
        pre[o] = p;
        alpha[o] = a;
      }
      broadcast(cluster, next, g * K + col, a);
    }
    cluster.sync();
  }
  // The score (and log-likelihood) of each sequence, by the cluster's first block: one warp per sequence.
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, b = b0 + w;
  if (cluster.block_rank() != 0 || w >= kSeq || b >= c.B) return;
  const T* last = (Lmax % 2 ? sm.msg0 : sm.msg1) + w * K;
  LogSemiring::Accumulator<T> acc;
  for (int k = lane; k < K; k += 32) acc.add(last[k] + end[k], k);
  for (int offset = 16; offset > 0; offset >>= 1) {
    LogSemiring::Accumulator<T> other;
    other.max = __shfl_xor_sync(0xffffffffu, acc.max, offset);
    other.sum = __shfl_xor_sync(0xffffffffu, acc.sum, offset);
    acc.merge(other);
  }
  const T z = acc.value();
  if (lane == 0) score[b] = z;
  if (!tags) return;
  // log-likelihood: the tagged sequence's score minus the sum over all
  const int64_t* y = tags + int64_t(b) * c.Tn;
  const int L = lens[w];
  T gold = T(0);
  for (int t = lane; t < L; t += 32)
    gold += E[(int64_t(b) * c.Tn + t) * K + y[t]] + (t == 0 ? start[y[0]] : W[y[t - 1] * K + y[t]]);
  for (int offset = 16; offset > 0; offset >>= 1) gold += __shfl_xor_sync(0xffffffffu, gold, offset);
  if (lane == 0) loglik[b] = gold + end[y[L - 1]] - z;
}

// Reverse mode of the forward kernel for the score's adjoint (−G with tags: the output was gold − score; the gold
// indicators are taken off by the launcher), sequence b's G at G[b·g_stride] (stride 0: one value for every sequence).
// Fills g_em (zero at padding), V[b,t] = v and Q[b,t] = q of step t (left zero where a sequence has no step t), and
// adds the exact columns' share of the transitions' gradient to g_exact.
template <class T>
__global__ void __launch_bounds__(kThreads)
    scaled_chain_backward_kernel(const T* __restrict__ G, int64_t g_stride, const T* __restrict__ W,
                                 const T* __restrict__ P, const T* __restrict__ colmax, const T* __restrict__ end,
                                 const int64_t* __restrict__ len, bool tagged, const T* __restrict__ alpha,
                                 const T* __restrict__ pre, const T* __restrict__ score, T* __restrict__ g_em,
                                 T* __restrict__ V, T* __restrict__ Q, T* __restrict__ g_exact, Chain c) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ T mx[kSeq];
  __shared__ int lens[kSeq], exact_count[kSeq];
  cg::cluster_group cluster = cg::this_cluster();
  const Smem<T> sm(smem_raw, c.K, c.Kc, c.splits);
  const int K = c.K, c0 = static_cast<int>(cluster.block_rank()) * c.Kc, b0 = blockIdx.x / cluster.num_blocks() * kSeq;
  load_block<T, true>(P, colmax, len, sm, c, c0, b0, lens);
  __syncthreads();
  // The adjoint of alpha at each sequence's last position: the softmax weights of the end sum.
  for (int e = threadIdx.x; e < kSeq * K; e += blockDim.x) {
    const int g = e / K, k = e % K, b = b0 + g;
    T a = T(0);
    if (b < c.B) {
      const int64_t row = int64_t(b) * c.Tn * K;
      const T gb = tagged ? -G[b * g_stride] : G[b * g_stride];
      a = gb * LogSemiring::weight(alpha[row + int64_t(lens[g] - 1) * K + k] + end[k], score[b], k, -1);
      if (k >= c0 && k < c0 + c.Kc) {
        g_em[row + int64_t(lens[g] - 1) * K + k] = a;
        for (int t = lens[g]; t < c.Tn; ++t) g_em[row + int64_t(t) * K + k] = T(0);
      }
    }
    sm.msg0[e] = a;
  }
  cluster.sync();
  int Lmax = 0;
  for (int g = 0; g < kSeq; ++g) Lmax = max(Lmax, lens[g]);
  for (int t = Lmax - 1, n = 0; t >= 1; --t, ++n) {
    T* cur = n % 2 ? sm.msg1 : sm.msg0;
    T* next = n % 2 ? sm.msg0 : sm.msg1;
    for (int e = threadIdx.x; e < kSeq * K; e += blockDim.x) {
      const int g = e / K, k = e % K, b = b0 + g;
      const bool active = b < c.B && t < lens[g];
      const int64_t o = (int64_t(b) * c.Tn + t) * K + k;
      sm.al[e] = active ? alpha[o - K] : neg_inf<T>();
      sm.pr[e] = active ? pre[o] : T(0);
    }
    if (threadIdx.x < kSeq) exact_count[threadIdx.x] = 0;
    __syncthreads();
    row_maxima(sm.al, K, mx);
    __syncthreads();
    // q = adj / s column by column, or the column is exact (flagged).
    for (int e = threadIdx.x; e < kSeq * K; e += blockDim.x) {
      const int k = e / kSeq, g = e % kSeq, b = b0 + g;
      const T adj = cur[g * K + k];
      T q = T(0);
      bool exact = false;
      if (b < c.B && t < lens[g] && adj != T(0)) {
        const T lp = sm.pr[g * K + k] - mx[g] - sm.cmax[k];  // log of the scaled sum the forward step saw
        if (lp >= T(c.log_threshold)) {
          q = adj * exp(-lp);
          if (k >= c0 && k < c0 + c.Kc) Q[(int64_t(b) * c.Tn + t) * K + k] = q;
        } else {
          exact = true;
          atomicAdd(&exact_count[g], 1);
        }
      }
      sm.x[e] = q;
      sm.exact[g * K + k] = exact;
    }
    __syncthreads();
    product(sm, c);
    __syncthreads();
    for (int e = threadIdx.x; e < kSeq * c.Kc; e += blockDim.x) {
      const int g = e / c.Kc, i = c0 + e % c.Kc, b = b0 + g;
      if (i >= K) continue;
      T a = cur[g * K + i];  // before its last position a sequence keeps its adjoint (and a missing one its zero)
      if (t < lens[g]) {
        const T ai = sm.al[g * K + i];
        const T v = exp(ai - mx[g]);
        a = v * summed(sm, c, g, e % c.Kc);
        if (exact_count[g] > 0)
          for (int j = 0; j < K; ++j) {
            if (!sm.exact[g * K + j]) continue;
            const T w = cur[g * K + j] * LogSemiring::weight(ai + W[int64_t(i) * K + j], sm.pr[g * K + j], i, -1);
            a += w;
            atomicAdd(g_exact + int64_t(i) * K + j, w);
          }
        const int64_t o = (int64_t(b) * c.Tn + t) * K + i;
        g_em[o - K] = a;
        V[o] = v;
      }
      broadcast(cluster, next, g * K + i, a);
    }
    cluster.sync();
  }
}

template <class Kernel, class... Args>
void launch(Kernel kernel, const Plan& p, int B, const char* what, Args... args) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(p.smem)), what);
  const LaunchShape shape{dim3(static_cast<unsigned>((B + kSeq - 1) / kSeq * p.C)), dim3(kThreads), p.smem,
                          at::cuda::getCurrentCUDAStream(), static_cast<unsigned>(p.C)};
  check(launch_kernel(kernel, shape, args...), what);
}

Chain chain_of(const Plan& p, int64_t B, int64_t Tn, int64_t K, double threshold) {
  return {int(B), int(Tn), int(K), p.Kc, p.pairs, p.splits, static_cast<float>(std::log(threshold))};
}

}  // namespace

bool scaled_chain_crf_supported(int64_t K, at::ScalarType dtype) {
  return dtype == at::kDouble ? make_plan<double>(K).C > 0 : make_plan<float>(K).C > 0;
}

void scaled_chain_crf_forward(const ChainInputs& in, const ScaledTransitions& w, ChainRecord& record) {
  const at::Tensor& em = in.emissions;
  const int64_t B = em.size(0), Tn = em.size(1), K = em.size(2);
  if (B == 0) return;
  const c10::cuda::CUDAGuard guard(em.device());
  AT_DISPATCH_FLOATING_TYPES(em.scalar_type(), "scaled_chain_crf_forward", [&] {
    const Plan p = make_plan<scalar_t>(K);
    launch(scaled_chain_forward_kernel<scalar_t>, p, int(B), "scaled_chain_crf_forward", em.data_ptr<scalar_t>(),
           in.transitions.data_ptr<scalar_t>(), w.scaled.data_ptr<scalar_t>(), w.colmax.data_ptr<scalar_t>(),
           in.start.data_ptr<scalar_t>(), in.end.data_ptr<scalar_t>(), in.lengths.data_ptr<int64_t>(),
           detail::data_or_null<int64_t>(in.tags), record.alpha.data_ptr<scalar_t>(), record.pre.data_ptr<scalar_t>(),
           record.score.data_ptr<scalar_t>(), detail::data_or_null<scalar_t>(record.loglik),
           chain_of(p, B, Tn, K, w.threshold));
  });
}

void scaled_chain_crf_backward(const at::Tensor& grad, const ChainInputs& in, const ScaledTransitions& w,
                               const ChainRecord& record, ChainGradients& grads) {
  const at::Tensor &alpha = record.alpha, &lengths = in.lengths, &tags = in.tags;
  const int64_t B = alpha.size(0), Tn = alpha.size(1), K = alpha.size(2);
  const c10::cuda::CUDAGuard guard(alpha.device());
  at::Tensor V = at::zeros_like(alpha), Q = at::zeros_like(alpha), g_exact = at::zeros_like(in.transitions);
  at::Tensor& g_em = grads.emissions;
  if (B > 0) {
    AT_DISPATCH_FLOATING_TYPES(alpha.scalar_type(), "scaled_chain_crf_backward", [&] {
      const Plan p = make_plan<scalar_t>(K);
      launch(scaled_chain_backward_kernel<scalar_t>, p, int(B), "scaled_chain_crf_backward", grad.data_ptr<scalar_t>(),
             grad.stride(0), in.transitions.data_ptr<scalar_t>(), w.scaled.data_ptr<scalar_t>(),
             w.colmax.data_ptr<scalar_t>(), in.end.data_ptr<scalar_t>(), lengths.data_ptr<int64_t>(), tags.numel() > 0, alpha.data_ptr<scalar_t>(),
             record.pre.data_ptr<scalar_t>(), record.frame_score.data_ptr<scalar_t>(), g_em.data_ptr<scalar_t>(),
             V.data_ptr<scalar_t>(), Q.data_ptr<scalar_t>(), g_exact.data_ptr<scalar_t>(),
             chain_of(p, B, Tn, K, w.threshold));
    });
  }
  // Σ over sequences and steps of v_i·P_ij·q_j: one GEMM over the saved vectors, then the elementwise factor P.
  at::Tensor& g_trans = grads.transitions;
  g_trans = at::mm(V.view({B * Tn, K}).t(), Q.view({B * Tn, K})).mul_(w.scaled).add_(g_exact);
  const at::Tensor mask = at::arange(Tn, lengths.options()).unsqueeze(0) < lengths.unsqueeze(1);
  if (tags.numel()) {  // the tagged sequence's score was subtracted: its indicators, weighted by G
    const at::Tensor y = tags.masked_fill(~mask, 0);
    const at::Tensor coef = grad.unsqueeze(1) * mask.to(grad.scalar_type());
    g_em.scatter_add_(2, y.unsqueeze(2), coef.unsqueeze(2));
    if (Tn > 1) g_trans.index_put_({y.slice(1, 0, -1), y.slice(1, 1)}, coef.slice(1, 1), /*accumulate=*/true);
  }
  // The start's adjoint is alpha_0's, the end's alpha's at the last position (both include the gold indicators).
  grads.start = g_em.select(1, 0).sum(0);
  grads.end = g_em.gather(1, (lengths - 1).view({B, 1, 1}).expand({B, 1, K})).squeeze(1).sum(0);
}

}  // namespace trellis::cuda
