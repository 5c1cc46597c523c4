#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <set>
#include <unordered_map>

#include "trellis/train/crf_train.h"
#include "trellis/error.h"
#include "../lib/src/train/encoded_batch.h"  // private to the library: CrfTagger::encode
#include "../lib/src/train/owlqn.h"          // internal optimiser, tested on its own

using namespace trellis;

namespace {

// A toy chunking task whose labels follow from word and neighbour: determiners open NPs, nouns continue them.
LabeledSentences toy_corpus(int sentences, uint64_t seed) {
  const std::vector<std::string> dets{"the", "a", "this"}, nouns{"cat", "dog", "idea", "car"},
      verbs{"runs", "sees", "is"};
  std::mt19937_64 rng(seed);
  LabeledSentences d;
  d.source = "toy";
  for (int s = 0; s < sentences; ++s) {
    TokenRows rows;
    std::vector<std::string> labels;
    const int clauses = 1 + rng() % 3;
    for (int c = 0; c < clauses; ++c) {
      rows.push_back({dets[rng() % 3], "DT"});
      labels.push_back("B-NP");
      const int n = 1 + rng() % 2;
      for (int k = 0; k < n; ++k) rows.push_back({nouns[rng() % 4], "NN"}), labels.push_back("I-NP");
      rows.push_back({verbs[rng() % 3], "VB"});
      labels.push_back("B-VP");
    }
    rows.push_back({".", "."});
    labels.push_back("O");
    d.inputs.push_back(rows);
    d.labels.push_back(labels);
    d.first_lines.push_back(1);
  }
  return d;
}

std::vector<const TokenRows*> pointers(const LabeledSentences& d) {
  std::vector<const TokenRows*> p;
  for (const auto& r : d.inputs) p.push_back(&r);
  return p;
}

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + name + "." + std::to_string(::getpid());
}

CrfTagger train_toy(CrfTrainSummary* summary = nullptr, int iterations = 30) {
  CrfTrainOptions o;
  o.max_iterations = iterations;
  o.c2 = 0.01;
  const LabeledSentences train = toy_corpus(60, 1), dev = toy_corpus(20, 2);
  return train_crf(train, &dev, builtin_features(), o, {}, summary);
}

}  // namespace

TEST(CrfTagger, LearnsAToyChunkingTaskAndReportsProgress) {
  CrfTrainSummary summary;
  std::vector<double> objective;
  CrfTrainOptions o;
  o.max_iterations = 30;
  o.c2 = 0.01;
  const LabeledSentences train = toy_corpus(60, 1), dev = toy_corpus(20, 2);
  const CrfTagger m = train_crf(
      train, &dev, builtin_features(), o, [&](const CrfIteration& it) { objective.push_back(it.objective); }, &summary);
  ASSERT_GE(objective.size(), 2u);
  EXPECT_LT(objective.back(), objective.front());
  EXPECT_EQ(summary.best_dev_f1.value_or(0), 100.0);
  EXPECT_EQ(m.labels(), (std::vector<std::string>{"B-NP", "I-NP", "B-VP", "O"}));
  const auto tagged = m.tag(pointers(dev), /*with_marginals=*/true);
  for (std::size_t s = 0; s < tagged.size(); ++s) {
    EXPECT_EQ(tagged[s].labels, dev.labels[s]);
    double min_marginal = 1;
    for (double p : tagged[s].marginals) {
      EXPECT_GT(p, 0.25);  // better than uniform over the 4 labels
      EXPECT_LE(p, 1.0 + 1e-6);
      min_marginal = std::min(min_marginal, p);
    }
    EXPECT_LE(tagged[s].probability, min_marginal + 1e-6);
  }
}

TEST(CrfTagger, SavedModelLoadsBackIdentically) {
  const CrfTagger m = train_toy(nullptr, 5);
  const std::string path = temp_path("model.crf");
  m.save(path);
  const CrfTagger l = CrfTagger::load(path);
  EXPECT_EQ(l.labels(), m.labels());
  EXPECT_EQ(l.features(), m.features());
  EXPECT_EQ(l.input_columns(), 2u);
  for (std::size_t i = 0; i < 4; ++i) EXPECT_TRUE(at::equal(l.parameters()[i], m.parameters()[i]));
  std::remove(path.c_str());
}

TEST(CrfTagger, CorruptTruncatedOrForeignModelFilesAreClearErrors) {
  const CrfTagger m = train_toy(nullptr, 2);
  const std::string path = temp_path("bad.crf");
  m.save(path);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto expect_error = [&](const std::string& content, const std::string& needle) {
    {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out << content;
    }
    try {
      CrfTagger::load(path);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  };
  std::string flipped = bytes;
  flipped[bytes.size() / 2] ^= 0x20;
  expect_error(flipped, "corrupt");
  expect_error(bytes.substr(0, bytes.size() - 100), "corrupt");
  expect_error(bytes.substr(0, 10), "corrupt");
  expect_error("word POS label\n", "not a Trellis CRF model");
  std::remove(path.c_str());
  EXPECT_THROW(CrfTagger::load(path), Error);
}

TEST(CrfTagger, EncodingRejectsUnknownLabelsAndWrongColumnCounts) {
  const CrfTagger m = train_toy(nullptr, 1);
  const TokenRows rows{{"the", "DT"}, {"cat", "NN"}};
  const std::vector<std::string> labels{"B-NP", "B-XX"};
  const std::vector<const std::vector<std::string>*> gold{&labels};
  EXPECT_THROW(m.encode({&rows}, &gold), Error);
  const TokenRows narrow{{"the"}};
  EXPECT_THROW(m.encode({&narrow}), Error);
}

TEST(CrfTagger, SplitLabelsTakesTheChosenColumn) {
  ConllCorpus c;
  c.source = "x";
  c.num_columns = 3;
  c.sentences.push_back({{{"a", "b", "c"}}, 7});
  const LabeledSentences last = split_labels(c);
  EXPECT_EQ(last.labels[0][0], "c");
  EXPECT_EQ(last.inputs[0][0], (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(split_labels(c, 1).labels[0][0], "b");
  EXPECT_THROW(split_labels(c, 3), Error);
}

TEST(CrfTagger, CrfppTemplateModelsTrainSaveAndTag) {
  CrfTrainOptions o;
  o.max_iterations = 25;
  o.c2 = 0.01;
  const LabeledSentences train = toy_corpus(60, 3), dev = toy_corpus(20, 4);
  const CrfTagger m = train_crf(train, &dev, crfpp_template_features("U00:%x[0,0]\nU01:%x[-1,0]\nU02:%x[0,1]\nB\n"), o);
  const std::string path = temp_path("template.crf");
  m.save(path);
  const CrfTagger l = CrfTagger::load(path);
  std::remove(path.c_str());
  EXPECT_EQ(l.extractor().spec(), m.extractor().spec());
  const auto tagged = l.tag(pointers(dev));
  for (std::size_t s = 0; s < tagged.size(); ++s) EXPECT_EQ(tagged[s].labels, dev.labels[s]);
  // A template column the data does not have is an error before any training.
  EXPECT_THROW(train_crf(train, nullptr, crfpp_template_features("U00:%x[0,2]\n"), o), Error);
}

TEST(CrfTagger, KBestAlternativesAreSortedProbabilities) {
  const CrfTagger m = train_toy(nullptr, 10);
  const LabeledSentences dev = toy_corpus(5, 9);
  const auto best = m.tag(pointers(dev), true);
  const auto kb = m.tag_kbest(pointers(dev), 3);
  ASSERT_EQ(kb.size(), 5u);
  for (std::size_t s = 0; s < kb.size(); ++s) {
    ASSERT_EQ(kb[s].size(), 3u);
    EXPECT_EQ(kb[s][0].labels, best[s].labels);
    EXPECT_NEAR(kb[s][0].probability, best[s].probability, 1e-5);
    double total = 0;
    for (std::size_t n = 0; n < 3; ++n) {
      if (n > 0) EXPECT_LE(kb[s][n].probability, kb[s][n - 1].probability);
      EXPECT_NE(kb[s][n].labels, n > 0 ? kb[s][n - 1].labels : std::vector<std::string>{});
      total += kb[s][n].probability;
    }
    EXPECT_LE(total, 1.0 + 1e-6);
  }
}

TEST(CrfTagger, MinibatchOptimisersLearnTheToyTask) {
  const LabeledSentences train = toy_corpus(60, 5), dev = toy_corpus(20, 6);
  for (const char* algorithm : {"sgd", "adagrad", "adam"}) {
    CrfTrainOptions o;
    o.algorithm = parse_crf_algorithm(algorithm);
    o.learning_rate = std::string(algorithm) == "sgd" ? 0.01 : 0.1;
    o.batch_size = 8;
    o.max_iterations = 15;
    o.c2 = 0.01;
    o.seed = 3;
    std::vector<double> objective;
    CrfTrainSummary summary;
    train_crf(
        train, &dev, builtin_features(), o, [&](const CrfIteration& it) { objective.push_back(it.objective); },
        &summary);
    EXPECT_LT(objective.back(), objective.front()) << algorithm;
    EXPECT_EQ(summary.best_dev_f1.value_or(0), 100.0) << algorithm;
  }
  CrfTrainOptions bad;
  bad.algorithm = static_cast<CrfAlgorithm>(7);
  EXPECT_THROW(train_crf(train, nullptr, builtin_features(), bad), Error);
}

TEST(OwlQn, FindsTheSoftThresholdedMinimumOfAQuadratic) {
  // f(x) = ½ Σ w_i (x_i − a_i)² + c1·‖x‖₁ has the minimum x_i = sign(a_i) · max(|a_i| − c1/w_i, 0).
  at::manual_seed(7);
  const at::Tensor a = at::rand({40}, at::kDouble) * 2 - 1, w = at::rand({40}, at::kDouble) * 4 + 0.5;
  const double c1 = 1.0;
  at::Tensor x = (at::rand({40}, at::kDouble) - 0.5).requires_grad_();
  OwlQn opt({x}, c1, [&] {
    x.mutable_grad() = at::Tensor();
    const at::Tensor f = 0.5 * (w * (x - a).square()).sum();
    f.backward();
    return f.item<double>();
  });
  double previous = std::numeric_limits<double>::infinity();
  for (int i = 0; i < 200; ++i) {
    const double f = opt.step();
    ASSERT_LE(f, previous + 1e-12);  // never goes up
    if (f == previous) break;
    previous = f;
  }
  const at::Tensor want = a.sign() * (a.abs() - c1 / w).clamp_min(0);
  EXPECT_TRUE(at::allclose(x.detach(), want, 1e-6, 1e-6)) << x << want;
  EXPECT_TRUE(at::equal(x.detach() == 0, want == 0));  // exact zeros, not small values
  EXPECT_GT((want == 0).sum().item<int64_t>(), 5);
  EXPECT_LT(opt.pseudo_gradient_norm(), 1e-5);
}

TEST(CrfTagger, L1TrainingWithOwlQnGivesASparseModelThatStillLearns) {
  const LabeledSentences train = toy_corpus(60, 1), dev = toy_corpus(20, 2);
  CrfTrainOptions o;
  o.max_iterations = 40;
  o.c1 = 0.5;
  o.c2 = 0;
  std::vector<double> objective;
  CrfTrainSummary summary;
  // No dev set: the model is the last iterate, not the first that scored best.
  const CrfTagger m = train_crf(
      train, nullptr, builtin_features(), o, [&](const CrfIteration& it) { objective.push_back(it.objective); },
      &summary);
  for (std::size_t i = 1; i < objective.size(); ++i) EXPECT_LE(objective[i], objective[i - 1]);
  const auto tagged = m.tag(pointers(dev));
  for (std::size_t s = 0; s < tagged.size(); ++s) EXPECT_EQ(tagged[s].labels, dev.labels[s]);
  EXPECT_LT(summary.nonzero_parameters, summary.parameters / 4);
  EXPECT_GT(summary.nonzero_parameters, 0u);
  o.algorithm = CrfAlgorithm::Adam;
  EXPECT_THROW(train_crf(train, nullptr, builtin_features(), o), Error);  // OWL-QN is full-batch
  o.algorithm = CrfAlgorithm::Lbfgs;
  o.c1 = -1;
  EXPECT_THROW(train_crf(train, nullptr, builtin_features(), o), Error);
}

TEST(CrfTagger, AnExtractorThatLeavesAFeatureOpenIsAnError) {
  // An unclosed feature would run into the next token's first one in training's packed buffers.
  struct Unclosed final : FeatureExtractor {
    void add_features(const TokenRows& rows, std::size_t t, FeatureList& out) const override { out << rows[t][0]; }
    std::string spec() const override { return "unclosed"; }
  };
  CrfTrainOptions o;
  o.max_iterations = 1;
  EXPECT_THROW(train_crf(toy_corpus(4, 1), nullptr, std::make_unique<Unclosed>(), o), Error);
}

TEST(CrfTagger, FeatureCutOffAndThreadCountGiveTheSameDictionaryAndModel) {
  // Training extracts features once, in parallel blocks and hash shards: the result must be the serial first-seen
  // dictionary, cut at min_feature_count, and the same model for any thread count.
  const LabeledSentences train = toy_corpus(80, 11);
  const auto fx = builtin_features();
  std::unordered_map<std::string, int> count;
  std::vector<std::string> order;
  FeatureList feats;
  for (const auto& rows : train.inputs)
    for (std::size_t t = 0; t < rows.size(); ++t) {
      feats.clear();
      fx->extract(rows, t, feats);
      for (const std::string& f : feats.strings())
        if (count[f]++ == 0) order.push_back(f);
    }
  std::vector<std::string> want;
  for (const auto& f : order)
    if (count[f] >= 3) want.push_back(f);
  ASSERT_LT(want.size(), order.size());  // the cut-off drops some
  const int threads = at::get_num_threads();
  std::vector<CrfTagger> models;
  for (int n : {1, 2, 3}) {
    CrfTrainOptions o;
    o.max_iterations = 5;
    o.min_feature_count = 3;
    o.threads = n;
    models.push_back(train_crf(train, nullptr, builtin_features(), o));
    EXPECT_EQ(models.back().features(), want) << n << " threads";
  }
  at::set_num_threads(threads);
  for (std::size_t i = 1; i < models.size(); ++i)
    EXPECT_TRUE(at::allclose(models[i].weights, models[0].weights, 1e-5, 1e-6));
}

namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// The model files' checksum (FNV-1a over everything before it), for files crafted by the tests.
std::string with_checksum(std::string body) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : body) h = (h ^ c) * 1099511628211ull;
  body.append(reinterpret_cast<const char*>(&h), sizeof h);
  return body;
}

}  // namespace

TEST(CrfTagger, ColumnLayoutTravelsWithTheModel) {
  CrfTagger m = train_toy(nullptr, 2);
  // The toy data's two input columns read from a file "word POS label CHUNK": label column 2, column 3 ignored.
  const ColumnLayout layout = ColumnLayout::resolve(4, 2, {}, "file");
  EXPECT_EQ(layout.describe(), "4 columns: inputs 0,1, label 2, ignored 3");
  m.set_layout(layout);
  const std::string path = temp_path("layout.crf");
  m.save(path);
  const CrfTagger l = CrfTagger::load(path);
  EXPECT_EQ(l.layout().describe(), layout.describe());
  std::remove(path.c_str());
  EXPECT_THROW(m.set_layout(ColumnLayout::resolve(4, 2, {0}, "file")), Error);  // one input, the model has two

  ConllCorpus file{"file", 4, {{{{"the", "DT", "B-NP", "x"}, {"cat", "NN", "I-NP", "y"}}, 1}}};
  bool has_labels = false;
  ConllCorpus p = layout.project(file, &has_labels);
  EXPECT_TRUE(has_labels);
  EXPECT_EQ(p.sentences[0].rows[1], (std::vector<std::string>{"cat", "NN", "I-NP"}));
  // Without the label column the ignored column moves one place left; it is still not read.
  file.num_columns = 3;
  for (auto& row : file.sentences[0].rows) row.erase(row.begin() + 2);
  p = layout.project(file, &has_labels);
  EXPECT_FALSE(has_labels);
  EXPECT_EQ(p.sentences[0].rows[1], (std::vector<std::string>{"cat", "NN"}));
  file.num_columns = 2;
  EXPECT_THROW(layout.project(file), Error);

  // Explicit inputs may come after the label; the label is never an input.
  EXPECT_EQ(ColumnLayout::resolve(4, 1, {0, -1}, "f").describe(), "4 columns: inputs 0,3, label 1, ignored 2");
  EXPECT_THROW(ColumnLayout::resolve(4, 1, {1}, "f"), Error);
  EXPECT_THROW(ColumnLayout::resolve(4, 0, {}, "f"), Error);  // nothing before the label: inputs must be named
  EXPECT_THROW(ColumnLayout::resolve(4, 4, {}, "f"), Error);
}

TEST(CrfTagger, ModelsOfTheFirstFormatStillLoad) {
  const CrfTagger m = train_toy(nullptr, 2);
  const std::string path = temp_path("v1.crf");
  m.save(path);
  std::string bytes = read_bytes(path);
  // Version 1 is version 2 without the layout (columns, label, one index per input) after the input-column count.
  const uint32_t v1 = 1;
  std::memcpy(&bytes[8], &v1, sizeof v1);
  const std::size_t layout_at = 8 + 4 + 8, layout_bytes = 8 * (2 + m.input_columns());
  bytes = with_checksum(bytes.substr(0, layout_at) +
                        bytes.substr(layout_at + layout_bytes, bytes.size() - layout_at - layout_bytes - 8));
  write_bytes(path, bytes);
  const CrfTagger l = CrfTagger::load(path);
  EXPECT_EQ(l.layout().describe(), "3 columns: inputs 0,1, label 2");
  for (std::size_t i = 0; i < 4; ++i) EXPECT_TRUE(at::equal(l.parameters()[i], m.parameters()[i]));
  std::remove(path.c_str());
}

TEST(CrfTagger, HostileModelFilesAreRejectedBeforeTheyAllocate) {
  const CrfTagger m = train_toy(nullptr, 2);
  const std::string path = temp_path("hostile.crf");
  m.save(path);
  const std::string good = read_bytes(path);
  const auto expect_corrupt = [&](const std::string& bytes, const std::string& needle) {
    write_bytes(path, bytes);
    try {
      CrfTagger::load(path);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  // The label count sits after the layout and the feature-set spec.
  const std::size_t spec_at = 8 + 4 + 8 + 8 * (2 + m.input_columns());
  uint64_t spec_bytes;
  std::memcpy(&spec_bytes, &good[spec_at], 8);
  std::string huge = good.substr(0, good.size() - 8);
  const uint64_t labels = 100000000;
  std::memcpy(&huge[spec_at + 8 + spec_bytes], &labels, 8);
  expect_corrupt(with_checksum(huge), "label count 100000000 exceeds the file");
  // A NaN, +inf or -inf weight (the last end weight) would make every probability NaN.
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::string w = good.substr(0, good.size() - 8);
    std::memcpy(&w[w.size() - 4], &bad, 4);
    expect_corrupt(with_checksum(w), "end weights entry " + std::to_string(m.labels().size() - 1) + " is not finite");
  }
  std::remove(path.c_str());
}

TEST(CrfTagger, ASentenceThatNoLabelSequenceCanTakeIsAnError) {
  CrfTagger m = train_toy(nullptr, 2);
  const LabeledSentences dev = toy_corpus(3, 4);
  m.transitions.fill_(-std::numeric_limits<float>::infinity());  // sentences of one token still have paths
  try {
    m.tag(pointers(dev), true);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sentence 0: the model allows no label sequence"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(m.tag_kbest(pointers(dev), 2), Error);
}

TEST(CrfTagger, KBestStaysWithinItsMemoryBound) {
  const CrfTagger m = train_toy(nullptr, 5);
  const LabeledSentences dev = toy_corpus(40, 5);
  const int64_t K = m.labels().size();
  // k so large that one sentence's tables exceed the bound: an error naming it, before any allocation.
  try {
    m.tag_kbest(pointers(dev), CrfTagger::kMaxKBestBytes / K);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sentence 0: "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("ask for fewer"), std::string::npos) << e.what();
  }
  EXPECT_THROW(m.tag_kbest(pointers(dev), 0), Error);
}

TEST(CrfTagger, SeenFeaturePairsGiveFewerWeightsThatRoundTripAndTagAlike) {
  CrfTrainOptions o;
  o.max_iterations = 25;
  o.c2 = 0.01;
  o.feature_pairs = FeaturePairs::Seen;
  const LabeledSentences train = toy_corpus(60, 5), dev = toy_corpus(20, 6);
  const std::string features = "U00:%x[0,0]\nU01:%x[-1,0]\nU02:%x[0,1]\nB\n";
  const CrfTagger m = train_crf(train, &dev, crfpp_template_features(features), o);
  ASSERT_EQ(m.feature_pairs(), FeaturePairs::Seen);
  // The (feature, label) pairs of the training data, counted here from the extractor's strings.
  std::unordered_map<std::string, int64_t> feature_id;
  for (std::size_t f = 0; f < m.features().size(); ++f) feature_id.emplace(m.features()[f], f);
  std::set<std::pair<int64_t, int64_t>> seen;
  for (std::size_t s = 0; s < train.inputs.size(); ++s)
    for (std::size_t t = 0; t < train.inputs[s].size(); ++t) {
      FeatureList list;
      m.extractor().extract(train.inputs[s], t, list);
      for (const std::string_view f : list) seen.emplace(feature_id.at(std::string(f)), m.label_id(train.labels[s][t]));
    }
  const int64_t K = static_cast<int64_t>(m.labels().size()), F = static_cast<int64_t>(m.features().size());
  EXPECT_EQ(m.weights.numel(), static_cast<int64_t>(seen.size()));
  EXPECT_LT(m.weights.numel(), F * K / 2);
  for (int64_t j = 0; j < m.weights.numel(); ++j) EXPECT_EQ(seen.count(m.weight_pair(j)), 1u) << "weight " << j;
  o.feature_pairs = FeaturePairs::All;
  EXPECT_EQ(train_crf(train, &dev, crfpp_template_features(features), o).weights.numel(), F * K);

  const std::string path = temp_path("seen.crf");
  m.save(path);
  const CrfTagger l = CrfTagger::load(path);
  std::remove(path.c_str());
  EXPECT_EQ(l.feature_pairs(), FeaturePairs::Seen);
  EXPECT_TRUE(at::equal(l.pair_offsets(), m.pair_offsets()));
  EXPECT_TRUE(at::equal(l.pair_labels(), m.pair_labels()));
  for (std::size_t i = 0; i < 4; ++i) EXPECT_TRUE(at::equal(l.parameters()[i], m.parameters()[i]));
  const auto before = m.tag(pointers(dev), true), after = l.tag(pointers(dev), true);
  for (std::size_t s = 0; s < dev.inputs.size(); ++s) {
    EXPECT_EQ(after[s].labels, dev.labels[s]);  // the toy task is learnt
    EXPECT_EQ(after[s].labels, before[s].labels);
    EXPECT_EQ(after[s].marginals, before[s].marginals);
  }
  try {
    parse_feature_pairs("some");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--feature-pairs must be all"), std::string::npos) << e.what();
  }
}
