// Exact batched semiring matmul C = A ⊗ B and the gradient of its left operand, tiled through shared memory with
// one online accumulator per output element. Generic over the semiring policy (trellis/semiring/semiring.h).
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>

#include "cuda/cuda_check.h"
#include "cuda/semiring_kernels.h"
#include "lib/src/semiring/backpointers.h"
#include "trellis/semiring/semiring.h"

namespace trellis::cuda {
namespace {

constexpr int kTile = 16;

// One thread per C[b,i,j]; K is walked in tiles of A [kTile x kTile] and B [kTile x kTile] staged in shared memory.
template <class S, class T>
__global__ void matmul_forward_kernel(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C,
                                      int64_t* __restrict__ arg, int64_t batch, int M, int K, int N, int64_t sa,
                                      int64_t sb) {
  __shared__ T As[kTile][kTile + 1];
  __shared__ T Bs[kTile][kTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int i = blockIdx.y * kTile + ty, j = blockIdx.x * kTile + tx;
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const T* Ab = A + b * sa;
    const T* Bb = B + b * sb;
    typename S::template Accumulator<T> acc;
    for (int k0 = 0; k0 < K; k0 += kTile) {
      As[ty][tx] = (i < M && k0 + tx < K) ? Ab[int64_t(i) * K + k0 + tx] : S::template zero<T>();
      Bs[ty][tx] = (k0 + ty < K && j < N) ? Bb[int64_t(k0 + ty) * N + j] : S::template zero<T>();
      __syncthreads();
      const int kn = min(kTile, K - k0);
      for (int kk = 0; kk < kn; ++kk) acc.add(S::times(As[ty][kk], Bs[kk][tx]), k0 + kk);
      __syncthreads();
    }
    if (i < M && j < N) {
      const int64_t o = (b * M + i) * int64_t(N) + j;
      C[o] = acc.value();
      S::Backpointers::store(arg, o, acc.arg());
    }
  }
}

// One thread per gA[b,i,k]; the reduction over j walks tiles of B [k x j] and of C, gC, arg [i x j].
template <class S, class T>
__global__ void matmul_grad_left_kernel(const T* __restrict__ G, const T* __restrict__ A, const T* __restrict__ B,
                                        const T* __restrict__ C, const int64_t* __restrict__ arg, T* __restrict__ GA,
                                        int64_t batch, int M, int K, int N, int64_t sa, int64_t sb) {
  __shared__ T Bs[kTile][kTile + 1];  // [k][j]
  __shared__ T Cs[kTile][kTile + 1];  // [i][j]
  __shared__ T Gs[kTile][kTile + 1];  // [i][j]
  using BP = typename S::Backpointers;
  constexpr int ld = kTile + 1;
  __shared__ int64_t Is[BP::slots(kTile * ld)];  // [i][j], staged back-pointers (none: one unused slot)
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int i = blockIdx.y * kTile + ty, k = blockIdx.x * kTile + tx;
  const int kload = blockIdx.x * kTile + ty;  // B tile rows are loaded with ty as the k offset
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const T aik = (i < M && k < K) ? A[b * sa + int64_t(i) * K + k] : S::template zero<T>();
    const T* Bb = B + b * sb;
    T g = 0;
    for (int j0 = 0; j0 < N; j0 += kTile) {
      const int j = j0 + tx;
      const int64_t o = (b * M + i) * int64_t(N) + j;
      const bool in = i < M && j < N;
      Cs[ty][tx] = in ? C[o] : S::template zero<T>();
      Gs[ty][tx] = in ? G[o] : T(0);
      BP::store(Is, ty * ld + tx, in ? BP::load(arg, o) : -1);
      Bs[ty][tx] = (kload < K && j < N) ? Bb[int64_t(kload) * N + j] : S::template zero<T>();
      __syncthreads();
      const int jn = min(kTile, N - j0);
      for (int jj = 0; jj < jn; ++jj) {
        const T gij = Gs[ty][jj];
        if (gij != T(0)) g += gij * S::weight(S::times(aik, Bs[tx][jj]), Cs[ty][jj], k, BP::load(Is, ty * ld + jj));
      }
      __syncthreads();
    }
    if (i < M && k < K) GA[(b * M + i) * int64_t(K) + k] = g;
  }
}

// One thread per output; threads of a warp take neighbouring columns, so the reads of B are coalesced.
template <class T>
__global__ void log_matmul_fixup_kernel(const T* __restrict__ A, const T* __restrict__ B, const T* __restrict__ S,
                                        T* __restrict__ C, int64_t total, int M, int K, int N, int64_t sa, int64_t sb,
                                        T threshold) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e >= total || !(S[e] < threshold)) return;
  const int64_t row = e / N, j = e % N, b = row / M;
  const T* Ar = A + b * sa + (row % M) * K;
  const T* Bb = B + b * sb;
  C[e] = exact_log_dot(Ar, Bb + j, K, N);
}

dim3 batch_grid(int64_t cols, int64_t rows, int64_t batch) {
  return dim3(grid_dim(cols, kTile), grid_dim(rows, kTile), static_cast<unsigned>(std::min<int64_t>(batch, 65535)));
}

}  // namespace

template <class S>
void semiring_matmul_forward(const at::Tensor& a, const at::Tensor& b, at::Tensor& c, at::Tensor& arg) {
  const int64_t batch = c.size(0), M = c.size(1), N = c.size(2), K = a.size(2);
  if (batch * M * N == 0) return;
  const int64_t sa = a.size(0) == 1 ? 0 : M * K, sb = b.size(0) == 1 ? 0 : K * N;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "semiring_matmul_cuda", [&] {
    matmul_forward_kernel<S, scalar_t><<<batch_grid(N, M, batch), dim3(kTile, kTile), 0, stream>>>(
        a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), detail::data_or_null<int64_t>(arg),
        batch, int(M), int(K), int(N), sa, sb);
  });
  check_launch("semiring_matmul_forward");
}

template <class S>
void semiring_matmul_grad_left(const at::Tensor& grad_c, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                               const at::Tensor& arg, at::Tensor& grad_a) {
  const int64_t batch = c.size(0), M = c.size(1), N = c.size(2), K = a.size(2);
  if (batch * M * K == 0) return;
  const int64_t sa = a.size(0) == 1 ? 0 : M * K, sb = b.size(0) == 1 ? 0 : K * N;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "semiring_matmul_grad_left_cuda", [&] {
    matmul_grad_left_kernel<S, scalar_t><<<batch_grid(K, M, batch), dim3(kTile, kTile), 0, stream>>>(
        grad_c.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(),
        detail::data_or_null<int64_t>(arg), grad_a.data_ptr<scalar_t>(), batch, int(M), int(K), int(N), sa, sb);
  });
  check_launch("semiring_matmul_grad_left");
}

void log_matmul_fixup(const at::Tensor& a, const at::Tensor& b, const at::Tensor& s, at::Tensor& c, double threshold) {
  const int64_t total = c.numel(), M = c.size(1), N = c.size(2), K = a.size(2);
  if (total == 0) return;
  const int64_t sa = a.size(0) == 1 ? 0 : M * K, sb = b.size(0) == 1 ? 0 : K * N;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "log_matmul_fixup_cuda", [&] {
    log_matmul_fixup_kernel<scalar_t><<<grid_dim(total, 256), 256, 0, stream>>>(
        a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), total, int(M),
        int(K), int(N), sa, sb, static_cast<scalar_t>(threshold));
  });
  check_launch("log_matmul_fixup");
}

template void semiring_matmul_forward<LogSemiring>(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&);
template void semiring_matmul_forward<MaxSemiring>(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&);
template void semiring_matmul_grad_left<LogSemiring>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, const at::Tensor&, at::Tensor&);
template void semiring_matmul_grad_left<MaxSemiring>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, const at::Tensor&, at::Tensor&);

}  // namespace trellis::cuda
