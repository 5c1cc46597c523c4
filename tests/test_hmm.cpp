#include "trellis/hmm/hmm.h"

#include <cmath>

#include "lib/src/crf/chain_routes.h"
#include "lib/src/hmm/hmm_infer.h"
#include "test_util.h"

using namespace trellis;
using namespace trellis::testing;

namespace {

// log P(observations[b]) by enumerating every state sequence in probability space (float64).
double brute_log_likelihood(const CategoricalHMM& m, const at::Tensor& obs, int64_t b, int64_t T,
                            double* best = nullptr, std::vector<int64_t>* best_path = nullptr) {
  const at::Tensor pi = m.log_start.exp(), A = m.log_transitions.exp(), E = m.log_emissions.exp();
  const int64_t K = m.num_states();
  std::vector<int64_t> s(T, 0);
  double total = 0, top = -1;
  while (true) {
    double p = pi[s[0]].item<double>() * E[s[0]][obs[b][0].item<int64_t>()].item<double>();
    for (int64_t t = 1; t < T; ++t)
      p *= A[s[t - 1]][s[t]].item<double>() * E[s[t]][obs[b][t].item<int64_t>()].item<double>();
    total += p;
    if (p > top) top = p, best_path ? (void)(*best_path = s) : void();
    int64_t t = T - 1;
    while (t >= 0 && ++s[t] == K) s[t--] = 0;
    if (t < 0) break;
  }
  if (best) *best = std::log(top);
  return std::log(total);
}

struct Data {
  at::Tensor obs, lengths;
};

Data random_observations(int64_t B, int64_t T, int64_t V) {
  Data d{at::randint(0, V, {B, T}, at::kLong), at::randint(1, T + 1, {B}, at::kLong)};
  d.lengths[0] = T;
  d.lengths[1] = 1;
  return d;
}

}  // namespace

TEST(HMM, LogLikelihoodMatchesEnumerationAndCrfPartition) {
  const CategoricalHMM m = CategoricalHMM::random(3, 5, 1);
  const Data d = random_observations(5, 5, 5);
  const at::Tensor ll = log_likelihood(m, d.obs, d.lengths);
  for (int64_t b = 0; b < 5; ++b)
    EXPECT_NEAR(ll[b].item<double>(), brute_log_likelihood(m, d.obs, b, d.lengths[b].item<int64_t>()), 1e-10);
  // The same numbers through a CRF built from the HMM's potentials.
  ChainPotentials p;
  p.emissions = m.log_emissions.t().index_select(0, d.obs.flatten()).view({5, 5, 3});
  p.transitions = m.log_transitions;
  p.start = m.log_start;
  p.lengths = d.lengths;
  expect_close(log_partition(p), ll);
}

TEST(HMM, ForwardBackwardAndPosteriorsAreConsistent) {
  const CategoricalHMM m = CategoricalHMM::random(4, 6, 2);
  const Data d = random_observations(6, 7, 6);
  const ForwardBackward fb = forward_backward(m, d.obs, d.lengths);
  const at::Tensor post = posteriors(m, d.obs, d.lengths);
  const at::Tensor mask = (at::arange(7).unsqueeze(0) < d.lengths.unsqueeze(1)).unsqueeze(2);
  const at::Tensor from_fb = at::where(mask, (fb.log_alpha + fb.log_beta - fb.log_likelihood.view({6, 1, 1})).exp(),
                                       at::zeros({}, at::kDouble));
  expect_close(post, from_fb, 1e-9, 1e-12);
  expect_close(post.sum(2), mask.squeeze(2).to(at::kDouble));
  // alpha at the last position sums to the likelihood.
  for (int64_t b = 0; b < 6; ++b)
    EXPECT_NEAR(at::logsumexp(fb.log_alpha[b][d.lengths[b].item<int64_t>() - 1], 0).item<double>(),
                fb.log_likelihood[b].item<double>(), 1e-10);
}

TEST(HMM, ViterbiMatchesEnumeration) {
  const CategoricalHMM m = CategoricalHMM::random(3, 4, 3);
  const Data d = random_observations(6, 5, 4);
  const ViterbiResult v = viterbi(m, d.obs, d.lengths);
  for (int64_t b = 0; b < 6; ++b) {
    const int64_t T = d.lengths[b].item<int64_t>();
    double best;
    std::vector<int64_t> path;
    brute_log_likelihood(m, d.obs, b, T, &best, &path);
    EXPECT_NEAR(v.score[b].item<double>(), best, 1e-10);
    for (int64_t t = 0; t < T; ++t) EXPECT_EQ(v.path[b][t].item<int64_t>(), path[t]);
  }
}

TEST(HMM, SamplingIsSeededAndFollowsTheModel) {
  const CategoricalHMM m = CategoricalHMM::random(3, 4, 4);
  const HMMSample a = sample(m, 4000, 6, 6, 11), b = sample(m, 4000, 6, 6, 11), c = sample(m, 4000, 6, 6, 12);
  EXPECT_TRUE(at::equal(a.observations, b.observations));
  EXPECT_FALSE(at::equal(a.observations, c.observations));
  const at::Tensor first = at::bincount(a.states.select(1, 0), {}, 3).to(at::kDouble) / 4000;
  expect_close(first, m.log_start.exp(), 0, 0.03);
  // Supervised MLE on a large sample recovers the model.
  const CategoricalHMM fit = fit_supervised(a.observations, a.states, {}, 3, 4, 0.0);
  expect_close(fit.log_transitions.exp(), m.log_transitions.exp(), 0, 0.03);
  expect_close(fit.log_emissions.exp(), m.log_emissions.exp(), 0, 0.03);
}

TEST(HMM, SupervisedCountsWithSmoothingAreExact) {
  // One sequence 0 1 1 over states a b b, padding ignored, Laplace smoothing 1.
  const at::Tensor obs = at::tensor({0, 1, 1, 9}, at::kLong).view({1, 4});
  const at::Tensor st = at::tensor({0, 1, 1, 7}, at::kLong).view({1, 4});
  const CategoricalHMM m = fit_supervised(obs, st, at::tensor({3}, at::kLong), 2, 2, 1.0);
  expect_close(m.log_start.exp(), at::tensor({2. / 3, 1. / 3}, at::kDouble));
  expect_close(m.log_transitions.exp(), at::tensor({1. / 3, 2. / 3, 1. / 3, 2. / 3}, at::kDouble).view({2, 2}));
  expect_close(m.log_emissions.exp(), at::tensor({2. / 3, 1. / 3, 1. / 4, 3. / 4}, at::kDouble).view({2, 2}));
  EXPECT_THROW(fit_supervised(obs, st, {}, 2, 2, 1.0), Error);  // padding read as a real state 7
}

TEST(HMM, BaumWelchStepEqualsEnumeratedExpectedCountsAndNeverDecreases) {
  const CategoricalHMM m = CategoricalHMM::random(2, 3, 5);
  const Data d = random_observations(4, 4, 3);
  // Expected counts by enumeration.
  at::Tensor start = at::zeros({2}, at::kDouble), trans = at::zeros({2, 2}, at::kDouble),
             emit = at::zeros({2, 3}, at::kDouble);
  const ChainPotentials p = m.potentials(d.obs, d.lengths);
  for (int64_t b = 0; b < 4; ++b) {
    const Enumeration e = enumerate(p, b);
    const double z = e.log_partition();
    for (std::size_t n = 0; n < e.paths.size(); ++n) {
      const double w = std::exp(e.scores[n] - z);
      const auto& s = e.paths[n];
      start[s[0]] += w;
      for (std::size_t t = 0; t < s.size(); ++t) {
        emit[s[t]][d.obs[b][t].item<int64_t>()] += w;
        if (t > 0) trans[s[t - 1]][s[t]] += w;
      }
    }
  }
  const auto one = baum_welch(m, d.obs, d.lengths, {1, 0.0, {0.0}});
  expect_close(one.model.log_start.exp(), start / start.sum());
  expect_close(one.model.log_transitions.exp(), trans / trans.sum(1, true));
  expect_close(one.model.log_emissions.exp(), emit / emit.sum(1, true));

  const HMMSample data = sample(CategoricalHMM::random(3, 5, 6), 50, 20, 20, 7);
  const auto r = baum_welch(CategoricalHMM::random(3, 5, 8), data.observations, {}, {50, 1e-8, {0.0}});
  ASSERT_GT(r.log_likelihood.size(), 3u);
  for (std::size_t i = 1; i < r.log_likelihood.size(); ++i)
    EXPECT_GE(r.log_likelihood[i], r.log_likelihood[i - 1] - 1e-9);
}

TEST(HMM, ObservationOutsideVocabularyIsAnErrorNamingItsPosition) {
  const CategoricalHMM m = CategoricalHMM::random(2, 3, 9);
  at::Tensor obs = at::zeros({2, 3}, at::kLong);
  obs[1][2] = 3;
  try {
    log_likelihood(m, obs);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[1][2] = 3"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(log_likelihood(m, obs, at::tensor({3, 2}, at::kLong)));  // position 2 of sequence 1 is padding
}

TEST(HMM, Float32MatchesFloat64OnLongSequences) {
  // Log-space messages of a long sequence reach about -T nats, where a float32 keeps only about 1e-2 absolutely: the
  // recursions must keep their numbers small.
  const int64_t T = 100000;
  const CategoricalHMM m = CategoricalHMM::random(3, 4, 21);
  const CategoricalHMM m32 = m.to(at::TensorOptions().dtype(at::kFloat));
  at::manual_seed(22);
  const at::Tensor obs = at::randint(0, 4, {1, T}, at::kLong);
  const at::Tensor post64 = posteriors(m, obs), post32 = posteriors(m32, obs);
  EXPECT_LT((post32.to(at::kDouble) - post64).abs().max().item<double>(), 1e-4);
  EXPECT_LT((post32.sum(2) - 1).abs().max().item<double>(), 1e-4);
  const double ll64 = log_likelihood(m, obs).item<double>(), ll32 = log_likelihood(m32, obs).item<double>();
  EXPECT_NEAR(ll32, ll64, 1e-6 * std::abs(ll64));
  const ViterbiResult v64 = viterbi(m, obs), v32 = viterbi(m32, obs);
  EXPECT_NEAR(v32.score.item<double>(), v64.score.item<double>(), 1e-6 * std::abs(v64.score.item<double>()));
  EXPECT_GT(v32.path.eq(v64.path).to(at::kDouble).mean().item<double>(), 0.999);
  // The E-step (the same recursion's gradient) as well.
  const auto s64 = expected_statistics(m, obs), s32 = expected_statistics(m32, obs);
  expect_close(s32.transitions.to(at::kDouble) / T, s64.transitions / T, 0, 1e-4);
  EXPECT_NEAR(s32.log_likelihood, s64.log_likelihood, 1e-6 * std::abs(s64.log_likelihood));
}

TEST(HMM, ModelShapesAndOptionsOutOfRangeAreErrors) {
  EXPECT_THROW(CategoricalHMM::random(-1, 5, 0), Error);
  EXPECT_THROW(CategoricalHMM::random(3, 0, 0), Error);
  EXPECT_THROW(GaussianHMM::random(2, -3, 0), Error);
  try {
    CategoricalHMM::random(int64_t(1) << 33, 5, 0);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than this machine's"), std::string::npos) << e.what();
  }
  const CategoricalHMM m = CategoricalHMM::random(2, 3, 1);
  const at::Tensor obs = at::zeros({1, 4}, at::kLong);
  BaumWelchOptions nan_tolerance;
  nan_tolerance.tolerance = std::nan("");
  EXPECT_THROW(baum_welch(m, obs, {}, nan_tolerance), Error);
  BaumWelchOptions negative_smoothing;
  negative_smoothing.m_step.smoothing = -1;
  EXPECT_THROW(baum_welch(m, obs, {}, negative_smoothing), Error);
  EXPECT_THROW(fit_supervised(obs, at::zeros({1, 4}, at::kLong), {}, 2, 3, std::nan("")), Error);
}

TEST(GaussianHMM, VariancesTooSmallForTheComputationsTypeAreErrorsNotNaN) {
  GaussianHMM m = GaussianHMM::random(2, 1, 3);
  m.variances[1][0] = 1e-50;  // fine in float64, zero in float32
  const at::Tensor x = at::randn({1, 5, 1}, at::kDouble);
  EXPECT_TRUE(at::isfinite(log_likelihood(m, x)).all().item<bool>());
  EXPECT_TRUE(at::isfinite(viterbi(m, x).score).all().item<bool>());
  const GaussianHMM m32 = m.to(at::TensorOptions().dtype(at::kFloat));
  try {
    viterbi(m32, x.to(at::kFloat));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("variance [1][0]"), std::string::npos) << e.what();
  }
  m.variances[1][0] = 1e-310;  // subnormal: 1/variance overflows float64
  EXPECT_THROW(posteriors(m, x), Error);
}

TEST(GaussianHMM, Float32EmissionScoresStayExactForDataFarFromZero) {
  GaussianHMM m = GaussianHMM::random(3, 4, 5);
  m.means = m.means + 1000.0;
  m.variances = at::full_like(m.variances, 0.3);
  // float32 inputs, and float64 scores of exactly those values: what is left is the computation's own rounding.
  const GaussianHMM single_model = m.to(at::TensorOptions().dtype(at::kFloat));
  const at::Tensor x = (randn({2, 6, 4}, at::kDouble, 1.0) + 1000.0).to(at::kFloat);
  const at::Tensor exact =
      single_model.to(at::TensorOptions().dtype(at::kDouble)).emission_scores(x.to(at::kDouble), {});
  const at::Tensor single = single_model.emission_scores(x, {});
  EXPECT_LT((single.to(at::kDouble) - exact).abs().max().item<double>(), 1e-3);
}

TEST(HMMCuda, MatchesCpu) {
  TRELLIS_REQUIRE_CUDA();
  const CategoricalHMM m = CategoricalHMM::random(5, 7, 10);
  const Data d = random_observations(8, 12, 7);
  const at::Device cuda(at::kCUDA);
  const CategoricalHMM g{m.log_start.to(cuda), m.log_transitions.to(cuda), m.log_emissions.to(cuda)};
  expect_close(log_likelihood(g, d.obs.to(cuda), d.lengths.to(cuda)), log_likelihood(m, d.obs, d.lengths), 1e-10,
               1e-10);
  expect_close(posteriors(g, d.obs.to(cuda), d.lengths), posteriors(m, d.obs, d.lengths), 1e-10, 1e-10);
  EXPECT_TRUE(at::equal(viterbi(g, d.obs.to(cuda), d.lengths).path.cpu(), viterbi(m, d.obs, d.lengths).path));
}

namespace {

// log N(x; μ, diag σ²) written out term by term (float64), independent of the library's GEMM form.
double gaussian_log_density(const GaussianHMM& m, const at::Tensor& x, int64_t k) {
  double s = 0;
  for (int64_t f = 0; f < m.num_features(); ++f) {
    const double v = m.variances[k][f].item<double>(), d = x[f].item<double>() - m.means[k][f].item<double>();
    s += -0.5 * (std::log(2 * M_PI * v) + d * d / v);
  }
  return s;
}

}  // namespace

TEST(GaussianHMM, LogLikelihoodAndViterbiMatchEnumeration) {
  const GaussianHMM m = GaussianHMM::random(3, 4, 21);
  const at::Tensor x = randn({4, 5, 4}, at::kDouble, 2.0), lengths = at::tensor({5, 1, 3, 4}, at::kLong);
  const at::Tensor scores = m.emission_scores(x, lengths);
  for (int64_t b = 0; b < 4; ++b)
    for (int64_t t = 0; t < lengths[b].item<int64_t>(); ++t)
      for (int64_t k = 0; k < 3; ++k)
        EXPECT_NEAR(scores[b][t][k].item<double>(), gaussian_log_density(m, x[b][t], k), 1e-10);
  const at::Tensor ll = log_likelihood(m, x, lengths);
  const ViterbiResult v = viterbi(m, x, lengths);
  const ChainPotentials p = m.potentials(x, lengths);
  for (int64_t b = 0; b < 4; ++b) {
    const Enumeration e = enumerate(p, b);
    EXPECT_NEAR(ll[b].item<double>(), e.log_partition(), 1e-10);
    EXPECT_NEAR(v.score[b].item<double>(), e.scores[e.best()], 1e-10);
    for (std::size_t t = 0; t < e.paths[e.best()].size(); ++t)
      EXPECT_EQ(v.path[b][t].item<int64_t>(), e.paths[e.best()][t]);
  }
}

TEST(GaussianHMM, EStepMatchesEnumerationAndMStepIsHmmlearnsUpdate) {
  const GaussianHMM m = GaussianHMM::random(2, 3, 22);
  const at::Tensor x = randn({3, 4, 3}, at::kDouble, 2.0), lengths = at::tensor({4, 2, 3}, at::kLong);
  const ChainPotentials p = m.potentials(x, lengths);
  at::Tensor start = at::zeros({2}, at::kDouble), trans = at::zeros({2, 2}, at::kDouble),
             w = at::zeros({2}, at::kDouble), first = at::zeros({2, 3}, at::kDouble),
             second = at::zeros({2, 3}, at::kDouble);
  double total = 0;
  for (int64_t b = 0; b < 3; ++b) {
    const Enumeration e = enumerate(p, b);
    const double z = e.log_partition();
    total += z;
    for (std::size_t n = 0; n < e.paths.size(); ++n) {
      const double g = std::exp(e.scores[n] - z);
      const auto& s = e.paths[n];
      start[s[0]] += g;
      for (std::size_t t = 0; t < s.size(); ++t) {
        w[s[t]] += g;
        first[s[t]] += g * x[b][t];
        second[s[t]] += g * x[b][t] * x[b][t];
        if (t > 0) trans[s[t - 1]][s[t]] += g;
      }
    }
  }
  // Statistics of two batches add up to those of the whole (what streaming EM relies on).
  GaussianHMM::Statistics s = expected_statistics(m, x.slice(0, 0, 1), lengths.slice(0, 0, 1));
  s += expected_statistics(m, x.slice(0, 1), lengths.slice(0, 1));
  EXPECT_NEAR(s.log_likelihood, total, 1e-9);
  expect_close(s.start, start);
  expect_close(s.transitions, trans);
  expect_close(s.weight, w);
  expect_close(s.first, first);
  expect_close(s.second, second);
  const GaussianHMM next = m.maximise(s, {0.0, 1e-2});
  const at::Tensor mu = first / w.unsqueeze(1);
  expect_close(next.means, mu);
  expect_close(next.variances, (1e-2 + second - 2 * mu * first + mu * mu * w.unsqueeze(1)) / w.unsqueeze(1));
  expect_close(next.log_transitions.exp(), trans / trans.sum(1, true));
}

TEST(GaussianHMM, SamplesRecoverTheModelAndEmNeverDecreases) {
  const GaussianHMM m = GaussianHMM::random(3, 2, 23);
  const HMMSample a = sample(m, 3000, 5, 15, 24), b = sample(m, 3000, 5, 15, 24);
  EXPECT_TRUE(at::equal(a.observations, b.observations));
  EXPECT_EQ(a.observations.size(2), 2);
  const GaussianHMM fit = m.maximise(labelled_statistics(m, a.observations, a.states, a.lengths), {0.0, 0.0});
  expect_close(fit.means, m.means, 0, 0.05);
  expect_close(fit.variances, m.variances, 0, 0.08);
  expect_close(fit.log_transitions.exp(), m.log_transitions.exp(), 0, 0.03);
  const HMMSample small = sample(m, 30, 5, 25, 25);
  const auto r = baum_welch(GaussianHMM::random(3, 2, 26), small.observations, small.lengths, {30, 1e-9, {}});
  ASSERT_GT(r.log_likelihood.size(), 3u);
  for (std::size_t i = 1; i < r.log_likelihood.size(); ++i)
    EXPECT_GE(r.log_likelihood[i], r.log_likelihood[i - 1] - 1e-7);
}

TEST(HMMCuda, ManyStatesFloat32LongSequences) {
  TRELLIS_REQUIRE_CUDA();
  // 300 states (past the shared-memory kernels), sequences of up to 10000 observations, log-likelihoods near -4e4,
  // where an unshifted float32 message keeps about 4e-3 absolutely and its rounding accumulates step after step. The
  // streamed forward and the many-label Viterbi rebase each step: float32 log-likelihoods stay within 1e-6 of float64
  // and the Viterbi paths equal the CPU's float32 paths. Masked transitions and padding included.
  CategoricalHMM m = CategoricalHMM::random(300, 50, 50);
  m.log_transitions.select(1, 3).fill_(-kInf);
  m.log_transitions = at::log_softmax(m.log_transitions, 1);
  const Data d = random_observations(4, 10000, 50);
  const at::Device cuda(at::kCUDA);
  const CategoricalHMM f32 = m.to(at::TensorOptions().dtype(at::kFloat)), g = f32.to(at::TensorOptions().device(cuda));
  const at::Tensor ll = log_likelihood(g, d.obs.to(cuda), d.lengths.to(cuda));
  ASSERT_EQ(ll.scalar_type(), at::kFloat);
  expect_close(ll, log_likelihood(m, d.obs, d.lengths), 1e-6, 0);
  const ViterbiResult a = viterbi(g, d.obs.to(cuda), d.lengths.to(cuda)), b = viterbi(f32, d.obs, d.lengths);
  EXPECT_TRUE(at::equal(a.path.cpu(), b.path));
  expect_close(a.score, b.score, 1e-6, 0);
}

TEST(HMMCuda, InferStepReadsTransitionsOnceForLikelihoodAndViterbiAndMatchesCpu) {
  TRELLIS_REQUIRE_CUDA();
  // hmm infer's fused route (cuda::many_label_infer: one read of the transitions per step for the forward and the
  // Viterbi): log-likelihoods against the CPU's float64 and the separate CUDA forward, Viterbi paths equal to the CPU's
  // float32 paths. 300 states (a partial column tile, one or two rows per warp) for groups of 1, 4 and 16 sequences
  // (two groups at 20, the second partly full), and 2044 states (31 or 32 rows per warp: the ring wraps and a warp
  // ends on a single row) for a group of 8; ragged lengths (1 and T among them) and a masked transition column. Only
  // float32 potentials with transitions ≤ 0 take it.
  const at::Device cuda(at::kCUDA);
  const auto check = [&](int64_t K, int64_t B, int64_t T) {
    SCOPED_TRACE(c10::str("K=", K, " B=", B));
    CategoricalHMM m = CategoricalHMM::random(K, 40, 71);
    m.log_transitions.select(1, 5).fill_(-kInf);
    m.log_transitions = at::log_softmax(m.log_transitions, 1);
    const CategoricalHMM f32 = m.to(at::TensorOptions().dtype(at::kFloat));
    const CategoricalHMM g = f32.to(at::TensorOptions().device(cuda));
    Data d{at::randint(0, 40, {B, T}, at::kLong), at::randint(1, T + 1, {B}, at::kLong)};
    d.lengths[0] = T;
    if (B > 1) d.lengths[1] = 1;
    const at::Tensor obs = d.obs.to(cuda), lengths = d.lengths.to(cuda);
    const std::optional<trellis::detail::LikelihoodAndPath> both =
        trellis::detail::likelihood_and_path(g.potentials(obs, lengths));
    ASSERT_TRUE(both.has_value());
    expect_close(both->log_likelihood, log_likelihood(m, d.obs, d.lengths), 1e-6, 0);
    expect_close(both->log_likelihood, log_likelihood(g, obs, lengths), 1e-6, 0);
    const ViterbiResult cpu = viterbi(f32, d.obs, d.lengths);
    EXPECT_TRUE(at::equal(both->viterbi.path.cpu(), cpu.path));
    expect_close(both->viterbi.score, cpu.score, 1e-6, 0);
    if (K > 300) return;
    const CategoricalHMM g64 = m.to(at::TensorOptions().device(cuda));
    EXPECT_FALSE(trellis::detail::likelihood_and_path(g64.potentials(obs, lengths)).has_value());
    ChainPotentials positive = g.potentials(obs, lengths);
    positive.transitions = positive.transitions.clone();
    positive.transitions[0][0] = 0.5;
    EXPECT_FALSE(trellis::detail::likelihood_and_path(positive).has_value());
  };
  for (const int64_t B : {1, 3, 20}) check(300, B, 333);
  check(2044, 5, 40);
}

TEST(HMMCuda, ManyStatesPosteriorsAndExpectedCountsMatchCpu) {
  TRELLIS_REQUIRE_CUDA();
  // The streamed forward-backward for many states (posteriors, and the E-step's expected counts as two GEMMs over the
  // batch) against the CPU's autograd route: ragged lengths (1 and T among them), a masked transition column, float64
  // and float32.
  CategoricalHMM m = CategoricalHMM::random(200, 30, 60);
  m.log_transitions.select(1, 3).fill_(-kInf);
  m.log_transitions = at::log_softmax(m.log_transitions, 1);
  const Data d = random_observations(5, 40, 30);
  const at::Device cuda(at::kCUDA);
  const at::Tensor nodes = posteriors(m, d.obs, d.lengths);
  const CategoricalHMM::Statistics expected = expected_statistics(m, d.obs, d.lengths);
  for (const auto dtype : {at::kDouble, at::kFloat}) {
    SCOPED_TRACE(c10::str(dtype));
    const double tol = dtype == at::kDouble ? 1e-9 : 1e-4;
    const CategoricalHMM g = m.to(at::TensorOptions().device(cuda).dtype(dtype));
    expect_close(posteriors(g, d.obs.to(cuda), d.lengths.to(cuda)), nodes, tol, tol);
    const CategoricalHMM::Statistics s = expected_statistics(g, d.obs.to(cuda), d.lengths.to(cuda));
    expect_close(s.start, expected.start, tol, tol);
    expect_close(s.transitions, expected.transitions, tol, tol);
    expect_close(s.emissions, expected.emissions, tol, tol);
    EXPECT_NEAR(s.log_likelihood, expected.log_likelihood, tol * std::abs(expected.log_likelihood));
  }
}

TEST(HMMCuda, StreamedKernelsTakeMoreSequencesThanAGridsYExtent) {
  TRELLIS_REQUIRE_CUDA();
  // 70,000 short sequences in one batch: more than a CUDA grid's y extent (65,535), along which the streamed kernels'
  // finish steps once laid out sequences. Log-likelihoods, posteriors and Viterbi paths (the many-label kernel) of
  // every sequence against the CPU, float64.
  const int64_t B = 70000, T = 3, K = 130;
  CategoricalHMM m = CategoricalHMM::random(K, 20, 70);
  const Data d = random_observations(B, T, 20);
  const at::Device cuda(at::kCUDA);
  const CategoricalHMM g = m.to(at::TensorOptions().device(cuda).dtype(at::kDouble));
  const at::Tensor obs = d.obs.to(cuda), lengths = d.lengths.to(cuda);
  // The CPU's answers first: the forced routes below apply to CUDA potentials only.
  const at::Tensor ll = log_likelihood(m, d.obs, d.lengths), nodes = posteriors(m, d.obs, d.lengths);
  const ViterbiResult b = viterbi(m, d.obs, d.lengths);
  {
    const ForcedHMMRoute forced(HMMQuantity::log_likelihood, HMMRoute::streamed);
    expect_close(log_likelihood(g, obs, lengths).cpu(), ll, 1e-10, 1e-10);
  }
  {
    const ForcedHMMRoute forced(HMMQuantity::posteriors, HMMRoute::streamed);
    expect_close(posteriors(g, obs, lengths).cpu(), nodes, 1e-10, 1e-10);
  }
  const trellis::detail::ForcedChainRoute forced(trellis::detail::ChainRoute::kManyLabelViterbi);
  const ViterbiResult a = viterbi(g, obs, lengths);
  EXPECT_TRUE(at::equal(a.path.cpu(), b.path));
  expect_close(a.score.cpu(), b.score, 1e-10, 1e-10);
}

TEST(HMMCuda, ManySequencesOfManyStatesTakeGemmStepsAndMatchCpu) {
  TRELLIS_REQUIRE_CUDA();
  // 4096 states and 70 sequences, 65 of them full: the streamed forward and backward take every step as a cuBLAS GEMM
  // (cuda/scaled_chain_forward.cu: 64 or more sequences running). Log-likelihoods and posteriors against the CPU
  // (float64), float32 within 1e-4.
  const int64_t B = 70, T = 4, K = 4096;
  CategoricalHMM m = CategoricalHMM::random(K, 20, 80);
  m.log_transitions.select(1, 5).fill_(-kInf);
  m.log_transitions = at::log_softmax(m.log_transitions, 1);
  Data d = random_observations(B, T, 20);
  d.lengths.narrow(0, 2, 64).fill_(T);
  const at::Tensor ll = log_likelihood(m, d.obs, d.lengths), nodes = posteriors(m, d.obs, d.lengths);
  const at::Device cuda(at::kCUDA);
  for (const auto dtype : {at::kDouble, at::kFloat}) {
    SCOPED_TRACE(c10::str(dtype));
    const double tol = dtype == at::kDouble ? 1e-10 : 1e-4;
    const CategoricalHMM g = m.to(at::TensorOptions().device(cuda).dtype(dtype));
    const at::Tensor obs = d.obs.to(cuda), lengths = d.lengths.to(cuda);
    expect_close(log_likelihood(g, obs, lengths).cpu().to(at::kDouble), ll, tol, tol);
    expect_close(posteriors(g, obs, lengths).cpu().to(at::kDouble), nodes, tol, tol);
  }
}

namespace {

// Every HMM route (HMMRoute) of every quantity (HMMQuantity), forced, on each device and dtype it takes, against
// enumeration in float64: 4 states with a forbidden transition and a state that never emits symbol 0 (zero
// probabilities, -inf in the messages), ragged lengths 1 to 6. On CUDA the streamed route is forced at a K far below
// the one choose_route gives it, so its kernels' unaligned-row paths run too.
struct RouteCase {
  HMMQuantity quantity;
  HMMRoute route;
  at::ScalarType dtype;
  bool cuda;
};

std::string route_case_name(const ::testing::TestParamInfo<RouteCase>& info) {
  const RouteCase& c = info.param;
  const char* quantity = c.quantity == HMMQuantity::log_likelihood ? "LogLikelihood"
                         : c.quantity == HMMQuantity::posteriors   ? "Posteriors"
                                                                   : "ExpectedStatistics";
  return std::string(c.route == HMMRoute::streamed ? "Streamed" : "Chain") + quantity +
         (c.dtype == at::kFloat ? "Float32" : "Float64") + (c.cuda ? "Cuda" : "Cpu");
}

std::vector<RouteCase> route_cases() {
  std::vector<RouteCase> cases;
  for (const auto q : {HMMQuantity::log_likelihood, HMMQuantity::posteriors, HMMQuantity::expected_statistics})
    for (const auto dtype : {at::kDouble, at::kFloat}) {
      cases.push_back({q, HMMRoute::chain, dtype, false});
      cases.push_back({q, HMMRoute::chain, dtype, true});
      cases.push_back({q, HMMRoute::streamed, dtype, true});
    }
  return cases;
}

class HMMRoutes : public ::testing::TestWithParam<RouteCase> {};

}  // namespace

TEST_P(HMMRoutes, MatchEnumeration) {
  const RouteCase c = GetParam();
  if (c.cuda) TRELLIS_REQUIRE_CUDA();
  CategoricalHMM m = CategoricalHMM::random(4, 5, 21);
  m.log_transitions[1][2] = -kInf;
  m.log_transitions = at::log_softmax(m.log_transitions, 1);
  m.log_emissions[2][0] = -kInf;
  m.log_emissions = at::log_softmax(m.log_emissions, 1);
  Data d = random_observations(6, 6, 5);
  d.obs[0][2] = 0;
  d.lengths[2] = 2;
  // The reference: posteriors, log-likelihoods and expected counts by enumerating every state sequence.
  const int64_t B = 6, T = 6, K = 4, V = 5;
  at::Tensor ll = at::zeros({B}, at::kDouble), nodes = at::zeros({B, T, K}, at::kDouble);
  at::Tensor start = at::zeros({K}, at::kDouble), trans = at::zeros({K, K}, at::kDouble),
             emit = at::zeros({K, V}, at::kDouble);
  const ChainPotentials p = m.potentials(d.obs, d.lengths);
  for (int64_t b = 0; b < B; ++b) {
    const Enumeration e = enumerate(p, b);
    const double z = e.log_partition();
    ll[b] = z;
    for (std::size_t n = 0; n < e.paths.size(); ++n) {
      const double w = std::exp(e.scores[n] - z);
      const auto& s = e.paths[n];
      start[s[0]] += w;
      for (std::size_t t = 0; t < s.size(); ++t) {
        nodes[b][t][s[t]] += w;
        emit[s[t]][d.obs[b][t].item<int64_t>()] += w;
        if (t > 0) trans[s[t - 1]][s[t]] += w;
      }
    }
  }
  const at::Device device(c.cuda ? at::kCUDA : at::kCPU);
  const CategoricalHMM g = m.to(at::TensorOptions().device(device).dtype(c.dtype));
  const at::Tensor obs = d.obs.to(device), lengths = d.lengths.to(device);
  const double tol = c.dtype == at::kDouble ? 1e-10 : 2e-5;
  const ForcedHMMRoute forced(c.quantity, c.route);
  EXPECT_EQ(choose_route(c.quantity, g.potentials(obs, lengths)), c.route);
  if (c.quantity == HMMQuantity::log_likelihood) {
    expect_close(log_likelihood(g, obs, lengths).cpu().to(at::kDouble), ll, tol, tol);
  } else if (c.quantity == HMMQuantity::posteriors) {
    expect_close(posteriors(g, obs, lengths).cpu().to(at::kDouble), nodes, tol, tol);
  } else {
    const CategoricalHMM::Statistics s = expected_statistics(g, obs, lengths);
    expect_close(s.start.cpu().to(at::kDouble), start, tol, tol);
    expect_close(s.transitions.cpu().to(at::kDouble), trans, tol, tol);
    expect_close(s.emissions.cpu().to(at::kDouble), emit, tol, tol);
    EXPECT_NEAR(s.log_likelihood, ll.sum().item<double>(), tol * std::abs(ll.sum().item<double>()));
  }
}

INSTANTIATE_TEST_SUITE_P(EveryRoute, HMMRoutes, ::testing::ValuesIn(route_cases()), route_case_name);

TEST(HMM, ChooseRouteTakesTheStreamedKernelsOnlyForManyStatesOnCudaAndForcingThemOnTheCpuIsAnError) {
  const CategoricalHMM m = CategoricalHMM::random(130, 5, 3);
  const Data d = random_observations(3, 4, 5);
  const ChainPotentials p = m.potentials(d.obs, d.lengths);
  for (const auto q : {HMMQuantity::log_likelihood, HMMQuantity::posteriors, HMMQuantity::expected_statistics}) {
    EXPECT_EQ(choose_route(q, p), HMMRoute::chain);
    {
      const ForcedHMMRoute forced(q, HMMRoute::streamed);
      try {
        choose_route(q, p);
        ADD_FAILURE() << "forcing the streamed route on CPU potentials was not an error";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("the streamed route needs potentials on a CUDA device"), std::string::npos)
            << e.what();
      }
    }
    EXPECT_EQ(choose_route(q, p), HMMRoute::chain);  // the override ends with its scope
  }
  if (!at::hasCUDA()) return;
  const at::Device cuda(at::kCUDA);
  const CategoricalHMM g = m.to(at::TensorOptions().device(cuda));
  for (const auto q : {HMMQuantity::log_likelihood, HMMQuantity::posteriors, HMMQuantity::expected_statistics})
    EXPECT_EQ(choose_route(q, g.potentials(d.obs.to(cuda), d.lengths.to(cuda))), HMMRoute::streamed);
  const CategoricalHMM small = CategoricalHMM::random(127, 5, 3).to(at::TensorOptions().device(cuda));
  EXPECT_EQ(choose_route(HMMQuantity::posteriors, small.potentials(d.obs.to(cuda), d.lengths.to(cuda))),
            HMMRoute::chain);
}
