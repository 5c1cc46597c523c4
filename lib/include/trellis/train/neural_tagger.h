// A neural CRF tagger: word, character, shape and extra-column embeddings, a BiLSTM or a stack of dilated
// convolutions, linear emissions (optionally plus sparse CRF++/built-in feature weights: a hybrid), and a
// trellis::nn::CRF on top. Trained with Adam on length-bucketed minibatches; tagged with Viterbi, marginals or k-best.
//
// The model lives behind a pointer (LibTorch's module headers stay out of this header, which the command line and
// applications include cheaply). Model files are self-describing (magic, format version, kind, hyper-parameters,
// column layout, vocabularies, named parameters, checksum) and written atomically.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "trellis/crf/crf_features.h"
#include "trellis/crf/crf_tagger.h"
#include "trellis/train/crf_train.h"

namespace trellis {

// The sentence encoder under the emissions: a BiLSTM, or a stack of dilated convolutions.
enum class SentenceEncoder { BiLstm, Cnn };
// The character representation: a BiLSTM's last states in both directions, or the max over a convolution.
enum class CharEncoder { BiLstm, Cnn };
// The encoder's arithmetic: Auto (bf16 on CUDA, fp32 on the CPU), Bf16 (CUDA only) or Fp32. The CRF is fp32 always.
enum class EncoderPrecision { Auto, Bf16, Fp32 };
// From and to the names the command line and model files use. A name outside the list is an Error naming the option
// (--encoder: "bilstm" or "cnn"; --char-encoder: "bilstm" or "cnn"; --precision: "auto", "bf16" or "fp32"); a value
// outside the enumeration is an Error too.
SentenceEncoder parse_sentence_encoder(const std::string& name);
CharEncoder parse_char_encoder(const std::string& name);
EncoderPrecision parse_encoder_precision(const std::string& name);
const char* sentence_encoder_name(SentenceEncoder encoder);
const char* char_encoder_name(CharEncoder encoder);
const char* encoder_precision_name(EncoderPrecision precision);

// The neural tagger's architecture and how train_neural_tagger trains it.
struct NeuralTaggerOptions {
  SentenceEncoder encoder = SentenceEncoder::BiLstm;
  int64_t word_dim = 0;        // word embedding size; 0: the pretrained vectors' size, or 100 without them
  int64_t char_dim = 50;       // character embedding size (0: no character representation)
  int64_t char_filters = 200;  // char CNN filters, or char BiLSTM units per direction
  CharEncoder char_encoder = CharEncoder::BiLstm;
  int64_t feature_dim = 20;   // embedding size of the word shape and of each extra input column
  int64_t hidden = 300;       // BiLSTM units per direction; convolution channels are twice this
  int64_t layers = 2;         // BiLSTM layers, or dilated convolution blocks (dilations 1, 2, 4, ...)
  double dropout = 0.5;       // on the token inputs, between layers and before the emissions
  double word_dropout = 0.5;  // a training word seen c times becomes unknown with probability a/(a+c)
  // Dropout masks drawn once per sentence, the same at every position (variational dropout, Gal & Ghahramani 2016),
  // instead of per token. Stored in the model file: a BiLSTM of several layers is then one module per layer.
  bool variational_dropout = true;
  std::string pretrained_embeddings;  // word2vec/GloVe text file ("" for none); its words join the vocabulary

  int epochs = 50;              // passes over the training set at most
  std::size_t batch_size = 32;  // sentences per minibatch (of similar lengths)
  double learning_rate = 4e-3;  // Adam
  double beta2 = 0.999;         // Adam's decay of the squared-gradient average
  // Decay per step of an exponential moving average of the weights (Polyak averaging), which is what the dev set
  // scores and the model keeps (0: off, the weights themselves).
  double average = 0.999;
  double lr_decay = 0.95;  // the learning rate is multiplied by this after every epoch
  double clip = 5.0;       // gradient norm clipping (0: off)
  int patience = 8;        // with a dev set: stop after this many epochs without a better dev score (0: never)
  uint64_t seed = 0;       // initialisation, dropout, batches: a CPU run with the same seed gives the same model
  c10::Device device = c10::kCPU;  // where the model trains
  EncoderPrecision precision = EncoderPrecision::Auto;
  int threads = 0;            // CPU threads; 0 keeps LibTorch's default
  int min_feature_count = 1;  // hybrid: sparse features seen fewer times in training are dropped
  double c2 = 1.0;  // hybrid: L2 on the sparse weights, c2·‖w‖² over the training set (as the feature CRF)
};

// One training epoch, as reported to train_neural_tagger's callback.
struct NeuralEpoch {
  int epoch;                           // from 1
  double loss;                         // training negative log-likelihood per token (dropout on)
  double learning_rate;                // used during the epoch
  double tokens_per_second;            // of the training pass
  double seconds;                      // since training started
  std::optional<double> dev_accuracy;  // percentage of dev tokens tagged right, with a dev set
  std::optional<double> dev_f1;        // dev chunk F1 (percentage), with a dev set of chunk labels
};

// What train_neural_tagger did.
struct NeuralTrainSummary {
  int epochs = 0;              // epochs run
  bool stopped_early = false;  // by patience
  std::size_t parameters = 0;  // the model's parameters (dense and, in a hybrid, sparse)
  // Vocabulary sizes:
  std::size_t words = 0;                    // words
  std::size_t characters = 0;               // characters
  std::size_t features = 0;                 // the hybrid's sparse features
  double seconds = 0;                       // wall time of the whole call
  double setup_seconds = 0;                 // of `seconds`, before the first epoch
  int best_epoch = 0;                       // the epoch whose weights are returned
  double seconds_to_best = 0;               // from the start of training to the end of the best epoch
  std::optional<double> best_dev_accuracy;  // the returned weights' dev accuracy, with a dev set
  std::optional<double> best_dev_f1;        // their dev chunk F1, with a dev set of chunk labels
};

// A trained neural CRF tagger (train_neural_tagger, or load): tags sentences, saves itself. One thread at a time.
class NeuralTagger {
 public:
  // Takes over the model.
  NeuralTagger(NeuralTagger&&) noexcept;
  // Takes over the model.
  NeuralTagger& operator=(NeuralTagger&&) noexcept;
  ~NeuralTagger();

  // The labels, in id order.
  const std::vector<std::string>& labels() const;
  int64_t label_id(const std::string& label) const;  // -1 when unknown
  // The number of input columns the tagger reads (the label column excluded).
  std::size_t input_columns() const;
  // The CoNLL layout of the training data (stored in the model file).
  const ColumnLayout& layout() const;
  void set_layout(ColumnLayout layout);        // Error unless it has input_columns() inputs
  const NeuralTaggerOptions& options() const;  // the architecture's fields; training fields as trained
  bool hybrid() const;                         // sparse features add to the emissions
  std::string describe() const;                // architecture, vocabulary and parameter counts, one line each
  std::size_t num_parameters() const;          // the model's parameters

  // Moves the model to `device`, its encoder computing in `precision` (Bf16 needs a CUDA device).
  void to(const at::Device& device, EncoderPrecision precision = EncoderPrecision::Auto);
  // Starts what tagging on a CUDA `device` needs before its first batch and that no model is needed for: the CUDA
  // context and the cuDNN and cuBLAS handles (their libraries load then). A caller may run it on another thread while
  // it reads the model and the input; a CPU device needs nothing.
  static void start_device(const at::Device& device);

  // As CrfTagger's: Viterbi labels, with marginals and the sequence's probability when asked for; the k best
  // sequences with their probabilities. Sentences hold the input columns only.
  std::vector<TaggedSentence> tag(const std::vector<const TokenRows*>& sentences, bool with_marginals = false) const;
  // The k best label sequences of each sentence, best first, with their probabilities.
  std::vector<std::vector<TaggedSentence>> tag_kbest(const std::vector<const TokenRows*>& sentences, int64_t k) const;

  // Writes the model file atomically (a temporary renamed into place); Error naming the path on failure.
  void save(const std::string& path) const;
  // A corrupt, truncated or foreign file, a parameter whose name or shape does not fit the stored architecture and
  // weights that are not finite are Errors naming the file.
  static NeuralTagger load(const std::string& path);
  // Whether `path` starts as a neural tagger's model file does (false when it cannot be read).
  static bool is_model_file(const std::string& path);

  struct Impl;

 private:
  explicit NeuralTagger(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  friend NeuralTagger train_neural_tagger(const LabeledSentences&, const LabeledSentences*,
                                          std::unique_ptr<FeatureExtractor>, const NeuralTaggerOptions&,
                                          const std::function<void(const NeuralEpoch&)>&, NeuralTrainSummary*);
};

// Trains a tagger on `train` (input columns: the first is the word, the others are embedded as categories). With a
// dev set the returned model is the best epoch's (chunk F1 for chunk labels, token accuracy otherwise). `hybrid`, when
// given, adds sparse feature weights (one per feature and label) to the emissions. Options are checked first (Errors
// name the `trellis crf train` flag); a loss that becomes inf or NaN is an Error.
NeuralTagger train_neural_tagger(const LabeledSentences& train, const LabeledSentences* dev,
                                 std::unique_ptr<FeatureExtractor> hybrid, const NeuralTaggerOptions& options,
                                 const std::function<void(const NeuralEpoch&)>& on_epoch = {},
                                 NeuralTrainSummary* summary = nullptr);

}  // namespace trellis
