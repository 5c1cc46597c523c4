#include "trellis/semiring/semiring_ops.h"

#include "test_util.h"

using namespace trellis;
using namespace trellis::testing;

namespace {

// Plain LibTorch references (float64, materialise the [B,M,K,N] broadcast).
at::Tensor log_matmul_ref(const at::Tensor& a, const at::Tensor& b) {
  return at::logsumexp(a.unsqueeze(-1) + b.unsqueeze(1), 2);
}
at::Tensor max_matmul_ref(const at::Tensor& a, const at::Tensor& b) {
  return at::amax(a.unsqueeze(-1) + b.unsqueeze(1), 2);
}

}  // namespace

TEST(SemiringMatmul, LogMatchesReferenceWithBroadcastBatches) {
  for (auto [ba, bb] : {std::pair{3, 3}, std::pair{3, 1}, std::pair{1, 4}}) {
    const at::Tensor a = randn({ba, 5, 7}, at::kDouble, 3), b = randn({bb, 7, 6}, at::kDouble, 3);
    expect_close(log_matmul(a, b), log_matmul_ref(a, b));
  }
}

TEST(SemiringMatmul, MaxMatchesReference) {
  const at::Tensor a = randn({2, 4, 9}), b = randn({2, 9, 3});
  expect_close(max_matmul(a, b), max_matmul_ref(a, b), 0, 0);
}

TEST(SemiringMatmul, LogGradientsMatchFiniteDifferences) {
  const at::Tensor a = randn({2, 3, 4}).requires_grad_(), b = randn({1, 4, 5}).requires_grad_();
  const at::Tensor w = randn({2, 3, 5});  // random upstream gradient
  (log_matmul(a, b) * w).sum().backward();
  auto fa = [&](const at::Tensor& x) { return (log_matmul_ref(x, b.detach()) * w).sum().item<double>(); };
  auto fb = [&](const at::Tensor& x) { return (log_matmul_ref(a.detach(), x) * w).sum().item<double>(); };
  expect_close(a.grad(), numeric_gradient(fa, a), 1e-6, 1e-7);
  expect_close(b.grad(), numeric_gradient(fb, b), 1e-6, 1e-7);
}

TEST(SemiringMatmul, MaxGradientRoutesToOneArgmaxEvenOnTies) {
  const at::Tensor a = at::zeros({1, 1, 3}, at::kDouble).requires_grad_();
  const at::Tensor b = at::zeros({1, 3, 1}, at::kDouble).requires_grad_();  // every k ties
  max_matmul(a, b).sum().backward();
  EXPECT_EQ(a.grad().sum().item<double>(), 1.0);
  EXPECT_EQ(a.grad()[0][0][0].item<double>(), 1.0);  // the first index wins ties
  EXPECT_EQ(b.grad().sum().item<double>(), 1.0);
}

TEST(SemiringMatmul, NegativeInfinityGivesNoNaN) {
  at::Tensor a = randn({2, 3, 4}), b = randn({2, 4, 3});
  a.select(1, 0).fill_(-kInf);  // row 0 of A is impossible: C row 0 is -inf
  b.select(2, 1).fill_(-kInf);  // column 1 of B is impossible
  a.requires_grad_();
  b.requires_grad_();
  const at::Tensor c = log_matmul(a, b);
  EXPECT_TRUE(at::isinf(c.select(1, 0)).all().item<bool>());
  expect_close(c, log_matmul_ref(a.detach(), b.detach()));
  (c.masked_fill(c.isinf(), 0) * randn(c.sizes().vec())).sum().backward();
  EXPECT_FALSE(a.grad().isnan().any().item<bool>());
  EXPECT_FALSE(b.grad().isnan().any().item<bool>());
}

TEST(SemiringMatmul, LargeMagnitudesDoNotOverflow) {
  const at::Tensor a = randn({2, 6, 8}, at::kFloat, 1e4), b = randn({2, 8, 5}, at::kFloat, 1e4);
  const at::Tensor c = log_matmul(a, b);
  EXPECT_TRUE(c.isfinite().all().item<bool>());
  expect_close(c, log_matmul_ref(a.to(at::kDouble), b.to(at::kDouble)), 1e-6, 1e-2);
}

TEST(SemiringMatmul, LargeInnerSizeScaledPathIsExactForAnyRange) {
  // K >= 128 runs the forward as one scaled GEMM; entries that underflow there are recomputed exactly.
  for (double scale : {1.0, 1e3}) {
    at::Tensor a = randn({2, 5, 200}, at::kDouble, scale), b = randn({1, 200, 7}, at::kDouble, scale);
    a[0][1].fill_(-kInf);
    b.select(2, 3).fill_(-kInf);
    const at::Tensor ref = log_matmul_ref(a, b);
    expect_close(log_matmul(a, b), ref, 1e-12, 1e-12 * scale);
    const at::Tensor c32 = log_matmul(a.to(at::kFloat), b.to(at::kFloat));
    expect_close(c32, ref, 1e-6, 1e-6 * scale);
  }
}

TEST(SemiringMatmul, RejectsBadShapes) {
  EXPECT_THROW(log_matmul(randn({2, 3, 4}), randn({2, 5, 3})), Error);
  EXPECT_THROW(log_matmul(randn({2, 3, 4}), randn({3, 4, 3})), Error);
  EXPECT_THROW(log_matmul(randn({3, 4}), randn({4, 3})), Error);
  EXPECT_THROW(log_matmul(randn({1, 3, 4}).to(at::kInt), randn({1, 4, 3})), Error);
}

TEST(SemiringSum, LogSumExpMatchesTorchAlongAnyDim) {
  const at::Tensor x = randn({4, 5, 6}, at::kDouble, 10);
  for (int64_t d : {0, 1, 2, -1}) expect_close(logsumexp(x, d), at::logsumexp(x, d));
}

TEST(SemiringSum, GradientIsSoftmaxAndSafeOnAllNegInfRows) {
  at::Tensor x = randn({3, 5});
  x[1].fill_(-kInf);
  x.requires_grad_();
  const at::Tensor y = logsumexp(x, 1);
  EXPECT_EQ(y[1].item<double>(), -kInf);
  y.masked_fill(y.isinf(), 0).sum().backward();
  expect_close(x.grad()[0], at::softmax(x.detach()[0], 0));
  EXPECT_TRUE((x.grad()[1] == 0).all().item<bool>());
}

TEST(SemiringSum, MaxRoutesGradientToArgmax) {
  const at::Tensor x = randn({4, 7}).requires_grad_();
  semiring_sum<MaxSemiring>(x, 1).sum().backward();
  expect_close(x.grad(), at::one_hot(x.detach().argmax(1), 7).to(at::kDouble), 0, 0);
}

// ---- CUDA kernels against the CPU path ----

TEST(SemiringMatmulCuda, MatchesCpuValuesAndGradients) {
  TRELLIS_REQUIRE_CUDA();
  for (auto dtype : {at::kFloat, at::kDouble})
    for (auto [ba, bb, M, K, N] : {std::tuple{3, 3, 17, 33, 19}, std::tuple{5, 1, 1, 64, 64},
                                   std::tuple{1, 2, 40, 7, 3}, std::tuple{2, 1, 9, 300, 40}}) {
      const at::Tensor a = randn({ba, M, K}, dtype, 5), b = randn({bb, K, N}, dtype, 5);
      a.select(1, 0).select(1, 0).fill_(-kInf);
      const at::Tensor w = randn({std::max(ba, bb), M, N}, dtype);
      for (bool is_max : {false, true}) {
        auto run = [&](const at::Device& dev) {
          const at::Tensor x = a.detach().to(dev).requires_grad_(), y = b.detach().to(dev).requires_grad_();
          const at::Tensor c = is_max ? max_matmul(x, y) : log_matmul(x, y);
          (c * w.to(dev)).sum().backward();
          return std::tuple{c.cpu(), x.grad().cpu(), y.grad().cpu()};
        };
        const auto [c0, ga0, gb0] = run(at::kCPU);
        const auto [c1, ga1, gb1] = run(at::Device(at::kCUDA));
        const double tol = dtype == at::kFloat ? 1e-4 : 1e-10;
        expect_close(c1, c0, tol, tol);
        expect_close(ga1, ga0, tol, tol);
        expect_close(gb1, gb0, tol, tol);
      }
    }
}

TEST(SemiringSumCuda, MatchesCpuOnLongRows) {
  TRELLIS_REQUIRE_CUDA();
  for (auto dtype : {at::kFloat, at::kDouble})
    for (int64_t n : {1, 255, 4097, 100000}) {
      const at::Tensor x = randn({3, n}, dtype, 100);
      for (bool is_max : {false, true}) {
        auto run = [&](const at::Device& dev) {
          const at::Tensor xd = x.detach().to(dev).requires_grad_();
          const at::Tensor y = is_max ? semiring_sum<MaxSemiring>(xd, 1) : logsumexp(xd, 1);
          (y * at::arange(1, 4, y.options())).sum().backward();
          return std::pair{y.cpu(), xd.grad().cpu()};
        };
        const auto [y0, g0] = run(at::kCPU);
        const auto [y1, g1] = run(at::Device(at::kCUDA));
        const double tol = dtype == at::kFloat ? 1e-5 : 1e-12;
        expect_close(y1, y0, tol, tol);
        expect_close(g1, g0, tol, tol);
      }
    }
}
