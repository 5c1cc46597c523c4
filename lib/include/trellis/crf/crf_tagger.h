// A CRF sequence tagger: labels, an observation-feature dictionary and the weights of a linear-chain CRF.
// Emission scores are sums of per-label feature weights; decoding and training use trellis/crf/linear_chain_crf.h.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "trellis/io/conll.h"
#include "trellis/crf/crf_features.h"
#include "trellis/crf/linear_chain_crf.h"

namespace trellis {

// The library's feature dictionary and its batches of encoded sentences (lib/src/io/string_index.h, encoded_batch.h).
class StringIndex;
struct EncodedBatch;

// Where a model's data sit in a CoNLL file: the file's number of columns, the label column, and the input columns the
// features read, in that order. Every other column is ignored, by name: a second tag column (XPOS beside UPOS) must
// never become an input by accident, where it would give the answer away.
struct ColumnLayout {
  std::size_t columns = 0;          // of the training file
  std::size_t label = 0;            // the label column
  std::vector<std::size_t> inputs;  // the input columns

  // label_column and input_columns count from the end when negative. Without input_columns, the inputs are the
  // columns before the label column. Errors name `source` (the file the layout is for).
  static ColumnLayout resolve(std::size_t columns, int label_column, const std::vector<int>& input_columns,
                              const std::string& source);
  // Input columns 0..n-1, then the label: the layout of every model written before layouts were stored.
  static ColumnLayout inputs_then_label(std::size_t inputs);
  std::vector<std::size_t> ignored() const;  // the columns that are neither an input nor the label
  std::string describe() const;              // e.g. "3 columns: inputs 0, label 1, ignored 2"

  // The corpus with each row reduced to the input columns, followed by the label when the file has it. The file
  // must have `columns` columns (as in training) or one fewer (the same without the label column); any other count
  // is an Error naming it. *has_labels (when given) tells which.
  ConllCorpus project(const ConllCorpus& corpus, bool* has_labels = nullptr) const;
};

// One sentence as tagged by CrfTagger::tag (or one of CrfTagger::tag_kbest's sequences).
struct TaggedSentence {
  std::vector<std::string> labels;  // best label sequence
  std::vector<double> marginals;    // P(y_t = labels[t] | x) per token, when asked for
  double probability = 0;           // P(labels | x), when marginals were asked for
};

// Which (feature, label) pairs have a weight: every feature with every label (weights [F,K]), or only the pairs seen
// in the training data, CRFsuite's default (weights [P]: far fewer, as most features occur with one or two labels;
// a feature then scores nothing for the labels it was never seen with).
enum class FeaturePairs { All, Seen };
FeaturePairs parse_feature_pairs(const std::string& name);  // "all" or "seen"; an Error naming --feature-pairs
std::string feature_pairs_name(FeaturePairs pairs);         // "all" or "seen"

// A trained (or zero-initialised) CRF tagger: labels, feature dictionary, feature extractor and weights. Move-only.
// tag() and tag_kbest() may run on one tagger from several threads at once; to(), set_layout() and writes to the
// parameter tensors need it to themselves.
class CrfTagger {
 public:
  // A model with zero weights over the given labels and features: one per feature and label, or, with
  // `seen_labels` (per feature, the ids of the labels it has a weight for, increasing), one per listed pair.
  CrfTagger(std::vector<std::string> labels, std::vector<std::string> features,
            std::unique_ptr<FeatureExtractor> extractor, std::size_t input_columns,
            const std::vector<std::vector<int64_t>>* seen_labels = nullptr);

  const std::vector<std::string>& labels() const { return labels_; }  // label names, in id order
  const std::vector<std::string>& features() const;                   // feature strings, in id order (rows of weights)
  const FeatureExtractor& extractor() const { return *extractor_; }   // what turns tokens into feature strings
  std::size_t input_columns() const { return input_columns_; }        // columns of a sentence given to tag()
  // The CoNLL layout of the training data (stored in the model file); inputs_then_label(input_columns()) until set.
  const ColumnLayout& layout() const { return layout_; }
  void set_layout(ColumnLayout layout);              // Error unless it has input_columns() inputs
  int64_t label_id(const std::string& label) const;  // -1 when unknown

  // Which (feature, label) pairs have weights: all of them, or those seen in the training data.
  FeaturePairs feature_pairs() const { return pair_labels_.defined() ? FeaturePairs::Seen : FeaturePairs::All; }
  // With FeaturePairs::Seen: feature f's weights are weights[pair_offsets()[f] .. pair_offsets()[f + 1]), for the
  // labels pair_labels() at the same places (int64 CPU tensors [F+1] and [P]). Undefined with FeaturePairs::All.
  const at::Tensor& pair_offsets() const { return pair_offsets_; }
  const at::Tensor& pair_labels() const { return pair_labels_; }  // see pair_offsets()
  // The feature and label of weights.flatten()[j].
  std::pair<int64_t, int64_t> weight_pair(int64_t j) const;

  // Parameters, float32 on CPU unless moved with to(): weights [F,K] (or [P] with seen pairs), transitions [K,K],
  // start [K], end [K].
  at::Tensor weights;      // [F,K]: each feature's score for each label; [P] with seen pairs
  at::Tensor transitions;  // [K,K]: transitions[i][j] scores label i followed by label j
  at::Tensor start;        // [K]: score of the first label
  at::Tensor end;          // [K]: score of the last label
  std::vector<at::Tensor> parameters() const { return {weights, transitions, start, end}; }  // handles, shared
  void to(const at::Device& device);  // moves the parameters (detached) to `device`: tagging then runs there

  // Encodes sentences (input columns only). gold, if given, holds each sentence's label strings; an unknown label is
  // an error naming the sentence and token. encode() and potentials() serve the library's trainer: EncodedBatch is
  // defined in its private headers, and applications tag with tag() and train with train_crf().
  EncodedBatch encode(const std::vector<const TokenRows*>& sentences,
                      const std::vector<const std::vector<std::string>*>* gold = nullptr) const;
  // Chain potentials of an encoded batch, differentiable in the parameters, on the parameters' device.
  ChainPotentials potentials(const EncodedBatch& batch) const;

  // A sentence that no label sequence can take (every path has a weight of -inf) is an Error naming it.
  std::vector<TaggedSentence> tag(const std::vector<const TokenRows*>& sentences, bool with_marginals = false) const;
  // Bytes of k-best tables tag_kbest() holds at once: it cuts its batches to stay within them.
  static constexpr int64_t kMaxKBestBytes = int64_t{1} << 30;
  // The k most probable label sequences of each sentence, best first, each with its probability (no marginals);
  // fewer when a sentence has fewer label sequences. k >= 1; an Error when one sentence's k-best tables alone would
  // exceed kMaxKBestBytes. The k-best search runs on the CPU.
  std::vector<std::vector<TaggedSentence>> tag_kbest(const std::vector<const TokenRows*>& sentences, int64_t k) const;

  // Model file: self-describing (magic, format version, labels, feature set, dictionary, weights, checksum),
  // written to a temporary file and renamed. Loading a corrupt, truncated or foreign file is an Error naming it, and
  // so are weights that are not finite and counts the file's length cannot hold.
  void save(const std::string& path) const;
  static CrfTagger load(const std::string& path);  // a model written by save(), on the CPU

 private:
  std::vector<std::string> labels_;
  std::unordered_map<std::string, int64_t> label_ids_;
  // Behind a shared_ptr, deleted by the deleter made with it, so that this header needs no definition of StringIndex.
  std::shared_ptr<const StringIndex> features_;
  std::unique_ptr<FeatureExtractor> extractor_;
  std::size_t input_columns_;
  ColumnLayout layout_;
  at::Tensor pair_offsets_, pair_labels_;  // seen pairs only
};

}  // namespace trellis
