#include "trellis/train/neural_tagger.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/rnn.h>
#include <torch/nn/utils/rnn.h>
#include <ATen/Context.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <string_view>
#include <thread>
#include <unordered_map>

#include "lib/src/io/input_file.h"
#include "lib/src/io/model_file.h"
#include "lib/src/train/training_start.h"
#include "trellis/io/atomic_file.h"
#include "trellis/io/chunk_eval.h"
#include "trellis/crf/linear_chain_crf.h"
#include "trellis/error.h"
#include "trellis/nn/crf.h"

namespace trellis {
namespace {

constexpr char kMagic[8] = {'T', 'R', 'E', 'L', 'N', 'C', 'R', '\n'};
constexpr uint32_t kFormatVersion = 1;
constexpr const char* kKind = "neural-crf";
constexpr int64_t kPad = 0, kUnknown = 1;        // ids in every vocabulary
constexpr int64_t kWordBegin = 2, kWordEnd = 3;  // character vocabulary: markers around each word
constexpr std::size_t kMaxWordChars = 50;        // longer tokens (URLs) are cut for the character model
// Padded tokens and sentences per batch when tagging: each batch costs the device a fixed time (the BiLSTM's steps
// over its longest sentence, kernel launches), so a file is best cut into few of them.
constexpr int64_t kTagTokens = 65536;
constexpr int64_t kTagSentences = 8192;
// Characters per pass of the character BiLSTM over a tagging call's distinct words (its outputs take 2H floats each).
constexpr int64_t kCharTableCells = int64_t{1} << 19;
constexpr int64_t kDefaultWordDim = 100;  // without pretrained vectors

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------------------------------
// Text: code points, lowercase, shape.

// The UTF-8 code points of a word (a stray byte counts as one).
std::vector<std::string_view> code_points(const std::string& word) {
  std::vector<std::string_view> out;
  for (std::size_t i = 0; i < word.size();) {
    const auto c = static_cast<unsigned char>(word[i]);
    std::size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    n = std::min(n, word.size() - i);
    out.emplace_back(word.data() + i, n);
    i += n;
  }
  return out;
}

// ASCII lowercase: the word embeddings are shared by a word's capitalisations (the characters and the shape keep them).
std::string lowercase(const std::string& word) {
  std::string s = word;
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

// "Xx" for "Hello", "d,d" for "1,000", "xXxd" for "iPhone7": classes of characters with runs collapsed.
std::string word_shape(const std::string& word) {
  std::string s;
  for (const std::string_view cp : code_points(word)) {
    const char c = cp[0];
    const char cls = cp.size() > 1            ? 'u'
                     : (c >= 'A' && c <= 'Z') ? 'X'
                     : (c >= 'a' && c <= 'z') ? 'x'
                     : (c >= '0' && c <= '9') ? 'd'
                                              : c;
    if (s.empty() || s.back() != cls) s.push_back(cls);
  }
  return s;
}

std::string show(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::ostringstream s;
  s.precision(17);
  s << v;
  return s.str();
}

// A string -> id map whose ids 0 and 1 are padding and unknown.
class Vocabulary {
 public:
  Vocabulary() : Vocabulary({"<pad>", "<unk>"}) {}
  explicit Vocabulary(std::vector<std::string> items) : items_(std::move(items)) {
    for (std::size_t i = 0; i < items_.size(); ++i) ids_.emplace(items_[i], static_cast<int64_t>(i));
  }
  int64_t add(const std::string& s) {
    const auto [it, fresh] = ids_.emplace(s, static_cast<int64_t>(items_.size()));
    if (fresh) items_.push_back(s);
    return it->second;
  }
  int64_t find(std::string_view s, int64_t missing = kUnknown) const {
    // The key in a reused buffer: tagging looks up dozens of sparse features per token, on every thread.
    thread_local std::string key;
    key.assign(s.data(), s.size());
    const auto it = ids_.find(key);
    return it == ids_.end() ? missing : it->second;
  }
  bool unique() const { return ids_.size() == items_.size(); }
  int64_t size() const { return static_cast<int64_t>(items_.size()); }
  const std::vector<std::string>& items() const { return items_; }

 private:
  std::vector<std::string> items_;
  std::unordered_map<std::string, int64_t> ids_;
};

// ---------------------------------------------------------------------------------------------------------------
// The network.

struct Architecture {
  SentenceEncoder encoder = SentenceEncoder::BiLstm;
  CharEncoder char_encoder = CharEncoder::BiLstm;
  int64_t words = 0, word_dim = 0, chars = 0, char_dim = 0, char_filters = 0, shapes = 0, feature_dim = 0;
  std::vector<int64_t> extra;                                // vocabulary size of each extra input column
  int64_t hidden = 0, layers = 0, labels = 0, features = 0;  // features: hybrid sparse features (0: none)
  double dropout = 0;
  // Dropout masks drawn per sentence (the same at every position) instead of per token. A BiLSTM of several layers
  // then runs as one module per layer, so that the masks between layers are drawn here and not inside cuDNN.
  bool sentence_masks = false;
};

// How many numbers NetworkImpl(a) holds (a double: hyper-parameters read from a file may imply more than int64_t
// can count), so that a model file's architecture is checked against the file's size before any of it is allocated.
// NeuralTagger::load checks it against the network it builds, so the two cannot drift apart.
double parameter_count(const Architecture& a) {
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  // A bidirectional LSTM layer: per direction, input and recurrent weights of 4h gates and their two biases.
  const auto bilstm_layer = [&](double input, double h) { return 2 * (4 * h * input + 4 * h * h + 8 * h); };
  double n = d(a.words) * d(a.word_dim) + d(a.shapes) * d(a.feature_dim);
  for (int64_t v : a.extra) n += d(v) * d(a.feature_dim);
  double input = d(a.word_dim) + d(a.feature_dim) * d(1 + static_cast<int64_t>(a.extra.size()));
  if (a.char_dim > 0) {
    n += d(a.chars) * d(a.char_dim);
    if (a.char_encoder == CharEncoder::BiLstm) {
      n += bilstm_layer(d(a.char_dim), d(a.char_filters));
      input += 2 * d(a.char_filters);
    } else {
      n += d(a.char_filters) * d(a.char_dim) * 3 + d(a.char_filters);
      input += d(a.char_filters);
    }
  }
  const double encoded = 2 * d(a.hidden);
  if (a.encoder == SentenceEncoder::BiLstm) {
    n += bilstm_layer(input, d(a.hidden)) + d(a.layers - 1) * bilstm_layer(encoded, d(a.hidden));
  } else {
    n += input * encoded * 3 + encoded + d(a.layers) * (encoded * encoded * 3 + encoded);
  }
  n += encoded * d(a.labels) + d(a.labels) + d(a.features) * d(a.labels);
  return n + d(a.labels) * d(a.labels) + 2 * d(a.labels);  // the CRF's transitions, start and end
}

// A batch on the model's device, its rows sorted by length, longest first (as packing the BiLSTM's input needs).
// Token-level tensors list the real tokens row after row; positions maps them into the padded [B,T] layout.
struct Batch {
  int64_t B = 0, T = 0, N = 0;
  std::vector<std::size_t> rows;   // the index, among the sentences given, of each row
  at::Tensor words, shapes;        // [B,T] int64
  std::vector<at::Tensor> extra;   // [B,T] int64 each
  at::Tensor chars, char_lengths;  // [N,L], [N] int64: the tokens' characters, the longest word first
  at::Tensor char_lengths_cpu;     // the same on the CPU (the character BiLSTM packs by it)
  at::Tensor char_table;      // tagging with a character BiLSTM: the call's table [U,2H]; chars then [N], rows in it
  at::Tensor char_positions;  // [N] int64: b*T + t of each row of chars
  at::Tensor positions;       // [N] int64: b*T + t of each token
  at::Tensor mask;            // [B,T] bool
  at::Tensor lengths;         // [B] int64, on the CPU (packing reads it there)
  // Tagging with a BiLSTM encoder: b*T + t of each token time-major (step t: the rows longer than t), [N] on the
  // device, and the rows at each step [T] on the CPU, to pack the encoder's input without a copy per step.
  at::Tensor packed_positions, step_sizes;
  at::Tensor device_lengths;                // [B] int64 on the device
  at::Tensor tags;                          // [B,T] int64 (0 at padding); undefined without labels
  at::Tensor feature_ids, feature_offsets;  // hybrid: [nnz], [N]
};

// Turns autocast to bfloat16 on for the CUDA operations in its scope (or nothing when off).
class Bf16Autocast {
 public:
  explicit Bf16Autocast(bool on) : on_(on) {
    if (!on_) return;
    was_enabled_ = at::autocast::is_autocast_enabled(at::kCUDA);
    was_dtype_ = at::autocast::get_autocast_dtype(at::kCUDA);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~Bf16Autocast() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCUDA, was_enabled_);
    at::autocast::set_autocast_dtype(at::kCUDA, was_dtype_);
  }
  Bf16Autocast(const Bf16Autocast&) = delete;
  Bf16Autocast& operator=(const Bf16Autocast&) = delete;

 private:
  bool on_, was_enabled_ = false;
  at::ScalarType was_dtype_ = at::kBFloat16;
};

// Autocast off for the operations in its scope (the LSTM: LibTorch's autocast would run cuDNN's RNN in float16).
class NoAutocast {
 public:
  NoAutocast() : was_(at::autocast::is_autocast_enabled(at::kCUDA)) {
    at::autocast::set_autocast_enabled(at::kCUDA, false);
  }
  ~NoAutocast() { at::autocast::set_autocast_enabled(at::kCUDA, was_); }
  NoAutocast(const NoAutocast&) = delete;
  NoAutocast& operator=(const NoAutocast&) = delete;

 private:
  bool was_;
};

class NetworkImpl : public torch::nn::Module {
 public:
  explicit NetworkImpl(const Architecture& a) : arch(a) {
    const auto uniform_rows = [](torch::nn::Embedding& e) {
      c10::NoGradGuard no_grad;
      const double r = std::sqrt(3.0 / static_cast<double>(e->options.embedding_dim()));
      e->weight.uniform_(-r, r);
      e->weight[kPad].zero_();
    };
    int64_t input = a.word_dim + a.feature_dim * (1 + static_cast<int64_t>(a.extra.size()));
    word_embedding = register_module(
        "word_embedding", torch::nn::Embedding(torch::nn::EmbeddingOptions(a.words, a.word_dim).padding_idx(kPad)));
    uniform_rows(word_embedding);
    shape_embedding =
        register_module("shape_embedding",
                        torch::nn::Embedding(torch::nn::EmbeddingOptions(a.shapes, a.feature_dim).padding_idx(kPad)));
    uniform_rows(shape_embedding);
    extra_embeddings = register_module("extra_embeddings", torch::nn::ModuleList());
    for (int64_t v : a.extra) {
      torch::nn::Embedding e(torch::nn::EmbeddingOptions(v, a.feature_dim).padding_idx(kPad));
      uniform_rows(e);
      extra_embeddings->push_back(e);
    }
    if (a.char_dim > 0) {
      char_embedding = register_module(
          "char_embedding", torch::nn::Embedding(torch::nn::EmbeddingOptions(a.chars, a.char_dim).padding_idx(kPad)));
      uniform_rows(char_embedding);
      if (a.char_encoder == CharEncoder::BiLstm) {
        char_lstm = register_module(
            "char_lstm",
            torch::nn::LSTM(torch::nn::LSTMOptions(a.char_dim, a.char_filters).bidirectional(true).batch_first(true)));
        input += 2 * a.char_filters;
      } else {
        char_conv = register_module(
            "char_conv", torch::nn::Conv1d(torch::nn::Conv1dOptions(a.char_dim, a.char_filters, 3).padding(1)));
        input += a.char_filters;
      }
    }
    int64_t encoded = 2 * a.hidden;
    if (a.encoder == SentenceEncoder::BiLstm && a.sentence_masks && a.layers > 1) {
      lstm_layers = register_module("lstm_layers", torch::nn::ModuleList());
      for (int64_t l = 0; l < a.layers; ++l)
        lstm_layers->push_back(torch::nn::LSTM(
            torch::nn::LSTMOptions(l == 0 ? input : encoded, a.hidden).bidirectional(true).batch_first(true)));
    } else if (a.encoder == SentenceEncoder::BiLstm) {
      lstm = register_module("lstm", torch::nn::LSTM(torch::nn::LSTMOptions(input, a.hidden)
                                                         .num_layers(a.layers)
                                                         .bidirectional(true)
                                                         .batch_first(true)
                                                         .dropout(a.layers > 1 ? a.dropout : 0.0)));
    } else {
      convolutions = register_module("convolutions", torch::nn::ModuleList());
      convolutions->push_back(torch::nn::Conv1d(torch::nn::Conv1dOptions(input, encoded, 3).padding(1)));
      for (int64_t l = 0; l < a.layers; ++l) {
        const int64_t dilation = int64_t{1} << l;
        convolutions->push_back(
            torch::nn::Conv1d(torch::nn::Conv1dOptions(encoded, encoded, 3).padding(dilation).dilation(dilation)));
      }
    }
    output = register_module("output", torch::nn::Linear(encoded, a.labels));
    if (a.features > 0) hybrid_weights = register_parameter("hybrid_weights", at::zeros({a.features, a.labels}));
    crf = register_module("crf", trellis::nn::CRF(a.labels));
  }

  at::Tensor dropout(const at::Tensor& x) {
    return torch::nn::functional::dropout(
        x, torch::nn::functional::DropoutFuncOptions().p(arch.dropout).training(is_training()));
  }

  // Masks of kept units (scaled by 1/keep) for dropout on a tensor of `shape`.
  at::Tensor keep_mask(at::IntArrayRef shape, const at::TensorOptions& options) const {
    const double keep = 1.0 - arch.dropout;
    return at::empty(shape, options).bernoulli_(keep).div_(keep);
  }
  bool sentence_dropout() const { return arch.sentence_masks && is_training() && arch.dropout > 0; }

  // Dropout on x, whose dimension 0 is the sentence and `position_dim` the position in it: with sentence masks a
  // unit is dropped at every position of its sentence or at none.
  at::Tensor sequence_dropout(const at::Tensor& x, int64_t position_dim) {
    if (!sentence_dropout()) return dropout(x);
    std::vector<int64_t> shape = x.sizes().vec();
    shape[position_dim] = 1;
    return x * keep_mask(shape, x.options());
  }

  // The BiLSTM's output rows [N,2H] over packed input rows `data` [N,D] (`steps`: rows per step, on the CPU).
  // `row_sentence` [N], the sentence of each row, is read only with sentence masks in training.
  at::Tensor encode_packed(at::Tensor data, const at::Tensor& steps, const at::Tensor& row_sentence,
                           int64_t sentences) {
    namespace rnn = torch::nn::utils::rnn;
    if (lstm) return std::get<0>(lstm->forward_with_packed_input(rnn::PackedSequence(data, steps))).data();
    for (std::size_t l = 0; l < lstm_layers->size(); ++l) {
      if (l > 0 && sentence_dropout())
        data = data * keep_mask({sentences, data.size(1)}, data.options()).index_select(0, row_sentence);
      data = std::get<0>(
                 lstm_layers[l]->as<torch::nn::LSTM>()->forward_with_packed_input(rnn::PackedSequence(data, steps)))
                 .data();
    }
    return data;
  }

  // Emission scores [B,T,K], float32 (the encoder in bfloat16 under `bf16`).
  at::Tensor emissions(const Batch& b, bool bf16) {
    const at::Tensor scores = network_scores(b, bf16);
    return hybrid_weights.defined() ? with_sparse_scores(scores, b) : scores;
  }

  // The network's emission scores [B,T,K], float32, without a hybrid's sparse feature weights.
  at::Tensor network_scores(const Batch& b, bool bf16) {
    at::Tensor scores;
    {
      const Bf16Autocast autocast(bf16);
      std::vector<at::Tensor> parts{word_embedding(b.words), shape_embedding(b.shapes)};
      for (std::size_t i = 0; i < b.extra.size(); ++i)
        parts.push_back(extra_embeddings[i]->as<torch::nn::Embedding>()->forward(b.extra[i]));
      if (arch.char_dim > 0) {
        // Max over each word's own characters only: padding would make a token's representation depend on the
        // longest word of its batch.
        at::Tensor c;
        if (b.char_table.defined()) {
          c = b.char_table.index_select(0, b.chars);  // [N,2H]
        } else if (char_lstm) {
          // The last states of both directions over each word's own characters.
          const NoAutocast fp32;
          namespace rnn = torch::nn::utils::rnn;
          const auto packed = rnn::pack_padded_sequence(dropout(char_embedding(b.chars)), b.char_lengths_cpu,
                                                        /*batch_first=*/true, /*enforce_sorted=*/true);
          const at::Tensor last = std::get<0>(std::get<1>(char_lstm->forward_with_packed_input(packed)));  // [2,N,H]
          c = at::cat({last[0], last[1]}, 1);                                                              // [N,2H]
        } else {
          c = char_conv(dropout(char_embedding(b.chars)).transpose(1, 2));  // [N,F,L]
          const at::Tensor past_end =
              at::arange(c.size(2), b.char_lengths.options()).unsqueeze(0).ge(b.char_lengths.unsqueeze(1));
          c = c.masked_fill(past_end.unsqueeze(1), -std::numeric_limits<float>::infinity()).amax(2);  // [N,F]
        }
        parts.push_back(
            at::zeros({b.B * b.T, c.size(1)}, c.options()).index_copy(0, b.char_positions, c).view({b.B, b.T, -1}));
      }
      for (auto& p : parts) p = p.to(at::kFloat);
      at::Tensor x = sequence_dropout(at::cat(parts, 2), 1);
      at::Tensor h;
      if (arch.encoder == SentenceEncoder::BiLstm) {
        const NoAutocast fp32;
        namespace rnn = torch::nn::utils::rnn;
        if (b.packed_positions.defined()) {
          // Packed and unpacked as pack_padded_sequence and pad_packed_sequence do, by one gather and one scatter.
          const at::Tensor out =
              encode_packed(x.reshape({b.B * b.T, x.size(2)}).index_select(0, b.packed_positions), b.step_sizes,
                            sentence_dropout() ? at::floor_divide(b.packed_positions, b.T) : at::Tensor(), b.B);
          h = at::zeros({b.B * b.T, out.size(1)}, out.options())
                  .index_copy(0, b.packed_positions, out)
                  .view({b.B, b.T, out.size(1)});
        } else {
          const auto packed = rnn::pack_padded_sequence(x, b.lengths, /*batch_first=*/true, /*enforce_sorted=*/true);
          at::Tensor row_sentence;
          if (lstm_layers && sentence_dropout())
            row_sentence = rnn::pack_padded_sequence(
                               at::arange(b.B, b.words.options()).unsqueeze(1).expand({b.B, b.T}).contiguous(),
                               b.lengths, /*batch_first=*/true, /*enforce_sorted=*/true)
                               .data();
          const at::Tensor out = encode_packed(packed.data(), packed.batch_sizes(), row_sentence, b.B);
          h = std::get<0>(rnn::pad_packed_sequence(rnn::PackedSequence(out, packed.batch_sizes()),
                                                   /*batch_first=*/true, 0.0, b.T));
        }
      } else {
        // Padding positions are zero after every layer, so a token's receptive field reads zeros past its sentence
        // whatever the batch.
        const at::Tensor keep = b.mask.unsqueeze(1).to(x.scalar_type());  // [B,1,T]
        h = at::relu(convolutions[0]->as<torch::nn::Conv1d>()->forward(x.transpose(1, 2))) * keep;
        for (std::size_t l = 1; l < convolutions->size(); ++l)
          h = h + sequence_dropout(at::relu(convolutions[l]->as<torch::nn::Conv1d>()->forward(h)), 2) * keep;
        h = h.transpose(1, 2);
      }
      scores = output(sequence_dropout(h, 1)).to(at::kFloat);
    }
    return scores;
  }

  // The character BiLSTM's last states of both directions [n,2H] over words packed as it reads them: `chars` the
  // characters time-major, longest word first, `batch_sizes` (on the CPU) the words at each step.
  at::Tensor packed_char_states(const at::Tensor& chars, const at::Tensor& batch_sizes) {
    const torch::nn::utils::rnn::PackedSequence packed(dropout(char_embedding(chars)), batch_sizes);
    const at::Tensor last = std::get<0>(std::get<1>(char_lstm->forward_with_packed_input(packed)));  // [2,n,H]
    return at::cat({last[0], last[1]}, 1);
  }

  // `scores` plus the hybrid's sparse feature weights of the batch's tokens.
  at::Tensor with_sparse_scores(const at::Tensor& scores, const Batch& b) {
    const at::Tensor sparse = std::get<0>(at::embedding_bag(hybrid_weights, b.feature_ids, b.feature_offsets));
    return scores + at::zeros({b.B * b.T, arch.labels}, scores.options())
                        .index_copy(0, b.positions, sparse)
                        .view({b.B, b.T, arch.labels});
  }

  Architecture arch;
  torch::nn::Embedding word_embedding{nullptr}, shape_embedding{nullptr}, char_embedding{nullptr};
  torch::nn::ModuleList extra_embeddings{nullptr}, convolutions{nullptr}, lstm_layers{nullptr};
  torch::nn::Conv1d char_conv{nullptr};
  torch::nn::LSTM lstm{nullptr}, char_lstm{nullptr};
  torch::nn::Linear output{nullptr};
  at::Tensor hybrid_weights;
  trellis::nn::CRF crf{nullptr};
};
TORCH_MODULE(Network);

// A sentence as the network's ids.
struct EncodedSentence {
  std::vector<int64_t> words, shapes, chars, char_counts, tags, feature_ids, feature_counts;
  std::vector<std::vector<int64_t>> extra;  // [column][token]
  std::size_t size() const { return words.size(); }
};

}  // namespace

// ---------------------------------------------------------------------------------------------------------------

struct NeuralTagger::Impl {
  class ChunkedSentences;
  NeuralTaggerOptions options;
  std::vector<std::string> labels;
  std::unordered_map<std::string, int64_t> label_ids;
  std::size_t input_columns = 0;
  ColumnLayout layout;
  Vocabulary words, shapes, chars{{"<pad>", "<unk>", "<w>", "</w>"}};
  std::vector<Vocabulary> extra;     // input columns 1.. (column 0 is the word)
  std::vector<int64_t> word_counts;  // training occurrences per word id (training only)
  std::unique_ptr<FeatureExtractor> hybrid;
  Vocabulary features{std::vector<std::string>{}};  // hybrid's sparse features (no padding or unknown entries)
  std::string scheme = "none";                      // "BIO", "BIOES": decoding keeps to the chunk scheme of the labels
  mutable Network net{nullptr};                     // LibTorch's forward() methods are not const
  at::Device device = at::kCPU;
  bool bf16 = false;

  Architecture architecture() const {
    Architecture a;
    a.encoder = options.encoder;
    a.words = words.size();
    a.word_dim = options.word_dim;
    a.chars = chars.size();
    a.char_dim = options.char_dim;
    a.char_filters = options.char_filters;
    a.char_encoder = options.char_encoder;
    a.shapes = shapes.size();
    a.feature_dim = options.feature_dim;
    for (const auto& v : extra) a.extra.push_back(v.size());
    a.hidden = options.hidden;
    a.layers = options.layers;
    a.labels = static_cast<int64_t>(labels.size());
    a.features = hybrid ? features.size() : 0;
    a.dropout = options.dropout;
    a.sentence_masks = options.variational_dropout;
    return a;
  }

  void build_network() {
    net = Network(architecture());
    if (scheme != "none") net->crf->set_constraints(labels, scheme == "BIO" ? TagScheme::BIO : TagScheme::BIOES);
  }

  void set_labels(std::vector<std::string> l) {
    labels = std::move(l);
    label_ids.clear();
    for (std::size_t i = 0; i < labels.size(); ++i)
      if (!label_ids.emplace(labels[i], static_cast<int64_t>(i)).second)
        throw Error("duplicate label '" + labels[i] + "'");
  }

  int64_t label_id(const std::string& l) const {
    const auto it = label_ids.find(l);
    return it == label_ids.end() ? -1 : it->second;
  }

  // Where token `t` of sentence `index` is, for messages: `source`:line when the line is known.
  static std::string position(std::size_t index, std::size_t t, const std::string& source, std::size_t first_line) {
    return source.empty() || first_line == 0 ? "sentence " + std::to_string(index) + ", token " + std::to_string(t)
                                             : source + ":" + std::to_string(first_line + t);
  }

  // Checks sentence `index` (for messages) before it is encoded: not empty, as many labels as tokens when `gold` is
  // given, input_columns columns in every row.
  void check(const TokenRows& rows, const std::vector<std::string>* gold, std::size_t index,
             const std::string& source = "", std::size_t first_line = 0) const {
    if (rows.empty()) throw Error("sentence " + std::to_string(index) + " is empty");
    if (gold && gold->size() != rows.size())
      throw Error("sentence " + std::to_string(index) + ": " + std::to_string(rows.size()) + " tokens but " +
                  std::to_string(gold->size()) + " labels");
    for (std::size_t t = 0; t < rows.size(); ++t)
      if (rows[t].size() != input_columns)
        throw Error(position(index, t, source, first_line) + ": expected " + std::to_string(input_columns) +
                    " input columns, found " + std::to_string(rows[t].size()));
  }

  // The ids the encoder network reads of a checked sentence (words, shapes, extra columns, characters) and, with
  // `gold`, its label ids; an unknown label is an Error naming `source` and the line when known.
  void encode_ids(const TokenRows& rows, const std::vector<std::string>* gold, std::size_t index,
                  const std::string& source, std::size_t first_line, EncodedSentence& e) const {
    e.extra.resize(extra.size());
    for (std::size_t t = 0; t < rows.size(); ++t) {
      const auto& row = rows[t];
      e.words.push_back(words.find(lowercase(row[0])));
      e.shapes.push_back(shapes.find(word_shape(row[0])));
      for (std::size_t c = 0; c < extra.size(); ++c) e.extra[c].push_back(extra[c].find(row[c + 1]));
      const auto cps = code_points(row[0]);
      const std::size_t n = std::min(cps.size(), kMaxWordChars);
      e.chars.push_back(kWordBegin);
      for (std::size_t i = 0; i < n; ++i) e.chars.push_back(chars.find(cps[i]));
      e.chars.push_back(kWordEnd);
      e.char_counts.push_back(static_cast<int64_t>(n + 2));
      if (gold) {
        const int64_t y = label_id((*gold)[t]);
        if (y < 0) {
          if (!source.empty() && first_line > 0)
            throw ParseError(source, first_line + t, "label '" + (*gold)[t] + "' does not occur in the training data");
          throw Error(position(index, t, source, first_line) + ": label '" + (*gold)[t] + "' was not seen in training");
        }
        e.tags.push_back(y);
      }
    }
  }

  // The hybrid's sparse feature ids of a checked sentence.
  void encode_features(const TokenRows& rows, EncodedSentence& e) const {
    FeatureList feats;
    for (std::size_t t = 0; t < rows.size(); ++t) {
      feats.clear();
      hybrid->extract(rows, t, feats);
      const std::size_t before = e.feature_ids.size();
      for (const std::string_view f : feats)
        if (const int64_t id = features.find(f, -1); id >= 0) e.feature_ids.push_back(id);
      e.feature_counts.push_back(static_cast<int64_t>(e.feature_ids.size() - before));
    }
  }

  // Sentence `index` (for messages) as ids; unknown labels are an Error naming `source` and the line when known.
  EncodedSentence encode(const TokenRows& rows, const std::vector<std::string>* gold, std::size_t index,
                         const std::string& source = "", std::size_t first_line = 0) const {
    check(rows, gold, index, source, first_line);
    EncodedSentence e;
    encode_ids(rows, gold, index, source, first_line, e);
    if (hybrid) encode_features(rows, e);
    return e;
  }

  std::vector<EncodedSentence> encode_all(const std::vector<const TokenRows*>& sentences,
                                          const std::vector<const std::vector<std::string>*>* gold,
                                          const std::string& source = "",
                                          const std::vector<std::size_t>* first_lines = nullptr) const {
    std::vector<EncodedSentence> out(sentences.size());
    at::parallel_for(0, static_cast<int64_t>(sentences.size()), 64, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s)
        out[s] = encode(*sentences[s], gold ? (*gold)[s] : nullptr, s, source,
                        first_lines && static_cast<std::size_t>(s) < first_lines->size() ? (*first_lines)[s] : 0);
    });
    return out;
  }

  // The sentences as one padded batch on the model's device, longest first. With a random generator, training words
  // become unknown with probability a/(a+c) (c: the word's training count). Every index goes to the device in one
  // copy from pinned memory that does not wait for the device, so the host prepares the next batch while the device
  // works on this one. A tagging batch (`tagging`) holds no sparse feature ids (add_feature_ids() sends them, so that
  // the network can start before they are extracted) and, given `char_rows` (each sentence's tokens' rows in the
  // call's character table, char_table()), those rows in place of the characters.
  Batch batch(const std::vector<const EncodedSentence*>& sentences, std::mt19937_64* word_dropout, bool tagging = false,
              const std::vector<const std::vector<int64_t>*>* char_rows = nullptr) const {
    Batch b;
    b.B = static_cast<int64_t>(sentences.size());
    b.rows.resize(sentences.size());
    std::iota(b.rows.begin(), b.rows.end(), 0);
    std::stable_sort(b.rows.begin(), b.rows.end(),
                     [&](std::size_t x, std::size_t y) { return sentences[x]->size() > sentences[y]->size(); });
    const bool with_features = hybrid && !tagging;
    int64_t L = 0;
    for (const auto* s : sentences) {
      b.T = std::max<int64_t>(b.T, s->size());
      b.N += static_cast<int64_t>(s->size());
      for (int64_t c : s->char_counts) L = std::max(L, c);
    }
    const bool labelled = !sentences.empty() && !sentences.front()->tags.empty();
    int64_t nnz = 0;
    if (with_features)
      for (const auto* s : sentences) nnz += static_cast<int64_t>(s->feature_ids.size());
    // One int64 buffer: words, shapes, extra columns and tags [B,T] each, chars [N,L] (or the char table's rows [N]),
    // char lengths, char positions, positions, offsets [N] each, lengths [B], feature ids [nnz], and tagging with a
    // BiLSTM encoder packed positions [N] and step sizes [T].
    const int64_t BT = b.B * b.T, E = static_cast<int64_t>(extra.size());
    const int64_t tag_cells = labelled ? BT : 0;
    const int64_t char_cells = char_rows ? b.N : b.N * L;
    const bool packed = tagging && options.encoder == SentenceEncoder::BiLstm;
    const int64_t packed_cells = packed ? b.N + b.T : 0;
    const int64_t total = BT * (2 + E) + tag_cells + char_cells + 4 * b.N + b.B + nnz + packed_cells;
    const bool pinned = device.is_cuda();
    const at::Tensor host = at::empty({total}, at::TensorOptions().dtype(at::kLong).pinned_memory(pinned));
    int64_t* const h = host.data_ptr<int64_t>();
    std::fill(h, h + BT * (2 + E) + tag_cells + char_cells, kPad);  // padding; tags 0 there
    int64_t* const w = h;
    int64_t* const sh = w + BT;
    int64_t* const ex = sh + BT;
    int64_t* const tags = ex + BT * E;
    int64_t* const ch = tags + tag_cells;
    int64_t* const chl = ch + char_cells;
    int64_t* const chp = chl + b.N;
    int64_t* const pos = chp + b.N;
    int64_t* const foff = pos + b.N;
    int64_t* const len = foff + b.N;
    int64_t* const fid = len + b.B;
    int64_t* const packed_positions = fid + nnz;
    int64_t* const step_sizes = packed_positions + (packed ? b.N : 0);
    // Rows of chars, longest word first (the character BiLSTM packs them so): token index, character count, offset.
    struct Word {
      int64_t token, count;
      const int64_t* chars;
    };
    std::vector<Word> word_rows;
    word_rows.reserve(b.N);
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    const double a = options.word_dropout;
    int64_t token = 0, features = 0;
    for (int64_t i = 0; i < b.B; ++i) {
      const EncodedSentence& s = *sentences[b.rows[i]];
      len[i] = static_cast<int64_t>(s.size());
      std::size_t c0 = 0, f0 = 0;
      for (std::size_t t = 0; t < s.size(); ++t, ++token) {
        const int64_t p = i * b.T + static_cast<int64_t>(t);
        int64_t word = s.words[t];
        if (word_dropout && a > 0 && word >= 2) {
          const double count =
              word < static_cast<int64_t>(word_counts.size()) ? static_cast<double>(word_counts[word]) : 0.0;
          if (uniform(*word_dropout) < a / (a + count)) word = kUnknown;
        }
        w[p] = word;
        sh[p] = s.shapes[t];
        for (int64_t c = 0; c < E; ++c) ex[c * BT + p] = s.extra[c][t];
        if (labelled) tags[p] = s.tags[t];
        if (char_rows) {
          ch[token] = (*(*char_rows)[b.rows[i]])[t];
          chl[token] = s.char_counts[t];
          chp[token] = p;
        } else {
          word_rows.push_back({token, s.char_counts[t], s.chars.data() + c0});
        }
        c0 += static_cast<std::size_t>(s.char_counts[t]);
        pos[token] = p;
        if (with_features) {
          foff[token] = features;
          const std::size_t n = static_cast<std::size_t>(s.feature_counts[t]);
          std::copy(s.feature_ids.begin() + f0, s.feature_ids.begin() + f0 + n, fid + features);
          f0 += n;
          features += static_cast<int64_t>(n);
        } else {
          foff[token] = 0;
        }
      }
    }
    if (packed) {
      int64_t out = 0, rows_at_step = b.B;
      for (int64_t t = 0; t < b.T; ++t) {
        while (len[rows_at_step - 1] <= t) --rows_at_step;
        step_sizes[t] = rows_at_step;
        for (int64_t i = 0; i < rows_at_step; ++i) packed_positions[out++] = i * b.T + t;
      }
    }
    if (!char_rows) {
      std::stable_sort(word_rows.begin(), word_rows.end(),
                       [](const Word& x, const Word& y) { return x.count > y.count; });
      for (int64_t r = 0; r < b.N; ++r) {
        std::copy(word_rows[r].chars, word_rows[r].chars + word_rows[r].count, ch + r * L);
        chl[r] = word_rows[r].count;
        chp[r] = pos[word_rows[r].token];
      }
    }
    const at::Tensor on_device = pinned ? host.to(device, /*non_blocking=*/true) : host.to(device);
    int64_t offset = 0;
    const auto take = [&](int64_t n) {
      const at::Tensor t = on_device.narrow(0, offset, n);
      offset += n;
      return t;
    };
    b.words = take(BT).view({b.B, b.T});
    b.shapes = take(BT).view({b.B, b.T});
    for (int64_t c = 0; c < E; ++c) b.extra.push_back(take(BT).view({b.B, b.T}));
    if (labelled) b.tags = take(BT).view({b.B, b.T});
    b.chars = char_rows ? take(char_cells) : take(char_cells).view({b.N, L});
    b.char_lengths = take(b.N);
    b.char_positions = take(b.N);
    b.positions = take(b.N);
    const at::Tensor offsets = take(b.N);
    b.device_lengths = take(b.B);
    const at::Tensor ids = take(nnz);
    if (packed) {
      b.packed_positions = take(b.N);
      b.step_sizes = host.narrow(0, step_sizes - h, b.T);
    }
    b.char_lengths_cpu = host.narrow(0, chl - h, b.N);
    b.lengths = host.narrow(0, len - h, b.B);
    b.mask = at::arange(b.T, b.device_lengths.options()).unsqueeze(0) < b.device_lengths.unsqueeze(1);
    if (with_features) {
      b.feature_ids = ids;
      b.feature_offsets = offsets;
    }
    return b;
  }

  // The character BiLSTM's representation of every distinct word (by its characters) of a tagging call, [U,2H] on
  // the device, and in `rows` each token's row, sentence by sentence. A pass of the BiLSTM runs as many steps as its
  // longest word has characters, so the call runs one pass (several only beyond kCharTableCells characters) instead
  // of one per chunk. Undefined without a character BiLSTM.
  at::Tensor char_table(ChunkedSentences& input, std::vector<std::vector<int64_t>>& rows) const {
    if (!net->char_lstm) return {};
    for (std::size_t k = 0; k < input.chunks().size(); ++k) input.wait_for(k, false);
    std::unordered_map<std::string_view, int64_t> distinct;
    std::vector<std::pair<const int64_t*, int64_t>> words;  // characters, count
    rows.assign(input.size(), {});
    for (std::size_t s = 0; s < input.size(); ++s) {
      const EncodedSentence& e = input.sentence(s);
      const int64_t* c = e.chars.data();
      for (std::size_t t = 0; t < e.size(); ++t) {
        const int64_t n = e.char_counts[t];
        const std::string_view key(reinterpret_cast<const char*>(c), static_cast<std::size_t>(n) * sizeof(int64_t));
        const auto [it, fresh] = distinct.emplace(key, static_cast<int64_t>(words.size()));
        if (fresh) words.emplace_back(c, n);
        rows[s].push_back(it->second);
        c += n;
      }
    }
    // Longest first, as the BiLSTM packs them.
    std::vector<int64_t> order(words.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t x, int64_t y) { return words[x].second > words[y].second; });
    at::Tensor table =
        at::empty({static_cast<int64_t>(words.size()), 2 * options.char_filters}, at::TensorOptions().device(device));
    const bool pinned = device.is_cuda();
    for (std::size_t p = 0; p < order.size();) {
      std::size_t q = p;
      int64_t cells = 0;
      while (q < order.size() && (q == p || cells + words[order[q]].second <= kCharTableCells))
        cells += words[order[q++]].second;
      const int64_t n = static_cast<int64_t>(q - p), L = words[order[p]].second;
      // One int64 buffer: the characters time-major (step s: character s of every word longer than s) [cells], each
      // word's row in the table [n], the words at each step [L] (read on the host).
      const at::Tensor host = at::empty({cells + n + L}, at::TensorOptions().dtype(at::kLong).pinned_memory(pinned));
      int64_t* const ch = host.data_ptr<int64_t>();
      int64_t* const destination = ch + cells;
      int64_t* const batch_sizes = destination + n;
      int64_t out = 0, at_step = n;
      for (int64_t step = 0; step < L; ++step) {
        while (words[order[p + at_step - 1]].second <= step) --at_step;
        batch_sizes[step] = at_step;
        for (int64_t r = 0; r < at_step; ++r) ch[out++] = words[order[p + r]].first[step];
      }
      for (int64_t r = 0; r < n; ++r) destination[r] = order[p + r];
      const at::Tensor on_device = pinned ? host.to(device, /*non_blocking=*/true) : host.to(device);
      table.index_copy_(0, on_device.narrow(0, cells, n),
                        net->packed_char_states(on_device.narrow(0, 0, cells), host.narrow(0, cells + n, L)));
      p = q;
    }
    return table;
  }

  // A tagging batch's sparse feature ids, in its token order, sent to the device as batch() sends the rest.
  void add_feature_ids(const std::vector<const EncodedSentence*>& sentences, Batch& b) const {
    int64_t nnz = 0;
    for (const auto* s : sentences) nnz += static_cast<int64_t>(s->feature_ids.size());
    const bool pinned = device.is_cuda();
    const at::Tensor host = at::empty({b.N + nnz}, at::TensorOptions().dtype(at::kLong).pinned_memory(pinned));
    int64_t* const offsets = host.data_ptr<int64_t>();
    int64_t* const ids = offsets + b.N;
    int64_t token = 0, features = 0;
    for (const std::size_t row : b.rows) {
      const EncodedSentence& s = *sentences[row];
      std::size_t f0 = 0;
      for (std::size_t t = 0; t < s.size(); ++t, ++token) {
        offsets[token] = features;
        const std::size_t n = static_cast<std::size_t>(s.feature_counts[t]);
        std::copy(s.feature_ids.begin() + f0, s.feature_ids.begin() + f0 + n, ids + features);
        f0 += n;
        features += static_cast<int64_t>(n);
      }
    }
    const at::Tensor on_device = pinned ? host.to(device, /*non_blocking=*/true) : host.to(device);
    b.feature_offsets = on_device.narrow(0, 0, b.N);
    b.feature_ids = on_device.narrow(0, b.N, nnz);
  }

  // The chain potentials of a batch for training and decoding: the batch's lengths need no check (and no wait for
  // the device), as the batch was built here.
  ChainPotentials potentials(const at::Tensor& emissions, const Batch& b, bool constrained) const {
    ChainPotentials p;
    p.emissions = emissions;
    p.transitions = net->crf->transitions;
    p.start = net->crf->start_transitions;
    p.end = net->crf->end_transitions;
    p.lengths = b.device_lengths;
    p.values_checked = true;
    if (!constrained || scheme == "none") return p;
    return constrain(p,
                     {net->crf->allowed_transitions.ne(0), net->crf->allowed_start.ne(0), net->crf->allowed_end.ne(0)});
  }

  // The sentences of one decode() or kbest() call, cut into chunks longest first: each chunk holds at most
  // kTagSentences sentences and kTagTokens padded tokens (fewer when `cell_bytes` per padded token would take it over
  // `max_bytes`). A chunk's first sentence sets its padded length and the BiLSTM's steps, so starting from the longest
  // puts the long tail into one chunk and leaves the short sentences few steps. Sentences given as rows are checked
  // first, then encoded on worker threads in the order the chunks are tagged: every chunk's network ids, then every
  // chunk's sparse feature ids, which the network reads last. The device thus starts on the first chunk while the
  // hybrid's features, most of the encoding, are still being extracted.
  class ChunkedSentences {
   public:
    // Sentences encoded already (the dev set during training).
    ChunkedSentences(std::vector<const EncodedSentence*> encoded, double cell_bytes, double max_bytes)
        : sentences_(std::move(encoded)) {
      std::vector<std::size_t> lengths;
      for (const auto* s : sentences_) lengths.push_back(s->size());
      plan(lengths, cell_bytes, max_bytes);
    }
    // Sentences to encode; a sentence that cannot be encoded is an Error naming the first such one.
    ChunkedSentences(const Impl& model, const std::vector<const TokenRows*>& rows, double cell_bytes, double max_bytes)
        : model_(&model), rows_(rows), encoded_(rows.size()) {
      std::vector<std::size_t> lengths;
      for (std::size_t s = 0; s < rows.size(); ++s) {
        model.check(*rows[s], nullptr, s);
        lengths.push_back(rows[s]->size());
      }
      for (const auto& e : encoded_) sentences_.push_back(&e);
      plan(lengths, cell_bytes, max_bytes);
      start_workers();
    }
    ~ChunkedSentences() { stop_workers(); }
    ChunkedSentences(const ChunkedSentences&) = delete;
    ChunkedSentences& operator=(const ChunkedSentences&) = delete;

    std::size_t size() const { return sentences_.size(); }
    const std::vector<std::vector<std::size_t>>& chunks() const { return chunks_; }
    const EncodedSentence& sentence(std::size_t s) const { return *sentences_[s]; }

    // Chunk k's sentences once their network ids (with `features`, their sparse feature ids too) are encoded; an
    // error a worker met is thrown here.
    std::vector<const EncodedSentence*> wait_for(std::size_t k, bool features) {
      if (!workers_.empty()) {
        std::unique_lock<std::mutex> lock(mutex_);
        done_.wait(lock, [&] { return error_ || (ids_left_[k] == 0 && (!features || features_left_[k] == 0)); });
        if (error_) std::rethrow_exception(error_);
      }
      std::vector<const EncodedSentence*> picked;
      for (const std::size_t s : chunks_[k]) picked.push_back(sentences_[s]);
      return picked;
    }

   private:
    // Sentences per task of a worker.
    static constexpr std::size_t kBlock = 64;
    struct Task {
      std::size_t chunk, begin, end;  // positions in the chunk
      bool features;                  // the sparse feature ids; else the network's ids
    };

    void plan(const std::vector<std::size_t>& lengths, double cell_bytes, double max_bytes) {
      std::vector<std::size_t> order(lengths.size());
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](std::size_t x, std::size_t y) { return lengths[x] > lengths[y]; });
      for (std::size_t i = 0; i < order.size();) {
        const double T = static_cast<double>(lengths[order[i]]);
        std::vector<std::size_t> chunk{order[i++]};
        while (i < order.size()) {
          const double padded = static_cast<double>(chunk.size() + 1) * T;
          if (static_cast<int64_t>(chunk.size()) >= kTagSentences || padded > kTagTokens ||
              padded * cell_bytes > max_bytes)
            break;
          chunk.push_back(order[i++]);
        }
        chunks_.push_back(std::move(chunk));
      }
    }

    void start_workers() {
      for (const bool features : {false, true}) {
        if (features && !model_->hybrid) break;
        for (std::size_t k = 0; k < chunks_.size(); ++k)
          for (std::size_t i = 0; i < chunks_[k].size(); i += kBlock)
            tasks_.push_back({k, i, std::min(chunks_[k].size(), i + kBlock), features});
      }
      ids_left_.assign(chunks_.size(), 0);
      features_left_.assign(chunks_.size(), 0);
      for (const Task& t : tasks_) ++(t.features ? features_left_ : ids_left_)[t.chunk];
      const std::size_t n = std::min<std::size_t>(tasks_.size(), std::max(1, at::get_num_threads()));
      try {
        for (std::size_t i = 0; i < n; ++i) workers_.emplace_back([this] { work(); });
      } catch (...) {
        stop_workers();
        throw;
      }
    }

    void work() {
      for (std::size_t i = next_++; i < tasks_.size() && !stop_; i = next_++) {
        const Task& t = tasks_[i];
        try {
          for (std::size_t j = t.begin; j < t.end; ++j) {
            const std::size_t s = chunks_[t.chunk][j];
            if (t.features) model_->encode_features(*rows_[s], encoded_[s]);
            else model_->encode_ids(*rows_[s], nullptr, s, "", 0, encoded_[s]);
          }
        } catch (...) {
          const std::lock_guard<std::mutex> lock(mutex_);
          if (!error_) error_ = std::current_exception();
          stop_ = true;
          done_.notify_all();
          return;
        }
        {
          const std::lock_guard<std::mutex> lock(mutex_);
          --(t.features ? features_left_ : ids_left_)[t.chunk];
        }
        done_.notify_all();
      }
    }

    void stop_workers() {
      stop_ = true;
      for (auto& w : workers_) w.join();
      workers_.clear();
    }

    const Impl* model_ = nullptr;
    std::vector<const TokenRows*> rows_;
    std::vector<EncodedSentence> encoded_;  // of rows_
    std::vector<const EncodedSentence*> sentences_;
    std::vector<std::vector<std::size_t>> chunks_;  // sentence indices
    std::vector<Task> tasks_;
    std::atomic<std::size_t> next_{0};
    std::atomic<bool> stop_{false};
    std::mutex mutex_;
    std::condition_variable done_;
    std::vector<std::size_t> ids_left_, features_left_;  // tasks not done, per chunk (under mutex_)
    std::exception_ptr error_;                           // the first a worker met (under mutex_)
    std::vector<std::thread> workers_;
  };

  // The characters' representations of a tagging call: a table of its distinct words and each token's row in it
  // (char_table()), or none where each chunk encodes its own (a character CNN).
  struct CharTable {
    at::Tensor table;
    std::vector<std::vector<int64_t>> rows;  // [sentence][token]
  };

  // Chunk k's emissions as a tagging batch. The network's scores are queued on the device before the chunk's sparse
  // features are waited for.
  at::Tensor emissions_of(ChunkedSentences& input, std::size_t k, const CharTable& chars, Batch* b) const {
    const std::vector<const EncodedSentence*> picked = input.wait_for(k, false);
    std::vector<const std::vector<int64_t>*> char_rows;
    if (chars.table.defined())
      for (const std::size_t s : input.chunks()[k]) char_rows.push_back(&chars.rows[s]);
    *b = batch(picked, nullptr, /*tagging=*/true, chars.table.defined() ? &char_rows : nullptr);
    b->char_table = chars.table;
    const at::Tensor scores = net->network_scores(*b, bf16);
    if (!net->hybrid_weights.defined()) return scores;
    add_feature_ids(input.wait_for(k, true), *b);
    return net->with_sparse_scores(scores, *b);
  }

  // Viterbi label ids of every sentence (and, with marginals, each chosen label's marginal and the sequence's
  // probability). Every chunk is queued on the device before the first result is read back, so the host builds a
  // chunk's batch while the device computes the ones before it.
  std::vector<TaggedSentence> decode(ChunkedSentences& input, bool with_marginals) const {
    c10::NoGradGuard no_grad;
    struct Decoded {
      std::vector<std::size_t> sentence;     // of each row
      at::Tensor path, chosen, probability;  // on the device until read back
    };
    std::vector<Decoded> decoded;
    CharTable chars;
    chars.table = char_table(input, chars.rows);
    for (std::size_t k = 0; k < input.chunks().size(); ++k) {
      const std::vector<std::size_t>& chunk = input.chunks()[k];
      Batch b;
      const at::Tensor e = emissions_of(input, k, chars, &b);
      Decoded d;
      for (std::size_t row : b.rows) d.sentence.push_back(chunk[row]);
      const ViterbiResult v = viterbi(potentials(e, b, /*constrained=*/true));
      d.path = v.path;
      if (with_marginals) {
        const Marginals m = net->crf->marginals(e, b.mask);
        d.chosen = m.nodes.gather(2, v.path.clamp_min(0).unsqueeze(2)).squeeze(2).to(at::kDouble);
        d.probability = (v.score - m.log_partition).exp().to(at::kDouble);
      }
      decoded.push_back(std::move(d));
    }
    std::vector<TaggedSentence> out(input.size());
    for (const Decoded& d : decoded) {
      const at::Tensor path = d.path.cpu();
      const auto P = path.accessor<int64_t, 2>();
      at::Tensor chosen, probability;
      if (with_marginals) chosen = d.chosen.cpu(), probability = d.probability.cpu();
      for (std::size_t i = 0; i < d.sentence.size(); ++i) {
        TaggedSentence& s = out[d.sentence[i]];
        // -1: decoding under the model's chunk scheme found no allowed path (labels such as I-X alone, which only a
        // crafted or corrupt model file holds; a trained model has O or B- labels to start with).
        if (P[i][0] < 0)
          throw Error("sentence " + std::to_string(d.sentence[i]) + ": the model allows no label sequence (its labels " +
                      "under the " + scheme + " chunk scheme forbid every path)");
        for (std::size_t t = 0; t < input.sentence(d.sentence[i]).size(); ++t) {
          s.labels.push_back(labels[P[i][t]]);
          if (with_marginals) s.marginals.push_back(chosen.accessor<double, 2>()[i][t]);
        }
        if (with_marginals) s.probability = probability.data_ptr<double>()[i];
      }
    }
    return out;
  }

  std::vector<std::vector<TaggedSentence>> kbest(const std::vector<const TokenRows*>& sentences, int64_t k) const {
    if (k < 1) throw Error("k-best tagging needs k >= 1, not " + std::to_string(k));
    c10::NoGradGuard no_grad;
    const double K = static_cast<double>(labels.size());
    const double cell = K * static_cast<double>(k) * (sizeof(int64_t) + sizeof(double));  // per padded token
    ChunkedSentences input(*this, sentences, cell, static_cast<double>(CrfTagger::kMaxKBestBytes));
    for (const auto* s : sentences)
      if (static_cast<double>(s->size()) * cell > static_cast<double>(CrfTagger::kMaxKBestBytes))
        throw Error(std::to_string(k) + "-best tables of a sentence of " + std::to_string(s->size()) + " tokens and " +
                    std::to_string(labels.size()) + " labels need more than the " +
                    std::to_string(CrfTagger::kMaxKBestBytes >> 20) + " MiB allowed: ask for fewer");
    std::vector<std::vector<TaggedSentence>> out(sentences.size());
    CharTable chars;
    chars.table = char_table(input, chars.rows);
    for (std::size_t c = 0; c < input.chunks().size(); ++c) {
      const std::vector<std::size_t>& chunk = input.chunks()[c];
      Batch b;
      const at::Tensor e = emissions_of(input, c, chars, &b);
      const KBestResult kb = net->crf->kbest(e, k, b.mask);
      const at::Tensor prob =
          (kb.scores.cpu() - net->crf->log_partition(e, b.mask).cpu().unsqueeze(1)).exp().to(at::kDouble);
      const at::Tensor paths = kb.paths.cpu();
      const auto Pa = paths.accessor<int64_t, 3>();
      const auto Pr = prob.accessor<double, 2>();
      for (std::size_t i = 0; i < chunk.size(); ++i) {
        const std::size_t sentence = chunk[b.rows[i]];
        std::vector<TaggedSentence> alternatives;
        for (int64_t n = 0; n < k && Pa[i][n][0] >= 0; ++n) {
          TaggedSentence s;
          for (std::size_t t = 0; t < input.sentence(sentence).size(); ++t) s.labels.push_back(labels[Pa[i][n][t]]);
          s.probability = Pr[i][n];
          alternatives.push_back(std::move(s));
        }
        out[sentence] = std::move(alternatives);
      }
    }
    return out;
  }

  void move_to(const at::Device& d, EncoderPrecision precision) {
    encoder_precision_name(precision);  // a value outside the enumeration is an Error
    if (precision == EncoderPrecision::Bf16 && !d.is_cuda())
      throw Error("--precision bf16 needs --device cuda (the CPU runs fp32)");
    net->to(d);
    device = d;
    bf16 = d.is_cuda() && precision != EncoderPrecision::Fp32;
  }

  std::string hyperparameters() const {
    std::ostringstream s;
    s << "encoder=" << sentence_encoder_name(options.encoder) << "\nword_dim=" << options.word_dim
      << "\nchar_dim=" << options.char_dim << "\nchar_filters=" << options.char_filters
      << "\nchar_encoder=" << char_encoder_name(options.char_encoder) << "\nfeature_dim=" << options.feature_dim
      << "\nhidden=" << options.hidden << "\nlayers=" << options.layers << "\ndropout=" << show(options.dropout)
      << "\ndropout_masks=" << (options.variational_dropout ? "sentence" : "token") << "\nscheme=" << scheme << "\n";
    return s.str();
  }
};

namespace {

// "BIO" or "BIOES" when every label is O or a chunk label of that scheme, "none" otherwise.
std::string chunk_scheme(const std::vector<std::string>& labels) {
  bool chunk = false, bioes = false;
  for (const auto& l : labels) {
    if (l == "O") continue;
    if (l.size() < 3 || l[1] != '-') return "none";
    const char p = l[0];
    if (p == 'E' || p == 'S') bioes = true;
    else if (p != 'B' && p != 'I') return "none";
    chunk = true;
  }
  return chunk ? (bioes ? "BIOES" : "BIO") : "none";
}

void check_options(const NeuralTaggerOptions& o) {
  // Values outside the enumerations are Errors.
  sentence_encoder_name(o.encoder);
  char_encoder_name(o.char_encoder);
  encoder_precision_name(o.precision);
  const auto at_least = [](int64_t v, int64_t least, const char* flag) {
    if (v < least)
      throw Error(std::string(flag) + " must be at least " + std::to_string(least) + ", not " + std::to_string(v));
  };
  const auto probability = [](double v, const char* flag) {
    if (!std::isfinite(v) || v < 0 || v >= 1) throw Error(std::string(flag) + " must be in [0, 1), not " + show(v));
  };
  // Widths beyond any tagger's (and beyond memory long before): refused by name, not by the allocator's message.
  const auto in_range = [&](int64_t v, int64_t least, const char* flag) {
    at_least(v, least, flag);
    constexpr int64_t kWidest = 16384;
    if (v > kWidest)
      throw Error(std::string(flag) + " must be at most " + std::to_string(kWidest) + ", not " + std::to_string(v));
  };
  in_range(o.word_dim, 0, "--embedding-dim");
  in_range(o.char_dim, 0, "--char-dim");
  if (o.char_dim > 0) in_range(o.char_filters, 1, "--char-filters");
  in_range(o.feature_dim, 1, "--feature-dim");
  in_range(o.hidden, 1, "--hidden");
  at_least(o.layers, 1, "--layers");
  if (o.encoder == SentenceEncoder::BiLstm && o.layers > 8)
    throw Error("--layers must be at most 8, not " + std::to_string(o.layers));
  if (o.encoder == SentenceEncoder::Cnn && o.layers > 16)
    throw Error("--layers must be at most 16 for --encoder cnn, not " + std::to_string(o.layers));
  probability(o.dropout, "--dropout");
  if (!std::isfinite(o.word_dropout) || o.word_dropout < 0)
    throw Error("--word-dropout must be a finite number >= 0, not " + show(o.word_dropout));
  at_least(o.epochs, 1, "--epochs");
  if (o.batch_size < 1 || o.batch_size > (std::size_t{1} << 31))
    throw Error("--batch-size must be at least 1, not " + std::to_string(static_cast<int64_t>(o.batch_size)));
  if (!std::isfinite(o.learning_rate) || o.learning_rate <= 0)
    throw Error("--lr must be a finite number > 0, not " + show(o.learning_rate));
  if (!std::isfinite(o.beta2) || o.beta2 < 0 || o.beta2 >= 1)
    throw Error("--beta2 must be in [0, 1), not " + show(o.beta2));
  probability(o.average, "--average");
  if (!std::isfinite(o.lr_decay) || o.lr_decay <= 0 || o.lr_decay > 1)
    throw Error("--lr-decay must be in (0, 1], not " + show(o.lr_decay));
  if (!std::isfinite(o.clip) || o.clip < 0)
    throw Error("--clip must be a finite number >= 0 (0: off), not " + show(o.clip));
  at_least(o.patience, 0, "--patience");
  at_least(o.threads, 0, "--threads");
  at_least(o.min_feature_count, 1, "--min-freq");
  if (!std::isfinite(o.c2) || o.c2 < 0) throw Error("--c2 must be a finite number >= 0, not " + show(o.c2));
}

// Scales the gradients so that their joint norm is at most max_norm, as torch::nn::utils::clip_grad_norm_ does, but
// without reading the norm back to the host (which would wait for the device every step).
void clip_gradient_norm(const std::vector<at::Tensor>& parameters, double max_norm) {
  std::vector<at::Tensor> grads;
  for (const auto& p : parameters)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return;
  const at::Tensor total = at::stack(at::_foreach_norm(grads, 2)).norm();
  at::_foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp_max(1.0));
}

// Adam (Kingma & Ba) in one fused operation over every parameter (ATen's, as torch.optim.Adam(fused=True)): a
// per-parameter loop of small operations would cost the host more time per step than the device spends.
class AdamState {
 public:
  explicit AdamState(std::vector<at::Tensor> params) : params_(std::move(params)) {
    c10::NoGradGuard no_grad;
    for (const auto& p : params_) {
      exp_avg_.push_back(at::zeros_like(p));
      exp_avg_sq_.push_back(at::zeros_like(p));
      steps_.push_back(at::zeros({}, p.options().dtype(at::kFloat)));
    }
  }
  void zero_grad() {
    for (auto& p : params_) p.mutable_grad() = at::Tensor();
  }
  void step(double lr, double beta2) {
    c10::NoGradGuard no_grad;
    std::vector<at::Tensor> params, grads, exp_avg, exp_avg_sq, steps;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].grad().defined()) continue;
      params.push_back(params_[i]);
      grads.push_back(params_[i].grad());
      exp_avg.push_back(exp_avg_[i]);
      exp_avg_sq.push_back(exp_avg_sq_[i]);
      steps.push_back(steps_[i]);
    }
    at::_foreach_add_(steps, 1);  // the fused step reads the count after this step, as torch.optim.Adam gives it
    at::_fused_adam_(params, grads, exp_avg, exp_avg_sq, {}, steps, lr, /*beta1=*/0.9, beta2, /*weight_decay=*/0.0,
                     /*eps=*/1e-8, /*amsgrad=*/false, /*maximize=*/false);
  }

 private:
  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_, steps_;
};

// word2vec/GloVe text vectors: an optional "COUNT DIM" line, then "word v1 ... vD" per line. Words are lowercased as
// the vocabulary is (the first vector of a lowercased form wins).
std::vector<std::pair<std::string, std::vector<float>>> read_embeddings(const std::string& path) {
  std::ifstream in = open_input_file(path, "embeddings");
  std::vector<std::pair<std::string, std::vector<float>>> out;
  std::unordered_map<std::string, int> seen;
  std::string line;
  std::size_t dim = 0, number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (const std::size_t bad = invalid_utf8_offset(line); bad != std::string::npos)
      throw ParseError(path, number, "invalid UTF-8 byte at column " + std::to_string(bad + 1));
    if (number == 1 && line.compare(0, kBom.size(), kBom) == 0) line.erase(0, kBom.size());
    std::istringstream fields(line);
    std::string word;
    if (!(fields >> word)) continue;
    std::vector<float> v;
    std::string field;
    while (fields >> field) {
      char* end = nullptr;
      errno = 0;
      const float x = std::strtof(field.c_str(), &end);
      if (end == field.c_str() || *end != '\0' || !std::isfinite(x))
        throw ParseError(path, number, "'" + field + "' is not a finite number");
      v.push_back(x);
    }
    if (number == 1 && v.size() == 1) continue;  // word2vec's "COUNT DIM" header
    if (v.empty()) throw ParseError(path, number, "a word without a vector");
    if (dim == 0) dim = v.size();
    if (v.size() != dim)
      throw ParseError(path, number,
                       "expected " + std::to_string(dim) + " values after the word, found " + std::to_string(v.size()));
    if (seen.emplace(lowercase(word), 0).second) out.emplace_back(lowercase(word), std::move(v));
  }
  if (in.bad()) throw Error("error reading embeddings '" + path + "': " + std::strerror(errno));
  if (out.empty()) throw Error("'" + path + "': no word vectors");
  return out;
}

}  // namespace

SentenceEncoder parse_sentence_encoder(const std::string& name) {
  for (const SentenceEncoder e : {SentenceEncoder::BiLstm, SentenceEncoder::Cnn})
    if (name == sentence_encoder_name(e)) return e;
  throw Error("--encoder must be bilstm, cnn or none, not '" + name + "'");
}

CharEncoder parse_char_encoder(const std::string& name) {
  for (const CharEncoder e : {CharEncoder::BiLstm, CharEncoder::Cnn})
    if (name == char_encoder_name(e)) return e;
  throw Error("--char-encoder must be cnn or bilstm, not '" + name + "'");
}

EncoderPrecision parse_encoder_precision(const std::string& name) {
  for (const EncoderPrecision p : {EncoderPrecision::Auto, EncoderPrecision::Bf16, EncoderPrecision::Fp32})
    if (name == encoder_precision_name(p)) return p;
  throw Error("--precision must be auto, bf16 or fp32, not '" + name + "'");
}

const char* sentence_encoder_name(SentenceEncoder encoder) {
  switch (encoder) {
    case SentenceEncoder::BiLstm: return "bilstm";
    case SentenceEncoder::Cnn: return "cnn";
  }
  throw Error("the encoder holds " + std::to_string(static_cast<int>(encoder)) + ", which is no SentenceEncoder");
}

const char* char_encoder_name(CharEncoder encoder) {
  switch (encoder) {
    case CharEncoder::BiLstm: return "bilstm";
    case CharEncoder::Cnn: return "cnn";
  }
  throw Error("the character encoder holds " + std::to_string(static_cast<int>(encoder)) + ", which is no CharEncoder");
}

const char* encoder_precision_name(EncoderPrecision precision) {
  switch (precision) {
    case EncoderPrecision::Auto: return "auto";
    case EncoderPrecision::Bf16: return "bf16";
    case EncoderPrecision::Fp32: return "fp32";
  }
  throw Error("the precision holds " + std::to_string(static_cast<int>(precision)) + ", which is no EncoderPrecision");
}

NeuralTagger::NeuralTagger(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NeuralTagger::NeuralTagger(NeuralTagger&&) noexcept = default;
NeuralTagger& NeuralTagger::operator=(NeuralTagger&&) noexcept = default;
NeuralTagger::~NeuralTagger() = default;

const std::vector<std::string>& NeuralTagger::labels() const { return impl_->labels; }
int64_t NeuralTagger::label_id(const std::string& label) const { return impl_->label_id(label); }
std::size_t NeuralTagger::input_columns() const { return impl_->input_columns; }
const ColumnLayout& NeuralTagger::layout() const { return impl_->layout; }
const NeuralTaggerOptions& NeuralTagger::options() const { return impl_->options; }
bool NeuralTagger::hybrid() const { return impl_->hybrid != nullptr; }

void NeuralTagger::set_layout(ColumnLayout layout) {
  if (layout.inputs.size() != impl_->input_columns || layout.label >= layout.columns)
    throw Error("a column layout with " + std::to_string(layout.inputs.size()) + " inputs (" + layout.describe() +
                ") does not fit a model of " + std::to_string(impl_->input_columns) + " input columns");
  impl_->layout = std::move(layout);
}

std::size_t NeuralTagger::num_parameters() const {
  std::size_t n = 0;
  for (const auto& p : impl_->net->parameters()) n += static_cast<std::size_t>(p.numel());
  return n;
}

std::string NeuralTagger::describe() const {
  const Impl& m = *impl_;
  const NeuralTaggerOptions& o = m.options;
  std::ostringstream s;
  const bool lstm = o.encoder == SentenceEncoder::BiLstm;
  s << "encoder: " << sentence_encoder_name(o.encoder) << " (" << o.layers
    << (lstm ? " layers of " : " dilated blocks of ") << (lstm ? o.hidden : 2 * o.hidden)
    << (lstm ? " units per direction" : " channels") << ", dropout " << o.dropout
    << (o.variational_dropout ? " per sentence" : "") << ")\n";
  s << "inputs: words " << m.words.size() << " x " << o.word_dim << ", shapes " << m.shapes.size() << " x "
    << o.feature_dim;
  if (o.char_dim > 0)
    s << ", characters " << m.chars.size() << " x " << o.char_dim
      << (o.char_encoder == CharEncoder::BiLstm ? " -> BiLSTM 2 x " : " -> CNN ") << o.char_filters;
  for (std::size_t c = 0; c < m.extra.size(); ++c)
    s << ", input column " << c + 1 << " " << m.extra[c].size() << " x " << o.feature_dim;
  s << "\n";
  if (m.hybrid) s << "hybrid sparse features: " << m.features.size() << " (" << m.hybrid->spec().substr(0, 60) << ")\n";
  s << "decoding constraints: " << m.scheme << "\nparameters: " << num_parameters() << "\n";
  return s.str();
}

void NeuralTagger::to(const at::Device& device, EncoderPrecision precision) { impl_->move_to(device, precision); }

void NeuralTagger::start_device(const at::Device& device) {
  if (!device.is_cuda()) return;
  c10::NoGradGuard no_grad;
  const at::TensorOptions on = at::TensorOptions().device(device);
  // The smallest of what a tagging batch runs: a packed BiLSTM (cuDNN), float32 and bfloat16 matrix products (cuBLAS).
  torch::nn::LSTM lstm(torch::nn::LSTMOptions(1, 1).bidirectional(true).batch_first(true));
  lstm->to(device);
  namespace rnn = torch::nn::utils::rnn;
  const auto packed = rnn::pack_padded_sequence(at::zeros({1, 1, 1}, on), at::ones({1}, at::kLong), true, true);
  const at::Tensor h =
      std::get<0>(rnn::pad_packed_sequence(std::get<0>(lstm->forward_with_packed_input(packed)), true));
  const at::Tensor m = at::zeros({8, 8}, on);
  (h.sum() + at::mm(m, m).sum() + at::mm(m.to(at::kBFloat16), m.to(at::kBFloat16)).sum()).item();
}

std::vector<TaggedSentence> NeuralTagger::tag(const std::vector<const TokenRows*>& sentences,
                                              bool with_marginals) const {
  impl_->net->eval();
  Impl::ChunkedSentences input(*impl_, sentences, 0, 1);
  return impl_->decode(input, with_marginals);
}

std::vector<std::vector<TaggedSentence>> NeuralTagger::tag_kbest(const std::vector<const TokenRows*>& sentences,
                                                                 int64_t k) const {
  if (k < 1) throw Error("k-best tagging needs k >= 1, not " + std::to_string(k));
  impl_->net->eval();
  return impl_->kbest(sentences, k);
}

void NeuralTagger::save(const std::string& path) const {
  const Impl& m = *impl_;
  ModelWriter w;
  w.buffer().append(kMagic, sizeof kMagic);
  w.pod<uint32_t>(kFormatVersion);
  w.str(kKind);
  w.str(m.hyperparameters());
  w.pod<uint64_t>(m.input_columns);
  w.pod<uint64_t>(m.layout.columns);
  w.pod<uint64_t>(m.layout.label);
  for (std::size_t c : m.layout.inputs) w.pod<uint64_t>(c);
  w.strings(m.labels);
  w.strings(m.words.items());
  w.strings(m.shapes.items());
  w.strings(m.chars.items());
  for (const auto& v : m.extra) w.strings(v.items());
  w.str(m.hybrid ? m.hybrid->spec() : "");
  if (m.hybrid) w.strings(m.features.items());
  const auto named = m.net->named_parameters(/*recurse=*/true);
  w.pod<uint64_t>(named.size());
  for (const auto& p : named) {
    w.str(p.key());
    w.pod<uint64_t>(static_cast<uint64_t>(p.value().dim()));
    for (int64_t d : p.value().sizes()) w.pod<int64_t>(d);
    w.floats(p.value());
  }
  w.pod<uint64_t>(fnv1a(w.buffer().data(), w.buffer().size()));
  write_file_atomically(path, [&](std::ostream& out) { out.write(w.buffer().data(), w.buffer().size()); });
}

bool NeuralTagger::is_model_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char head[sizeof kMagic];
  return in && in.read(head, sizeof head) && std::memcmp(head, kMagic, sizeof kMagic) == 0;
}

NeuralTagger NeuralTagger::load(const std::string& path) {
  std::ifstream in = open_input_file(path, "model");
  std::string data(sizeof kMagic, '\0');
  if (!in.read(data.data(), sizeof kMagic) || std::memcmp(data.data(), kMagic, sizeof kMagic) != 0)
    throw Error("'" + path + "' is not a Trellis neural CRF model");
  char chunk[1 << 16];
  while (in.read(chunk, sizeof chunk) || in.gcount() > 0) data.append(chunk, in.gcount());
  if (in.bad()) throw Error("error reading model '" + path + "': " + std::strerror(errno));
  ModelReader r(data, sizeof kMagic,
                data.size() >= sizeof kMagic + sizeof(uint64_t) ? data.size() - sizeof(uint64_t) : sizeof kMagic, path,
                "neural CRF model file");
  const auto version = r.pod<uint32_t>();
  if (version != kFormatVersion)
    throw Error("'" + path + "': neural CRF model format version " + std::to_string(version) +
                " is not supported (this Trellis reads version " + std::to_string(kFormatVersion) + ")");
  uint64_t stored;
  std::memcpy(&stored, data.data() + data.size() - sizeof stored, sizeof stored);
  if (stored != fnv1a(data.data(), data.size() - sizeof stored)) r.corrupt("checksum mismatch: truncated or modified");
  if (const std::string kind = r.str(); kind != kKind) r.corrupt("kind '" + kind + "', expected '" + kKind + "'");

  auto m = std::make_unique<Impl>();
  std::map<std::string, std::string> hp;
  {
    std::istringstream lines(r.str());
    std::string line;
    while (std::getline(lines, line)) {
      const auto eq = line.find('=');
      if (eq == std::string::npos) r.corrupt("hyper-parameter line '" + line + "'");
      hp[line.substr(0, eq)] = line.substr(eq + 1);
    }
  }
  const auto text = [&](const char* key) {
    const auto it = hp.find(key);
    if (it == hp.end()) r.corrupt(std::string("hyper-parameter '") + key + "' missing");
    return it->second;
  };
  const auto integer = [&](const char* key, int64_t least, int64_t most) {
    const std::string v = text(key);
    char* end = nullptr;
    const long long x = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || x < least || x > most) r.corrupt(std::string("hyper-parameter ") + key + "=" + v);
    return static_cast<int64_t>(x);
  };
  NeuralTaggerOptions& o = m->options;
  const std::string encoder = text("encoder");
  if (encoder != "bilstm" && encoder != "cnn") r.corrupt("encoder '" + encoder + "'");
  o.encoder = parse_sentence_encoder(encoder);
  constexpr int64_t kMaxDim = int64_t{1} << 16;
  o.word_dim = integer("word_dim", 1, kMaxDim);
  o.char_dim = integer("char_dim", 0, kMaxDim);
  o.char_filters = integer("char_filters", o.char_dim > 0 ? 1 : 0, kMaxDim);
  const std::string char_encoder = text("char_encoder");
  if (char_encoder != "cnn" && char_encoder != "bilstm") r.corrupt("character encoder '" + char_encoder + "'");
  o.char_encoder = parse_char_encoder(char_encoder);
  o.feature_dim = integer("feature_dim", 1, kMaxDim);
  o.hidden = integer("hidden", 1, kMaxDim);
  o.layers = integer("layers", 1, 16);
  {
    const std::string v = text("dropout");
    char* end = nullptr;
    o.dropout = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !(o.dropout >= 0 && o.dropout < 1)) r.corrupt("hyper-parameter dropout=" + v);
  }
  {
    // Files written before sentence masks existed have no key: their masks were per token.
    const auto it = hp.find("dropout_masks");
    const std::string masks = it == hp.end() ? "token" : it->second;
    if (masks != "token" && masks != "sentence") r.corrupt("hyper-parameter dropout_masks=" + masks);
    o.variational_dropout = masks == "sentence";
  }
  m->scheme = text("scheme");
  if (m->scheme != "none" && m->scheme != "BIO" && m->scheme != "BIOES") r.corrupt("scheme '" + m->scheme + "'");

  m->input_columns = r.count(sizeof(uint64_t), "input column");
  if (m->input_columns < 1) r.corrupt("no input columns");
  ColumnLayout layout = ColumnLayout::inputs_then_label(m->input_columns);
  layout.columns = r.pod<uint64_t>();
  layout.label = r.pod<uint64_t>();
  if (layout.columns <= m->input_columns || layout.label >= layout.columns) r.corrupt("column layout");
  for (auto& c : layout.inputs) {
    c = r.pod<uint64_t>();
    if (c >= layout.columns || c == layout.label) r.corrupt("column layout");
  }
  m->layout = std::move(layout);
  std::vector<std::string> labels = r.strings("label");
  if (labels.empty()) r.corrupt("no labels");
  try {
    m->set_labels(std::move(labels));
  } catch (const Error& e) {
    r.corrupt(e.what());
  }
  const auto vocabulary = [&](const std::string& what, std::size_t reserved) {
    std::vector<std::string> items = r.strings(what);
    if (items.size() < reserved) r.corrupt(what + " vocabulary");
    Vocabulary v(std::move(items));
    if (!v.unique()) r.corrupt(what + " vocabulary repeats an entry");
    return v;
  };
  m->words = vocabulary("word", 2);
  m->shapes = vocabulary("shape", 2);
  m->chars = vocabulary("character", 4);
  for (std::size_t c = 1; c < m->input_columns; ++c) m->extra.push_back(vocabulary("column " + std::to_string(c), 2));
  if (const std::string spec = r.str(); !spec.empty()) {
    try {
      m->hybrid = FeatureExtractor::from_spec(spec);
      m->hybrid->validate(m->input_columns, path);
    } catch (const Error& e) {
      r.corrupt(std::string("hybrid feature set: ") + e.what());
    }
    m->features = Vocabulary(r.strings("feature"));
    if (!m->features.unique()) r.corrupt("feature list repeats an entry");
  }
  // Every parameter is stored in the file: an architecture larger than the rest of it (a crafted or corrupt file
  // claiming 65536 hidden units) is an error before anything is allocated for it.
  const double parameters = parameter_count(m->architecture());
  if (sizeof(float) * parameters > static_cast<double>(r.remaining())) r.corrupt("the parameters exceed the file");
  m->build_network();
  auto named = m->net->named_parameters(/*recurse=*/true);
  {
    double built = 0;
    for (const auto& p : named) built += static_cast<double>(p.value().numel());
    if (built != parameters)
      throw Error("internal error: the network holds " + std::to_string(built) + " parameters, parameter_count() " +
                  std::to_string(parameters));
  }
  const uint64_t stored_parameters = r.pod<uint64_t>();
  if (stored_parameters != named.size())
    r.corrupt(std::to_string(stored_parameters) + " parameter tensors, the architecture has " +
              std::to_string(named.size()));
  for (auto& p : named) {
    const std::string name = r.str();
    if (name != p.key()) r.corrupt("parameter '" + name + "' where the architecture has '" + p.key() + "'");
    const uint64_t rank = r.pod<uint64_t>();
    std::vector<int64_t> shape;
    for (uint64_t d = 0; d < rank && d < 8; ++d) shape.push_back(r.pod<int64_t>());
    if (rank != static_cast<uint64_t>(p.value().dim()) || shape != p.value().sizes().vec())
      r.corrupt("parameter '" + name + "' has a shape that does not fit the architecture");
    r.floats_into(p.value(), "parameter '" + name + "'");
  }
  if (!r.done()) r.corrupt("trailing bytes");
  m->net->eval();
  return NeuralTagger(std::move(m));
}

// ---------------------------------------------------------------------------------------------------------------

NeuralTagger train_neural_tagger(const LabeledSentences& train, const LabeledSentences* dev,
                                 std::unique_ptr<FeatureExtractor> hybrid, const NeuralTaggerOptions& o,
                                 const std::function<void(const NeuralEpoch&)>& on_epoch, NeuralTrainSummary* summary) {
  const auto t0 = Clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  check_options(o);
  start_training(train, o.threads);
  const at::Device device = o.device;
  at::manual_seed(o.seed);  // the CPU generator and every CUDA one
  std::mt19937_64 rng(o.seed);

  auto m = std::make_unique<NeuralTagger::Impl>();
  m->options = o;
  m->input_columns = train.inputs.front().front().size();
  m->layout = ColumnLayout::inputs_then_label(m->input_columns);
  if (m->options.word_dim == 0) m->options.word_dim = kDefaultWordDim;
  m->extra.resize(m->input_columns - 1);
  {
    std::vector<std::string> labels;
    std::unordered_map<std::string, int> seen;
    for (const auto& s : train.labels)
      for (const auto& l : s)
        if (seen.emplace(l, 0).second) labels.push_back(l);
    m->set_labels(std::move(labels));
  }
  m->scheme = chunk_scheme(m->labels);
  // Vocabularies in first-seen order, so that the same data give the same ids.
  for (std::size_t s = 0; s < train.inputs.size(); ++s)
    for (std::size_t t = 0; t < train.inputs[s].size(); ++t) {
      const auto& row = train.inputs[s][t];
      if (row.size() != m->input_columns)
        throw ParseError(
            train.source, (s < train.first_lines.size() ? train.first_lines[s] : 0) + t,
            "expected " + std::to_string(m->input_columns) + " input columns, found " + std::to_string(row.size()));
      const int64_t w = m->words.add(lowercase(row[0]));
      if (w >= static_cast<int64_t>(m->word_counts.size())) m->word_counts.resize(w + 1, 0);
      ++m->word_counts[w];
      m->shapes.add(word_shape(row[0]));
      for (const std::string_view cp : code_points(row[0])) m->chars.add(std::string(cp));
      for (std::size_t c = 1; c < m->input_columns; ++c) m->extra[c - 1].add(row[c]);
    }
  std::vector<std::pair<std::string, std::vector<float>>> pretrained;
  if (!o.pretrained_embeddings.empty()) {
    pretrained = read_embeddings(o.pretrained_embeddings);
    const int64_t dim = static_cast<int64_t>(pretrained.front().second.size());
    if (o.word_dim != 0 && o.word_dim != dim)
      throw Error("--embedding-dim " + std::to_string(o.word_dim) + " differs from the " + std::to_string(dim) +
                  " dimensions of '" + o.pretrained_embeddings + "' (leave it out to take the file's)");
    m->options.word_dim = dim;
    for (const auto& [word, v] : pretrained) m->words.add(word);
  }
  if (hybrid) {
    hybrid->validate(m->input_columns, train.source);
    std::unordered_map<std::string, int64_t> counts;
    std::vector<std::string> order;
    FeatureList feats;
    for (const auto& rows : train.inputs)
      for (std::size_t t = 0; t < rows.size(); ++t) {
        feats.clear();
        hybrid->extract(rows, t, feats);
        for (const std::string_view f : feats) {
          auto [it, fresh] = counts.emplace(std::string(f), 0);
          if (fresh) order.push_back(it->first);
          ++it->second;
        }
      }
    std::vector<std::string> kept;
    for (auto& f : order)
      if (counts[f] >= o.min_feature_count) kept.push_back(std::move(f));
    m->features = Vocabulary(std::move(kept));
    m->hybrid = std::move(hybrid);
  }
  m->build_network();
  if (!pretrained.empty()) {
    c10::NoGradGuard no_grad;
    at::Tensor table = m->net->word_embedding->weight;
    for (const auto& [word, v] : pretrained) table[m->words.find(word)].copy_(at::tensor(v, at::kFloat));
  }

  const auto gather = [](const LabeledSentences& d) {
    std::pair<std::vector<const TokenRows*>, std::vector<const std::vector<std::string>*>> p;
    for (std::size_t s = 0; s < d.inputs.size(); ++s) p.first.push_back(&d.inputs[s]), p.second.push_back(&d.labels[s]);
    return p;
  };
  const auto [train_rows, train_gold] = gather(train);
  const std::vector<EncodedSentence> train_set =
      m->encode_all(train_rows, &train_gold, train.source, &train.first_lines);
  std::vector<EncodedSentence> dev_set;
  if (dev) {
    const auto [dev_rows, dev_gold] = gather(*dev);
    dev_set = m->encode_all(dev_rows, &dev_gold, dev->source, &dev->first_lines);
  }
  std::vector<const EncodedSentence*> dev_ptrs;
  for (const auto& e : dev_set) dev_ptrs.push_back(&e);
  m->move_to(device, o.precision);

  const std::vector<at::Tensor> params = m->net->parameters();
  AdamState adam(params);
  // The weights the dev set scores and the model keeps: the parameters, or their moving average.
  std::vector<at::Tensor> averaged;
  if (o.average > 0)
    for (const auto& p : params) averaged.push_back(p.detach().clone());
  int64_t average_steps = 0;
  // Exchanges the parameters' values with the average's (to score the average on the dev set, and back).
  const auto exchange_average = [&] {
    c10::NoGradGuard no_grad;
    for (std::size_t i = 0; i < averaged.size(); ++i) {
      const at::Tensor weights = params[i].detach().clone();
      params[i].copy_(averaged[i]);
      averaged[i].copy_(weights);
    }
  };
  NeuralTrainSummary sum;
  for (const auto& p : m->net->parameters()) sum.parameters += static_cast<std::size_t>(p.numel());
  sum.words = static_cast<std::size_t>(m->words.size());
  sum.characters = static_cast<std::size_t>(m->chars.size());
  sum.features = m->hybrid ? static_cast<std::size_t>(m->features.size()) : 0;
  sum.setup_seconds = elapsed();
  int64_t train_tokens = 0;
  for (const auto& e : train_set) train_tokens += static_cast<int64_t>(e.size());

  std::vector<at::Tensor> best;
  double best_score = -1;
  for (int epoch = 1; epoch <= o.epochs; ++epoch) {
    const auto epoch_start = Clock::now();
    const double lr = o.learning_rate * std::pow(o.lr_decay, epoch - 1);
    // Buckets of similar lengths: a random order, sorted by length (ties stay random), cut into minibatches whose
    // order is shuffled.
    std::vector<std::size_t> order(train_set.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t x, std::size_t y) { return train_set[x].size() < train_set[y].size(); });
    std::vector<std::vector<const EncodedSentence*>> batches;
    for (std::size_t i = 0; i < order.size(); i += o.batch_size) {
      std::vector<const EncodedSentence*> b;
      for (std::size_t j = i; j < std::min(order.size(), i + o.batch_size); ++j) b.push_back(&train_set[order[j]]);
      batches.push_back(std::move(b));
    }
    std::shuffle(batches.begin(), batches.end(), rng);
    m->net->train();
    at::Tensor total = at::zeros({}, at::TensorOptions().device(device));
    for (const auto& sentences : batches) {
      const Batch b = m->batch(sentences, &rng);
      adam.zero_grad();
      const at::Tensor nll = -log_likelihood(m->potentials(m->net->emissions(b, m->bf16), b, false), b.tags).sum();
      (nll / static_cast<double>(b.B)).backward();
      if (m->hybrid && o.c2 > 0) {
        // The batch's share (by tokens) of c2·‖w‖², scaled as its log-likelihood is: the gradient only.
        c10::NoGradGuard no_grad;
        const at::Tensor& w = m->net->hybrid_weights;
        w.mutable_grad().add_(
            w, 2 * o.c2 * static_cast<double>(b.N) / static_cast<double>(train_tokens) / static_cast<double>(b.B));
      }
      if (o.clip > 0) clip_gradient_norm(params, o.clip);
      adam.step(lr, o.beta2);
      if (!averaged.empty()) {
        // Early on the average follows the weights more closely (TensorFlow's ExponentialMovingAverage with
        // num_updates), so that the first epochs' scores are not those of the random initial weights.
        ++average_steps;
        const double decay = std::min(o.average, (1.0 + average_steps) / (10.0 + average_steps));
        c10::NoGradGuard no_grad;
        at::_foreach_lerp_(averaged, params, 1.0 - decay);
      }
      total += nll.detach();
    }
    const double loss = total.item<double>() / static_cast<double>(train_tokens);
    const double train_seconds = std::chrono::duration<double>(Clock::now() - epoch_start).count();
    if (!std::isfinite(loss))
      throw Error("training diverged in epoch " + std::to_string(epoch) + ": the loss is " + show(loss) +
                  "; a smaller --lr or --clip may help");
    NeuralEpoch rec{epoch, loss,         lr,          static_cast<double>(train_tokens) / std::max(train_seconds, 1e-9),
                    0,     std::nullopt, std::nullopt};
    sum.epochs = epoch;
    bool stop = false;
    if (dev) {
      m->net->eval();
      exchange_average();
      NeuralTagger::Impl::ChunkedSentences dev_input(dev_ptrs, 0, 1);
      const std::vector<TaggedSentence> tagged = m->decode(dev_input, false);
      ChunkEvaluation ev;
      for (std::size_t s = 0; s < tagged.size(); ++s) ev.add_sentence(dev->labels[s], tagged[s].labels);
      rec.dev_accuracy = ev.accuracy();
      const bool chunks = ev.overall.gold > 0;
      if (chunks) rec.dev_f1 = ev.overall.f1();
      const double score = chunks ? *rec.dev_f1 : *rec.dev_accuracy;
      if (score > best_score) {
        best_score = score;
        sum.best_epoch = epoch;
        sum.best_dev_accuracy = rec.dev_accuracy;
        sum.best_dev_f1 = rec.dev_f1;
        sum.seconds_to_best = elapsed();
        best.clear();
        for (const auto& p : params) best.push_back(p.detach().clone());
      }
      exchange_average();
      if (o.patience > 0 && epoch - sum.best_epoch >= o.patience) sum.stopped_early = stop = true;
    }
    rec.seconds = elapsed();
    if (on_epoch) on_epoch(rec);
    if (stop) break;
  }
  if (!best.empty()) {
    c10::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params.size(); ++i) params[i].copy_(best[i]);
  } else {
    exchange_average();
    sum.best_epoch = sum.epochs;
    sum.seconds_to_best = elapsed();
  }
  m->net->eval();
  m->move_to(at::kCPU, EncoderPrecision::Auto);
  m->word_counts.clear();
  sum.seconds = elapsed();
  if (summary) *summary = sum;
  return NeuralTagger(std::move(m));
}

}  // namespace trellis
