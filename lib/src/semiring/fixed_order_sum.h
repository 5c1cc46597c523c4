// Sums over large tensors whose bits do not depend on the thread count. ATen's reductions and MKL's dot products
// split their work by the number of threads, so their rounding (and with it every later iterate of an optimiser)
// changes with --threads; these split it into fixed chunks instead, sum each chunk in double and add the chunks'
// sums in chunk order. Internal to the library (the CRF trainer and OWL-QN).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace trellis {

inline constexpr int64_t kFixedOrderChunk = int64_t{1} << 14;  // terms per chunk: the partial sums' boundaries

// Σ_{i<n} term(i), each chunk of kFixedOrderChunk terms summed in four interleaved double accumulators (so the adds
// pipeline), the chunks' sums added in order.
template <class Term>
double fixed_order_sum(int64_t n, const Term& term) {
  const int64_t chunks = (n + kFixedOrderChunk - 1) / kFixedOrderChunk;
  std::vector<double> partial(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * kFixedOrderChunk, end = std::min(n, begin + kFixedOrderChunk);
      double acc[4] = {0, 0, 0, 0};
      int64_t i = begin;
      for (; i + 4 <= end; i += 4)
        for (int j = 0; j < 4; ++j) acc[j] += term(i + j);
      for (; i < end; ++i) acc[0] += term(i);
      partial[c] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
  });
  double total = 0;
  for (const double p : partial) total += p;
  return total;
}

// Σ a·b over all elements of two tensors of one shape. CPU float32/float64 tensors by fixed_order_sum; others (a
// CUDA tensor) by ATen, whose result there does not depend on the CPU thread count.
inline double fixed_order_dot(const at::Tensor& a, const at::Tensor& b) {
  if (!a.device().is_cpu() || !b.device().is_cpu()) return (a * b).sum().item<double>();
  const at::Tensor x = a.contiguous(), y = b.contiguous().to(x.scalar_type());
  double out = 0;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fixed_order_dot", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>();
    const scalar_t* q = y.data_ptr<scalar_t>();
    out = fixed_order_sum(x.numel(), [&](int64_t i) { return static_cast<double>(p[i]) * static_cast<double>(q[i]); });
  });
  return out;
}

// Σ |a| over all elements, as fixed_order_dot.
inline double fixed_order_abs_sum(const at::Tensor& a) {
  if (!a.device().is_cpu()) return a.abs().sum().item<double>();
  const at::Tensor x = a.contiguous();
  double out = 0;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fixed_order_abs_sum", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>();
    out = fixed_order_sum(x.numel(), [&](int64_t i) { return std::abs(static_cast<double>(p[i])); });
  });
  return out;
}

}  // namespace trellis
