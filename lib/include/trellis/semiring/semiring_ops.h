// Tensor operations over a semiring, with autograd, on CPU tensors and (when built with CUDA) CUDA tensors.
#pragma once
#include <ATen/core/Tensor.h>

#include "trellis/semiring/semiring.h"

namespace trellis {

// C[b,i,j] = ⊕_k A[b,i,k] ⊗ B[b,k,j] for A [Ba,M,K] and B [Bb,K,N], Ba and Bb equal or 1 (broadcast).
// float32 or float64. Gradients: softmax-weighted for LogSemiring, routed to the argmax for MaxSemiring.
template <class S>
at::Tensor semiring_matmul(const at::Tensor& a, const at::Tensor& b);

// ⊕ over one dimension (removed from the result), built on the mergeable Accumulator: the (max, sum) pair for
// LogSemiring, (max, argmax) for MaxSemiring. An empty or all -inf slice gives -inf and a zero gradient.
template <class S>
at::Tensor semiring_sum(const at::Tensor& x, int64_t dim);

// semiring_matmul<LogSemiring>: C[i,j] = log Σ_k exp(A[i,k] + B[k,j]).
inline at::Tensor log_matmul(const at::Tensor& a, const at::Tensor& b) { return semiring_matmul<LogSemiring>(a, b); }
// semiring_matmul<MaxSemiring>: C[i,j] = max_k A[i,k] + B[k,j].
inline at::Tensor max_matmul(const at::Tensor& a, const at::Tensor& b) { return semiring_matmul<MaxSemiring>(a, b); }
// semiring_sum<LogSemiring>: log Σ exp over dimension dim.
inline at::Tensor logsumexp(const at::Tensor& x, int64_t dim) { return semiring_sum<LogSemiring>(x, dim); }

}  // namespace trellis
