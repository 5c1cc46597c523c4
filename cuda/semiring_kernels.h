// Launchers for the semiring kernels in cuda/. Called by lib/ with validated, contiguous CUDA tensors and
// preallocated outputs; each launcher only launches (on the current stream) and checks the launch.
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

// Whether scaled_chain_forward takes B sequences of K labels (few sequences: it streams the transitions once per
// step for every 16 of them, up to 32).
bool scaled_chain_supported(int64_t B, int64_t K);

// The LogSemiring forward messages at each sequence's last position, alpha [B,K], without gradients: emissions
// [B,T,K] (contiguous), transitions W [K,K], scaled = exp(W − colmax) [K,K], colmax [K] (0 for all -inf columns),
// start [K], lengths [B] int64 in [1, T]. Outputs whose scaled sum is below threshold are recomputed exactly.
at::Tensor scaled_chain_forward(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& scaled,
                                const at::Tensor& colmax, const at::Tensor& start, const at::Tensor& lengths,
                                double threshold);

}  // namespace trellis::cuda
