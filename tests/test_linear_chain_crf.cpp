#include "trellis/crf/linear_chain_crf.h"

#include <c10/core/GradMode.h>

#include <tuple>

#include "test_util.h"
#include "trellis/crf/chain_inputs.h"
#include "trellis/error.h"

using namespace trellis;
using namespace trellis::testing;

namespace {

int64_t length_of(const ChainPotentials& p, int64_t b) {
  return p.lengths.defined() ? p.lengths[b].item<int64_t>() : p.emissions.size(1);
}

at::Tensor brute_log_partition(const ChainPotentials& p) {
  std::vector<double> z;
  for (int64_t b = 0; b < p.emissions.size(0); ++b) z.push_back(enumerate(p, b).log_partition());
  return at::tensor(z, at::kDouble);
}

// Node [B,T,K] and edge [B,T-1,K,K] marginals by enumeration.
std::pair<at::Tensor, at::Tensor> brute_marginals(const ChainPotentials& p) {
  const int64_t B = p.emissions.size(0), T = p.emissions.size(1), K = p.emissions.size(2);
  at::Tensor nodes = at::zeros({B, T, K}, at::kDouble),
             edges = at::zeros({B, std::max<int64_t>(T - 1, 0), K, K}, at::kDouble);
  for (int64_t b = 0; b < B; ++b) {
    const Enumeration e = enumerate(p, b);
    const double z = e.log_partition();
    for (std::size_t n = 0; n < e.paths.size(); ++n) {
      const double pr = std::exp(e.scores[n] - z);
      const auto& y = e.paths[n];
      for (std::size_t t = 0; t < y.size(); ++t) {
        nodes[b][t][y[t]] += pr;
        if (t > 0) edges[b][t - 1][y[t - 1]][y[t]] += pr;
      }
    }
  }
  return {nodes, edges};
}

at::Tensor random_tags(const ChainPotentials& p) {
  return at::randint(0, p.emissions.size(2), {p.emissions.size(0), p.emissions.size(1)}, at::kLong);
}

// Scores scaled (to ±1e3, where the scaled paths take their exact columns), row 2 and column 3 of the transitions
// masked.
ChainPotentials scaled_masked_chain(int64_t B, int64_t T, int64_t K, double scale) {
  ChainPotentials p = random_chain(B, T, K);
  p.emissions = p.emissions * scale;
  p.transitions = p.transitions * scale;
  p.transitions[2].fill_(-kInf);
  p.transitions.select(1, 3).fill_(-kInf);
  return p;
}

}  // namespace

TEST(LinearChainCRF, LogPartitionMatchesEnumeration) {
  for (auto [T, K] : {std::pair{1, 3}, std::pair{4, 3}, std::pair{5, 2}, std::pair{3, 4}, std::pair{6, 1}})
    for (bool ends : {false, true}) {
      const ChainPotentials p = random_chain(4, T, K, ends);
      expect_close(log_partition(p), brute_log_partition(p));
    }
}

TEST(LinearChainCRF, LogLikelihoodMatchesEnumeration) {
  const ChainPotentials p = random_chain(5, 4, 3);
  const at::Tensor tags = random_tags(p);
  const at::Tensor ll = log_likelihood(p, tags);
  for (int64_t b = 0; b < 5; ++b) {
    const Enumeration e = enumerate(p, b);
    std::vector<int64_t> y(tags[b].data_ptr<int64_t>(), tags[b].data_ptr<int64_t>() + length_of(p, b));
    const auto it = std::find(e.paths.begin(), e.paths.end(), y);
    ASSERT_NE(it, e.paths.end());
    EXPECT_NEAR(ll[b].item<double>(), e.scores[it - e.paths.begin()] - e.log_partition(), 1e-10);
  }
}

TEST(LinearChainCRF, MarginalsMatchEnumerationAndSumToOne) {
  const ChainPotentials p = random_chain(4, 5, 3);
  const Marginals m = marginals(p, /*with_edges=*/true);
  const auto [nodes, edges] = brute_marginals(p);
  expect_close(m.nodes, nodes, 1e-9, 1e-12);
  expect_close(m.edges, edges, 1e-9, 1e-12);
  expect_close(m.log_partition, brute_log_partition(p));
  const at::Tensor mask = at::arange(5).unsqueeze(0) < p.lengths.unsqueeze(1);
  expect_close(m.nodes.sum(2), mask.to(at::kDouble));
}

TEST(LinearChainCRF, AlphasAndBetasCombineToThePartitionAtEveryPosition) {
  const ChainPotentials p = random_chain(4, 6, 3);
  const at::Tensor a = forward_log_alphas(p), b = backward_log_betas(p), z = log_partition(p);
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t t = 0; t < length_of(p, i); ++t)
      EXPECT_NEAR(at::logsumexp(a[i][t] + b[i][t], 0).item<double>(), z[i].item<double>(), 1e-10);
}

TEST(LinearChainCRF, GradientsMatchFiniteDifferences) {
  ChainPotentials p = random_chain(3, 4, 3);
  const at::Tensor tags = random_tags(p);
  std::vector<at::Tensor*> params{&p.emissions, &p.transitions, &p.start, &p.end};
  for (at::Tensor* x : params) x->requires_grad_();
  log_likelihood(p, tags).sum().backward();
  for (at::Tensor* x : params) {
    auto f = [&](const at::Tensor& v) {
      ChainPotentials q = p;
      q.emissions = p.emissions.detach();
      q.transitions = p.transitions.detach();
      q.start = p.start.detach();
      q.end = p.end.detach();
      (x == &p.emissions ? q.emissions : x == &p.transitions ? q.transitions : x == &p.start ? q.start : q.end) = v;
      return log_likelihood(q, tags).sum().item<double>();
    };
    expect_close(x->grad(), numeric_gradient(f, *x), 1e-6, 1e-7);
  }
}

TEST(LinearChainCRF, ViterbiMatchesBestEnumeratedPath) {
  for (bool ends : {false, true}) {
    const ChainPotentials p = random_chain(6, 5, 3, ends);
    const ViterbiResult v = viterbi(p);
    expect_close(v.score, gold_score(p, v.path.clamp_min(0)));
    for (int64_t b = 0; b < 6; ++b) {
      const Enumeration e = enumerate(p, b);
      const std::size_t best = e.best();
      EXPECT_NEAR(v.score[b].item<double>(), e.scores[best], 1e-10);
      for (int64_t t = 0; t < 5; ++t)
        EXPECT_EQ(v.path[b][t].item<int64_t>(), t < length_of(p, b) ? e.paths[best][t] : -1);
    }
  }
}

TEST(LinearChainCRF, ViterbiScoreGradientIsTheBestPathIndicator) {
  ChainPotentials p = random_chain(5, 6, 4);
  p.emissions.requires_grad_();
  p.transitions.requires_grad_();
  const at::Tensor score = viterbi_score(p);
  const ViterbiResult v = viterbi(p);
  expect_close(score, v.score);
  score.sum().backward();
  const at::Tensor mask = (v.path >= 0).unsqueeze(2).to(at::kDouble);
  expect_close(p.emissions.grad(), at::one_hot(v.path.clamp_min(0), 4).to(at::kDouble) * mask, 0, 0);
  at::Tensor counts = at::zeros({4, 4}, at::kDouble);
  for (int64_t b = 0; b < 5; ++b)
    for (int64_t t = 1; t < length_of(p, b); ++t)
      counts[v.path[b][t - 1].item<int64_t>()][v.path[b][t].item<int64_t>()] += 1;
  expect_close(p.transitions.grad(), counts, 0, 0);
}

TEST(LinearChainCRF, SingleLegalPathGivesExactAnswerWithoutNaN) {
  // Only 0 -> 1 -> 2 -> 0 -> ... is allowed, and the path must start in 0.
  const int64_t K = 3, T = 5;
  ChainPotentials p = random_chain(2, T, K, true, false);
  p.transitions = at::full({K, K}, -kInf, at::kDouble);
  for (int64_t i = 0; i < K; ++i) p.transitions[i][(i + 1) % K] = randn({}).item<double>();
  p.start = at::full({K}, -kInf, at::kDouble);
  p.start[0] = 0.5;
  p.emissions.requires_grad_();
  p.transitions.requires_grad_();
  const at::Tensor only = at::tensor({0, 1, 2, 0, 1}, at::kLong).expand({2, T}).contiguous();
  const at::Tensor ll = log_likelihood(p, only);
  expect_close(ll, at::zeros({2}, at::kDouble), 0, 1e-12);
  ll.sum().backward();
  EXPECT_FALSE(p.emissions.grad().isnan().any().item<bool>());
  EXPECT_FALSE(p.transitions.grad().isnan().any().item<bool>());
  const Marginals m = marginals(p, true);
  expect_close(m.nodes, at::one_hot(only, K).to(at::kDouble), 0, 1e-12);
  EXPECT_FALSE(m.edges.isnan().any().item<bool>());
  const ViterbiResult v = viterbi(p);
  EXPECT_TRUE(at::equal(v.path, only));
  expect_close(v.score, gold_score(p, only));
}

TEST(LinearChainCRF, LargeScoresDoNotOverflow) {
  ChainPotentials p = random_chain(3, 4, 3);
  p.emissions = p.emissions * 1e4;
  p.transitions = p.transitions * 1e4;
  const at::Tensor z = log_partition(p);
  EXPECT_TRUE(z.isfinite().all().item<bool>());
  expect_close(z, brute_log_partition(p), 1e-12, 1e-8);
  // The fused backward falls back to exact log-space columns where scaled sums underflow: same marginals as the
  // composed recursion.
  const Marginals m = marginals(p);
  expect_close(m.nodes, marginals(p, /*with_edges=*/true).nodes, 1e-9, 1e-9);
  ChainPotentials f = p;  // float32
  f.emissions = p.emissions.to(at::kFloat);
  f.transitions = p.transitions.to(at::kFloat);
  f.start = p.start.to(at::kFloat);
  f.end = p.end.to(at::kFloat);
  expect_close(log_partition(f), z, 1e-6, 1e-2);
}

TEST(LinearChainCRF, Float32AgreesWithFloat64) {
  const ChainPotentials p = random_chain(4, 7, 5);
  ChainPotentials f = p;
  f.emissions = p.emissions.to(at::kFloat);
  f.transitions = p.transitions.to(at::kFloat);
  f.start = p.start.to(at::kFloat);
  f.end = p.end.to(at::kFloat);
  expect_close(log_partition(f), log_partition(p), 1e-5, 1e-5);
  expect_close(marginals(f).nodes, marginals(p).nodes, 1e-4, 1e-5);
  EXPECT_TRUE(at::equal(viterbi(f).path, viterbi(p).path));
}

TEST(LinearChainCRF, Float32AgreesWithFloat64OnLongSequences) {
  // Forward messages reach about -T·(mean score), where a float32 keeps about 1e-7 of that absolutely: the recursions
  // keep them small. The fused recursion (few labels: log-partition, Viterbi, marginals):
  at::manual_seed(31);
  const auto to_float = [](ChainPotentials p) {
    p.emissions = p.emissions.to(at::kFloat);
    p.transitions = p.transitions.to(at::kFloat);
    return p;
  };
  const auto relative = [](const at::Tensor& a, const at::Tensor& b) {
    return ((a.to(at::kDouble) - b).abs() / b.abs()).max().item<double>();
  };
  const int64_t T = 100000;
  ChainPotentials p;
  p.emissions = randn({2, T, 4}) - 30;  // log-potentials well below zero: messages fall steadily
  p.transitions = randn({4, 4});
  p.lengths = at::tensor({T, T / 2}, at::kLong);
  const ChainPotentials f = to_float(p);
  EXPECT_LT(relative(log_partition(f), log_partition(p)), 1e-6);
  EXPECT_LT(relative(viterbi(f).score, viterbi(p).score), 1e-6);
  EXPECT_LT((marginals(f).nodes.to(at::kDouble) - marginals(p).nodes).abs().max().item<double>(), 1e-4);
  // The scaled recursion (many labels, log-partition without gradients), shorter as its steps are separate tensor
  // operations, with scores close together so that they stay on its GEMM path; its error grows as sqrt(T).
  const int64_t K = 128, T2 = 6000;
  ChainPotentials q;
  q.emissions = randn({1, T2, K}, at::kDouble, 0.1) - 30;
  q.transitions = randn({K, K}, at::kDouble, 0.1);
  EXPECT_LT(relative(log_partition(to_float(q)), log_partition(q)), 5e-7);
}

TEST(LinearChainCRF, RejectsBadInputWithIndex) {
  ChainPotentials p = random_chain(3, 4, 2);
  p.lengths = at::tensor({4, 0, 2}, at::kLong);
  try {
    log_partition(p);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lengths[1] = 0"), std::string::npos) << e.what();
  }
  p.lengths = at::tensor({4, 1, 2}, at::kLong);
  at::Tensor tags = at::zeros({3, 4}, at::kLong);
  tags[2][1] = 7;
  try {
    gold_score(p, tags);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tags[2][1] = 7"), std::string::npos) << e.what();
  }
  tags[2][1] = 0;
  tags[1][3] = 99;  // padding is never read
  EXPECT_NO_THROW(gold_score(p, tags));
  p.transitions = randn({3, 2});
  EXPECT_THROW(log_partition(p), Error);
}

TEST(Constraints, BioAndBioesRules) {
  const std::vector<std::string> bio{"O", "B-NP", "I-NP", "B-VP", "I-VP"};
  const TransitionConstraints c = tag_scheme_constraints(bio, TagScheme::BIO);
  EXPECT_TRUE(c.transitions[1][2].item<bool>());   // B-NP -> I-NP
  EXPECT_TRUE(c.transitions[2][2].item<bool>());   // I-NP -> I-NP
  EXPECT_FALSE(c.transitions[0][2].item<bool>());  // O -> I-NP
  EXPECT_FALSE(c.transitions[3][2].item<bool>());  // B-VP -> I-NP
  EXPECT_TRUE(c.transitions[2][3].item<bool>());   // I-NP -> B-VP
  EXPECT_FALSE(c.start[2].item<bool>());
  EXPECT_TRUE(c.start[1].item<bool>());
  EXPECT_TRUE(c.end.all().item<bool>());

  const std::vector<std::string> bioes{"O", "B-X", "I-X", "E-X", "S-X"};
  const TransitionConstraints d = tag_scheme_constraints(bioes, TagScheme::BIOES);
  const bool expected[5][5] = {{1, 1, 0, 0, 1}, {0, 0, 1, 1, 0}, {0, 0, 1, 1, 0}, {1, 1, 0, 0, 1}, {1, 1, 0, 0, 1}};
  for (int i = 0; i < 5; ++i)
    for (int j = 0; j < 5; ++j) EXPECT_EQ(d.transitions[i][j].item<bool>(), expected[i][j]) << i << "->" << j;
  EXPECT_TRUE(at::equal(d.start, at::tensor({1, 1, 0, 0, 1}).to(at::kBool)));
  EXPECT_TRUE(at::equal(d.end, at::tensor({1, 0, 0, 1, 1}).to(at::kBool)));

  EXPECT_THROW(tag_scheme_constraints({"O", "E-X"}, TagScheme::BIO), Error);
  EXPECT_THROW(tag_scheme_constraints({"O", "NP"}, TagScheme::BIOES), Error);
}

TEST(Constraints, ConstrainedViterbiIsTheBestAllowedPath) {
  const std::vector<std::string> labels{"O", "B-A", "I-A", "B-B", "I-B"};
  const TransitionConstraints c = tag_scheme_constraints(labels, TagScheme::BIO);
  const ChainPotentials p = random_chain(8, 4, 5);
  const ChainPotentials q = constrain(p, c);
  const ViterbiResult v = viterbi(q);
  for (int64_t b = 0; b < 8; ++b) {
    const Enumeration e = enumerate(p, b);
    double best = -kInf;
    std::vector<int64_t> best_path;
    for (std::size_t n = 0; n < e.paths.size(); ++n) {
      const auto& y = e.paths[n];
      bool ok = c.start[y[0]].item<bool>() && c.end[y.back()].item<bool>();
      for (std::size_t t = 1; t < y.size(); ++t) ok = ok && c.transitions[y[t - 1]][y[t]].item<bool>();
      if (ok && e.scores[n] > best) best = e.scores[n], best_path = y;
    }
    EXPECT_NEAR(v.score[b].item<double>(), best, 1e-10);
    for (std::size_t t = 0; t < best_path.size(); ++t) EXPECT_EQ(v.path[b][t].item<int64_t>(), best_path[t]);
  }
  // The constrained partition sums over allowed paths only, and its marginals have no NaN.
  EXPECT_LT((log_partition(q) - log_partition(p)).max().item<double>(), 0);
  EXPECT_FALSE(marginals(q, true).edges.isnan().any().item<bool>());
}

// ---- CUDA against CPU ----

TEST(LinearChainCRF, VouchedValuesSkipOnlyTheRangeCheck) {
  ChainPotentials p = random_chain(3, 4, 2);
  p.lengths = at::tensor({4, 1, 2}, at::kLong);
  const at::Tensor tags = random_tags(p);
  ChainPotentials v = p;
  v.values_checked = true;
  expect_close(log_likelihood(v, tags), log_likelihood(p, tags), 0, 0);
  expect_close(viterbi(v).score, viterbi(p).score, 0, 0);
  v.transitions = randn({3, 2});
  EXPECT_THROW(log_partition(v), Error);  // shapes are still checked
}

TEST(LinearChainCRFCuda, Float32AgreesWithFloat64OnLongSequences) {
  TRELLIS_REQUIRE_CUDA();
  // Up to 16384 steps the shared-memory kernels run float32 as it is, rebasing their messages each step; beyond, and
  // on the other CUDA routes past 256 steps, float32 runs in float64. Either way float32 must not drift.
  at::manual_seed(37);
  const int64_t T = 3000;  // messages reach about -8e4, where a float32 keeps about 1e-2
  ChainPotentials p;
  p.emissions = (randn({2, T, 6}) - 30).to(at::kFloat).to(at::kDouble);  // values a float32 holds exactly
  p.transitions = randn({6, 6}).to(at::kFloat).to(at::kDouble);
  p.lengths = at::tensor({T, T / 3}, at::kLong);
  const auto on_gpu = [](ChainPotentials q, at::ScalarType type) {
    for (at::Tensor* t : {&q.emissions, &q.transitions}) *t = t->to(at::kCUDA, type);
    q.lengths = q.lengths.to(at::kCUDA);
    return q;
  };
  const ChainPotentials f = on_gpu(p, at::kFloat), d = on_gpu(p, at::kDouble);
  const auto relative = [](const at::Tensor& a, const at::Tensor& b) {
    return ((a.to(at::kDouble) - b).abs() / b.abs()).max().item<double>();
  };
  EXPECT_EQ(log_partition(f).scalar_type(), at::kFloat);
  EXPECT_LT(relative(log_partition(f), log_partition(d)), 1e-6);
  const at::Tensor tags = at::randint(0, 6, {2, T}, at::kLong).to(at::kCUDA);
  EXPECT_LT(relative(log_likelihood(f, tags), log_likelihood(d, tags)), 1e-6);
  EXPECT_LT(relative(viterbi(f).score, viterbi(d).score), 1e-6);
  EXPECT_TRUE(at::equal(viterbi(f).path, viterbi(d).path));
  EXPECT_LT((marginals(f).nodes.to(at::kDouble) - marginals(d).nodes).abs().max().item<double>(), 1e-4);
}

namespace {

// log_likelihood_with_gradients against log_likelihood differentiated by autograd, on `device`. The autograd side
// back-propagates -2.5 through the sum of the batch, whose backward hands the fused passes one value expanded with
// stride 0 (read in place, not copied): each sequence's gradients are the direct ones times -2.5.
void expect_gradients_as_autograd(int64_t B, int64_t T, int64_t K, bool with_ends, const at::Device& device) {
  SCOPED_TRACE("K=" + std::to_string(K) + (with_ends ? " with ends" : "") + " on " + device.str());
  ChainPotentials p = random_chain(B, T, K, with_ends);
  for (at::Tensor* t : {&p.emissions, &p.transitions, &p.start, &p.end})
    if (t->defined()) *t = t->to(device);
  p.lengths = p.lengths.to(device);
  const at::Tensor tags = random_tags(p).to(device);
  const LogLikelihoodGradients direct = log_likelihood_with_gradients(p, tags);
  ChainPotentials q = p;
  for (at::Tensor* t : {&q.emissions, &q.transitions, &q.start, &q.end})
    if (t->defined()) *t = t->detach().requires_grad_();
  const at::Tensor ll = log_likelihood(q, tags);
  const double upstream = -2.5;
  (ll.sum() * upstream).backward();
  EXPECT_FALSE(direct.log_likelihood.requires_grad());
  expect_close(direct.log_likelihood, ll, 1e-10, 1e-10);
  // The reduced value: the batch's sum, and (another call) its mean.
  EXPECT_EQ(direct.reduced.dim(), 0);
  expect_close(direct.reduced, ll.sum(), 1e-10, 1e-10);
  expect_close(log_likelihood_with_gradients(p, tags, double(B)).reduced, ll.sum() / double(B), 1e-10, 1e-10);
  expect_close(direct.emissions * upstream, q.emissions.grad(), 1e-10, 1e-10);
  expect_close(direct.transitions * upstream, q.transitions.grad(), 1e-10, 1e-10);
  EXPECT_EQ(direct.start.defined(), with_ends);
  EXPECT_EQ(direct.end.defined(), with_ends);
  if (with_ends) {
    expect_close(direct.start * upstream, q.start.grad(), 1e-10, 1e-10);
    expect_close(direct.end * upstream, q.end.grad(), 1e-10, 1e-10);
  }
}

}  // namespace

TEST(LinearChainCRF, LogLikelihoodWithGradientsMatchesAutograd) {
  for (bool with_ends : {true, false}) expect_gradients_as_autograd(5, 7, 4, with_ends, at::kCPU);
}

TEST(LinearChainCRFCuda, LogLikelihoodWithGradientsMatchesAutograd) {
  TRELLIS_REQUIRE_CUDA();
  // The shared-memory kernels, the many-label kernels, and K past both (autograd through the composed recursion).
  for (int64_t K : {6, 180, 2000}) expect_gradients_as_autograd(3, 5, K, true, at::kCUDA);
  expect_gradients_as_autograd(3, 5, 6, false, at::kCUDA);
  // More sequences than the threads of the block that sums the batch (each thread takes several).
  expect_gradients_as_autograd(300, 4, 6, true, at::kCUDA);
}

TEST(LinearChainCRFCuda, OutOfRangeTagsAndLengthsGiveNaNWithoutWaitingForTheGpu) {
  TRELLIS_REQUIRE_CUDA();
  // The shared-memory kernels check lengths and tags themselves: a bad sequence scores NaN (an Error would need the
  // host to read the values back), the others are untouched; on the CPU the same input is an Error.
  ChainPotentials p = random_chain(4, 6, 5);
  p.lengths = at::tensor({6, 3, 6, 4}, at::kLong);
  at::Tensor tags = random_tags(p);
  tags[1][4] = 99;  // padding of sequence 1: never read
  tags[2][5] = 5;   // sequence 2: out of range
  tags[3][0] = -1;  // sequence 3: out of range
  EXPECT_THROW(log_likelihood(p, tags), Error);
  ChainPotentials g = p;
  for (at::Tensor* t : {&g.emissions, &g.transitions, &g.start, &g.end}) *t = t->cuda().requires_grad_();
  g.lengths = p.lengths.cuda();
  const at::Tensor ll = log_likelihood(g, tags.cuda()).cpu();
  EXPECT_TRUE(at::isnan(ll[2]).item<bool>() && at::isnan(ll[3]).item<bool>());
  ChainPotentials good = p;
  good.emissions = p.emissions.narrow(0, 0, 2);
  good.lengths = p.lengths.narrow(0, 0, 2);
  at::Tensor good_tags = tags.narrow(0, 0, 2).clone();
  good_tags[1][4] = 0;
  expect_close(ll.narrow(0, 0, 2), log_likelihood(good, good_tags), 1e-5, 1e-5);
  log_likelihood(g, tags.cuda()).sum().backward();
  const at::Tensor ge = g.emissions.grad().cpu();
  // (sequence 3 has 4 positions: its padding's gradient stays 0)
  EXPECT_TRUE(at::isnan(ge[2]).all().item<bool>() && at::isnan(ge[3].narrow(0, 0, 4)).all().item<bool>());
  EXPECT_TRUE(at::isfinite(ge.narrow(0, 0, 2)).all().item<bool>());
  // A length outside [1, T].
  g.lengths = at::tensor({6, 0, 6, 7}, at::kLong).cuda();
  const at::Tensor bad_lengths = log_likelihood(g, random_tags(p).cuda()).cpu();
  EXPECT_TRUE(at::isnan(bad_lengths[1]).item<bool>() && at::isnan(bad_lengths[3]).item<bool>());
  EXPECT_TRUE(at::isfinite(bad_lengths[0]).item<bool>() && at::isfinite(bad_lengths[2]).item<bool>());
}

TEST(LinearChainCRFCuda, MatchesCpu) {
  TRELLIS_REQUIRE_CUDA();
  // K from one warp-shared block to one sequence per block, and past the fused kernels' shared-memory limit (the
  // composed recursion takes over there).
  for (auto dtype : {at::kFloat, at::kDouble})
    for (int64_t K : {1, 6, 33, 70, 150}) {
      ChainPotentials p = random_chain(9, 11, K);
      p.transitions[0][K - 1] = -kInf;
      const at::Tensor tags = random_tags(p);
      ChainPotentials c = p, g = p;
      const at::Device cuda(at::kCUDA);
      for (auto [dst, dev] : {std::pair{&c, at::Device(at::kCPU)}, std::pair{&g, cuda}}) {
        dst->emissions = p.emissions.detach().to(dev, dtype).requires_grad_();
        dst->transitions = p.transitions.detach().to(dev, dtype).requires_grad_();
        dst->start = p.start.detach().to(dev, dtype).requires_grad_();
        dst->end = p.end.detach().to(dev, dtype).requires_grad_();
        dst->lengths = p.lengths.to(dev);
        log_likelihood(*dst, tags.to(dev)).sum().backward();
      }
      const double tol = dtype == at::kFloat ? 2e-4 : 1e-10;
      SCOPED_TRACE("K=" + std::to_string(K) + (dtype == at::kFloat ? " float" : " double"));
      ChainPotentials vouched = g;
      vouched.values_checked = true;
      // (K = 1 with its one transition masked has no path: NaN on both sides.)
      EXPECT_TRUE(at::allclose(log_likelihood(vouched, tags.to(cuda)), log_likelihood(g, tags.to(cuda)), 0, 0, true));
      expect_close(log_partition(g), log_partition(c), tol, tol);
      for (auto [x, y] : {std::pair{&g.emissions, &c.emissions}, std::pair{&g.transitions, &c.transitions},
                          std::pair{&g.start, &c.start}, std::pair{&g.end, &c.end}})
        expect_close(x->grad(), y->grad(), tol, tol);
      expect_close(marginals(g).nodes, marginals(c).nodes, tol, tol);
      const ViterbiResult vg = viterbi(g), vc = viterbi(c);
      expect_close(vg.score, vc.score, tol, tol);
      EXPECT_TRUE(at::equal(vg.path.cpu(), vc.path));
      const at::Tensor eg = g.emissions.detach().requires_grad_(), ec = c.emissions.detach().requires_grad_();
      ChainPotentials g2 = g, c2 = c;
      g2.emissions = eg;
      c2.emissions = ec;
      viterbi_score(g2).sum().backward();
      viterbi_score(c2).sum().backward();
      expect_close(eg.grad(), ec.grad(), 0, 0);
    }
  // Edge marginals (composed recursion on the GPU) once.
  const ChainPotentials p = random_chain(4, 6, 5);
  ChainPotentials g = p;
  g.emissions = p.emissions.cuda();
  g.transitions = p.transitions.cuda();
  g.start = p.start.cuda();
  g.end = p.end.cuda();
  expect_close(marginals(g, true).edges, marginals(p, true).edges, 1e-10, 1e-10);
}

TEST(LinearChainCRF, FusedAndComposedRecursionsAgreeWithGradients) {
  // marginals(with_edges) runs the composed semiring-matmul recursion, marginals() the fused one.
  ChainPotentials p = random_chain(6, 7, 5);
  p.transitions[1][2] = -kInf;
  p.transitions[3].fill_(-kInf);
  const Marginals fused = marginals(p), composed = marginals(p, true);
  expect_close(fused.log_partition, composed.log_partition, 1e-12, 1e-12);
  expect_close(fused.nodes, composed.nodes, 1e-10, 1e-12);
  // Gradient of the fused log-partition w.r.t. the transitions = Σ of edge marginals.
  ChainPotentials q = p;
  q.transitions = p.transitions.clone().requires_grad_();
  q.start = p.start.clone().requires_grad_();
  q.end = p.end.clone().requires_grad_();
  log_partition(q).sum().backward();
  expect_close(q.transitions.grad(), composed.edges.sum(at::IntArrayRef{0, 1}), 1e-10, 1e-12);
  expect_close(q.start.grad(), composed.nodes.select(1, 0).sum(0), 1e-10, 1e-12);
  at::Tensor last = at::zeros({5}, at::kDouble);
  for (int64_t b = 0; b < 6; ++b) last += composed.nodes[b][length_of(p, b) - 1];
  expect_close(q.end.grad(), last, 1e-10, 1e-12);
}

TEST(LinearChainCRF, ManyLabelsScaledPathIsExactForAnyRange) {
  // Without gradients, K >= 128 runs one scaled GEMM per step; outputs that underflow are recomputed exactly.
  for (double scale : {1.0, 1e3}) {
    ChainPotentials p = random_chain(3, 5, 150);
    p.emissions = p.emissions * scale;
    p.transitions = p.transitions * scale;
    p.transitions[2].fill_(-kInf);
    const at::Tensor reference = marginals(p, /*with_edges=*/true).log_partition;  // composed recursion, float64
    c10::NoGradGuard no_grad;
    expect_close(log_partition(p), reference, 1e-12, 1e-9);
    ChainPotentials f = p;
    f.emissions = p.emissions.to(at::kFloat);
    f.transitions = p.transitions.to(at::kFloat);
    f.start = p.start.to(at::kFloat);
    f.end = p.end.to(at::kFloat);
    const at::Tensor z = log_partition(f);
    EXPECT_TRUE(z.isfinite().all().item<bool>());
    expect_close(z, reference, 1e-5, 1e-4 * scale);
  }
}

TEST(LinearChainCRFCuda, ManyLabelsScaledPathMatchesCpu) {
  TRELLIS_REQUIRE_CUDA();
  // The streamed recursion for few sequences (cuda/scaled_chain_forward.cu): sequence groups of 1, 2, 4, 8 and 16, and
  // two groups of 16; K a multiple of the 16-byte vectors (streamed rows) and not (element loads), K spanning several
  // blocks; inputs up to ±1e3, where many outputs take the exact log-space fallback; masked transitions; float32 and
  // float64. Past 32 sequences the fused chain kernels take over (B=40).
  const at::Device cuda(at::kCUDA);
  for (auto [B, K] :
       {std::pair<int64_t, int64_t>{1, 130}, {2, 1024}, {3, 256}, {5, 150}, {13, 512}, {20, 1032}, {40, 200}})
    for (double scale : {1.0, 1e3})
      for (auto dtype : {at::kFloat, at::kDouble}) {
        SCOPED_TRACE(c10::str("B=", B, " K=", K, " scale=", scale, " ", dtype));
        const ChainPotentials p = scaled_masked_chain(B, 7, K, scale);
        c10::NoGradGuard no_grad;
        const at::Tensor reference = log_partition(p);  // float64 on the CPU
        ChainPotentials g;
        g.emissions = p.emissions.to(cuda, dtype);
        g.transitions = p.transitions.to(cuda, dtype);
        g.start = p.start.to(cuda, dtype);
        g.end = p.end.to(cuda, dtype);
        g.lengths = p.lengths.to(cuda);
        const at::Tensor z = log_partition(g).cpu().to(at::kDouble);
        EXPECT_TRUE(z.isfinite().all().item<bool>());
        if (dtype == at::kDouble) expect_close(z, reference, 1e-12, 1e-9 * scale);
        else expect_close(z, reference, 1e-5, 1e-4 * scale);
      }
}

TEST(LinearChainCRFCuda, ManyLabelsFusedChainMatchesCpu) {
  TRELLIS_REQUIRE_CUDA();
  // The fused chain for many labels with gradients (cuda/chain_fused_scaled.cu), log-likelihood and log-partition:
  // the transitions in one block and split over clusters of 2 and 4 (float32 K=180, 256, 400; float64 K=150 past the
  // one-block kernel's limit), sequence groups cut short by B, ragged lengths, masked transitions, and inputs up to
  // ±1e3, where columns take the exact log-space path in both directions. Against the CPU float64 path.
  const at::Device cuda(at::kCUDA);
  for (auto [B, K, dtype] :
       {std::tuple{7, 180, at::kFloat}, {6, 256, at::kFloat}, {5, 400, at::kFloat}, {3, 150, at::kDouble}})
    for (double scale : {1.0, 1e3}) {
      SCOPED_TRACE(c10::str("B=", B, " K=", K, " scale=", scale, " ", dtype));
      const ChainPotentials p = scaled_masked_chain(B, 9, K, scale);
      at::Tensor tags = random_tags(p);
      tags.masked_fill_((tags == 2) | (tags == 3), 4);  // a tagged path through a masked transition would score -inf
      for (bool tagged : {true, false}) {
        ChainPotentials c = p, g = p;
        for (auto [dst, dev, type] : {std::tuple{&c, at::Device(at::kCPU), at::kDouble}, std::tuple{&g, cuda, dtype}}) {
          dst->emissions = p.emissions.detach().to(dev, type).requires_grad_();
          dst->transitions = p.transitions.detach().to(dev, type).requires_grad_();
          dst->start = p.start.detach().to(dev, type).requires_grad_();
          dst->end = p.end.detach().to(dev, type).requires_grad_();
          dst->lengths = p.lengths.to(dev);
        }
        // Random output weights, so that every sequence's share of the gradient is checked.
        const at::Tensor weights = at::rand({B}, at::kDouble) + 0.5;
        const at::Tensor zc = tagged ? log_likelihood(c, tags) : log_partition(c);
        (zc * weights).sum().backward();
        const auto run_gpu = [&] {
          for (at::Tensor* x : {&g.emissions, &g.transitions, &g.start, &g.end}) x->mutable_grad() = at::Tensor();
          const at::Tensor z = tagged ? log_likelihood(g, tags.to(cuda)) : log_partition(g);
          (z * weights.to(cuda, dtype)).sum().backward();
          return z;
        };
        const at::Tensor zg = run_gpu();
        const std::vector<at::Tensor> first{g.emissions.grad(), g.start.grad(), g.end.grad()};
        // No atomics on these paths: a second run gives the same bits.
        EXPECT_TRUE(at::equal(run_gpu(), zg));
        EXPECT_TRUE(at::equal(g.emissions.grad(), first[0]) && at::equal(g.start.grad(), first[1]) &&
                    at::equal(g.end.grad(), first[2]));
        // At ±1e3 the float32 scores themselves are rounded by ~1e-3, which the marginals feel.
        const double tol = dtype == at::kDouble ? 1e-10 : 2e-4, grad_tol = scale > 1 ? 50 * tol : tol;
        ASSERT_TRUE(zg.isfinite().all().item<bool>());
        expect_close(zg, zc, tol, tol * scale);
        for (auto [x, y] : {std::pair{&g.emissions, &c.emissions}, std::pair{&g.transitions, &c.transitions},
                            std::pair{&g.start, &c.start}, std::pair{&g.end, &c.end}})
          expect_close(x->grad(), y->grad(), tol, grad_tol);
      }
    }
}

TEST(LinearChainCRF, KBestMatchesSortedEnumeration) {
  ChainPotentials p = random_chain(5, 4, 3);
  p.transitions[2][0] = -kInf;  // some sequences are forbidden
  const int64_t k = 7;
  const KBestResult r = kbest_viterbi(p, k);
  const ViterbiResult v = viterbi(p);
  EXPECT_TRUE(at::equal(r.paths.select(1, 0), v.path));
  for (int64_t b = 0; b < 5; ++b) {
    const Enumeration e = enumerate(p, b);
    std::vector<double> sorted;
    for (double x : e.scores)
      if (x > -kInf) sorted.push_back(x);
    std::sort(sorted.rbegin(), sorted.rend());
    for (int64_t n = 0; n < k; ++n) {
      const double got = r.scores[b][n].item<double>();
      if (n < static_cast<int64_t>(sorted.size())) {
        EXPECT_NEAR(got, sorted[n], 1e-10) << "b=" << b << " n=" << n;
        // The reported path has the reported score.
        ChainPotentials one = p;
        one.emissions = p.emissions.narrow(0, b, 1);
        one.lengths = p.lengths.narrow(0, b, 1);
        EXPECT_NEAR(gold_score(one, r.paths[b][n].clamp_min(0).unsqueeze(0)).item<double>(), got, 1e-10);
      } else {
        EXPECT_EQ(got, -kInf);
        EXPECT_TRUE((r.paths[b][n] == -1).all().item<bool>());
      }
    }
  }
  EXPECT_THROW(kbest_viterbi(p, 0), Error);
}

namespace {

// Viterbi on the GPU against the CPU recursion in the same dtype: the same additions in the same order, so the paths
// are the same label for label, ties included.
void expect_viterbi_matches_cpu(const ChainPotentials& p, at::ScalarType dtype) {
  ChainPotentials c, g;
  for (auto [dst, dev] : {std::pair{&c, at::Device(at::kCPU)}, std::pair{&g, at::Device(at::kCUDA)}}) {
    dst->emissions = p.emissions.to(dev, dtype);
    dst->transitions = p.transitions.to(dev, dtype);
    dst->start = p.start.to(dev, dtype);
    dst->end = p.end.to(dev, dtype);
    dst->lengths = p.lengths.to(dev);
  }
  const ViterbiResult expected = viterbi(c), got = viterbi(g);
  EXPECT_TRUE(at::equal(got.path.cpu(), expected.path))
      << "first differing sequence: " << (got.path.cpu() != expected.path).any(1).nonzero()[0].item<int64_t>();
  expect_close(got.score, expected.score, 1e-5, 1e-5);
}

}  // namespace

TEST(LinearChainCRFCuda, ManyLabelViterbiMatchesCpu) {
  TRELLIS_REQUIRE_CUDA();
  // The streaming max-semiring kernels (cuda/many_label_viterbi.cu), past the shared-memory kernels' reach: sequence
  // groups of 1, 4 and 16 and a third group cut short (B=40), K a multiple of the 16-byte vectors and not (element
  // loads), K over several column tiles and row spans, ragged lengths (1 and T among them), masked transitions; then
  // integer scores, where many paths tie and the lowest label must win as on the CPU.
  for (auto [B, T, K] : {std::tuple<int64_t, int64_t, int64_t>{1, 9, 130}, {3, 7, 1031}, {13, 6, 1024}, {40, 5, 2100}})
    for (bool ties : {false, true})
      for (auto dtype : {at::kFloat, at::kDouble}) {
        SCOPED_TRACE(c10::str("B=", B, " T=", T, " K=", K, ties ? " integer scores " : " ", dtype));
        ChainPotentials p = scaled_masked_chain(B, T, K, 1.0);
        if (ties) {
          p.emissions = (p.emissions * 2).round();
          p.transitions = (p.transitions * 2).round();
          p.start = (p.start * 2).round();
          p.end = (p.end * 2).round();
        }
        expect_viterbi_matches_cpu(p, dtype);
      }
}

TEST(LinearChainCRFCuda, ManyLabelViterbiFloat32LongSequences) {
  TRELLIS_REQUIRE_CUDA();
  // Log-probabilities over 5000 steps: scores near -5e4, where an unshifted float32 message keeps about 4e-3. The
  // kernels rebase each step, so float32 follows the CPU's float32 path exactly and its score stays within 1e-6 of
  // float64.
  ChainPotentials p = random_chain(3, 5000, 200);
  p.transitions.select(1, 3).fill_(-kInf);
  p.emissions = at::log_softmax(p.emissions * 3, 2);
  p.transitions = at::log_softmax(p.transitions * 3, 1);
  p.lengths = at::tensor({5000, 4999, 2500}, at::kLong);
  expect_viterbi_matches_cpu(p, at::kFloat);
  ChainPotentials g = p;
  for (at::Tensor* t : {&g.emissions, &g.transitions, &g.start, &g.end}) *t = t->to(at::kCUDA, at::kFloat);
  g.lengths = p.lengths.to(at::kCUDA);
  expect_close(viterbi(g).score, viterbi(p).score, 1e-6, 0);
}

namespace {

// summarize_mask against a loop over the host's copy of random masks: right-padded rows, rows whose first position is
// off and rows with a hole (on again after an off position), each kind alone and mixed, as [B,T] or as the transposed
// [T,B] view (not contiguous), bool and uint8, for T across the 32-position warp width and B across many blocks.
void expect_mask_summaries_match_a_loop(const at::Device& device) {
  at::manual_seed(41);
  int checked = 0;
  for (const int64_t B : {0, 1, 5, 3001})
    for (const int64_t T : {0, 1, 2, 31, 33, 77})
      for (int kind = 0; kind < 4; ++kind) {  // right-padded, + first off, + hole, + both
        const at::Tensor lengths = at::randint(1, std::max<int64_t>(T, 1) + 1, {B}, at::kLong);
        at::Tensor mask = at::arange(T, at::kLong).unsqueeze(0) < lengths.unsqueeze(1);
        if (B > 0 && T > 0 && (kind & 1)) mask.index_put_({at::randint(B, {std::max<int64_t>(1, B / 7)}), 0}, false);
        if (B > 0 && T > 2 && (kind & 2)) {  // off somewhere in [1, T-2], on at T-1
          const at::Tensor rows = at::randint(B, {std::max<int64_t>(1, B / 5)});
          mask.index_put_({rows, T - 1}, true);
          mask.index_put_({rows, at::randint(1, T - 1, {rows.size(0)})}, false);
        }
        std::vector<int64_t> count(B, 0);
        bool first_off = false, hole = false;
        const auto on = mask.accessor<bool, 2>();
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < T; ++t) {
            count[b] += on[b][t];
            first_off |= t == 0 && !on[b][t];
            hole |= t > 0 && on[b][t] && !on[b][t - 1];
          }
        for (const bool batch_first : {true, false})
          for (const at::ScalarType dtype : {at::kBool, at::kByte}) {
            at::Tensor given = (batch_first ? mask : mask.t()).to(device, dtype);
            if (dtype == at::kByte)  // any nonzero byte is on
              given = given * at::randint(1, 256, given.sizes(), at::TensorOptions(device).dtype(at::kByte));
            const MaskSummary s = summarize_mask(given, batch_first, {B, T}, device, "test");
            ASSERT_EQ(s.lengths.device(), device);
            ASSERT_EQ(s.lengths.scalar_type(), at::kLong);
            ASSERT_EQ(s.flags.scalar_type(), at::kBool);
            const at::Tensor lengths_got = s.lengths.cpu(), flags_got = s.flags.cpu();
            ASSERT_EQ(lengths_got.size(0), B);
            for (int64_t b = 0; b < B; ++b) ASSERT_EQ(lengths_got[b].item<int64_t>(), count[b]) << "row " << b;
            EXPECT_EQ(flags_got[0].item<bool>(), first_off) << "B " << B << " T " << T << " kind " << kind;
            EXPECT_EQ(flags_got[1].item<bool>(), hole) << "B " << B << " T " << T << " kind " << kind;
            ++checked;
          }
      }
  EXPECT_EQ(checked, 4 * 6 * 4 * 4);
}

}  // namespace

TEST(LinearChainCRF, MaskSummaryMatchesALoop) { expect_mask_summaries_match_a_loop(at::kCPU); }

TEST(LinearChainCRFCuda, MaskSummaryMatchesALoop) {
  TRELLIS_REQUIRE_CUDA();
  expect_mask_summaries_match_a_loop(at::Device(at::kCUDA, 0));
}
