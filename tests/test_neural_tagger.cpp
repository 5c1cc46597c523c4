// trellis::NeuralTagger: learning a toy task, model files (round trip, determinism, corruption), options, CUDA.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <cmath>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "test_util.h"
#include "trellis/error.h"
#include "trellis/train/neural_tagger.h"

using namespace trellis;

namespace {

// A toy part-of-speech language. "saw" and "run" are nouns after a determiner or adjective and verbs elsewhere (the
// context decides); words ending in "-ly" are adverbs and the rare "-ness" words nouns (characters decide for words
// only seen once or never).
LabeledSentences toy_corpus(int sentences, uint64_t seed, const std::string& source) {
  const std::vector<std::string> dets{"the", "a", "this", "every"}, adjs{"big", "red", "old", "quiet"},
      nouns{"cat", "dog", "idea", "car", "house", "tree"}, verbs{"sees", "likes", "finds", "needs"},
      advs{"quickly", "slowly", "gladly", "badly"}, ambiguous{"saw", "run"};
  std::mt19937_64 rng(seed);
  const auto pick = [&](const std::vector<std::string>& v) { return v[rng() % v.size()]; };
  LabeledSentences d;
  d.source = source;
  for (int s = 0; s < sentences; ++s) {
    TokenRows rows;
    std::vector<std::string> labels;
    const auto add = [&](const std::string& w, const std::string& l) { rows.push_back({w}), labels.push_back(l); };
    const auto noun_phrase = [&] {
      add(pick(dets), "DET");
      if (rng() % 2) add(pick(adjs), "ADJ");
      if (rng() % 4 == 0) add(pick(ambiguous), "NOUN");
      else if (rng() % 5 == 0) add("odd" + std::to_string(rng() % 1000) + "ness", "NOUN");
      else add(pick(nouns), "NOUN");
    };
    noun_phrase();
    if (rng() % 3 == 0) add(pick(advs), "ADV");
    add(rng() % 4 == 0 ? pick(ambiguous) : pick(verbs), "VERB");
    noun_phrase();
    add(".", "PUNCT");
    d.inputs.push_back(std::move(rows));
    d.labels.push_back(std::move(labels));
    d.first_lines.push_back(0);
  }
  return d;
}

NeuralTaggerOptions small_options() {
  NeuralTaggerOptions o;
  o.word_dim = 16;
  o.char_dim = 8;
  o.char_filters = 8;
  o.char_encoder = CharEncoder::Cnn;
  o.feature_dim = 4;
  o.hidden = 16;
  o.layers = 1;
  o.dropout = 0.1;
  o.epochs = 6;
  o.batch_size = 8;
  o.learning_rate = 0.01;
  o.average = 0;
  o.threads = 1;
  return o;
}

std::vector<const TokenRows*> pointers(const LabeledSentences& d) {
  std::vector<const TokenRows*> p;
  for (const auto& r : d.inputs) p.push_back(&r);
  return p;
}

double accuracy(const NeuralTagger& m, const LabeledSentences& d) {
  const auto tagged = m.tag(pointers(d));
  double right = 0, all = 0;
  for (std::size_t s = 0; s < tagged.size(); ++s)
    for (std::size_t t = 0; t < tagged[s].labels.size(); ++t) right += tagged[s].labels[t] == d.labels[s][t], ++all;
  return 100 * right / all;
}

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "neural_" + std::to_string(getpid()) + "_" + name;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_bytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// One tiny model for the tests that only need a trained one.
const NeuralTagger& trained_model() {
  static const NeuralTagger model = [] {
    const LabeledSentences train = toy_corpus(150, 1, "train");
    return train_neural_tagger(train, nullptr, nullptr, small_options());
  }();
  return model;
}

}  // namespace

TEST(NeuralTagger, LearnsAToyTaskBeyondTheMajorityTag) {
  const LabeledSentences train = toy_corpus(200, 1, "train"), dev = toy_corpus(60, 2, "dev");
  std::map<std::string, int> counts;
  int tokens = 0;
  for (const auto& s : dev.labels)
    for (const auto& l : s) ++counts[l], ++tokens;
  int majority = 0;
  for (const auto& [label, n] : counts) majority = std::max(majority, n);
  const double majority_accuracy = 100.0 * majority / tokens;

  std::vector<NeuralEpoch> epochs;
  NeuralTrainSummary sum;
  const NeuralTagger m = train_neural_tagger(
      train, &dev, nullptr, small_options(), [&](const NeuralEpoch& e) { epochs.push_back(e); }, &sum);
  ASSERT_EQ(epochs.size(), 6u);
  EXPECT_LT(epochs.back().loss, 0.5 * epochs.front().loss);
  for (const auto& e : epochs) {
    EXPECT_GT(e.tokens_per_second, 0);
    ASSERT_TRUE(e.dev_accuracy.has_value());
    EXPECT_FALSE(e.dev_f1.has_value());  // not chunk labels
  }
  ASSERT_TRUE(sum.best_dev_accuracy.has_value());
  EXPECT_GT(*sum.best_dev_accuracy, majority_accuracy + 40);
  EXPECT_GT(*sum.best_dev_accuracy, 90);
  // The model returned is the best epoch's.
  EXPECT_NEAR(accuracy(m, dev), *sum.best_dev_accuracy, 1e-9);
  EXPECT_EQ(sum.parameters, m.num_parameters());
}

TEST(NeuralTagger, TheAveragedWeightsAreWhatTheDevSetScoresAndTheModelKeeps) {
  const LabeledSentences train = toy_corpus(150, 1, "train"), dev = toy_corpus(60, 2, "dev");
  NeuralTaggerOptions o = small_options();
  o.epochs = 4;
  const auto train_and_save = [&](double average, NeuralTrainSummary* sum) {
    o.average = average;
    const NeuralTagger m = train_neural_tagger(train, &dev, nullptr, o, {}, sum);
    const std::string path = temp_path("average" + std::to_string(average) + ".ncrf");
    m.save(path);
    std::string bytes = read_bytes(path);
    std::remove(path.c_str());
    return std::pair(accuracy(m, dev), bytes);
  };
  NeuralTrainSummary plain_sum, averaged_sum;
  const auto plain = train_and_save(0, &plain_sum);
  const auto averaged = train_and_save(0.9, &averaged_sum);
  // The same steps (the average does not steer training), but another model: the average of the weights.
  EXPECT_TRUE(averaged.second != plain.second) << "the averaged model file is the plain one";
  ASSERT_TRUE(averaged_sum.best_dev_accuracy.has_value());
  EXPECT_NEAR(averaged.first, *averaged_sum.best_dev_accuracy, 1e-9);
  EXPECT_GT(averaged.first, 90);
}

TEST(NeuralTagger, TagsDoNotDependOnTheOtherSentencesTaggedWithThem) {
  const NeuralTagger& m = trained_model();
  const LabeledSentences test = toy_corpus(40, 3, "test");
  const auto together = m.tag(pointers(test), true);
  ASSERT_EQ(together.size(), test.inputs.size());
  for (std::size_t s = 0; s < test.inputs.size(); ++s) {
    const auto alone = m.tag({&test.inputs[s]}, true);
    ASSERT_EQ(together[s].labels.size(), test.inputs[s].size());
    EXPECT_EQ(together[s].labels, alone[0].labels) << "sentence " << s;
    for (std::size_t t = 0; t < alone[0].marginals.size(); ++t)
      EXPECT_NEAR(together[s].marginals[t], alone[0].marginals[t], 1e-5) << "sentence " << s << ", token " << t;
  }
}

// A file of many sentences is cut into several chunks and encoded on worker threads ahead of the network (the
// character BiLSTM run once over the file's distinct words, sparse features added after the network): each sentence
// still gets the tags and marginals it gets in a small group.
TEST(NeuralTagger, AFileOfManyChunksTagsAsItsSentencesDoInSmallGroups) {
  NeuralTaggerOptions o = small_options();
  o.char_encoder = CharEncoder::BiLstm;
  o.epochs = 2;
  const NeuralTagger m = train_neural_tagger(toy_corpus(100, 1, "train"), nullptr, builtin_features(), o);
  const LabeledSentences test = toy_corpus(20000, 4, "test");  // three chunks of at most 8192 sentences
  const auto together = m.tag(pointers(test), true);
  ASSERT_EQ(together.size(), test.inputs.size());
  constexpr std::size_t kGroup = 500;
  for (std::size_t g = 0; g < test.inputs.size(); g += kGroup) {
    std::vector<const TokenRows*> group;
    for (std::size_t s = g; s < std::min(test.inputs.size(), g + kGroup); ++s) group.push_back(&test.inputs[s]);
    const auto apart = m.tag(group, true);
    for (std::size_t i = 0; i < apart.size(); ++i) {
      ASSERT_EQ(together[g + i].labels, apart[i].labels) << "sentence " << g + i;
      for (std::size_t t = 0; t < apart[i].marginals.size(); ++t)
        ASSERT_NEAR(together[g + i].marginals[t], apart[i].marginals[t], 1e-5)
            << "sentence " << g + i << ", token " << t;
    }
  }
}

TEST(NeuralTagger, SavedModelTagsIdenticallyAfterLoading) {
  const NeuralTagger& m = trained_model();
  const std::string path = temp_path("roundtrip.ncrf");
  m.save(path);
  ASSERT_TRUE(NeuralTagger::is_model_file(path));
  const NeuralTagger back = NeuralTagger::load(path);
  const LabeledSentences test = toy_corpus(40, 3, "test");
  const auto a = m.tag(pointers(test), true), b = back.tag(pointers(test), true);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t s = 0; s < a.size(); ++s) {
    EXPECT_EQ(a[s].labels, b[s].labels);
    EXPECT_EQ(a[s].marginals, b[s].marginals);
    EXPECT_EQ(a[s].probability, b[s].probability);
  }
  EXPECT_EQ(back.labels(), m.labels());
  EXPECT_EQ(back.describe(), m.describe());
  // k-best: the first sequence is the Viterbi one, probabilities fall, and the best one's is the sequence probability.
  const auto kb = back.tag_kbest(pointers(test), 3);
  for (std::size_t s = 0; s < kb.size(); ++s) {
    ASSERT_FALSE(kb[s].empty());
    EXPECT_EQ(kb[s][0].labels, a[s].labels);
    EXPECT_NEAR(kb[s][0].probability, a[s].probability, 1e-5);
    for (std::size_t n = 1; n < kb[s].size(); ++n) EXPECT_LE(kb[s][n].probability, kb[s][n - 1].probability + 1e-9);
  }
  std::remove(path.c_str());
}

TEST(NeuralTagger, TheSameSeedGivesTheSameModelFileOnTheCpu) {
  const LabeledSentences train = toy_corpus(60, 5, "train");
  NeuralTaggerOptions o = small_options();
  o.epochs = 2;
  const auto file_of = [&](uint64_t seed) {
    o.seed = seed;
    const std::string path = temp_path("seed" + std::to_string(seed) + ".ncrf");
    train_neural_tagger(train, nullptr, nullptr, o).save(path);
    std::string bytes = read_bytes(path);
    std::remove(path.c_str());
    return bytes;
  };
  const std::string first = file_of(7);
  EXPECT_EQ(file_of(7), first);
  EXPECT_NE(file_of(8), first);
}

TEST(NeuralTagger, CorruptTruncatedOrForeignModelFilesAreClearErrors) {
  const std::string path = temp_path("good.ncrf"), bad = temp_path("bad.ncrf");
  trained_model().save(path);
  const std::string bytes = read_bytes(path);

  std::string flipped = bytes;
  flipped[bytes.size() / 2] ^= 0x10;
  write_bytes(bad, flipped);
  std::string what = error_of([&] { NeuralTagger::load(bad); });
  EXPECT_NE(what.find("'" + bad + "': corrupt neural CRF model file (checksum mismatch"), std::string::npos) << what;

  write_bytes(bad, bytes.substr(0, bytes.size() - 100));
  what = error_of([&] { NeuralTagger::load(bad); });
  EXPECT_NE(what.find("'" + bad + "': corrupt neural CRF model file"), std::string::npos) << what;

  write_bytes(bad, bytes.substr(0, 10));
  what = error_of([&] { NeuralTagger::load(bad); });
  EXPECT_NE(what.find("'" + bad + "': corrupt neural CRF model file (truncated"), std::string::npos) << what;

  // Hyper-parameters whose network is larger than the file, checksum and all (a crafted file): an error before the
  // network is allocated (65536 hidden units over 16 layers would be over 2 TB).
  const auto with_hyper_parameter = [&](const std::string& key, const std::string& value) {
    std::string big = bytes;
    const std::size_t found = big.find("\n" + key + "=");
    EXPECT_NE(found, std::string::npos) << key;
    const std::size_t begin = found + 1, end = big.find('\n', begin);
    const std::size_t length_at = big.find("encoder=") - sizeof(uint64_t);  // the text's first line
    const std::string line = key + "=" + value;
    uint64_t length;  // the hyper-parameter text's stored length changes too
    std::memcpy(&length, big.data() + length_at, sizeof length);
    length = length + line.size() - (end - begin);
    std::memcpy(big.data() + length_at, &length, sizeof length);
    big.replace(begin, end - begin, line);
    uint64_t h = 1469598103934665603ull;
    for (std::size_t i = 0; i + sizeof(uint64_t) < big.size(); ++i)
      h = (h ^ static_cast<unsigned char>(big[i])) * 1099511628211ull;
    std::memcpy(big.data() + big.size() - sizeof h, &h, sizeof h);
    return big;
  };
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"word_dim", "60000"}, {"hidden", "65536"}, {"layers", "16"}, {"char_filters", "65536"}}) {
    write_bytes(bad, with_hyper_parameter(key, value));
    what = error_of([&] { NeuralTagger::load(bad); });
    EXPECT_NE(what.find("'" + bad + "': corrupt neural CRF model file (the parameters exceed the file)"),
              std::string::npos)
        << key << "=" << value << ": " << what;
  }

  write_bytes(bad, "word POS label\n");
  EXPECT_FALSE(NeuralTagger::is_model_file(bad));
  what = error_of([&] { NeuralTagger::load(bad); });
  EXPECT_NE(what.find("'" + bad + "' is not a Trellis neural CRF model"), std::string::npos) << what;

  what = error_of([&] { NeuralTagger::load(temp_path("missing.ncrf")); });
  EXPECT_NE(what.find("missing.ncrf"), std::string::npos) << what;
  std::remove(path.c_str());
  std::remove(bad.c_str());
}

TEST(NeuralTagger, BadOptionsAreErrorsNamingTheFlag) {
  const LabeledSentences train = toy_corpus(5, 1, "train");
  const auto message = [&](const std::function<void(NeuralTaggerOptions&)>& change) {
    NeuralTaggerOptions o = small_options();
    change(o);
    return error_of([&] { train_neural_tagger(train, nullptr, nullptr, o); });
  };
  EXPECT_NE(error_of([] { parse_sentence_encoder("rnn"); }).find("--encoder must be bilstm, cnn or none, not 'rnn'"),
            std::string::npos);
  EXPECT_NE(message([](auto& o) { o.encoder = static_cast<SentenceEncoder>(7); }).find("which is no SentenceEncoder"),
            std::string::npos);
  EXPECT_NE(message([](auto& o) { o.dropout = 1.5; }).find("--dropout must be in [0, 1), not 1.5"), std::string::npos);
  EXPECT_NE(message([](auto& o) { o.dropout = std::nan(""); }).find("--dropout must be in [0, 1), not nan"),
            std::string::npos);
  EXPECT_NE(message([](auto& o) { o.epochs = 0; }).find("--epochs must be at least 1, not 0"), std::string::npos);
  EXPECT_NE(message([](auto& o) { o.learning_rate = -1; }).find("--lr must be a finite number > 0, not -1"),
            std::string::npos);
  EXPECT_NE(message([](auto& o) { o.lr_decay = 0; }).find("--lr-decay must be in (0, 1], not 0"), std::string::npos);
  EXPECT_NE(error_of([] { parse_char_encoder("gru"); }).find("--char-encoder must be cnn or bilstm, not 'gru'"),
            std::string::npos);
  EXPECT_NE(message([](auto& o) { o.c2 = -1; }).find("--c2 must be a finite number >= 0, not -1"), std::string::npos);
  EXPECT_NE(message([](auto& o) { o.hidden = 0; }).find("--hidden must be at least 1, not 0"), std::string::npos);
  EXPECT_NE(message([](auto& o) { o.layers = 0; }).find("--layers must be at least 1, not 0"), std::string::npos);
  EXPECT_NE(message([](auto& o) { o.batch_size = 0; }).find("--batch-size must be at least 1, not 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_encoder_precision("fp8"); }).find("--precision must be auto, bf16 or fp32, not 'fp8'"),
            std::string::npos);
  EXPECT_EQ(parse_encoder_precision("bf16"), EncoderPrecision::Bf16);
  EXPECT_EQ(parse_device("cuda:1"), c10::Device(c10::kCUDA, 1));
  EXPECT_NE(error_of([] { parse_device("gpu"); }).find("--device must be cpu, cuda or cuda:N, not 'gpu'"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_device("meta"); }).find("--device must be cpu, cuda or cuda:N, not 'meta'"),
            std::string::npos);
  EXPECT_NE(message([](auto& o) { o.precision = EncoderPrecision::Bf16; }).find("--precision bf16 needs --device cuda"),
            std::string::npos);
  EXPECT_NE(
      message([](auto& o) { o.pretrained_embeddings = temp_path("no-such-vectors.txt"); }).find("no-such-vectors.txt"),
      std::string::npos);
  // A dev label that training never saw names the file and line.
  LabeledSentences dev = toy_corpus(2, 1, "dev.txt");
  dev.first_lines = {1, 20};
  dev.labels[1][2] = "WEIRD";
  EXPECT_NE(error_of([&] {
              train_neural_tagger(train, &dev, nullptr, small_options());
            }).find("dev.txt:22: label 'WEIRD' does not occur in the training data"),
            std::string::npos);
}

TEST(NeuralTagger, CnnEncoderCharacterBiLstmAndHybridFeaturesTrainAndRoundTrip) {
  const LabeledSentences train = toy_corpus(100, 1, "train"), dev = toy_corpus(30, 2, "dev");
  NeuralTaggerOptions o = small_options();
  o.encoder = SentenceEncoder::Cnn;
  o.char_encoder = CharEncoder::BiLstm;
  o.layers = 2;
  o.epochs = 4;
  NeuralTrainSummary sum;
  const NeuralTagger m = train_neural_tagger(train, &dev, builtin_features(), o, {}, &sum);
  EXPECT_TRUE(m.hybrid());
  EXPECT_GT(sum.features, 100u);
  EXPECT_GT(*sum.best_dev_accuracy, 80);
  const std::string path = temp_path("cnn.ncrf");
  m.save(path);
  const NeuralTagger back = NeuralTagger::load(path);
  EXPECT_TRUE(back.hybrid());
  EXPECT_NE(back.describe().find("-> BiLSTM 2 x 8"), std::string::npos) << back.describe();
  const auto a = m.tag(pointers(dev), true), b = back.tag(pointers(dev), true);
  for (std::size_t s = 0; s < a.size(); ++s) EXPECT_EQ(a[s].marginals, b[s].marginals);
  std::remove(path.c_str());
}

TEST(NeuralTagger, SentenceDropoutMasksTrainRoundTripAndSteerTraining) {
  const LabeledSentences train = toy_corpus(100, 1, "train"), dev = toy_corpus(30, 2, "dev");
  NeuralTaggerOptions o = small_options();
  o.dropout = 0.3;
  o.epochs = 4;
  o.variational_dropout = true;
  // Two layers: one BiLSTM module per layer, which the model file must bring back.
  o.layers = 2;
  NeuralTrainSummary sum;
  const NeuralTagger m = train_neural_tagger(train, &dev, nullptr, o, {}, &sum);
  EXPECT_GT(*sum.best_dev_accuracy, 80);
  const std::string path = temp_path("sentence_masks.ncrf");
  m.save(path);
  const NeuralTagger back = NeuralTagger::load(path);
  std::remove(path.c_str());
  EXPECT_TRUE(back.options().variational_dropout);
  EXPECT_NE(back.describe().find("dropout 0.3 per sentence"), std::string::npos) << back.describe();
  const auto a = m.tag(pointers(dev), true), b = back.tag(pointers(dev), true);
  for (std::size_t s = 0; s < a.size(); ++s) EXPECT_EQ(a[s].marginals, b[s].marginals);

  // One layer (the same modules either way): the masks alone make another model from the same seed.
  o.layers = 1;
  const auto marginals_of = [&](bool sentence_masks) {
    o.variational_dropout = sentence_masks;
    return train_neural_tagger(train, nullptr, nullptr, o).tag(pointers(dev), true);
  };
  const auto per_sentence = marginals_of(true), per_token = marginals_of(false);
  double largest = 0;
  for (std::size_t s = 0; s < per_sentence.size(); ++s)
    for (std::size_t i = 0; i < per_sentence[s].marginals.size(); ++i)
      largest = std::max(largest, std::abs(per_sentence[s].marginals[i] - per_token[s].marginals[i]));
  EXPECT_GT(largest, 1e-3) << "sentence masks trained the model that token masks train";
}

TEST(NeuralTagger, PretrainedVectorsSetTheEmbeddingSizeAndJoinTheVocabulary) {
  const LabeledSentences train = toy_corpus(20, 1, "train");
  const std::string vectors = temp_path("vectors.txt");
  write_bytes(vectors, "3 6\nThe 1 2 3 4 5 6\nunseenword 0.5 0 0 0 0 1\ncat 0 0 0 0 0 0\n");
  NeuralTaggerOptions o = small_options();
  o.word_dim = 0;
  o.epochs = 1;
  o.pretrained_embeddings = vectors;
  const NeuralTagger m = train_neural_tagger(train, nullptr, nullptr, o);
  EXPECT_EQ(m.options().word_dim, 6);
  const NeuralTagger plain = train_neural_tagger(train, nullptr, nullptr, [] {
    NeuralTaggerOptions p = small_options();
    p.word_dim = 6;
    p.epochs = 1;
    return p;
  }());
  EXPECT_EQ(m.num_parameters(), plain.num_parameters() + 6);  // one more word: "unseenword"
  o.word_dim = 16;
  EXPECT_NE(
      error_of([&] { train_neural_tagger(train, nullptr, nullptr, o); }).find("--embedding-dim 16 differs from the 6"),
      std::string::npos);
  o.word_dim = 0;
  write_bytes(vectors, "the 1 2 3\ncat 1 2\n");
  EXPECT_NE(error_of([&] { train_neural_tagger(train, nullptr, nullptr, o); }).find(vectors + ":2: expected 3 values"),
            std::string::npos);
  std::remove(vectors.c_str());
}

TEST(NeuralTagger, ChunkLabelsAreDecodedWithinTheirScheme) {
  // BIO chunks. An untrained model (a learning rate of almost nothing) has no preference: unconstrained, its 50 best
  // sequences of 4 tokens would include I-X after O or after another type.
  LabeledSentences train;
  train.source = "chunks";
  const std::vector<std::vector<std::string>> words{{"the", "big", "cat"}, {"sees"}, {"a", "dog"}, {"in"}, {"."}};
  const std::vector<std::string> types{"NP", "VP", "NP", "PP", "O"};
  for (int s = 0; s < 20; ++s) {
    TokenRows rows;
    std::vector<std::string> labels;
    for (std::size_t c = 0; c < words.size(); ++c)
      for (std::size_t w = 0; w < words[c].size(); ++w) {
        rows.push_back({words[c][w]});
        labels.push_back(types[c] == "O" ? "O" : (w == 0 ? "B-" : "I-") + types[c]);
      }
    train.inputs.push_back(rows);
    train.labels.push_back(labels);
  }
  NeuralTaggerOptions o = small_options();
  o.epochs = 1;
  o.learning_rate = 1e-9;
  std::vector<NeuralEpoch> epochs;
  const NeuralTagger m =
      train_neural_tagger(train, &train, nullptr, o, [&](const NeuralEpoch& e) { epochs.push_back(e); });
  EXPECT_NE(m.describe().find("decoding constraints: BIO"), std::string::npos) << m.describe();
  ASSERT_TRUE(epochs.at(0).dev_f1.has_value());  // chunk labels: F1 beside accuracy
  std::mt19937_64 rng(3);
  std::vector<TokenRows> sentences(10);
  for (auto& rows : sentences)
    for (int t = 0; t < 4; ++t) rows.push_back({"w" + std::to_string(rng() % 1000)});
  std::vector<const TokenRows*> p;
  for (const auto& r : sentences) p.push_back(&r);
  const auto valid = [](const std::vector<std::string>& labels) {
    for (std::size_t t = 0; t < labels.size(); ++t)
      if (labels[t][0] == 'I' && (t == 0 || labels[t - 1] == "O" || labels[t - 1].substr(2) != labels[t].substr(2)))
        return false;
    return true;
  };
  for (const auto& s : m.tag(p)) EXPECT_TRUE(valid(s.labels));
  for (const auto& alternatives : m.tag_kbest(p, 50)) {
    EXPECT_EQ(alternatives.size(), 50u);
    for (const auto& s : alternatives) EXPECT_TRUE(valid(s.labels));
  }
}

TEST(NeuralTagger, CudaAgreesWithTheCpu) {
  TRELLIS_REQUIRE_CUDA();
  const std::string path = temp_path("cuda.ncrf");
  trained_model().save(path);
  NeuralTagger cpu = NeuralTagger::load(path), gpu = NeuralTagger::load(path), gpu_bf16 = NeuralTagger::load(path);
  gpu.to(at::kCUDA, EncoderPrecision::Fp32);
  gpu_bf16.to(at::kCUDA, EncoderPrecision::Bf16);
  const LabeledSentences test = toy_corpus(200, 4, "test");
  const auto a = cpu.tag(pointers(test), true), b = gpu.tag(pointers(test), true), c = gpu_bf16.tag(pointers(test));
  // cuDNN may run float32 convolutions and RNNs in TF32: near-ties may decode differently, marginals differ slightly.
  std::size_t tokens = 0, same = 0, same_bf16 = 0;
  double largest = 0;
  for (std::size_t s = 0; s < a.size(); ++s)
    for (std::size_t t = 0; t < a[s].labels.size(); ++t) {
      largest = std::max(largest, std::abs(a[s].marginals[t] - b[s].marginals[t]));
      same += a[s].labels[t] == b[s].labels[t];
      same_bf16 += a[s].labels[t] == c[s].labels[t], ++tokens;
    }
  EXPECT_LT(largest, 1e-2);
  EXPECT_GE(same, tokens * 995 / 1000);
  EXPECT_GE(same_bf16, tokens * 98 / 100);
  // And training on CUDA learns as on the CPU.
  NeuralTaggerOptions o = small_options();
  o.device = c10::kCUDA;
  NeuralTrainSummary sum;
  const LabeledSentences train = toy_corpus(150, 1, "train"), dev = toy_corpus(60, 2, "dev");
  for (const EncoderPrecision precision : {EncoderPrecision::Fp32, EncoderPrecision::Bf16}) {
    o.precision = precision;
    train_neural_tagger(train, &dev, nullptr, o, {}, &sum);
    EXPECT_GT(*sum.best_dev_accuracy, 90) << encoder_precision_name(precision);
  }
  std::remove(path.c_str());
}
