// Tree-reduced ⊕ along the last dimension: each thread folds a strided slice of its row into an accumulator, then the
// block merges the accumulators in a tree (CUB BlockReduce with the semiring's merge). For LogSemiring this is the
// (max, sum) merge, so long rows never overflow.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>

#include <cub/block/block_reduce.cuh>

#include "cuda/cuda_check.h"
#include "cuda/semiring_kernels.h"
#include "lib/src/semiring/backpointers.h"
#include "trellis/semiring/semiring.h"

namespace trellis::cuda {
namespace {

constexpr int kThreads = 256;

template <class S, class T>
struct MergeOp {
  using Acc = typename S::template Accumulator<T>;
  __device__ Acc operator()(Acc a, const Acc& b) const {
    a.merge(b);
    return a;
  }
};

template <class S, class T>
__global__ void reduce_forward_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t* __restrict__ arg,
                                      int64_t R, int64_t N) {
  using Acc = typename S::template Accumulator<T>;
  using Reduce = cub::BlockReduce<Acc, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    Acc acc;
    for (int64_t n = threadIdx.x; n < N; n += kThreads) acc.add(x[r * N + n], n);
    const Acc total = Reduce(temp).Reduce(acc, MergeOp<S, T>());
    if (threadIdx.x == 0) {
      out[r] = total.value();
      S::Backpointers::store(arg, r, total.arg());
    }
    __syncthreads();  // temp is reused by the next row
  }
}

template <class S, class T>
__global__ void reduce_backward_kernel(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ out,
                                       const int64_t* __restrict__ arg, T* __restrict__ gx, int64_t R, int64_t N) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < R * N; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / N, n = e % N;
    gx[e] = g[r] != T(0) ? g[r] * S::weight(x[e], out[r], n, S::Backpointers::load(arg, r)) : T(0);
  }
}

}  // namespace

template <class S>
void semiring_reduce_forward(const at::Tensor& x, at::Tensor& out, at::Tensor& arg) {
  const int64_t R = x.size(0), N = x.size(1);
  if (R == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(R, 65535));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "semiring_reduce_cuda", [&] {
    reduce_forward_kernel<S, scalar_t><<<blocks, kThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), detail::data_or_null<int64_t>(arg), R, N);
  });
  check_launch("semiring_reduce_forward");
}

template <class S>
void semiring_reduce_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& out,
                              const at::Tensor& arg, at::Tensor& grad_x) {
  const int64_t R = x.size(0), N = x.size(1);
  if (R * N == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(grid_dim(R * N, kThreads), 65535));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "semiring_reduce_backward_cuda", [&] {
    reduce_backward_kernel<S, scalar_t><<<blocks, kThreads, 0, stream>>>(
        grad_out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
        detail::data_or_null<int64_t>(arg), grad_x.data_ptr<scalar_t>(), R, N);
  });
  check_launch("semiring_reduce_backward");
}

template void semiring_reduce_forward<LogSemiring>(const at::Tensor&, at::Tensor&, at::Tensor&);
template void semiring_reduce_forward<MaxSemiring>(const at::Tensor&, at::Tensor&, at::Tensor&);
template void semiring_reduce_backward<LogSemiring>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, at::Tensor&);
template void semiring_reduce_backward<MaxSemiring>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, at::Tensor&);

}  // namespace trellis::cuda
