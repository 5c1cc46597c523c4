// train_crf's contract: options checked before any work, divergence an error, `converged` honest, and the optimum
// reached being the one of the documented objective -log-likelihood + c2·‖θ‖² (full batch and minibatch alike).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "trellis/train/crf_train.h"
#include "trellis/error.h"
#include "trellis/crf/linear_chain_crf.h"
#include "../lib/src/train/encoded_batch.h"  // private to the library: CrfTagger::encode

using namespace trellis;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Random sentences of min_length to max_length tokens over `vocabulary` words ("w0", "w1", ...); each word leans to
// one label (the rest are drawn at random), so the weights are far from 0. With `tag_column`, a second input column
// holds a coarse class of the word.
LabeledSentences random_sentences(int sentences, uint64_t seed, uint64_t vocabulary,
                                  const std::vector<std::string>& labels, int min_length, int max_length,
                                  bool tag_column) {
  std::mt19937_64 rng(seed);
  LabeledSentences d;
  d.source = "random";
  for (int s = 0; s < sentences; ++s) {
    TokenRows rows;
    std::vector<std::string> y;
    const int length = min_length + rng() % (max_length - min_length + 1);
    for (int t = 0; t < length; ++t) {
      const uint64_t w = rng() % vocabulary;
      rows.push_back({"w" + std::to_string(w)});
      if (tag_column) rows.back().push_back("p" + std::to_string(w % 40));
      y.push_back(labels[rng() % 4 == 0 ? rng() % labels.size() : w % labels.size()]);
    }
    d.inputs.push_back(rows);
    d.labels.push_back(y);
    d.first_lines.push_back(1);
  }
  return d;
}

// One-column sentences over six words and three labels.
LabeledSentences random_corpus(int sentences, uint64_t seed) {
  return random_sentences(sentences, seed, 6, {"X", "Y", "Z"}, 2, 6, false);
}

// The same sentence `copies` times: every minibatch of a partition into equal batches is then the same.
LabeledSentences repeated_sentence(int copies) {
  LabeledSentences d;
  d.source = "repeated";
  const TokenRows rows{{"a"}, {"b"}, {"c"}, {"a"}, {"d"}};
  const std::vector<std::string> labels{"X", "Y", "X", "Z", "Y"};
  for (int i = 0; i < copies; ++i) d.inputs.push_back(rows), d.labels.push_back(labels), d.first_lines.push_back(1);
  return d;
}

// Few features, so that the float32 trainer can get close to the optimum.
std::unique_ptr<FeatureExtractor> small_features() { return crfpp_template_features("U00:%x[0,0]\nU01:%x[-1,0]\nB\n"); }

std::vector<at::Tensor> float64_parameters(const CrfTagger& m) {
  std::vector<at::Tensor> p;
  for (const auto& t : m.parameters()) p.push_back(t.detach().to(at::kDouble));
  return p;
}

// -log-likelihood of `data` under the given float64 parameters of `m`'s dictionary and its gradient, by autograd
// through the CRF library (independently of the trainer's objective).
double negative_log_likelihood(CrfTagger& m, const LabeledSentences& data, const std::vector<at::Tensor>& theta,
                               std::vector<at::Tensor>* gradient) {
  std::vector<at::Tensor> p;
  for (const auto& t : theta) p.push_back(t.detach().clone().requires_grad_());
  m.weights = p[0], m.transitions = p[1], m.start = p[2], m.end = p[3];
  std::vector<const TokenRows*> rows;
  std::vector<const std::vector<std::string>*> gold;
  for (std::size_t s = 0; s < data.inputs.size(); ++s) rows.push_back(&data.inputs[s]), gold.push_back(&data.labels[s]);
  const EncodedBatch b = m.encode(rows, &gold);
  const at::Tensor nll = -log_likelihood(m.potentials(b), b.tags).sum();
  nll.backward();
  if (gradient) {
    gradient->clear();
    for (const auto& t : p) gradient->push_back(t.grad());
  }
  return nll.item<double>();
}

double squared_norm(const std::vector<at::Tensor>& theta) {
  double s = 0;
  for (const auto& t : theta) s += t.square().sum().item<double>();
  return s;
}

double max_abs(const std::vector<at::Tensor>& theta) {
  double m = 0;
  for (const auto& t : theta) m = std::max(m, t.abs().max().item<double>());
  return m;
}

// The message of the Error that training with `o` throws ("" if none), and whether any iteration ran before it.
std::string training_error(const CrfTrainOptions& o, bool* iterated = nullptr) {
  const LabeledSentences train = random_corpus(10, 1);
  bool any = false;
  std::string what;
  try {
    train_crf(train, nullptr, small_features(), o, [&](const CrfIteration&) { any = true; });
  } catch (const Error& e) {
    what = e.what();
  }
  if (iterated) *iterated = any;
  return what;
}

}  // namespace

TEST(CrfTrain, EachInvalidOptionIsAnErrorNamingItsFlagBeforeAnyWork) {
  struct Case {
    std::function<void(CrfTrainOptions&)> set;
    std::string message;
  };
  const std::vector<Case> cases{
      {[](auto& o) { o.c2 = kNaN; }, "--c2 must be a finite number >= 0, not nan"},
      {[](auto& o) { o.c2 = kInf; }, "--c2 must be a finite number >= 0, not inf"},
      {[](auto& o) { o.c2 = -1; }, "--c2 must be a finite number >= 0, not -1"},
      {[](auto& o) { o.c1 = kNaN; }, "--c1 must be a finite number >= 0, not nan"},
      {[](auto& o) { o.c1 = -kInf; }, "--c1 must be a finite number >= 0, not -inf"},
      {[](auto& o) { o.c1 = -0.5; }, "--c1 must be a finite number >= 0, not -0.5"},
      {[](auto& o) { o.c1 = 0.5, o.algorithm = CrfAlgorithm::Adam; },
       "L1 regularisation (--c1 > 0) trains with OWL-QN, which needs --algorithm lbfgs, not 'adam'"},
      {[](auto& o) { o.max_iterations = 0; }, "--max-iter must be at least 1, not 0"},
      {[](auto& o) { o.max_iterations = -5; }, "--max-iter must be at least 1, not -5"},
      {[](auto& o) { o.learning_rate = kNaN; }, "--learning-rate must be a finite number > 0, not nan"},
      {[](auto& o) { o.learning_rate = kInf; }, "--learning-rate must be a finite number > 0, not inf"},
      {[](auto& o) { o.learning_rate = 0; }, "--learning-rate must be a finite number > 0, not 0"},
      {[](auto& o) { o.learning_rate = -0.1, o.algorithm = CrfAlgorithm::Sgd; },
       "--learning-rate must be a finite number > 0, not -0.1"},
      {[](auto& o) { o.batch_size = 0, o.algorithm = CrfAlgorithm::Sgd; }, "--batch-size must be at least 1, not 0"},
      {[](auto& o) { o.batch_size = static_cast<std::size_t>(-1), o.algorithm = CrfAlgorithm::Sgd; },
       "--batch-size must be at least 1, not -1"},
      {[](auto& o) { o.tolerance = kNaN; }, "--tolerance must be a finite number >= 0, not nan"},
      {[](auto& o) { o.tolerance = -1e-3; }, "--tolerance must be a finite number >= 0, not -0.001"},
      {[](auto& o) { o.period = 0; }, "the tolerance period (CrfTrainOptions::period) must be at least 1, not 0"},
      {[](auto& o) { o.min_feature_count = 0; }, "--min-freq must be at least 1, not 0"},
      {[](auto& o) { o.early_stopping = -1; }, "--early-stopping must be >= 0 (0: off), not -1"},
      {[](auto& o) { o.threads = -2; }, "--threads must be >= 0 (0: all), not -2"},
      {[](auto& o) { o.algorithm = static_cast<CrfAlgorithm>(7); },
       "CrfTrainOptions::algorithm holds 7, which is no CrfAlgorithm"},
  };
  for (const Case& c : cases) {
    CrfTrainOptions o;
    o.max_iterations = 2;
    c.set(o);
    bool iterated = true;
    EXPECT_EQ(training_error(o, &iterated), c.message);
    EXPECT_FALSE(iterated) << c.message;
  }
  // The boundary values themselves are fine.
  CrfTrainOptions edge;
  edge.c2 = 0, edge.c1 = 0, edge.tolerance = 0, edge.max_iterations = 1, edge.period = 1, edge.early_stopping = 0;
  edge.min_feature_count = 1;
  EXPECT_EQ(training_error(edge), "");
  edge.algorithm = CrfAlgorithm::Sgd, edge.batch_size = 1, edge.learning_rate = 1e-300;
  EXPECT_EQ(training_error(edge), "");
}

TEST(CrfTrain, AlgorithmNamesAreTheFlagsValuesAndAnUnknownOneIsAnErrorNamingTheFlag) {
  for (const CrfAlgorithm a : {CrfAlgorithm::Lbfgs, CrfAlgorithm::Sgd, CrfAlgorithm::Adagrad, CrfAlgorithm::Adam})
    EXPECT_EQ(parse_crf_algorithm(crf_algorithm_name(a)), a) << crf_algorithm_name(a);
  EXPECT_STREQ(crf_algorithm_name(CrfAlgorithm::Adagrad), "adagrad");
  try {
    parse_crf_algorithm("newton");
    ADD_FAILURE() << "no error for 'newton'";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "--algorithm must be lbfgs, sgd, adagrad or adam, not 'newton'");
  }
}

TEST(CrfTrain, DivergingTrainingIsAnErrorNotANanModel) {
  for (const char* algorithm : {"sgd", "adam"}) {
    CrfTrainOptions o;
    o.algorithm = parse_crf_algorithm(algorithm);
    o.learning_rate = 1e30;  // finite, but the weights overflow float32 within an epoch or two
    o.batch_size = 2;
    o.max_iterations = 5;
    const std::string what = training_error(o);
    EXPECT_NE(what.find("training diverged"), std::string::npos) << algorithm << ": " << what;
    EXPECT_NE(what.find("not finite; a smaller --learning-rate may help"), std::string::npos) << what;
  }
}

TEST(CrfTrain, ConvergedIsFalseWhenTheIterationsRunOut) {
  const LabeledSentences train = random_corpus(30, 2);
  for (const char* algorithm : {"lbfgs", "sgd"}) {
    CrfTrainOptions o;
    o.algorithm = parse_crf_algorithm(algorithm);
    o.max_iterations = 3;
    o.period = 1;
    o.tolerance = 1e-9;  // the objective still falls by much more than this at iteration 3
    CrfTrainSummary summary;
    train_crf(train, nullptr, small_features(), o, {}, &summary);
    EXPECT_EQ(summary.iterations, 3) << algorithm;
    EXPECT_FALSE(summary.converged) << algorithm;
  }
}

TEST(CrfTrain, ConvergedIsTrueWhenTheToleranceTestStops) {
  const LabeledSentences train = random_corpus(30, 2);
  CrfTrainOptions o;
  o.max_iterations = 500;
  o.c2 = 0.5;
  CrfTrainSummary summary;
  train_crf(train, nullptr, small_features(), o, {}, &summary);
  EXPECT_LT(summary.iterations, 500);
  EXPECT_TRUE(summary.converged);

  // A minibatch run with a tolerance that the second epoch already meets.
  o.algorithm = CrfAlgorithm::Adam;
  o.learning_rate = 0.01;
  o.tolerance = 0.9;
  o.period = 1;
  train_crf(train, nullptr, small_features(), o, {}, &summary);
  EXPECT_EQ(summary.iterations, 2);
  EXPECT_TRUE(summary.converged);
}

TEST(CrfTrain, EarlyStoppingCountsAsConverged) {
  const LabeledSentences train = random_corpus(30, 3), dev = random_corpus(10, 4);
  CrfTrainOptions o;
  o.algorithm =
      CrfAlgorithm::Sgd;  // no line search: only early stopping can end it before max_iterations (tolerance 0)
  o.learning_rate = 0.05;
  o.batch_size = 4;
  o.tolerance = 0;
  o.max_iterations = 200;
  o.early_stopping = 2;
  CrfTrainSummary summary;
  train_crf(train, &dev, small_features(), o, {}, &summary);
  ASSERT_LT(summary.iterations, 200);
  EXPECT_EQ(summary.iterations, summary.best_iteration + 2);
  EXPECT_TRUE(summary.converged);
}

TEST(CrfTrain, FullBatchOptimumIsAStationaryPointOfTheL2Objective) {
  // At the minimum of -log-likelihood + c2·‖θ‖², ∇(-log-likelihood) + 2·c2·θ = 0. The gradient here comes from the
  // CRF library by autograd in float64, not from the trainer.
  const LabeledSentences train = random_corpus(30, 5);
  CrfTrainOptions o;
  o.c2 = 0.5;
  o.tolerance = 0;  // run until a line search finds no lower point
  o.max_iterations = 1000;
  double last_objective = 0;
  CrfTrainSummary summary;
  CrfTagger m = train_crf(
      train, nullptr, small_features(), o, [&](const CrfIteration& it) { last_objective = it.objective; }, &summary);
  ASSERT_TRUE(summary.converged);
  const std::vector<at::Tensor> theta = float64_parameters(m);
  std::vector<at::Tensor> gradient;
  const double nll = negative_log_likelihood(m, train, theta, &gradient);
  double residual = 0;
  for (std::size_t i = 0; i < theta.size(); ++i)
    residual = std::max(residual, (gradient[i] + 2 * o.c2 * theta[i]).abs().max().item<double>());
  // The L2 gradient alone is far larger than what float32 training leaves, so a wrong L2 gradient cannot pass.
  ASSERT_GT(2 * o.c2 * max_abs(theta), 0.5);
  EXPECT_LT(residual, 2e-2) << "float32 training; max |θ| " << max_abs(theta);
  // The objective the trainer reports is the documented one (CRFsuite's c2·‖θ‖², not c2/2).
  EXPECT_NEAR(last_objective, nll + o.c2 * squared_norm(theta), 1e-5 * std::abs(last_objective));
}

TEST(CrfTrain, MinibatchOptimisersReachTheFullBatchOptimum) {
  // Identical sentences in equal minibatches: every minibatch objective is the same, so a minibatch optimiser is
  // plain (deterministic) descent on -log-likelihood/4 + share·c2·‖θ‖² with share = 1/4, whose minimum is the full
  // batch's exactly. A minibatch given the whole L2 term would find the minimum of -log-likelihood + 4·c2·‖θ‖².
  const LabeledSentences train = repeated_sentence(16);
  CrfTrainOptions o;
  o.c2 = 2;
  o.tolerance = 0;
  o.max_iterations = 1000;
  const std::vector<at::Tensor> optimum = float64_parameters(train_crf(train, nullptr, small_features(), o));
  ASSERT_GT(max_abs(optimum), 0.5);
  for (const char* algorithm : {"sgd", "adagrad", "adam"}) {
    CrfTrainOptions mb = o;
    mb.algorithm = parse_crf_algorithm(algorithm);
    mb.batch_size = 4;
    mb.learning_rate = std::string(algorithm) == "sgd" ? 0.02 : std::string(algorithm) == "adagrad" ? 0.2 : 0.005;
    mb.max_iterations = 400;
    mb.tolerance = 0;
    const std::vector<at::Tensor> theta = float64_parameters(train_crf(train, nullptr, small_features(), mb));
    double distance = 0;
    for (std::size_t i = 0; i < theta.size(); ++i)
      distance = std::max(distance, (theta[i] - optimum[i]).abs().max().item<double>());
    EXPECT_LT(distance, 0.03 * max_abs(optimum)) << algorithm;
  }
}

TEST(CrfTrain, FullBatchTrainingIsIndependentOfTheThreadCount) {
  // The objective and its gradient are sums over blocks of sentences fixed by the data alone, reduced in a fixed
  // order, and the optimisers' own reductions too: every iteration's objective and gradient norm, and the weights,
  // are the same bits on 1, 2 or 3 threads (L2 L-BFGS and L1 OWL-QN).
  // A vocabulary large enough that the weights (and the data) span many of the trainer's blocks and many of ATen's
  // parallel grains: a reduction whose order followed the thread count would show in the last bits.
  const LabeledSentences train =
      random_sentences(1500, 11, 6000, {"P", "Q", "R", "S", "T", "U", "V", "W"}, 5, 34, true);
  const int threads_before = at::get_num_threads();
  for (const double c1 : {0.0, 0.5}) {
    std::vector<std::vector<double>> objectives, norms;
    std::vector<std::vector<at::Tensor>> weights;
    for (const int threads : {1, 2, 3}) {
      CrfTrainOptions o;
      o.c1 = c1;
      o.threads = threads;
      o.max_iterations = 4;
      objectives.emplace_back(), norms.emplace_back();
      const CrfTagger m =
          train_crf(train, nullptr, crfpp_template_features("U00:%x[0,0]\nU01:%x[-1,0]\nU02:%x[1,0]\nU03:%x[0,1]\nB\n"),
                    o, [&](const CrfIteration& it) {
                      objectives.back().push_back(it.objective);
                      norms.back().push_back(it.gradient_norm);
                    });
      weights.push_back(m.parameters());
    }
    at::set_num_threads(threads_before);
    ASSERT_EQ(objectives[0].size(), 4u) << "c1 " << c1;
    ASSERT_GT(weights[0][0].numel(), 100000) << "too few weights to split into grains";
    for (std::size_t k = 1; k < objectives.size(); ++k) {
      EXPECT_EQ(objectives[k], objectives[0]) << "c1 " << c1 << ", " << k + 1 << " threads";
      EXPECT_EQ(norms[k], norms[0]) << "c1 " << c1 << ", " << k + 1 << " threads";
      for (std::size_t i = 0; i < weights[0].size(); ++i)
        EXPECT_TRUE(at::equal(weights[k][i], weights[0][i]))
            << "c1 " << c1 << ", parameter " << i << ", " << k + 1 << " threads";
    }
  }
}
