// HMM models and sequence datasets in HDF5 files (layout: docs/hmm-format.md), read and written in batches so that
// datasets larger than memory stream through. Readers validate everything and name the file, dataset and row at
// fault; writers fill a temporary file that only commit() renames to the final name.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "trellis/hmm/hmm.h"

namespace trellis {

// An HMM model file's contents: the model and what the commands keep beside it.
struct HMMModelFile {
  std::variant<CategoricalHMM, GaussianHMM> model;  // the parameters
  std::vector<std::string> state_names;             // optional (empty)
  std::vector<std::string> vocabulary;              // optional (empty)
  std::vector<double> log_likelihood_history;       // total log-likelihood before each EM update; optional
  std::vector<int64_t> state_labels;                // optional: the label each state stands for (second-order models)
};
// Tensors come back as float64 on the CPU.
HMMModelFile load_hmm(const std::string& path);
// Writes a model file atomically (a temporary renamed into place); Error naming the path on failure.
void save_hmm(const std::string& path, const HMMModelFile& file);

// A 1-d string dataset (e.g. "vocabulary", "label_names") of any HDF5 file; empty when the file has none.
std::vector<std::string> read_string_dataset(const std::string& path, const std::string& name);

// Rows [first, first + count) of the posteriors an inference output holds (`hmm infer --posteriors`): float32
// [count, K] on the CPU; Error naming the file where it has no such rows.
at::Tensor read_posteriors(const std::string& path, int64_t first, int64_t count);

// A batch of consecutive sequences, padded.
struct SequenceBatch {
  int64_t first = 0;        // index of the batch's first sequence in the dataset
  at::Tensor observations;  // [B,T] int64, or [B,T,F] in the stored float type; zero at padding
  at::Tensor lengths;       // [B] int64
  at::Tensor labels;        // [B,T] int64 with -1 at padding; undefined unless asked for
};

// A dataset file of observation sequences (and optionally labels), read in batches of consecutive sequences.
class HMMDataset {
 public:
  // Opens the file and checks its structure: datasets present, types, ranks, offsets (starting at 0, strictly
  // increasing, ending at the number of rows). Observation values are checked as batches are read.
  explicit HMMDataset(const std::string& path);
  ~HMMDataset();
  // Takes over the open file.
  HMMDataset(HMMDataset&&) noexcept;
  // Takes over the open file.
  HMMDataset& operator=(HMMDataset&&) noexcept;

  // The file's path.
  const std::string& path() const;
  // Whether observations are symbol ids (rather than feature vectors).
  bool categorical() const;
  int64_t num_features() const;  // F for continuous observations, 0 for categorical ones
  // The number of sequences.
  int64_t num_sequences() const;
  // The number of observations over all sequences.
  int64_t num_tokens() const;
  // Whether the file holds a label per observation.
  bool has_labels() const;
  // Where each sequence starts among the rows, and the number of rows last ([num_sequences + 1]).
  const std::vector<int64_t>& offsets() const;
  std::vector<std::string> vocabulary() const;   // empty when the file has none
  std::vector<std::string> label_names() const;  // empty when the file has none

  // Reading checks ids against these bounds (when set) and continuous values for NaN/inf.
  void expect_symbols(int64_t num_symbols);
  // Labels must then lie in [0, num_labels).
  void expect_labels(int64_t num_labels);

  // Sequences [first, first + count), padded, with their labels when with_labels (the file must have them).
  SequenceBatch read(int64_t first, int64_t count, bool with_labels = false) const;
  // Starts reading that range on a thread of its own (where the HDF5 library is thread-safe; otherwise nothing), so
  // that it is read while the caller computes: the next read() of the same range returns it, or throws its error.
  // One range is read ahead at a time; a read() of another range drops it.
  void prefetch(int64_t first, int64_t count, bool with_labels = false) const;
  // Consecutive [first, first + count) ranges of at most max_tokens tokens each (a longer sequence is a range alone).
  std::vector<std::pair<int64_t, int64_t>> batches(int64_t max_tokens) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Writes a dataset one padded batch at a time.
class HMMDatasetWriter {
 public:
  // num_features = 0: categorical (int32 ids); otherwise float32 [total_T, F].
  HMMDatasetWriter(const std::string& path, int64_t num_features, bool with_labels);
  ~HMMDatasetWriter();  // without commit() the temporary file is removed
  // One padded batch: observations [B,T] (or [B,T,F]), lengths [B], labels [B,T] when the writer has them.
  void append(const at::Tensor& observations, const at::Tensor& lengths, const at::Tensor& labels = {});
  void write_strings(const std::string& name, const std::vector<std::string>& values);  // vocabulary, label_names
  // Finishes the file and renames it into place.
  void commit();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Writes what `trellis hmm infer` computes, in the dataset's order.
class HMMInferenceWriter {
 public:
  // With state_labels (see HMMModelFile), /labels gets the label of each Viterbi state as well. Posteriors are
  // gzip-compressed at posteriors_compression (0: not compressed, to 9).
  HMMInferenceWriter(const std::string& path, const std::vector<int64_t>& offsets, int64_t num_states,
                     bool with_posteriors, const std::vector<int64_t>& state_labels = {},
                     int posteriors_compression = 1);
  ~HMMInferenceWriter();
  // One batch: log_likelihood and viterbi_log_prob [B], paths [B,T], lengths [B], posteriors [B,T,K].
  void append(const at::Tensor& log_likelihood, const at::Tensor& viterbi_log_prob, const at::Tensor& paths,
              const at::Tensor& lengths, const at::Tensor& posteriors = {});
  // Finishes the file and renames it into place (without it the temporary file is removed).
  void commit();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Tokens scored and tokens whose predicted label matched.
struct LabelAccuracy {
  int64_t tokens = 0;   // tokens scored
  int64_t correct = 0;  // of which the label matched
  // Percentage correct (0..100); 0 when no token was scored.
  double accuracy() const { return tokens ? 100.0 * correct / tokens : 0.0; }
};
// Token accuracy of `predictions` (an infer output's /labels, or /states) against the dataset's /labels. `coarse`
// compares only the part of each label name before its first '|' (fine labels such as "AUX|VBZ" scored as "AUX").
LabelAccuracy score_predictions(HMMDataset& data, const std::string& predictions, bool coarse = false);

}  // namespace trellis
