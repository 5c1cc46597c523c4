// The first checks every trainer of the library makes (train_crf, train_neural_tagger). Internal to the library.
#pragma once
#include <ATen/Parallel.h>

#include "trellis/train/crf_train.h"
#include "trellis/error.h"

namespace trellis {

// An empty training set is an error naming its file; threads > 0 sets LibTorch's CPU threads before any work.
inline void start_training(const LabeledSentences& train, int threads) {
  if (train.inputs.empty()) throw Error("'" + train.source + "': no training sentences");
  if (threads > 0) at::set_num_threads(threads);
}

}  // namespace trellis
