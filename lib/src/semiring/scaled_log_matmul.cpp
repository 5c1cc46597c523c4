#include "lib/src/semiring/scaled_log_matmul.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "trellis/semiring/semiring.h"
#include "cuda/kernels_built.h"
#include "cuda/semiring_kernels.h"

namespace trellis::detail {
namespace {

at::Tensor finite_or_zero(const at::Tensor& m) { return at::where(m.isinf(), at::zeros({}, m.options()), m); }

template <class T>
void fixup_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& s, at::Tensor& c, double threshold) {
  const int64_t batch = c.size(0), M = c.size(1), N = c.size(2), K = a.size(2);
  const int64_t sa = a.size(0) == 1 ? 0 : M * K, sb = b.size(0) == 1 ? 0 : K * N;
  const T *A = a.data_ptr<T>(), *B = b.data_ptr<T>(), *S = s.data_ptr<T>();
  T* C = c.data_ptr<T>();
  at::parallel_for(0, batch * M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* Ar = A + (r / M) * sa + (r % M) * K;
      const T* Bb = B + (r / M) * sb;
      for (int64_t j = 0; j < N; ++j) {
        if (!(S[r * N + j] < threshold)) continue;
        C[r * N + j] = exact_log_dot(Ar, Bb + j, K, N);
      }
    }
  });
}

}  // namespace

// Each lost term is under the smallest normal number, so K of them stay under eps·threshold.
double underflow_threshold(at::ScalarType dtype, int64_t K) {
  return dtype == at::kDouble ? std::ldexp(static_cast<double>(K), -960) : std::ldexp(static_cast<double>(K), -100);
}

ScaledRight scale_right(const at::Tensor& b) {
  const at::Tensor bc = b.contiguous();
  const at::Tensor colmax = finite_or_zero(bc.amax(1, /*keepdim=*/true));
  return {bc, (bc - colmax).exp(), colmax};
}

at::Tensor scaled_log_matmul(const at::Tensor& a, const ScaledRight& b) {
  const at::Tensor ac = a.contiguous();
  const at::Tensor rowmax = finite_or_zero(ac.amax(2, /*keepdim=*/true));
  const at::Tensor pa = (ac - rowmax).exp();
  // One plain GEMM when neither side is batched (the chain recursions): bmm with a batch of one picks slower kernels.
  const at::Tensor s = ac.size(0) == 1 && b.scaled.size(0) == 1 ? at::mm(pa[0], b.scaled[0]).unsqueeze(0)
                                                                : at::matmul(pa, b.scaled).contiguous();
  at::Tensor c = (s.log() + rowmax + b.colmax).contiguous();
  const double threshold = underflow_threshold(ac.scalar_type(), ac.size(2));
  if (ac.is_cuda()) {
    // No host synchronisation. A build without the kernels leaves the scaled result as it is.
    if (cuda::kernels_built()) cuda::log_matmul_fixup(ac, b.original, s, c, threshold);
  } else {
    AT_DISPATCH_FLOATING_TYPES(ac.scalar_type(), "log_matmul_fixup",
                               [&] { fixup_cpu<scalar_t>(ac, b.original, s, c, threshold); });
  }
  return c;
}

}  // namespace trellis::detail
