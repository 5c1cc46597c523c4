// Whole-dataset HMM work on HDF5 files, in batches sized to a memory budget: inference, EM and supervised training,
// sampling, and conversion of CoNLL column files. The trellis command line is a thin front end to these.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "trellis/device.h"
#include "trellis/distributed/distributed.h"
#include "trellis/hmm/hmm_io.h"
#include "trellis/io/vocabulary.h"

namespace trellis {

// How the dataset commands run: device, precision, memory, threads and processes.
struct HMMRunOptions {
  c10::Device device = c10::kCPU;            // the CPU or a CUDA device
  at::ScalarType dtype = at::kDouble;        // precision of the computation (the model is kept in float64)
  int64_t memory_budget = int64_t(1) << 30;  // bytes for one batch's working tensors
  int threads = 0;                           // CPU threads (0: LibTorch's default)
  // gzip level of infer's posteriors, 0 (none) to 9. Posteriors are K float32 per token: gzip, single-threaded in
  // HDF5, writes some tens of MB/s, so at thousands of states it, not the computation, sets infer's pace.
  int posteriors_compression = 1;
  // Data parallelism (docs/distributed.md): with a process group, each rank works on its share of the sequences
  // (dataset_share) and the ranks combine their results; null or a single process: the whole dataset here.
  const DistributedContext* distributed = nullptr;
};

// This rank's share of the dataset's sequences: consecutive sequences [first, first + count), as near 1/world of the
// tokens as whole sequences allow. The whole dataset for a single process.
struct DatasetShare {
  int64_t first = 0;   // the first sequence
  int64_t count = 0;   // the number of sequences
  int64_t tokens = 0;  // their observations
};
// This rank's share of `data` under `distributed` (null: the whole dataset).
DatasetShare dataset_share(const HMMDataset& data, const DistributedContext* distributed);

// Tokens per batch that keep one batch's working tensors within options.memory_budget: with_posteriors for
// `hmm infer --posteriors` (written out) and for the E-step (summed, written_out false).
int64_t batch_tokens(const HMMModelFile& model, int64_t num_features, bool with_posteriors,
                     const HMMRunOptions& options, bool written_out = true);

// Called after each batch with the totals so far.
using BatchProgress = std::function<void(int64_t sequences, int64_t tokens)>;

// What infer_dataset did.
struct InferSummary {
  int64_t sequences = 0;        // sequences inferred
  int64_t tokens = 0;           // their observations
  double log_likelihood = 0;    // total over the dataset
  // Sequences the model gives probability 0 (log-likelihood -inf: an observation no state can emit, or no allowed
  // state path); their states are written as -1 and their posteriors as 0.
  int64_t impossible = 0;
  double seconds = 0;  // wall time of the whole call
  double assembly_seconds = 0;  // of `seconds`, rank 0 receiving and writing the other ranks' results (and the commit)
  // Of `seconds`, this rank's time in each stage:
  double setup_seconds = 0;       // the model put on the device and the output file made
  double read_seconds = 0;        // reading batches (to the device)
  double compute_seconds = 0;     // computing them (until their results are on the device)
  double posteriors_seconds = 0;  // of compute_seconds, the posteriors' (with posteriors; the rest is the Viterbi's)
  double write_seconds = 0;       // writing them (or keeping them for rank 0)
  // On a CUDA device, the most memory this rank's batches held at once in tensors beyond those held before the first
  // (the model's): what memory_budget bounds, but for the transitions' per-batch copies (a few K² values). 0 on the
  // CPU.
  int64_t batch_peak_bytes = 0;
};
// Per-sequence log-likelihood, Viterbi path and score (and posteriors), written to `output` (docs/hmm-format.md).
// Data-parallel: every rank computes its share and rank 0 alone writes the file, receiving the other ranks' results in
// dataset order; the summary is the whole dataset's on every rank, `progress` counts this rank's share.
InferSummary infer_dataset(const HMMModelFile& model, HMMDataset& data, const std::string& output, bool with_posteriors,
                           const HMMRunOptions& options, const BatchProgress& progress = {});

// What fit_dataset estimates, and from where it starts.
struct HMMFitOptions {
  bool supervised = false;              // maximum likelihood from /labels instead of EM
  int order = 1;                        // supervised only: 2 for a second-order (trigram) model over label pairs
  int64_t states = 0;                   // K (0: from the initial model, or the labels' names or largest id)
  int64_t symbols = 0;                  // V for categorical data (0: the vocabulary's size, or the largest id + 1)
  std::optional<HMMModelFile> initial;  // EM start; otherwise random starts
  int restarts = 1;                     // random starts; the one reaching the highest log-likelihood is kept
  uint64_t seed = 0;                    // of the random starts
  BaumWelchOptions em;                  // iterations, tolerance and M-step of EM
};
// One EM iteration, as reported to fit_dataset's on_iteration.
struct EMIteration {
  int restart = 0;            // which random start, from 0
  int iteration = 0;          // within the restart, from 0
  double log_likelihood = 0;  // total, before this iteration's update
  int64_t tokens = 0;         // observations the E-step covered
  double seconds = 0;         // wall time of the iteration
};
// Data-parallel: the statistics of each E-step (and of supervised counts) are summed over the ranks' shares, so every
// rank holds the same model after every iteration; the caller writes it from one rank.
HMMModelFile fit_dataset(HMMDataset& data, const HMMFitOptions& fit, const HMMRunOptions& options,
                         const std::function<void(const EMIteration&)>& on_iteration = {});

// `num_sequences` sequences with lengths uniform in [min_length, max_length], hidden states as /labels.
void sample_dataset(const HMMModelFile& model, const std::string& output, int64_t num_sequences, int64_t min_length,
                    int64_t max_length, uint64_t seed, const BatchProgress& progress = {});

// Log emissions [K,V] of a supervised tagger from emission counts [K,V] over `symbols` (a Vocabulary's). Words get
// additive smoothing over the words. With signature classes, those of unknown words follow TnT's suffix model: the
// words seen at most Vocabulary::kRareCount times give P(tag | class) for each class, interpolated from the most
// general class down its chain with weight theta (the standard deviation of the tag priors), and the class's
// emission is P(tag | class) / P(tag) times the tag's rate of rare words. Like TnT's, those scores are not
// normalised over the classes; decoding compares them across tags only.
at::Tensor tagger_log_emissions(const at::Tensor& counts, const std::vector<std::string>& symbols, double smoothing);

// CoNLL column files to the dataset layout: the word column through `words`, the label (if any) through `labels`
// (label names in id order; a label not among them is an error naming file:line). The label is one column, or several
// joined by '|' ("AUX|VBZ"): a tagger whose states are fine labels, scored on the first part (score_predictions).
// Columns count from 0; negative ones from the end.
struct ConversionSummary {
  int64_t sentences = 0;       // sequences written
  int64_t tokens = 0;          // observations written
  int64_t unknown_tokens = 0;  // of which words outside the vocabulary (mapped to an unknown class)
};
// Writes the CoNLL file at conll_path as a dataset at `output` under the rules above.
ConversionSummary convert_conll(const std::string& conll_path, const std::string& output, const Vocabulary& words,
                                int word_column, const std::vector<std::string>* labels,
                                const std::vector<int>& label_columns, const std::string& comment_prefix = "");
// The words and the distinct labels (in order of first appearance) of a CoNLL file, with the same column rules.
struct ConllVocabulary {
  std::vector<std::string> words;   // every word token, in file order
  std::vector<std::string> labels;  // the distinct labels, in order of first appearance
};
// Reads them from the file at conll_path (comment lines starting with comment_prefix skipped when it is set).
ConllVocabulary conll_words_and_labels(const std::string& conll_path, int word_column,
                                       const std::vector<int>& label_columns, const std::string& comment_prefix = "");

}  // namespace trellis
