// Training CRF taggers: feature dictionary, L-BFGS on the L2-regularised conditional log-likelihood (OWL-QN when an
// L1 term is added, minibatch SGD/AdaGrad/Adam for large data), progress.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "trellis/io/conll.h"
#include "trellis/crf/crf_tagger.h"
#include "trellis/device.h"
#include "trellis/distributed/distributed.h"

namespace trellis {

// Sentences split into input columns and labels.
struct LabeledSentences {
  std::string source;                            // file name, for messages
  std::vector<TokenRows> inputs;                 // [sentence][token][column]
  std::vector<std::vector<std::string>> labels;  // [sentence][token]
  std::vector<std::size_t> first_lines;          // line of each sentence's first token in `source`
  // The tokens of all sentences.
  std::size_t num_tokens() const;
};

// Takes column `label_column` (negative counts from the end: -1 is the last) as the label.
LabeledSentences split_labels(const ConllCorpus& corpus, int label_column = -1);

// A label the model was not trained on is an error naming its file and line.
void check_known_labels(const CrfTagger& model, const LabeledSentences& data);

// The optimiser of train_crf. Lbfgs: full-batch L-BFGS, or OWL-QN with an L1 term (an iteration is one quasi-Newton
// step); Sgd, Adagrad, Adam: minibatches of batch_size sentences (an iteration is one epoch; the L2 term is shared out
// over the minibatches).
enum class CrfAlgorithm { Lbfgs, Sgd, Adagrad, Adam };

// "lbfgs", "sgd", "adagrad" or "adam" (the `trellis crf train --algorithm` values); anything else is an Error naming
// the flag.
CrfAlgorithm parse_crf_algorithm(const std::string& name);
// The name parse_crf_algorithm reads.
const char* crf_algorithm_name(CrfAlgorithm algorithm);

// How train_crf trains: the algorithm, its regularisation and stopping, the device, threads and processes.
struct CrfTrainOptions {
  CrfAlgorithm algorithm = CrfAlgorithm::Lbfgs;  // the optimiser (see CrfAlgorithm)
  double learning_rate = 0.05;                   // minibatch algorithms
  std::size_t batch_size = 32;                   // sentences per minibatch
  int max_iterations = 100;                      // iterations (L-BFGS steps or epochs) at most
  double c2 = 1.0;  // L2: the objective is -log-likelihood + c2·‖θ‖² (CRFsuite's convention)
  double c1 = 0.0;  // L1: adds c1·‖θ‖₁ and trains with OWL-QN (lbfgs only); many weights become exactly 0
  double tolerance = 1e-5;    // stop when the objective improved by less than this fraction over `period` iterations
  int period = 10;            // iterations over which `tolerance` is measured
  int min_feature_count = 1;  // features seen fewer times in training are dropped
  // Which (feature, label) pairs get a weight: all of them, or those seen in the training data (CRFsuite's default).
  FeaturePairs feature_pairs = FeaturePairs::All;
  c10::Device device = c10::kCPU;  // where the weights and batches live (parse_device reads "cpu", "cuda", "cuda:N")
  int threads = 0;                 // CPU threads; 0 keeps LibTorch's default
  int early_stopping = 0;  // with a dev set: stop after this many iterations without a better dev score (0: never)
  uint64_t seed = 0;       // minibatch partition and epoch order
  // Data parallelism (docs/distributed.md): with a process group every rank reads the whole training set and builds
  // the same feature dictionary; lbfgs sums the objective and gradient of each rank's share (training_share) over
  // the ranks at every evaluation, the minibatch algorithms split every minibatch over the ranks and sum its
  // gradient. Every rank then takes the same steps and returns the same model. Null: one process.
  const DistributedContext* distributed = nullptr;
};

// The training sentences [first, first + count) whose objective this rank computes in full-batch training: as near
// 1/world of the tokens as whole sentences allow (all of them for one process).
struct TrainingShare {
  std::size_t first = 0;   // the first sentence
  std::size_t count = 0;   // the number of sentences
  std::size_t tokens = 0;  // their tokens
};
// This rank's share of `train` under `distributed` (null: every sentence).
TrainingShare training_share(const LabeledSentences& train, const DistributedContext* distributed);

// One training iteration, as reported to train_crf's callback.
struct CrfIteration {
  int iteration;                       // from 1
  double objective;                    // the objective (-log-likelihood plus the regularisation terms) it reports
  double gradient_norm;                // the norm of the objective's gradient (pseudo-gradient with L1)
  double seconds;                      // wall time since training started
  std::optional<double> dev_accuracy;  // percentage of dev tokens tagged right, with a dev set
  std::optional<double> dev_f1;        // the dev chunk F1 (percentage), with a dev set of chunk labels
};

// What train_crf did.
struct CrfTrainSummary {
  std::size_t features = 0;            // features kept (after min_feature_count)
  std::size_t parameters = 0;          // the model's weights, transition and start/end scores included
  std::size_t nonzero_parameters = 0;  // of the returned model (L1 zeroes many)
  int iterations = 0;                  // iterations run
  double seconds = 0;                  // wall time of the whole call
  double setup_seconds = 0;  // of `seconds`, before the first iteration: features, dictionary, batches on the device
  // Stopped before max_iterations: the tolerance test, early stopping, or a full-batch step that found no lower point
  // (L-BFGS's or OWL-QN's own convergence). False when the iterations ran out.
  bool converged = false;
  std::optional<double> best_dev_accuracy;  // the returned weights' dev accuracy, with a dev set
  std::optional<double> best_dev_f1;        // their dev chunk F1, with a dev set of chunk labels
  int best_iteration = 0;                   // the iteration whose weights are returned
};

// Trains a tagger. With a dev set, the returned weights are those of the best dev score (F1 for chunk labels,
// accuracy otherwise). A dev label unseen in training is an error naming its file and line. Every option is checked
// before any work starts (an Error naming its `trellis crf train` flag: "--c2 must be a finite number >= 0, not nan"),
// and an objective or gradient that becomes inf or NaN during training is an Error, never a model.
CrfTagger train_crf(const LabeledSentences& train, const LabeledSentences* dev,
                    std::unique_ptr<FeatureExtractor> extractor, const CrfTrainOptions& options,
                    const std::function<void(const CrfIteration&)>& on_iteration = {},
                    CrfTrainSummary* summary = nullptr);

}  // namespace trellis
