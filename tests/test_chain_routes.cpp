// Every route of every CRF quantity, forced, against enumeration of all label sequences (float64), on each device and
// dtype it applies to: a route that only thresholds would choose (many labels, long chains) is checked at small sizes.
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <cctype>
#include <string>
#include <tuple>

#include "lib/src/crf/chain_routes.h"
#include "test_util.h"

namespace trellis::testing {
namespace {

using detail::ChainQuantity;
using detail::ChainRoute;

struct RouteCase {
  ChainQuantity quantity;
  ChainRoute route;
  bool cuda;
  at::ScalarType dtype;
};

std::string case_name(const ::testing::TestParamInfo<RouteCase>& info) {
  std::string name = std::string(detail::quantity_name(info.param.quantity)) + "_" +
                     detail::route_name(info.param.route) + (info.param.cuda ? "_cuda_" : "_cpu_") +
                     (info.param.dtype == at::kDouble ? "float64" : "float32");
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return name;
}

class ChainRoutes : public ::testing::TestWithParam<RouteCase> {};

ChainPotentials on(const ChainPotentials& p, bool cuda, at::ScalarType dtype) {
  const at::TensorOptions o = at::TensorOptions().dtype(dtype).device(cuda ? at::kCUDA : at::kCPU);
  ChainPotentials q = p;
  for (at::Tensor* t : {&q.emissions, &q.transitions, &q.start, &q.end}) *t = t->to(o);
  q.lengths = p.lengths.to(o.dtype(at::kLong));
  return q;
}

TEST_P(ChainRoutes, MatchesEnumeration) {
  const RouteCase c = GetParam();
  if (c.cuda) TRELLIS_REQUIRE_CUDA();
  at::manual_seed(7);
  const int64_t B = 4, T = 5, K = 3;
  const ChainPotentials ref = random_chain(B, T, K);
  const ChainPotentials p = on(ref, c.cuda, c.dtype);
  if (!detail::route_applies(c.route, c.quantity, p))
    GTEST_SKIP() << detail::route_name(c.route) << " does not compute " << detail::quantity_name(c.quantity) << " here";
  const at::Tensor tags = at::randint(0, K, {B, T}, at::kLong).to(p.emissions.device());
  const double tol = c.dtype == at::kDouble ? 1e-9 : 1e-4;
  c10::NoGradGuard no_grad;  // (the scaled forward takes no gradients)
  const detail::ForcedChainRoute forced(c.route);
  for (int64_t b = 0; b < B; ++b) {
    const Enumeration e = enumerate(ref, b);
    const int64_t L = ref.lengths[b].item<int64_t>();
    switch (c.quantity) {
      case ChainQuantity::kLogPartition: EXPECT_NEAR(log_partition(p)[b].item<double>(), e.log_partition(), tol); break;
      case ChainQuantity::kLogLikelihood: {
        double gold = 0;
        for (std::size_t i = 0; i < e.paths.size(); ++i) {
          bool same = true;
          for (int64_t t = 0; t < L; ++t) same = same && e.paths[i][t] == tags[b][t].item<int64_t>();
          if (same) gold = e.scores[i];
        }
        EXPECT_NEAR(log_likelihood(p, tags)[b].item<double>(), gold - e.log_partition(), tol);
        break;
      }
      case ChainQuantity::kMarginals: {
        const at::Tensor nodes = marginals(p).nodes.to(at::kCPU, at::kDouble);
        for (int64_t t = 0; t < L; ++t)
          for (int64_t k = 0; k < K; ++k) {
            double mass = 0;
            for (std::size_t i = 0; i < e.paths.size(); ++i)
              if (e.paths[i][t] == k) mass += std::exp(e.scores[i] - e.log_partition());
            EXPECT_NEAR(nodes[b][t][k].item<double>(), mass, tol) << "b=" << b << " t=" << t << " k=" << k;
          }
        break;
      }
      case ChainQuantity::kViterbi: {
        const ViterbiResult v = viterbi(p);
        EXPECT_NEAR(v.score[b].item<double>(), e.scores[e.best()], tol);
        const at::Tensor path = v.path.cpu();
        for (int64_t t = 0; t < T; ++t)
          EXPECT_EQ(path[b][t].item<int64_t>(), t < L ? e.paths[e.best()][t] : -1) << "b=" << b << " t=" << t;
        break;
      }
    }
  }
}

std::vector<RouteCase> all_cases() {
  std::vector<RouteCase> cases;
  for (ChainQuantity q : {ChainQuantity::kLogPartition, ChainQuantity::kLogLikelihood, ChainQuantity::kMarginals,
                          ChainQuantity::kViterbi})
    for (ChainRoute r : {ChainRoute::kComposed, ChainRoute::kFused, ChainRoute::kScaledForward,
                         ChainRoute::kManyLabelViterbi, ChainRoute::kWidened})
      for (bool cuda : {false, true})
        for (at::ScalarType dtype : {at::kDouble, at::kFloat}) cases.push_back({q, r, cuda, dtype});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(EveryRoute, ChainRoutes, ::testing::ValuesIn(all_cases()), case_name);

// The routes the CPU takes: at least the composed and the fused one for every quantity (and the scaled forward for
// log Z), so that the parametrised test above is never all skips here.
TEST(ChainRoutesTable, CpuHasTwoRoutesPerQuantity) {
  const ChainPotentials p = random_chain(2, 3, 3);
  for (ChainQuantity q : {ChainQuantity::kLogPartition, ChainQuantity::kLogLikelihood, ChainQuantity::kMarginals,
                          ChainQuantity::kViterbi}) {
    EXPECT_TRUE(detail::route_applies(ChainRoute::kComposed, q, p));
    EXPECT_TRUE(detail::route_applies(ChainRoute::kFused, q, p));
  }
  c10::NoGradGuard no_grad;
  EXPECT_TRUE(detail::route_applies(ChainRoute::kScaledForward, ChainQuantity::kLogPartition, p));
}

// The CPU's fused Viterbi (columns compared a vector at a time) against the composed recursion's (one column's terms
// reduced in turn): integer scores, where many paths tie and the lowest label must win in both, at K = 9 and 37 (whole
// vectors and a remainder of columns in float32 and float64) with ragged lengths.
TEST(ChainRoutesTable, CpuFusedViterbiBreaksTiesAsTheComposedRecursion) {
  at::manual_seed(11);
  for (const int64_t K : {9, 37})
    for (const auto dtype : {at::kFloat, at::kDouble}) {
      SCOPED_TRACE(c10::str("K=", K, " ", dtype));
      ChainPotentials p = on(random_chain(8, 9, K), false, dtype);
      for (at::Tensor* t : {&p.emissions, &p.transitions, &p.start, &p.end}) *t = (*t * 2).round();
      ViterbiResult fused, composed;
      {
        const detail::ForcedChainRoute forced(ChainRoute::kFused);
        fused = viterbi(p);
      }
      {
        const detail::ForcedChainRoute forced(ChainRoute::kComposed);
        composed = viterbi(p);
      }
      EXPECT_TRUE(at::equal(fused.path, composed.path));
      expect_close(fused.score, composed.score, 0, 0);
    }
}

// The automatic choice: the fused passes for small K; the scaled forward for many labels without gradients; edge
// marginals composed; and a forced route that cannot compute the quantity is an error naming both.
TEST(ChainRoutesTable, AutomaticChoiceAndForcedErrors) {
  const ChainPotentials small = random_chain(2, 3, 3);
  EXPECT_EQ(detail::choose_route(ChainQuantity::kLogPartition, small), ChainRoute::kFused);
  EXPECT_EQ(detail::choose_route(ChainQuantity::kMarginals, small, /*with_edges=*/true), ChainRoute::kComposed);
  const ChainPotentials many = random_chain(2, 3, detail::kScaledMinLabels);
  const ChainPotentials batch = random_chain(detail::kScaledMinSequencesCpu, 3, detail::kScaledMinLabelsCpu);
  const ChainPotentials fewer = random_chain(detail::kScaledMinSequencesCpu - 1, 3, detail::kScaledMinLabelsCpu);
  {
    c10::NoGradGuard no_grad;
    EXPECT_EQ(detail::choose_route(ChainQuantity::kLogPartition, many), ChainRoute::kScaledForward);
    EXPECT_EQ(detail::choose_route(ChainQuantity::kLogPartition, batch), ChainRoute::kScaledForward);
    EXPECT_EQ(detail::choose_route(ChainQuantity::kLogPartition, fewer), ChainRoute::kFused);
  }
  const detail::ForcedChainRoute forced(ChainRoute::kManyLabelViterbi);
  try {
    log_partition(small);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("many-label Viterbi route cannot compute log_partition"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace trellis::testing
