// Launchers of the semiring kernels (cuda/semiring_matmul.cu, cuda/semiring_reduce.cu). Called by lib/ with validated,
// contiguous CUDA tensors and preallocated outputs; each launcher only launches (on the current stream) and checks the
// launch.
#pragma once
#include <ATen/core/Tensor.h>

namespace trellis::cuda {

// C[b] = A[b or 0] ⊗ B[b or 0]; A [Ba,M,K], B [Bb,K,N], C and arg [batch,M,N] (arg only for MaxSemiring).
template <class S>
void semiring_matmul_forward(const at::Tensor& a, const at::Tensor& b, at::Tensor& c, at::Tensor& arg);

// gA[b,i,k] = Σ_j gC[b,i,j] · S::weight(A[i,k] + B[k,j], C[b,i,j], k, arg[b,i,j]), for every batch b (not summed
// over broadcast batches). The right operand's gradient is this same function on the transposed problem.
template <class S>
void semiring_matmul_grad_left(const at::Tensor& grad_c, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                               const at::Tensor& arg, at::Tensor& grad_a);

// out[r] = ⊕_n x[r,n] (tree reduction of accumulators, one block per row); arg [R] for MaxSemiring.
template <class S>
void semiring_reduce_forward(const at::Tensor& x, at::Tensor& out, at::Tensor& arg);

// gx[r,n] = g[r] · S::weight(x[r,n], out[r], n, arg[r]).
template <class S>
void semiring_reduce_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& out,
                              const at::Tensor& arg, at::Tensor& grad_x);

// c[b,i,j] = ⊕_k a[b,i,k] + b[b,k,j] exactly, for every entry whose scaled sum s[b,i,j] is below threshold; a [Ba,M,K],
// b [Bb,K,N] (batches broadcast), s and c [batch,M,N]. Other entries are left as they are.
void log_matmul_fixup(const at::Tensor& a, const at::Tensor& b, const at::Tensor& s, at::Tensor& c, double threshold);

}  // namespace trellis::cuda
