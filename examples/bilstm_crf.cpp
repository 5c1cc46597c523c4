// A neural tagger in an application: word embeddings, a bidirectional LSTM and trellis::nn::CRF on top, trained with
// Adam on CoNLL "word ... label" files, scored on held-out sentences, saved with torch::save, loaded back into a fresh
// model (which must tag exactly as the trained one) and used to tag a sentence.
//
// Usage: bilstm_crf --train TRAIN.txt --dev DEV.txt [--epochs 5] [--device cpu|cuda] [--model bilstm_crf.pt]
//                   [--max-sentences N] [--check]
//   e.g. bilstm_crf --train data/ud-en-ewt-sample/train.txt --dev data/ud-en-ewt-sample/dev.txt
// --check exits with status 1 unless the training loss fell and the dev accuracy beats always predicting the most
// frequent training label (how the test suite runs it).
#include <torch/torch.h>
#include <trellis/io/conll.h>
#include <trellis/nn/crf.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct Options {
  std::string train, dev, model = "bilstm_crf.pt", device = "cpu";
  int epochs = 5;
  std::size_t max_sentences = 0;  // 0: all
  bool check = false;
};

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--train") o.train = value();
    else if (arg == "--dev") o.dev = value();
    else if (arg == "--model") o.model = value();
    else if (arg == "--device") o.device = value();
    else if (arg == "--epochs") o.epochs = std::stoi(value());
    else if (arg == "--max-sentences") o.max_sentences = std::stoul(value());
    else if (arg == "--check") o.check = true;
    else throw std::invalid_argument("unknown option " + arg);
  }
  if (o.train.empty() || o.dev.empty()) throw std::invalid_argument("--train and --dev are required");
  if (o.epochs < (o.check ? 2 : 1))
    throw std::invalid_argument(o.check ? "--check needs at least 2 epochs" : "--epochs must be at least 1");
  return o;
}

// Words and labels as ids. Word id 0 is padding, 1 the unknown word: training words seen once map to it, so that its
// embedding learns what unseen words look like.
struct Vocabulary {
  std::unordered_map<std::string, int64_t> words, labels;
  std::vector<std::string> label_names;

  static std::string key(const std::string& word) {
    std::string lower = word;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    return lower;
  }
  explicit Vocabulary(const trellis::ConllCorpus& train) {
    std::unordered_map<std::string, int> counts;
    for (const auto& s : train.sentences)
      for (const auto& row : s.rows) {
        ++counts[key(row.front())];
        if (labels.emplace(row.back(), int64_t(label_names.size())).second) label_names.push_back(row.back());
      }
    words = {{"<pad>", 0}, {"<unk>", 1}};
    for (const auto& s : train.sentences)
      for (const auto& row : s.rows)
        if (counts[key(row.front())] > 1) words.emplace(key(row.front()), int64_t(words.size()));
  }
  int64_t word(const std::string& w) const {
    const auto it = words.find(key(w));
    return it == words.end() ? 1 : it->second;
  }
  int64_t label(const std::string& l) const {
    const auto it = labels.find(l);
    return it == labels.end() ? -1 : it->second;  // a label training never saw: always an error
  }
};

struct Batch {
  torch::Tensor words, tags, mask, lengths;  // [B,T] ×3 on the device; lengths [B] int64 on the CPU
};

// Sentences padded to the longest of the batch.
Batch make_batch(const std::vector<const trellis::ConllSentence*>& sentences, const Vocabulary& vocab,
                 const torch::Device& device) {
  const int64_t B = int64_t(sentences.size());
  int64_t T = 0;
  for (const auto* s : sentences) T = std::max<int64_t>(T, int64_t(s->rows.size()));
  Batch b{torch::zeros({B, T}, torch::kLong), torch::zeros({B, T}, torch::kLong), torch::zeros({B, T}, torch::kBool),
          torch::empty({B}, torch::kLong)};
  auto words = b.words.accessor<int64_t, 2>();
  auto tags = b.tags.accessor<int64_t, 2>();
  auto mask = b.mask.accessor<bool, 2>();
  for (int64_t i = 0; i < B; ++i) {
    const auto& rows = sentences[i]->rows;
    b.lengths[i] = int64_t(rows.size());
    for (std::size_t t = 0; t < rows.size(); ++t) {
      words[i][t] = vocab.word(rows[t].front());
      tags[i][t] = vocab.label(rows[t].back());
      mask[i][t] = true;
    }
  }
  return {b.words.to(device), b.tags.to(device), b.mask.to(device), b.lengths};
}

struct BiLstmCrfImpl : torch::nn::Module {
  BiLstmCrfImpl(int64_t vocabulary, int64_t labels, int64_t embedding = 64, int64_t hidden = 64)
      : embed(register_module("embed",
                              torch::nn::Embedding(torch::nn::EmbeddingOptions(vocabulary, embedding).padding_idx(0)))),
        lstm(register_module(
            "lstm", torch::nn::LSTM(torch::nn::LSTMOptions(embedding, hidden).bidirectional(true).batch_first(true)))),
        dropout(register_module("dropout", torch::nn::Dropout(0.3))),
        project(register_module("project", torch::nn::Linear(2 * hidden, labels))),
        crf(register_module("crf", trellis::nn::CRF(labels))) {}

  // Emission scores [B,T,K]. The LSTM runs on packed sequences, so the backward direction starts at each sentence's
  // last word rather than in the padding.
  torch::Tensor emissions(const Batch& b) {
    const auto packed = torch::nn::utils::rnn::pack_padded_sequence(dropout(embed(b.words)), b.lengths,
                                                                    /*batch_first=*/true, /*enforce_sorted=*/false);
    const torch::Tensor states = std::get<0>(torch::nn::utils::rnn::pad_packed_sequence(
        std::get<0>(lstm->forward_with_packed_input(packed)), /*batch_first=*/true, /*padding_value=*/0.0,
        /*total_length=*/b.words.size(1)));
    return project(dropout(states));
  }
  // Negative log-likelihood per token, the training objective.
  torch::Tensor loss(const Batch& b) { return -crf(emissions(b), b.tags, b.mask, "token_mean"); }
  torch::Tensor decode(const Batch& b) { return crf->decode(emissions(b), b.mask).path; }

  torch::nn::Embedding embed;
  torch::nn::LSTM lstm;
  torch::nn::Dropout dropout;
  torch::nn::Linear project;
  trellis::nn::CRF crf;
};
TORCH_MODULE(BiLstmCrf);

std::vector<std::vector<const trellis::ConllSentence*>> batches(const trellis::ConllCorpus& corpus,
                                                                std::vector<std::size_t> order, std::size_t size) {
  std::vector<std::vector<const trellis::ConllSentence*>> out;
  for (std::size_t i = 0; i < order.size(); i += size) {
    out.emplace_back();
    for (std::size_t j = i; j < std::min(order.size(), i + size); ++j)
      out.back().push_back(&corpus.sentences[order[j]]);
  }
  return out;
}

// Token accuracy of the model's best paths, and the predictions (for comparing two models).
std::pair<double, torch::Tensor> evaluate(BiLstmCrf& model, const std::vector<Batch>& dev) {
  torch::NoGradGuard no_grad;
  model->eval();
  int64_t correct = 0, total = 0;
  std::vector<torch::Tensor> predictions;
  for (const Batch& b : dev) {
    const torch::Tensor path = model->decode(b);
    correct += (path.eq(b.tags) & b.mask).sum().item<int64_t>();
    total += b.mask.sum().item<int64_t>();
    predictions.push_back(path.flatten().cpu());
  }
  return {double(correct) / double(total), torch::cat(predictions)};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse_options(argc, argv);
    const torch::Device device(o.device);
    torch::manual_seed(0);
    trellis::ConllCorpus train = trellis::read_conll(o.train);
    const trellis::ConllCorpus dev = trellis::read_conll(o.dev);
    if (o.max_sentences && train.sentences.size() > o.max_sentences) train.sentences.resize(o.max_sentences);
    const Vocabulary vocab(train);
    std::printf("%zu training sentences (%zu tokens), %zu dev sentences; %zu words, %zu labels; device %s\n",
                train.sentences.size(), train.num_tokens(), dev.sentences.size(), vocab.words.size(),
                vocab.label_names.size(), o.device.c_str());

    // The majority-label baseline: always the most frequent training label.
    std::vector<int64_t> label_counts(vocab.label_names.size());
    for (const auto& s : train.sentences)
      for (const auto& row : s.rows) ++label_counts[vocab.label(row.back())];
    const int64_t majority = std::max_element(label_counts.begin(), label_counts.end()) - label_counts.begin();
    int64_t majority_correct = 0;
    for (const auto& s : dev.sentences)
      for (const auto& row : s.rows) majority_correct += vocab.label(row.back()) == majority;
    const double baseline = double(majority_correct) / double(dev.num_tokens());

    std::vector<std::size_t> dev_order(dev.sentences.size());
    std::iota(dev_order.begin(), dev_order.end(), 0);
    std::vector<Batch> dev_batches;
    for (const auto& sentences : batches(dev, dev_order, 64))
      dev_batches.push_back(make_batch(sentences, vocab, device));

    BiLstmCrf model(int64_t(vocab.words.size()), int64_t(vocab.label_names.size()));
    model->to(device);
    torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(5e-3));
    std::vector<std::size_t> order(train.sentences.size());
    std::iota(order.begin(), order.end(), 0);
    std::vector<double> epoch_losses;
    double accuracy = 0;
    for (int epoch = 1; epoch <= o.epochs; ++epoch) {
      const auto start = std::chrono::steady_clock::now();
      const torch::Tensor shuffled = torch::randperm(int64_t(order.size()), torch::kLong);
      std::copy_n(shuffled.data_ptr<int64_t>(), order.size(), order.begin());
      model->train();
      double loss_sum = 0;
      int64_t tokens = 0;
      for (const auto& sentences : batches(train, order, 32)) {
        const Batch b = make_batch(sentences, vocab, device);
        optimizer.zero_grad();
        const torch::Tensor loss = model->loss(b);
        loss.backward();
        torch::nn::utils::clip_grad_norm_(model->parameters(), 5.0);
        optimizer.step();
        const int64_t n = b.lengths.sum().item<int64_t>();
        loss_sum += loss.item<double>() * double(n);
        tokens += n;
      }
      epoch_losses.push_back(loss_sum / double(tokens));
      accuracy = evaluate(model, dev_batches).first;
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf("epoch %d: loss %.4f per token, dev accuracy %.2f%%, %.1f s\n", epoch, epoch_losses.back(),
                  100 * accuracy, seconds);
    }
    std::printf("majority-label baseline (%s): %.2f%%\n", vocab.label_names[majority].c_str(), 100 * baseline);

    // Save, load into a fresh model, and check that it tags the dev set exactly as the trained one.
    torch::save(model, o.model);
    BiLstmCrf loaded(int64_t(vocab.words.size()), int64_t(vocab.label_names.size()));
    torch::load(loaded, o.model);
    loaded->to(device);
    const bool same = torch::equal(evaluate(model, dev_batches).second, evaluate(loaded, dev_batches).second);
    std::printf("saved to %s and loaded back: %s\n", o.model.c_str(),
                same ? "the same dev predictions" : "DIFFERENT dev predictions");

    trellis::ConllSentence sentence;
    for (const char* w : {"The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "."})
      sentence.rows.push_back({w, vocab.label_names[majority]});
    torch::NoGradGuard no_grad;
    const torch::Tensor path = loaded->decode(make_batch({&sentence}, vocab, device)).cpu();
    for (std::size_t t = 0; t < sentence.rows.size(); ++t)
      std::printf("%s/%s ", sentence.rows[t][0].c_str(),
                  vocab.label_names[path[0][int64_t(t)].item<int64_t>()].c_str());
    std::printf("\n");

    if (o.check) {
      const bool fell = epoch_losses.back() < epoch_losses.front();
      if (!fell) std::fprintf(stderr, "check failed: the loss did not fall\n");
      if (!(accuracy > baseline)) std::fprintf(stderr, "check failed: dev accuracy is not above the baseline\n");
      if (!same) std::fprintf(stderr, "check failed: the loaded model tags differently\n");
      if (!fell || !(accuracy > baseline) || !same) return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
