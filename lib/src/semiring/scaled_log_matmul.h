// Log-space matrix product through one ordinary GEMM, exact to floating-point rounding (the fast path for large K).
//
// C = log(exp(A)·exp(B)) for A [Ba,M,K], B [Bb,K,N] (batches equal or 1): shifting each row of A and each column of B
// by its maximum keeps every exponent ≤ 0, so C = log(exp(A − a)·exp(B − b)) + a + b needs no exponent above 1. A
// scaled sum can still lose its mass to underflow when the rows' and columns' maxima sit in different places; every
// output whose scaled sum is below the level where all of its terms are still represented to full relative precision is
// recomputed exactly in log space. So the result is exact for any input range, and costs one GEMM when nothing
// underflows.
#pragma once
#include <ATen/core/Tensor.h>

namespace trellis::detail {

// Below this a scaled sum of K terms may have lost terms to underflow by more than a unit in the last place.
double underflow_threshold(at::ScalarType dtype, int64_t K);

// The right operand, scaled once for many products (e.g. the transitions of every step of a chain).
struct ScaledRight {
  at::Tensor original;  // B [Bb,K,N]
  at::Tensor scaled;    // exp(B − colmax) [Bb,K,N]
  at::Tensor colmax;    // [Bb,1,N], 0 for an all -inf column
};
ScaledRight scale_right(const at::Tensor& b);

// A [Ba,M,K] (float32 or float64, same dtype and device as B); returns [max(Ba,Bb),M,N]. No autograd.
at::Tensor scaled_log_matmul(const at::Tensor& a, const ScaledRight& b);

}  // namespace trellis::detail
