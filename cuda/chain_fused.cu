// Fused linear-chain kernels: the whole recursion over all positions of a batch in ONE launch (forward) and its exact
// reverse mode in one more (backward). Generic over the semiring: LogSemiring gives log-partition and marginals,
// MaxSemiring the Viterbi score and, through the backward pass, the backtrace.
//
// Layout: each label of a sequence gets R consecutive lanes that split its ⊕ over the K terms and merge their partial
// accumulators with warp shuffles (a short critical path per step, and more warps in flight); a sequence gets `tps`
// threads (K·R rounded up to a warp); a block holds `spb` sequences (several short-K sequences share a block). The
// transitions live in shared memory for the whole launch (rows padded to an odd length so column and row walks are both
// free of bank conflicts); so does each sequence's previous message. The backward pass accumulates each sequence's
// transition gradient in shared memory (thread i owns row i, so no two threads write the same word) and writes one
// partial per block; the partials are summed afterwards — no atomics.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include "cuda/chain_kernels.h"
#include "cuda/cuda_check.h"
#include "lib/src/semiring/backpointers.h"
#include "trellis/semiring/semiring.h"

namespace trellis::cuda {
namespace {

// Leading dimension of the transitions (and their gradient) in shared memory: odd, so that threads walking a row each
// (backward) and threads walking a column together (forward) both hit distinct banks.
__host__ __device__ inline int ld(int64_t K) { return static_cast<int>(K | 1); }

struct Layout {
  int R, tps, spb, blocks;
};

// One lane per label while a sequence fits in a warp (measured fastest for K=23 on an H200); beyond that about eight
// terms per lane, R a power of two up to 8 (so a label's lanes never straddle a warp), at most 1024 threads per
// sequence (R=8 took K=50, B=64, T=512 from 4.3 to 1.9 ms).
Layout layout(int64_t B, int64_t K) {
  int R = 1;
  while (K > 32 && R < 8 && K > 8 * R && K * 2 * R <= 1024) R *= 2;
  const int tps = static_cast<int>((K * R + 31) / 32 * 32);
  const int spb = std::max(1, 128 / tps);
  return {R, tps, spb, static_cast<int>((B + spb - 1) / spb)};
}

// Merges the accumulators of the R lanes of a label (all lanes of the warp take part).
template <class S, class T>
__device__ typename S::template Accumulator<T> merge_lanes(typename S::template Accumulator<T> acc, int R) {
  for (int offset = R / 2; offset > 0; offset /= 2)
    acc.merge(acc.transformed([&](auto field) { return __shfl_xor_sync(0xffffffffu, field, offset); }));
  return acc;
}

template <class T>
__device__ T sum_lanes(T v, int R) {
  for (int offset = R / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <class T>
__device__ T max_lanes(T v, int R) {
  for (int offset = R / 2; offset > 0; offset /= 2) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// A sequence's length as the kernels use it (no lengths: every sequence is T long): lengths outside [1, T] (values the
// host did not check, to spare a synchronisation) are clamped so that every access stays inside the sequence's rows,
// and flagged.
__device__ inline int usable_length(const int64_t* __restrict__ len, int b, int B, int Tn, bool& bad) {
  if (b >= B) return 0;
  const int64_t L = len ? len[b] : Tn;
  bad = L < 1 || L > Tn;
  return L < 1 ? 1 : L > Tn ? Tn : static_cast<int>(L);
}

// Whether a tag can index K labels.
__device__ inline bool tag_in_range(int64_t y, int K) { return y >= 0 && y < K; }

template <class T>
std::size_t forward_smem(int64_t K, int spb) {
  return sizeof(T) * (K * ld(K) + 2 * spb * K);
}

// Viterbi's back-pointers of a block's sequences, one byte each ([spb][T][K]; K ≤ 159 < 255), after the forward's
// shared memory: the backtrace then walks shared memory instead of T dependent reads of global memory, in the forward
// launch. Kept there while the whole block stays within the shared memory that needs no opt-in.
std::size_t backtrace_smem(int64_t Tn, int64_t K, int spb) { return static_cast<std::size_t>(spb) * Tn * K; }
constexpr std::size_t kBacktraceSmemLimit = 48 * 1024;

template <class T>
std::size_t backward_smem(int64_t K, int spb) {
  return sizeof(T) * (K * ld(K) + spb * K * ld(K) + 2 * spb * K) + sizeof(int) * spb * K;
}

template <class T>
__device__ void load_transitions(const T* __restrict__ W, T* w, int K) {
  for (int e = threadIdx.x; e < K * K; e += blockDim.x) w[(e / K) * ld(K) + e % K] = W[e];
}

template <class S, class T>
__global__ void chain_forward_kernel(const T* __restrict__ E, const T* __restrict__ W, const T* __restrict__ start,
                                     const T* __restrict__ end, const int64_t* __restrict__ len,
                                     const int64_t* __restrict__ tags, T* __restrict__ alpha, T* __restrict__ pre,
                                     int64_t* __restrict__ arg, int64_t* __restrict__ end_arg, T* __restrict__ score,
                                     T* __restrict__ frame_score, T* __restrict__ loglik, int64_t* __restrict__ path,
                                     int B, int Tn, int K, int R, int tps, int spb) {
  extern __shared__ unsigned char smem_raw[];
  T* w = reinterpret_cast<T*>(smem_raw);  // [K][ld]
  // [2][spb][K]: alpha_t in buffer t % 2. Step t reads one buffer and writes the other, so one barrier per step keeps
  // a row from being overwritten while it is read; a finished sequence leaves its last alpha where it was written.
  T* messages = w + K * ld(K);
  // With path (MaxSemiring): the back-pointers in shared memory ([spb][Tn][K], backtrace_smem), for the backtrace at
  // the end of this launch.
  unsigned char* kept = path ? reinterpret_cast<unsigned char*>(messages + 2 * spb * K) : nullptr;
  __shared__ int block_len;
  const int s = threadIdx.x / tps, j = threadIdx.x % tps / R, r = threadIdx.x % R;
  const int b = blockIdx.x * spb + s;
  const bool lane = b < B && j < K;   // this thread works for label j
  const bool owner = lane && r == 0;  // and writes its results
  bool bad = false;
  const int L = usable_length(len, b, B, Tn, bad);
  if (threadIdx.x == 0) block_len = 0;
  load_transitions(W, w, K);
  __syncthreads();
  if (threadIdx.x % tps == 0 && b < B) atomicMax(&block_len, L);
  const int64_t off = static_cast<int64_t>(b) * Tn * K;
  const auto alpha_row = [&](int t) { return messages + ((t & 1) * spb + s) * K; };
  if (owner) {
    const T a = S::times(start[j], E[off + j]);
    if (alpha) {  // (Viterbi alone records only the argmax)
      alpha[off + j] = a;
      pre[off + j] = start[j];
    }
    alpha_row(0)[j] = a;
  }
  __syncthreads();
  const int Lmax = block_len;
  const int terms = (K - r + R - 1) / R;              // this lane's share: i = r, r+R, r+2R, ...
  T e_next = owner && 1 < L ? E[off + K + j] : T(0);  // the next step's emission is loaded a step ahead
  // Messages of a long sequence fall to about −T·(nats per step), where a float32 keeps only about 1e-2 absolutely:
  // each alpha_t is stored minus the largest entry of alpha_{t−1} (found in the same pass over it), the shifts summed
  // in float64. pre_t stays in alpha_{t−1}'s frame, so the backward pass, which only takes their differences, is
  // unchanged; frame_score is the score in the last alpha's frame.
  double offset = 0;
  for (int t = 1; t < Lmax; ++t) {
    const bool active = lane && t < L;
    const T* ps = alpha_row(t - 1);
    typename S::template Accumulator<T> acc;
    T largest = T(-INFINITY);
    if (active) {
      acc = S::template reduce<T>(terms, [&](int k) {
        const int i = r + k * R;
        largest = fmax(largest, ps[i]);
        return S::times(ps[i], w[i * ld(K) + j]);
      });
      acc.renumber(r, R);  // the lane's k-th term is label r + k·R
    }
    acc = merge_lanes<S, T>(acc, R);
    largest = max_lanes(largest, R);
    const T shift = isfinite(largest) ? largest : T(0);
    if (active) offset += shift;
    if (active && r == 0) {
      const T e = e_next;
      if (t + 1 < L) e_next = E[off + static_cast<int64_t>(t + 1) * K + j];
      const int64_t o = off + static_cast<int64_t>(t) * K + j;
      const T a = S::times(acc.value(), e) - shift;
      if (alpha) {
        pre[o] = acc.value();
        alpha[o] = a;
      }
      if (arg) S::Backpointers::store(arg, o, acc.arg());
      if (kept) S::Backpointers::store(kept, (static_cast<int64_t>(s) * Tn + t) * K + j, acc.arg());
      alpha_row(t)[j] = a;
    }
    __syncthreads();
  }
  if (threadIdx.x % tps == 0 && b < B) {
    const T* last = alpha_row(L - 1);
    const auto acc = S::template reduce<T>(K, [&](int k) { return S::times(last[k], end[k]); });
    const double z = offset + acc.value();
    const T nan = T(NAN);
    if (tags) {  // log-likelihood: the tagged sequence's score minus the ⊕ of all
      const int64_t* y = tags + static_cast<int64_t>(b) * Tn;
      double g = 0;
      for (int t = 0; t < L && !bad; ++t) {
        bad = !tag_in_range(y[t], K);  // (y[t - 1] passed this at t − 1)
        if (bad) break;
        g += double(t == 0 ? start[y[0]] : w[y[t - 1] * ld(K) + y[t]]) + E[off + static_cast<int64_t>(t) * K + y[t]];
      }
      if (!bad) g += end[y[L - 1]];
      loglik[b] = bad ? nan : static_cast<T>(g - z);
    }
    // A sequence with a length or tag out of range scores NaN, and so do its gradients (through frame_score).
    score[b] = bad ? nan : static_cast<T>(z);
    frame_score[b] = bad ? nan : acc.value();
    if (end_arg) S::Backpointers::store(end_arg, b, acc.arg());
    if (path) {  // chain_backtrace_kernel's walk, over the back-pointers kept in shared memory
      int64_t* p = path + static_cast<int64_t>(b) * Tn;
      const bool nothing_allowed = isinf(acc.value()) && acc.value() < T(0);
      for (int t = nothing_allowed ? 0 : L; t < Tn; ++t) p[t] = -1;
      if (!nothing_allowed) {
        int64_t y = acc.arg();
        p[L - 1] = y;
        for (int t = L - 1; t >= 1; --t)
          p[t - 1] = y = S::Backpointers::load(kept, (static_cast<int64_t>(s) * Tn + t) * K + y);
      }
    }
  }
}

template <class S, class T>
__global__ void chain_backward_kernel(const T* __restrict__ G, int64_t g_stride, const T* __restrict__ W,
                                      const T* __restrict__ end, const int64_t* __restrict__ len,
                                      const int64_t* __restrict__ tags,
                                      const T* __restrict__ alpha, const T* __restrict__ pre,
                                      const int64_t* __restrict__ arg, const int64_t* __restrict__ end_arg,
                                      const T* __restrict__ score, T* __restrict__ g_em, T* __restrict__ part, int B,
                                      int Tn, int K, int R, int tps, int spb) {
  extern __shared__ unsigned char smem_raw[];
  T* w = reinterpret_cast<T*>(smem_raw);              // [K][ld]
  T* gw = w + K * ld(K);                              // [spb][K][ld]
  T* adj = gw + spb * K * ld(K);                      // [spb][K]
  T* res = adj + spb * K;                             // [spb][K]: the ⊕ results at step t
  int* best = reinterpret_cast<int*>(res + spb * K);  // [spb][K]: their back-pointers (where S records them)
  __shared__ int block_len;
  // This thread works for label i (row i of the transitions' gradient) with lanes r of R: columns j = r, r+R, ...
  const int s = threadIdx.x / tps, i = threadIdx.x % tps / R, r = threadIdx.x % R;
  const int b = blockIdx.x * spb + s;
  const bool lane = b < B && i < K;
  const bool owner = lane && r == 0;
  bool bad = false;  // (the forward pass made score NaN then: so is every gradient of the sequence)
  const int L = usable_length(len, b, B, Tn, bad);
  if (threadIdx.x == 0) block_len = 0;
  load_transitions(W, w, K);
  for (int e = threadIdx.x; e < spb * K * ld(K); e += blockDim.x) gw[e] = T(0);
  __syncthreads();
  if (threadIdx.x % tps == 0 && b < B) atomicMax(&block_len, L);
  const int64_t off = static_cast<int64_t>(b) * Tn * K;
  T *as = adj + s * K, *rs = res + s * K, *gws = gw + s * K * ld(K);
  int* bs = best + s * K;
  // Sequence b's G is G[b·g_stride] (stride 0: one value for every sequence, as a sum's backward hands it out).
  // With tags the output was the log-likelihood, gold − score: the score's adjoint is −G. A sequence the forward pass
  // scored NaN (a length or tag out of range) gets NaN gradients: S::weight would take its NaN score for a zero one.
  const T g = G ? G[(b < B ? b : 0) * g_stride] : T(1);
  const T gb = b < B ? (isnan(score[b]) ? T(NAN) : tags ? -g : g) : T(0);
  const auto at_pos = [&](int t) { return off + static_cast<int64_t>(t) * K + i; };
  using BP = typename S::Backpointers;
  T g_end = T(0);
  // Step t reads the adjoint at t (as), pre_t (rs) and its back-pointers (bs), which the step before (t + 1) wrote
  // after every thread had read its own: two barriers per step. What a step needs from global memory (pre and arg
  // at t - 1 for the next step's rows, alpha at t - 1) is loaded a step ahead.
  T pre_next = T(0), alpha_next = T(0);
  int arg_next = -1;
  if (owner) {
    for (int t = L; t < Tn; ++t) g_em[at_pos(t)] = T(0);  // padding
    const T a = gb * S::weight(S::times(alpha[at_pos(L - 1)], end[i]), score[b], i, BP::load(end_arg, b));
    as[i] = a;
    g_em[at_pos(L - 1)] = a;
    g_end = a;
    if (L >= 2) {
      rs[i] = pre[at_pos(L - 1)];
      BP::store(bs, i, BP::load(arg, at_pos(L - 1)));
    }
    if (L >= 3) {
      pre_next = pre[at_pos(L - 2)];
      arg_next = static_cast<int>(BP::load(arg, at_pos(L - 2)));
    }
  }
  if (lane && L >= 2) alpha_next = alpha[at_pos(L - 2)];
  __syncthreads();
  const int Lmax = block_len;
  for (int t = Lmax - 1; t >= 1; --t) {
    const bool active = lane && t < L;
    T ai = T(0);
    if (active) {
      ai = alpha_next;
      if (t >= 2) alpha_next = alpha[at_pos(t - 2)];
    }
    T next = T(0);
    if (active) {
      const T* wi = w + i * ld(K);
      T* gwi = gws + i * ld(K);
      // No branch on a zero adjoint: every weight is finite (term <= result); two partial sums keep the
      // independent exponentials in flight.
      T part0 = T(0), part1 = T(0);
      int j = r;
      for (; j + R < K; j += 2 * R) {
        const T c0 = as[j] * S::weight(S::times(ai, wi[j]), rs[j], i, BP::load(bs, j));
        const T c1 = as[j + R] * S::weight(S::times(ai, wi[j + R]), rs[j + R], i, BP::load(bs, j + R));
        gwi[j] += c0;
        gwi[j + R] += c1;
        part0 += c0;
        part1 += c1;
      }
      if (j < K) {
        const T c0 = as[j] * S::weight(S::times(ai, wi[j]), rs[j], i, BP::load(bs, j));
        gwi[j] += c0;
        part0 += c0;
      }
      next = part0 + part1;
    }
    next = sum_lanes(next, R);
    __syncthreads();
    if (active && r == 0) {
      as[i] = next;
      g_em[at_pos(t - 1)] = next;
      rs[i] = pre_next;
      BP::store(bs, i, arg_next);
      if (t >= 3) {
        pre_next = pre[at_pos(t - 2)];
        arg_next = static_cast<int>(BP::load(arg, at_pos(t - 2)));
      }
    }
    __syncthreads();
  }
  // The tagged sequence's score was subtracted: one thread per sequence takes its indicators off.
  const int64_t* y = tags && b < B ? tags + static_cast<int64_t>(b) * Tn : nullptr;
  if (y && threadIdx.x % tps == 0)
    for (int t = 0; t < L && tag_in_range(y[t], K); ++t) {
      g_em[off + static_cast<int64_t>(t) * K + y[t]] -= gb;
      if (t > 0) gws[y[t - 1] * ld(K) + y[t]] -= gb;
    }
  __syncthreads();
  // Per-block partials: transitions summed over the block's sequences, start and end likewise.
  for (int e = threadIdx.x; e < K * K; e += blockDim.x) {
    T sum = T(0);
    for (int q = 0; q < spb; ++q) sum += gw[q * K * ld(K) + (e / K) * ld(K) + e % K];
    part[static_cast<int64_t>(blockIdx.x) * (K * K + 2 * K) + e] = sum;
  }
  __syncthreads();
  // Reuse res/adj rows as staging for start/end sums across the block's sequences.
  if (i < K && r == 0) {
    rs[i] = lane ? as[i] - (y && y[0] == i ? gb : T(0)) : T(0);  // adjoint at position 0 = gradient of start
    as[i] = g_end - (y && y[L - 1] == i ? gb : T(0));
  }
  __syncthreads();
  if (threadIdx.x < K) {
    T st = T(0), en = T(0);
    for (int q = 0; q < spb; ++q) st += res[q * K + threadIdx.x], en += adj[q * K + threadIdx.x];
    T* row = part + static_cast<int64_t>(blockIdx.x) * (K * K + 2 * K) + K * K;
    row[threadIdx.x] = st;
    row[K + threadIdx.x] = en;
  }
}

// The column sums of the backward kernel's per-block partials [rows][K*K | K | K], each written to its own gradient
// (separate tensors, not views of one: an operator's outputs may not share storage), in a fixed order. Where loglik_sum
// is given, the grid's last block writes Σ_b loglik[b] / divisor to it (summed in float64, in a fixed order): the
// reduced log-likelihood of a training step, which then needs no reduction launch of its own.
constexpr int kPartialsThreads = 128;

template <class T>
__global__ void sum_partials_kernel(const T* __restrict__ part, int rows, int K, T* __restrict__ g_trans,
                                    T* __restrict__ g_start, T* __restrict__ g_end, const T* __restrict__ loglik,
                                    int B, double divisor, T* __restrict__ loglik_sum) {
  if (loglik_sum && blockIdx.x == gridDim.x - 1) {
    __shared__ double sums[kPartialsThreads];
    double sum = 0;
    for (int b = threadIdx.x; b < B; b += kPartialsThreads) sum += double(loglik[b]);
    sums[threadIdx.x] = sum;
    __syncthreads();
    for (int half = kPartialsThreads / 2; half > 0; half /= 2) {
      if (threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
      __syncthreads();
    }
    if (threadIdx.x == 0) *loglik_sum = static_cast<T>(sums[0] / divisor);
    return;
  }
  const int n = K * K + 2 * K, e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= n) return;
  T s[4] = {T(0), T(0), T(0), T(0)};
  int q = 0;
  for (; q + 4 <= rows; q += 4)
    for (int u = 0; u < 4; ++u) s[u] += part[static_cast<int64_t>(q + u) * n + e];
  for (; q < rows; ++q) s[0] += part[static_cast<int64_t>(q) * n + e];
  const T total = (s[0] + s[1]) + (s[2] + s[3]);
  if (e < K * K) g_trans[e] = total;
  else if (e < K * K + K) g_start[e - K * K] = total;
  else g_end[e - K * K - K] = total;
}

template <class T>
__global__ void chain_backtrace_kernel(const int64_t* __restrict__ arg, const int64_t* __restrict__ end_arg,
                                       const int64_t* __restrict__ len, const T* __restrict__ score,
                                       int64_t* __restrict__ path, int B, int Tn, int K) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= B) return;
  const T best = score[b];
  const bool nothing_allowed = isinf(best) && best < T(0);
  const int L = nothing_allowed ? 0 : len ? static_cast<int>(len[b]) : Tn;
  int64_t* p = path + static_cast<int64_t>(b) * Tn;
  for (int t = L; t < Tn; ++t) p[t] = -1;
  if (nothing_allowed) return;
  int64_t y = end_arg[b];
  p[L - 1] = y;
  for (int t = L - 1; t >= 1; --t) p[t - 1] = y = arg[(static_cast<int64_t>(b) * Tn + t) * K + y];
}

template <class Kernel>
void allow_smem(Kernel kernel, std::size_t bytes) {
  if (bytes > 48 * 1024)
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
          "chain kernel shared memory");
}

}  // namespace

bool chain_supported(int64_t K, at::ScalarType dtype) {
  const int spb = layout(1, K).spb;
  const std::size_t bytes = dtype == at::kDouble ? backward_smem<double>(K, spb) : backward_smem<float>(K, spb);
  return K <= 1024 && bytes <= 200 * 1024;
}

template <class S>
void chain_forward(const ChainInputs& in, ChainRecord& record) {
  const int64_t B = in.emissions.size(0), Tn = in.emissions.size(1), K = in.emissions.size(2);
  const Layout l = layout(B, K);
  const auto stream = at::cuda::getCurrentCUDAStream();
  bool backtraced = false;
  AT_DISPATCH_FLOATING_TYPES(in.emissions.scalar_type(), "chain_forward_cuda", [&] {
    std::size_t smem = forward_smem<scalar_t>(K, l.spb);
    // A backtrace whose back-pointers fit shared memory runs at the end of this launch; the record's back-pointers
    // are then neither written nor read.
    backtraced = S::Backpointers::kRecorded && record.path.defined() && B > 0 &&
                 smem + backtrace_smem(Tn, K, l.spb) <= kBacktraceSmemLimit;
    if (backtraced) smem += backtrace_smem(Tn, K, l.spb);
    auto kernel = chain_forward_kernel<S, scalar_t>;
    allow_smem(kernel, smem);
    kernel<<<l.blocks, l.tps * l.spb, smem, stream>>>(
        in.emissions.data_ptr<scalar_t>(), in.transitions.data_ptr<scalar_t>(), in.start.data_ptr<scalar_t>(),
        in.end.data_ptr<scalar_t>(), detail::data_or_null<int64_t>(in.lengths), detail::data_or_null<int64_t>(in.tags),
        detail::data_or_null<scalar_t>(record.alpha), detail::data_or_null<scalar_t>(record.pre),
        backtraced ? nullptr : detail::data_or_null<int64_t>(record.arg),
        backtraced ? nullptr : detail::data_or_null<int64_t>(record.end_arg), record.score.data_ptr<scalar_t>(),
        record.frame_score.data_ptr<scalar_t>(), detail::data_or_null<scalar_t>(record.loglik),
        backtraced ? record.path.data_ptr<int64_t>() : nullptr, int(B), int(Tn), int(K), l.R, l.tps, l.spb);
  });
  check_launch("chain_forward");
  if (record.path.defined() && !backtraced) chain_backtrace(record, in.lengths, record.path);
}

template <class S>
void chain_backward(const at::Tensor& grad, const ChainInputs& in, const ChainRecord& record, ChainGradients& grads) {
  const int64_t B = record.alpha.size(0), Tn = record.alpha.size(1), K = record.alpha.size(2);
  const Layout l = layout(B, K);
  const auto stream = at::cuda::getCurrentCUDAStream();
  // Per-block partial gradients, one row each: [K*K transitions | K start | K end], summed in one reduction.
  at::Tensor part = at::empty({l.blocks, K * K + 2 * K}, record.alpha.options());
  AT_DISPATCH_FLOATING_TYPES(record.alpha.scalar_type(), "chain_backward_cuda", [&] {
    const std::size_t smem = backward_smem<scalar_t>(K, l.spb);
    auto kernel = chain_backward_kernel<S, scalar_t>;
    allow_smem(kernel, smem);
    kernel<<<l.blocks, l.tps * l.spb, smem, stream>>>(
        detail::data_or_null<scalar_t>(grad), grad.defined() ? grad.stride(0) : int64_t(0),
        in.transitions.data_ptr<scalar_t>(), in.end.data_ptr<scalar_t>(),
        detail::data_or_null<int64_t>(in.lengths), detail::data_or_null<int64_t>(in.tags),
        record.alpha.data_ptr<scalar_t>(), record.pre.data_ptr<scalar_t>(), detail::data_or_null<int64_t>(record.arg),
        detail::data_or_null<int64_t>(record.end_arg), record.frame_score.data_ptr<scalar_t>(),
        grads.emissions.data_ptr<scalar_t>(), part.data_ptr<scalar_t>(), int(B), int(Tn), int(K), l.R, l.tps, l.spb);
  });
  check_launch("chain_backward");
  const int64_t n = K * K + 2 * K;
  const bool with_sum = grads.loglik_sum.defined();
  AT_DISPATCH_FLOATING_TYPES(record.alpha.scalar_type(), "chain_backward_partials_cuda", [&] {
    sum_partials_kernel<<<grid_dim(n, kPartialsThreads) + (with_sum ? 1 : 0), kPartialsThreads, 0, stream>>>(
        part.data_ptr<scalar_t>(), l.blocks, int(K), grads.transitions.data_ptr<scalar_t>(),
        grads.start.data_ptr<scalar_t>(), grads.end.data_ptr<scalar_t>(),
        with_sum ? record.loglik.data_ptr<scalar_t>() : nullptr, int(B), grads.sum_divisor,
        with_sum ? grads.loglik_sum.data_ptr<scalar_t>() : nullptr);
  });
  check_launch("chain_backward partials");
}

void chain_backtrace(const ChainRecord& record, const at::Tensor& lengths, at::Tensor& path) {
  const int64_t B = record.arg.size(0), Tn = record.arg.size(1), K = record.arg.size(2);
  if (B == 0) return;
  AT_DISPATCH_FLOATING_TYPES(record.score.scalar_type(), "chain_backtrace_cuda", [&] {
    chain_backtrace_kernel<<<grid_dim(B, 128), 128, 0, at::cuda::getCurrentCUDAStream()>>>(
        record.arg.data_ptr<int64_t>(), record.end_arg.data_ptr<int64_t>(), detail::data_or_null<int64_t>(lengths),
        record.score.data_ptr<scalar_t>(), path.data_ptr<int64_t>(), int(B), int(Tn), int(K));
  });
  check_launch("chain_backtrace");
}

template void chain_forward<LogSemiring>(const ChainInputs&, ChainRecord&);
template void chain_forward<MaxSemiring>(const ChainInputs&, ChainRecord&);
template void chain_backward<LogSemiring>(const at::Tensor&, const ChainInputs&, const ChainRecord&, ChainGradients&);
template void chain_backward<MaxSemiring>(const at::Tensor&, const ChainInputs&, const ChainRecord&, ChainGradients&);

}  // namespace trellis::cuda
