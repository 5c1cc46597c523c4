// Sentences encoded as feature ids for the CRF tagger's potentials. Private to the library: the trainer
// (crf_train.cpp) builds and reuses these batches; applications tag and train through CrfTagger and train_crf.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace trellis {

// Sentences as feature ids, padded into one batch of B sentences of at most T tokens.
struct EncodedBatch {
  at::Tensor feature_ids;  // [nnz] int64, the features of every token, token after token
  at::Tensor offsets;      // [tokens] int64: where each token's features start in feature_ids
  at::Tensor positions;    // [tokens] int64: b*T + t of each token
  at::Tensor lengths;      // [B] int64
  at::Tensor tags;         // [B,T] int64 gold label ids (0 at padding); undefined when no labels were given
  int64_t batch = 0, max_length = 0;
};

// A batch from features already looked up: per sentence, the ids of its tokens' features token after token and each
// token's number of them; `tags` is [B·max_length] gold label ids (0 at padding), or empty.
EncodedBatch assemble_batch(const std::vector<const std::vector<int64_t>*>& ids,
                            const std::vector<const std::vector<int64_t>*>& counts, const std::vector<int64_t>& tags);

}  // namespace trellis
