#include "trellis/train/crf_train.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <future>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <unordered_map>

#include "trellis/io/chunk_eval.h"
#include "trellis/error.h"
#include "lib/src/train/encoded_batch.h"
#include "lib/src/semiring/fixed_order_sum.h"
#include "lib/src/train/owlqn.h"
#include "lib/src/io/string_index.h"
#include "lib/src/train/training_start.h"

namespace trellis {
namespace {

constexpr int64_t kTokensPerBatch = 16384;  // on a GPU the objective is summed over length-sorted batches of this size
// On the CPU the objective is summed over blocks of about this many tokens, one thread per block: enough blocks to
// keep 16 threads busy on a corpus of 200k tokens, each large enough that the fixed cost of its operations is small.
constexpr int64_t kTokensPerBlock = 1024;
// Tasks of the weight-gradient pass, each about as many feature occurrences: features are numbered in first-seen
// order, so the frequent ones crowd the low numbers, and equal ranges of features would leave one thread most of the
// work. (A feature's row is summed by one thread whatever the split, so the split does not change the result.)
constexpr int64_t kGradientTasks = 512;

using Clock = std::chrono::steady_clock;

// Runs task(i) for every i in [0, n) on LibTorch's threads, each thread taking the next task when it is done with one
// (at::parallel_for gives each thread one contiguous range: tasks of unequal cost then leave threads idle). Which
// thread runs a task never changes what it computes.
void for_each_task(int64_t n, const std::function<void(int64_t)>& task) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) task(i);
  });
}

// The training set's features, extracted once: the dictionary (features seen at least min_count times, in
// first-seen order) and every training token's feature ids in it.
struct IndexedTrainingSet {
  std::vector<std::string> features;
  std::vector<std::vector<int64_t>> ids, counts;  // per sentence: its tokens' ids token after token; ids per token
};

IndexedTrainingSet index_features(const LabeledSentences& train, const FeatureExtractor& fx, int min_count) {
  // Three parallel passes, each writing only its own data (no locks, no shared cache lines), so the result is the
  // serial pass's first-seen order whatever the thread count:
  //  1. blocks of sentences: extract every feature occurrence into the block's packed text and hash it;
  //  2. shards of the hash space: each shard indexes its occurrences, in corpus order, in its own StringIndex,
  //     counting each key and noting its first occurrence, and lists the occurrences' shard-local ids in order;
  //  3. blocks again: occurrences -> ids among the kept features, ordered by first occurrence.
  const int64_t n = static_cast<int64_t>(train.inputs.size());
  const int64_t threads = at::get_num_threads();
  const int64_t blocks = std::min<int64_t>(n, 4 * threads);
  const uint64_t shards = static_cast<uint64_t>(threads);
  const auto shard_of = [&](uint64_t h) { return (h >> 32) % shards; };  // the index probes with the low bits
  struct alignas(64) Block {  // own cache lines: each thread appends to its blocks' vectors
    FeatureList text;
    std::vector<uint64_t> hash;
    std::vector<int64_t> in_shard;  // occurrences per shard
  };
  std::vector<Block> block(blocks);
  const auto sentences = [&](int64_t b) { return std::pair(n * b / blocks, n * (b + 1) / blocks); };
  IndexedTrainingSet out;
  out.ids.resize(n);
  out.counts.resize(n);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      Block& k = block[b];
      for (auto [s, s1] = sentences(b); s < s1; ++s) {
        const TokenRows& rows = train.inputs[s];
        for (std::size_t t = 0; t < rows.size(); ++t) {
          const std::size_t before = k.text.size();
          fx.extract(rows, t, k.text);
          out.counts[s].push_back(static_cast<int64_t>(k.text.size() - before));
        }
      }
      k.hash.reserve(k.text.size());
      k.in_shard.assign(shards, 0);
      for (const std::string_view f : k.text) ++k.in_shard[shard_of(k.hash.emplace_back(StringIndex::hash(f)))];
    }
  });

  struct alignas(64) Shard {
    StringIndex index;
    std::vector<int64_t> count, first;  // per key: occurrences, and the first one's position in the corpus
    std::vector<int64_t> ids;           // the shard's occurrences' ids, in corpus order
  };
  std::vector<Shard> shard(shards);
  at::parallel_for(0, static_cast<int64_t>(shards), 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      Shard& d = shard[s];
      int64_t occurrences = 0;
      for (const Block& k : block) occurrences += k.in_shard[s];
      d.ids.reserve(occurrences);
      int64_t position = 0;
      for (const Block& k : block) {
        for (std::size_t i = 0; i < k.hash.size(); ++i) {
          if (shard_of(k.hash[i]) != static_cast<uint64_t>(s)) continue;
          const auto [id, fresh] = d.index.insert(k.text[i], k.hash[i]);
          if (fresh) d.count.push_back(0), d.first.push_back(position + static_cast<int64_t>(i));
          ++d.count[id];
          d.ids.push_back(id);
        }
        position += static_cast<int64_t>(k.hash.size());
      }
    }
  });
  for (Block& k : block) k.text = FeatureList();  // the hashes carry on; the text is in the shards' keys now

  // The kept keys in first-seen order get ids 0, 1, ...; a shard-local id maps to its global id, or -1.
  std::vector<std::pair<int64_t, std::pair<uint64_t, int64_t>>> kept;  // (first occurrence, (shard, local id))
  for (uint64_t s = 0; s < shards; ++s)
    for (std::size_t j = 0; j < shard[s].count.size(); ++j)
      if (shard[s].count[j] >= min_count) kept.push_back({shard[s].first[j], {s, static_cast<int64_t>(j)}});
  std::sort(kept.begin(), kept.end());
  std::vector<std::vector<int64_t>> global(shards);
  std::vector<std::vector<std::string>> keys(shards);
  for (uint64_t s = 0; s < shards; ++s) {
    global[s].assign(shard[s].count.size(), -1);
    keys[s] = shard[s].index.release();
  }
  out.features.reserve(kept.size());
  for (const auto& [first, key] : kept) {
    global[key.first][key.second] = static_cast<int64_t>(out.features.size());
    out.features.push_back(std::move(keys[key.first][key.second]));
  }
  for (uint64_t s = 0; s < shards; ++s)
    for (int64_t& id : shard[s].ids) id = global[s][id];

  // Each block reads its occurrences' ids from every shard's list, starting after the earlier blocks' ones.
  std::vector<std::vector<int64_t>> cursor(blocks, std::vector<int64_t>(shards, 0));
  for (int64_t b = 1; b < blocks; ++b)
    for (uint64_t s = 0; s < shards; ++s) cursor[b][s] = cursor[b - 1][s] + block[b - 1].in_shard[s];
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const Block& k = block[b];
      std::vector<int64_t>& next = cursor[b];
      std::size_t i = 0;
      for (auto [s, s1] = sentences(b); s < s1; ++s)
        for (int64_t& c : out.counts[s]) {
          const std::size_t end = i + static_cast<std::size_t>(c);
          c = 0;
          for (; i < end; ++i) {
            const uint64_t sh = shard_of(k.hash[i]);
            if (const int64_t id = shard[sh].ids[next[sh]++]; id >= 0) out.ids[s].push_back(id), ++c;
          }
        }
    }
  });
  return out;
}

// Per feature, the ids of the labels it occurs with in the training data, increasing.
std::vector<std::vector<int64_t>> seen_labels(const LabeledSentences& train, const IndexedTrainingSet& indexed,
                                              const std::vector<std::string>& labels) {
  std::unordered_map<std::string, int64_t> label_id;
  for (std::size_t y = 0; y < labels.size(); ++y) label_id.emplace(labels[y], y);
  const int64_t K = static_cast<int64_t>(labels.size());
  // One bit per (feature, label): F·K bits, an eighth of a byte per weight of the dense model.
  std::vector<uint64_t> seen((indexed.features.size() * K + 63) / 64, 0);
  for (std::size_t s = 0; s < indexed.ids.size(); ++s) {
    std::size_t i = 0;
    for (std::size_t t = 0; t < indexed.counts[s].size(); ++t) {
      const int64_t y = label_id.at(train.labels[s][t]);
      for (int64_t n = 0; n < indexed.counts[s][t]; ++n, ++i) {
        const uint64_t bit = static_cast<uint64_t>(indexed.ids[s][i] * K + y);
        seen[bit / 64] |= uint64_t{1} << (bit % 64);
      }
    }
  }
  std::vector<std::vector<int64_t>> out(indexed.features.size());
  for (std::size_t f = 0; f < out.size(); ++f)
    for (int64_t y = 0; y < K; ++y) {
      const uint64_t bit = f * K + y;
      if (seen[bit / 64] >> (bit % 64) & 1) out[f].push_back(y);
    }
  return out;
}

// Labels in first-seen order.
std::vector<std::string> collect_labels(const LabeledSentences& train) {
  std::vector<std::string> labels;
  std::unordered_map<std::string, int> seen;
  for (const auto& s : train.labels)
    for (const auto& l : s)
      if (seen.emplace(l, 0).second) labels.push_back(l);
  return labels;
}

// Sentences in the given order, cut into batches of at most max_sentences sentences or about max_tokens tokens,
// on the device. Training sentences come from their indexed feature ids, others (dev) are extracted here.
std::vector<EncodedBatch> encode_batches(const CrfTagger& m, const LabeledSentences& data,
                                         const IndexedTrainingSet* indexed, const at::Device& device,
                                         const std::vector<std::size_t>& order, std::size_t max_sentences,
                                         int64_t max_tokens) {
  std::vector<EncodedBatch> batches;
  for (std::size_t i = 0; i < order.size();) {
    const std::size_t first = i;
    int64_t tokens = 0, longest = 0;
    for (; i < order.size() && tokens < max_tokens && i - first < max_sentences; ++i) {
      tokens += data.inputs[order[i]].size();
      longest = std::max<int64_t>(longest, data.inputs[order[i]].size());
    }
    EncodedBatch e;
    if (indexed) {
      std::vector<const std::vector<int64_t>*> ids, counts;
      std::vector<int64_t> tags((i - first) * longest, 0);
      for (std::size_t k = first; k < i; ++k) {
        ids.push_back(&indexed->ids[order[k]]);
        counts.push_back(&indexed->counts[order[k]]);
        const auto& labels = data.labels[order[k]];
        for (std::size_t t = 0; t < labels.size(); ++t) tags[(k - first) * longest + t] = m.label_id(labels[t]);
      }
      e = assemble_batch(ids, counts, tags);
    } else {
      std::vector<const TokenRows*> rows;
      std::vector<const std::vector<std::string>*> gold;
      for (std::size_t k = first; k < i; ++k)
        rows.push_back(&data.inputs[order[k]]), gold.push_back(&data.labels[order[k]]);
      e = m.encode(rows, &gold);
    }
    for (at::Tensor* t : {&e.feature_ids, &e.offsets, &e.positions, &e.lengths, &e.tags}) *t = t->to(device);
    batches.push_back(std::move(e));
  }
  return batches;
}

// Batches of about `max_tokens` tokens sorted by length, so padding stays small (full-batch objective, dev scoring):
// the sentences [first, first + count), or all of them.
std::vector<EncodedBatch> length_sorted_batches(const CrfTagger& m, const LabeledSentences& data,
                                                const IndexedTrainingSet* indexed, const at::Device& device,
                                                int64_t max_tokens, std::size_t first = 0,
                                                std::size_t count = std::numeric_limits<std::size_t>::max()) {
  std::vector<std::size_t> order(std::min(count, data.inputs.size() - first));
  std::iota(order.begin(), order.end(), first);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return data.inputs[a].size() < data.inputs[b].size(); });
  return encode_batches(m, data, indexed, device, order, std::numeric_limits<std::size_t>::max(), max_tokens);
}

// The full-batch objective -log-likelihood and its gradient on the CPU, the same bits on any number of threads.
// The sentences are cut into blocks fixed by the data alone; each thread takes whole blocks and computes each one's
// -log-likelihood and its gradient with respect to the block's token scores and the (small) transition, start and end
// weights, all of it serially within the block. The blocks' values and small gradients are then added in block
// order, and each feature's weight gradient is the sum of its tokens' score gradients, in token order, by one thread
// per feature: no per-thread copies of the [features, labels] gradient to zero and reduce, and no reduction whose
// order follows the thread count.
class BlockedObjective {
 public:
  // The token scores [tokens, K] of a block under a model with seen pairs: each feature occurrence adds its pairs'
  // weights to its token's labels (serially, as everything within a block).
  static at::Tensor seen_pair_scores(const CrfTagger& model, const EncodedBatch& b) {
    const int64_t K = model.transitions.size(0), tokens = b.offsets.numel(), nnz = b.feature_ids.numel();
    at::Tensor scores = at::zeros({tokens, K}, model.weights.options());
    float* out = scores.data_ptr<float>();
    const float* w = model.weights.data_ptr<float>();
    const int64_t* id = b.feature_ids.data_ptr<int64_t>();
    const int64_t* offset = b.offsets.data_ptr<int64_t>();
    const int64_t* pair_offset = model.pair_offsets().data_ptr<int64_t>();
    const int64_t* pair_label = model.pair_labels().data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t i = offset[t]; i < (t + 1 < tokens ? offset[t + 1] : nnz); ++i)
        for (int64_t p = pair_offset[id[i]]; p < pair_offset[id[i] + 1]; ++p) out[t * K + pair_label[p]] += w[p];
    return scores;
  }

  BlockedObjective(std::vector<EncodedBatch> blocks, int64_t num_features) : blocks_(std::move(blocks)) {
    int64_t tokens = 0;
    for (const EncodedBatch& b : blocks_) first_token_.push_back(tokens), tokens += b.offsets.numel();
    tokens_ = tokens;
    // Counting sort of every (feature, token) occurrence by feature; tokens stay in increasing order within one.
    occurrence_start_.assign(num_features + 1, 0);
    for (const EncodedBatch& b : blocks_) {
      const int64_t* id = b.feature_ids.data_ptr<int64_t>();
      for (int64_t i = 0; i < b.feature_ids.numel(); ++i) ++occurrence_start_[id[i] + 1];
    }
    for (int64_t f = 0; f < num_features; ++f) occurrence_start_[f + 1] += occurrence_start_[f];
    occurrence_token_.resize(occurrence_start_.back());
    std::vector<int64_t> next(occurrence_start_.begin(), occurrence_start_.end() - 1);
    for (std::size_t k = 0; k < blocks_.size(); ++k) {
      const EncodedBatch& b = blocks_[k];
      const int64_t* id = b.feature_ids.data_ptr<int64_t>();
      const int64_t* offset = b.offsets.data_ptr<int64_t>();
      const int64_t n = b.offsets.numel(), nnz = b.feature_ids.numel();
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = offset[t]; i < (t + 1 < n ? offset[t + 1] : nnz); ++i)
          occurrence_token_[next[id[i]]++] = first_token_[k] + t;
    }
    // A feature costs its occurrences and its row.
    const int64_t cost = static_cast<int64_t>(occurrence_token_.size()) + num_features;
    task_start_.push_back(0);
    for (int64_t f = 0; f < num_features; ++f)
      if ((occurrence_start_[f + 1] + f + 1) * kGradientTasks >= cost * static_cast<int64_t>(task_start_.size()))
        task_start_.push_back(f + 1);
    if (task_start_.back() != num_features) task_start_.push_back(num_features);
  }

  // -log-likelihood at the model's parameters; `gradients` gets its gradient for each of model.parameters().
  double evaluate(const CrfTagger& model, std::vector<at::Tensor>& gradients) {
    const int64_t K = model.transitions.size(0), blocks = static_cast<int64_t>(blocks_.size());
    if (!score_gradients_.defined()) score_gradients_ = at::empty({tokens_, K}, model.weights.options());
    std::vector<double> block_nll(blocks);
    std::vector<std::vector<at::Tensor>> block_gradients(blocks);  // transitions, start, end
    // The longest sentences' blocks first: they cost the most, and a thread that takes one last would finish last.
    for_each_task(blocks, [&](int64_t task) {
      c10::AutoGradMode grad_on(true);  // grad mode is thread-local: on for this block's graph on any thread
      {
        const int64_t k = blocks - 1 - task;
        const EncodedBatch& b = blocks_[k];
        // The block's leaves: its token scores, and its own handles on the shared transition, start and end weights.
        at::Tensor scores;
        {
          c10::NoGradGuard no_grad;
          scores = model.feature_pairs() == FeaturePairs::All
                       ? std::get<0>(at::embedding_bag(model.weights.detach(), b.feature_ids, b.offsets))
                       : seen_pair_scores(model, b);
        }
        scores.requires_grad_();
        ChainPotentials p;
        p.emissions = at::zeros({b.batch * b.max_length, K}, scores.options())
                          .index_copy(0, b.positions, scores)
                          .view({b.batch, b.max_length, K});
        p.transitions = model.transitions.detach().requires_grad_();
        p.start = model.start.detach().requires_grad_();
        p.end = model.end.detach().requires_grad_();
        p.lengths = b.lengths;
        p.values_checked = true;  // the trainer encoded the block itself
        // Summed in float64: the blocks' sums must not depend on which sentences share a block (with a process
        // group, a rank's share is blocked on its own), as the line search compares values in their last digits.
        const at::Tensor nll = -log_likelihood(p, b.tags).sum(at::kDouble);
        std::vector<at::Tensor> g = torch::autograd::grad({nll}, {scores, p.transitions, p.start, p.end});
        score_gradients_.narrow(0, first_token_[k], scores.size(0)).copy_(g[0]);
        block_nll[k] = nll.item<double>();
        block_gradients[k] = {g[1], g[2], g[3]};
      }
    });
    double nll = 0;
    for (int64_t k = 0; k < blocks; ++k) nll += block_nll[k];
    gradients.assign(4, at::Tensor());
    for (int i = 0; i < 3; ++i) {
      // In block order, as float adds on raw pointers: hundreds of small tensors, where ATen's per-call cost would
      // be a serial part of every evaluation.
      gradients[i + 1] = block_gradients[0][i].clone();
      float* sum = gradients[i + 1].data_ptr<float>();
      const int64_t n = gradients[i + 1].numel();
      for (int64_t k = 1; k < blocks; ++k) {
        const float* g = block_gradients[k][i].contiguous().data_ptr<float>();
        for (int64_t j = 0; j < n; ++j) sum[j] += g[j];
      }
    }
    // The weight gradient's buffer is reused: a fresh one every evaluation would be page-faulted in again.
    if (!weight_gradient_.defined() || weight_gradient_.use_count() > 1)
      weight_gradient_ = at::empty_like(model.weights);
    gradients[0] = weight_gradient_;
    float* out = gradients[0].data_ptr<float>();
    const float* score = score_gradients_.data_ptr<float>();
    const bool seen = model.feature_pairs() == FeaturePairs::Seen;
    const int64_t* pair_offset = seen ? model.pair_offsets().data_ptr<int64_t>() : nullptr;
    const int64_t* pair_label = seen ? model.pair_labels().data_ptr<int64_t>() : nullptr;
    // Summed in float64: a frequent feature's gradient is a small difference of many large terms.
    const int64_t tasks = static_cast<int64_t>(task_start_.size()) - 1;
    for_each_task(tasks, [&](int64_t task) {
      std::vector<double> sum(K);
      for (int64_t f = task_start_[task]; f < task_start_[task + 1]; ++f) {
        std::fill(sum.begin(), sum.end(), 0.0);
        for (int64_t i = occurrence_start_[f]; i < occurrence_start_[f + 1]; ++i) {
          const float* s = score + occurrence_token_[i] * K;
          for (int64_t y = 0; y < K; ++y) sum[y] += s[y];
        }
        if (seen) {
          for (int64_t p = pair_offset[f]; p < pair_offset[f + 1]; ++p) out[p] = static_cast<float>(sum[pair_label[p]]);
        } else {
          std::copy(sum.begin(), sum.end(), out + f * K);
        }
      }
    });
    return nll;
  }

 private:
  std::vector<EncodedBatch> blocks_;
  std::vector<int64_t> first_token_;  // per block: the row of its first token in score_gradients_
  int64_t tokens_ = 0;
  // The tokens (rows of score_gradients_) in which feature f occurs: occurrence_token_[occurrence_start_[f] ..
  // occurrence_start_[f + 1]), in increasing order.
  std::vector<int64_t> occurrence_start_, occurrence_token_;
  std::vector<int64_t> task_start_;  // the weight-gradient pass's tasks: features task_start_[i] .. task_start_[i + 1]
  at::Tensor weight_gradient_;       // the weights' gradient, rewritten by every evaluation
  at::Tensor score_gradients_;  // [tokens, K]: ∂(-log-likelihood)/∂(token score), rewritten by every evaluation
};

// A minibatch: this rank's part of its sentences (none when the minibatch has fewer sentences than there are ranks),
// and the whole minibatch's tokens (its share of the L2 term).
struct Minibatch {
  std::optional<EncodedBatch> part;
  int64_t tokens = 0;
};

// Minibatches of a seeded random partition (fixed for the run; their order is shuffled every epoch). Every rank draws
// the same partition and keeps its part of each minibatch (consecutive sentences, balanced by tokens).
std::vector<Minibatch> random_minibatches(const CrfTagger& m, const LabeledSentences& data,
                                          const IndexedTrainingSet& indexed, const at::Device& device,
                                          std::size_t batch_size, std::mt19937_64& rng,
                                          const DistributedContext* group) {
  std::vector<std::size_t> order(data.inputs.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const int rank = group ? group->rank() : 0, world = group ? group->world_size() : 1;
  std::vector<Minibatch> out;
  for (std::size_t first = 0; first < order.size(); first += batch_size) {
    const std::vector<std::size_t> sentences(order.begin() + first,
                                             order.begin() + std::min(order.size(), first + batch_size));
    std::vector<int64_t> lengths;
    for (std::size_t s : sentences) lengths.push_back(static_cast<int64_t>(data.inputs[s].size()));
    const std::vector<int64_t> bounds = balanced_shares(lengths, world);
    const std::vector<std::size_t> part(sentences.begin() + bounds[rank], sentences.begin() + bounds[rank + 1]);
    Minibatch b;
    b.tokens = std::accumulate(lengths.begin(), lengths.end(), int64_t(0));
    if (!part.empty())
      b.part = std::move(
          encode_batches(m, data, &indexed, device, part, part.size(), std::numeric_limits<int64_t>::max()).front());
    out.push_back(std::move(b));
  }
  return out;
}

std::unique_ptr<torch::optim::Optimizer> make_minibatch_optimizer(CrfAlgorithm algorithm,
                                                                  const std::vector<at::Tensor>& params, double lr) {
  switch (algorithm) {
    case CrfAlgorithm::Sgd: return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(lr));
    case CrfAlgorithm::Adagrad:
      return std::make_unique<torch::optim::Adagrad>(params, torch::optim::AdagradOptions(lr));
    case CrfAlgorithm::Adam: return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(lr));
    case CrfAlgorithm::Lbfgs: break;
  }
  throw Error(std::string("no minibatch optimiser is called ") + crf_algorithm_name(algorithm));
}

// The chain potentials of a batch the trainer encoded itself: lengths and tags need no range check (and no sync).
ChainPotentials trusted_potentials(const CrfTagger& m, const EncodedBatch& b) {
  ChainPotentials p = m.potentials(b);
  p.values_checked = true;
  return p;
}

// What the optimisers minimise: −log-likelihood + c2·‖θ‖² over this process's share of the training data (summed over
// the process group, when there is one), its gradient left in the parameters' .grad(). Full batch, it is summed over
// blocks (CPU, `blocked`) or length-sorted batches (GPU); minibatch, one pass is an epoch of optimiser steps.
class CrfObjective {
 public:
  CrfObjective(CrfTagger& model, std::vector<at::Tensor> params, double c2, double total_tokens,
               const DistributedContext* group, std::optional<BlockedObjective> blocked,
               std::vector<EncodedBatch> batches, std::vector<Minibatch> minibatches)
      : model_(model), params_(std::move(params)), c2_(c2), total_tokens_(total_tokens), group_(group),
        blocked_(std::move(blocked)), batches_(std::move(batches)), minibatches_(std::move(minibatches)) {}

  const std::vector<at::Tensor>& params() const { return params_; }

  // The full-batch objective.
  double full_batch() {
    for (auto& p : params_) p.mutable_grad() = at::Tensor();
    at::Tensor total = at::zeros({}, params_[0].options().dtype(at::kDouble).requires_grad(false));
    summed_over_ranks(
        [&] {
          if (blocked_) {
            std::vector<at::Tensor> gradients;
            total.fill_(blocked_->evaluate(model_, gradients));
            for (std::size_t i = 0; i < params_.size(); ++i) params_[i].mutable_grad() = gradients[i];
            return;
          }
          for (const EncodedBatch& b : batches_) {
            const at::Tensor nll = -log_likelihood(trusted_potentials(model_, b), b.tags).sum();
            nll.backward();
            total += nll.detach();
          }
        },
        total);
    return total.item<double>() + add_l2(1.0);
  }

  // One pass over the minibatches in a shuffled order, one step of `optimizer` each; returns the summed objective.
  double epoch(torch::optim::Optimizer& optimizer, std::mt19937_64& rng) {
    std::vector<std::size_t> order(minibatches_.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    at::Tensor total = at::zeros({}, params_[0].options().requires_grad(false));
    double l2 = 0;
    for (std::size_t i : order) {
      const Minibatch& b = minibatches_[i];
      optimizer.zero_grad();
      at::Tensor nll;
      summed_over_ranks(
          [&] {
            if (!b.part) return;
            nll = -log_likelihood(trusted_potentials(model_, *b.part), b.part->tags).sum();
            nll.backward();
            nll = nll.detach();
          },
          nll);
      total += nll;  // no sync
      l2 += add_l2(static_cast<double>(b.tokens) / total_tokens_);
      optimizer.step();
    }
    return total.item<double>() + l2;
  }

 private:
  // c2·‖θ‖² (times `share`, a minibatch's share of the data) and its gradient, added in place: no autograd graph
  // over millions of weights, and a sum whose bits do not depend on the thread count.
  double add_l2(double share) {
    c10::NoGradGuard no_grad;
    double squares = 0;
    for (auto& p : params_) {
      squares += fixed_order_dot(p, p);
      p.mutable_grad().add_(p, 2 * share * c2_);
    }
    return share * c2_ * squares;
  }

  // With a process group: sums this rank's gradients and `value` over the ranks (a rank without sentences adds
  // zeros). `local` computes them; its failure on any rank stops every rank with its message.
  void summed_over_ranks(const std::function<void()>& local, at::Tensor& value) {
    if (!group_) {
      local();
      return;
    }
    const std::optional<std::string> failure = failure_of(local);
    std::vector<at::Tensor> tensors;
    for (auto& p : params_) {
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      tensors.push_back(p.grad());
    }
    if (!value.defined()) value = at::zeros({}, params_[0].options().requires_grad(false));
    tensors.push_back(value);
    group_->all_reduce_sum(tensors, failure);
  }

  CrfTagger& model_;
  std::vector<at::Tensor> params_;
  double c2_, total_tokens_;
  const DistributedContext* group_;
  std::optional<BlockedObjective> blocked_;
  std::vector<EncodedBatch> batches_;
  std::vector<Minibatch> minibatches_;
};

// One iteration of an optimiser over a CrfObjective: step() returns the objective it evaluated, gradient_norm() the
// norm of the gradient it stepped along (the pseudo-gradient with L1).
class CrfOptimiser {
 public:
  virtual ~CrfOptimiser() = default;
  virtual double step() = 0;
  virtual double gradient_norm() const = 0;
};

// L-BFGS over the full-batch objective (no L1).
class LbfgsDriver : public CrfOptimiser {
 public:
  explicit LbfgsDriver(CrfObjective& f) : lbfgs_(f.params(), [&f] { return f.full_batch(); }) {}
  double step() override { return lbfgs_.step(); }
  double gradient_norm() const override { return lbfgs_.gradient_norm(); }

 private:
  Lbfgs lbfgs_;
};

// OWL-QN over the full-batch objective with c1·‖θ‖₁.
class OwlQnDriver : public CrfOptimiser {
 public:
  OwlQnDriver(CrfObjective& f, double c1) : owlqn_(f.params(), c1, [&f] { return f.full_batch(); }) {}
  double step() override { return owlqn_.step(); }
  double gradient_norm() const override { return owlqn_.pseudo_gradient_norm(); }

 private:
  OwlQn owlqn_;
};

// One epoch of a LibTorch optimiser (SGD, Adagrad, Adam) over the minibatches per iteration.
class MinibatchDriver : public CrfOptimiser {
 public:
  MinibatchDriver(CrfObjective& f, CrfAlgorithm algorithm, double learning_rate, std::mt19937_64& rng)
      : f_(f), optimizer_(make_minibatch_optimizer(algorithm, f.params(), learning_rate)), rng_(rng) {}
  double step() override { return f_.epoch(*optimizer_, rng_); }
  // In float64, so that only a gradient that is itself inf or NaN gives a non-finite norm.
  double gradient_norm() const override {
    double squares = 0;
    for (const auto& p : f_.params()) squares += fixed_order_dot(p.grad(), p.grad());
    return std::sqrt(squares);
  }

 private:
  CrfObjective& f_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::mt19937_64& rng_;
};

std::unique_ptr<CrfOptimiser> make_optimiser(const CrfTrainOptions& o, CrfObjective& f, std::mt19937_64& rng) {
  if (o.algorithm != CrfAlgorithm::Lbfgs)
    return std::make_unique<MinibatchDriver>(f, o.algorithm, o.learning_rate, rng);
  if (o.c1 > 0) return std::make_unique<OwlQnDriver>(f, o.c1);
  return std::make_unique<LbfgsDriver>(f);
}

// Scores the model on batches encoded once (features are not extracted again every iteration).
ChunkEvaluation evaluate(const CrfTagger& m, const std::vector<EncodedBatch>& batches) {
  c10::NoGradGuard no_grad;
  ChunkEvaluation ev;
  const auto& names = m.labels();
  for (const EncodedBatch& b : batches) {
    const at::Tensor path = viterbi(trusted_potentials(m, b)).path.cpu(), gold = b.tags.cpu(), len = b.lengths.cpu();
    const auto P = path.accessor<int64_t, 2>(), Y = gold.accessor<int64_t, 2>();
    const auto Ln = len.accessor<int64_t, 1>();
    for (int64_t s = 0; s < b.batch; ++s) {
      std::vector<std::string> want, got;
      for (int64_t t = 0; t < Ln[s]; ++t) {
        want.push_back(names[Y[s][t]]);
        got.push_back(names[P[s][t]]);
      }
      ev.add_sentence(want, got);
    }
  }
  return ev;
}

// A number as a message shows it: "nan", "inf" and "-inf" whatever the sign bit or platform.
std::string show(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::ostringstream s;
  s << v;
  return s.str();
}

// Every option is checked before any work starts, so that a nonsensical value is an error rather than a model of NaNs
// or zeros. The messages name the `trellis crf train` flags (period has none).
void check_options(const CrfTrainOptions& o) {
  crf_algorithm_name(o.algorithm);  // a value outside the enumeration is an Error
  const auto non_negative = [](double v, const char* flag) {
    if (!std::isfinite(v) || v < 0) throw Error(std::string(flag) + " must be a finite number >= 0, not " + show(v));
  };
  const auto at_least_one = [](int64_t v, const char* flag) {
    if (v < 1) throw Error(std::string(flag) + " must be at least 1, not " + std::to_string(v));
  };
  non_negative(o.c2, "--c2");
  non_negative(o.c1, "--c1");
  if (o.c1 > 0 && o.algorithm != CrfAlgorithm::Lbfgs)
    throw Error("L1 regularisation (--c1 > 0) trains with OWL-QN, which needs --algorithm lbfgs, not '" +
                std::string(crf_algorithm_name(o.algorithm)) + "'");
  if (!std::isfinite(o.learning_rate) || o.learning_rate <= 0)
    throw Error("--learning-rate must be a finite number > 0, not " + show(o.learning_rate));
  // A size above INT64_MAX is a negative number wrapped round by an unsigned parser: shown as the number typed.
  if (o.batch_size < 1 || o.batch_size > static_cast<std::size_t>(std::numeric_limits<int64_t>::max()))
    throw Error("--batch-size must be at least 1, not " + std::to_string(static_cast<int64_t>(o.batch_size)));
  at_least_one(o.max_iterations, "--max-iter");
  non_negative(o.tolerance, "--tolerance");
  at_least_one(o.period, "the tolerance period (CrfTrainOptions::period)");
  at_least_one(o.min_feature_count, "--min-freq");
  if (o.early_stopping < 0)
    throw Error("--early-stopping must be >= 0 (0: off), not " + std::to_string(o.early_stopping));
  if (o.threads < 0) throw Error("--threads must be >= 0 (0: all), not " + std::to_string(o.threads));
}

}  // namespace

CrfAlgorithm parse_crf_algorithm(const std::string& name) {
  for (const CrfAlgorithm a : {CrfAlgorithm::Lbfgs, CrfAlgorithm::Sgd, CrfAlgorithm::Adagrad, CrfAlgorithm::Adam})
    if (name == crf_algorithm_name(a)) return a;
  throw Error("--algorithm must be lbfgs, sgd, adagrad or adam, not '" + name + "'");
}

const char* crf_algorithm_name(CrfAlgorithm algorithm) {
  switch (algorithm) {
    case CrfAlgorithm::Lbfgs: return "lbfgs";
    case CrfAlgorithm::Sgd: return "sgd";
    case CrfAlgorithm::Adagrad: return "adagrad";
    case CrfAlgorithm::Adam: return "adam";
  }
  throw Error("CrfTrainOptions::algorithm holds " + std::to_string(static_cast<int>(algorithm)) +
              ", which is no CrfAlgorithm");
}

TrainingShare training_share(const LabeledSentences& train, const DistributedContext* distributed) {
  std::vector<int64_t> lengths;
  for (const auto& s : train.inputs) lengths.push_back(static_cast<int64_t>(s.size()));
  const int rank = distributed ? distributed->rank() : 0, world = distributed ? distributed->world_size() : 1;
  const std::vector<int64_t> bounds = balanced_shares(lengths, world);
  TrainingShare share{static_cast<std::size_t>(bounds[rank]), static_cast<std::size_t>(bounds[rank + 1] - bounds[rank]),
                      0};
  for (std::size_t s = share.first; s < share.first + share.count; ++s) share.tokens += train.inputs[s].size();
  return share;
}

void check_known_labels(const CrfTagger& m, const LabeledSentences& data) {
  for (std::size_t s = 0; s < data.labels.size(); ++s)
    for (std::size_t t = 0; t < data.labels[s].size(); ++t)
      if (m.label_id(data.labels[s][t]) < 0)
        throw ParseError(data.source, (s < data.first_lines.size() ? data.first_lines[s] : 0) + t,
                         "label '" + data.labels[s][t] + "' does not occur in the training data");
}

std::size_t LabeledSentences::num_tokens() const {
  std::size_t n = 0;
  for (const auto& s : inputs) n += s.size();
  return n;
}

LabeledSentences split_labels(const ConllCorpus& corpus, int label_column) {
  const int cols = static_cast<int>(corpus.num_columns);
  const int label = label_column < 0 ? cols + label_column : label_column;
  if (label < 0 || label >= cols)
    throw Error("'" + corpus.source + "': label column " + std::to_string(label_column) + " is outside its " +
                std::to_string(cols) + " columns");
  if (cols < 2) throw Error("'" + corpus.source + "': needs at least one input column besides the label");
  LabeledSentences out;
  out.source = corpus.source;
  for (const ConllSentence& s : corpus.sentences) {
    TokenRows rows;
    std::vector<std::string> labels;
    for (const auto& row : s.rows) {
      labels.push_back(row[label]);
      std::vector<std::string> in;
      for (int c = 0; c < cols; ++c)
        if (c != label) in.push_back(row[c]);
      rows.push_back(std::move(in));
    }
    out.inputs.push_back(std::move(rows));
    out.labels.push_back(std::move(labels));
    out.first_lines.push_back(s.first_line);
  }
  return out;
}

CrfTagger train_crf(const LabeledSentences& train, const LabeledSentences* dev,
                    std::unique_ptr<FeatureExtractor> extractor, const CrfTrainOptions& o,
                    const std::function<void(const CrfIteration&)>& on_iteration, CrfTrainSummary* summary) {
  const auto t0 = Clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  check_options(o);
  start_training(train, o.threads);
  const at::Device device = o.device;
  // Starting CUDA (0.1-0.2 s) overlaps the feature pass on the CPU.
  std::future<void> device_ready = std::async(std::launch::async, [device] {
    if (!device.is_cpu()) at::empty({0}, at::TensorOptions().device(device));
  });

  const std::size_t columns = train.inputs.front().front().size();
  extractor->validate(columns, train.source);
  IndexedTrainingSet indexed = index_features(train, *extractor, o.min_feature_count);
  std::vector<std::string> labels = collect_labels(train);
  std::optional<std::vector<std::vector<int64_t>>> pairs;
  if (o.feature_pairs == FeaturePairs::Seen) pairs = seen_labels(train, indexed, labels);
  CrfTagger model(std::move(labels), std::move(indexed.features), std::move(extractor), columns,
                  pairs ? &*pairs : nullptr);
  pairs.reset();
  if (dev) check_known_labels(model, *dev);
  device_ready.get();
  model.to(device);
  const bool full_batch = o.algorithm == CrfAlgorithm::Lbfgs;
  const DistributedContext* group = o.distributed && o.distributed->distributed() ? o.distributed : nullptr;
  std::mt19937_64 rng(o.seed);
  const TrainingShare share = training_share(train, group);
  // Full batch on the CPU: blocks (BlockedObjective); on a GPU: large batches, one after another.
  std::optional<BlockedObjective> blocked;
  if (full_batch && device.is_cpu())
    blocked.emplace(length_sorted_batches(model, train, &indexed, device, kTokensPerBlock, share.first, share.count),
                    static_cast<int64_t>(model.features().size()));
  std::vector<EncodedBatch> batches =
      full_batch && !blocked
          ? length_sorted_batches(model, train, &indexed, device, kTokensPerBatch, share.first, share.count)
          : std::vector<EncodedBatch>{};
  std::vector<Minibatch> minibatches =
      full_batch ? std::vector<Minibatch>{}
                 : random_minibatches(model, train, indexed, device, o.batch_size, rng, group);
  indexed = {};  // the batches hold the ids now
  const std::vector<EncodedBatch> dev_batches =
      dev ? length_sorted_batches(model, *dev, nullptr, device, kTokensPerBatch) : std::vector<EncodedBatch>{};
  const double total_tokens = static_cast<double>(train.num_tokens());

  std::vector<at::Tensor> params = model.parameters();
  for (auto& p : params) p.requires_grad_();
  model.weights = params[0], model.transitions = params[1], model.start = params[2], model.end = params[3];

  CrfObjective objective(model, params, o.c2, total_tokens, group, std::move(blocked), std::move(batches),
                         std::move(minibatches));
  const std::unique_ptr<CrfOptimiser> optimiser = make_optimiser(o, objective, rng);

  CrfTrainSummary sum;
  sum.setup_seconds = elapsed();
  sum.features = model.features().size();
  for (auto& p : params) sum.parameters += p.numel();
  std::vector<double> history;
  std::vector<at::Tensor> best;
  double best_score = -1;
  for (int it = 1; it <= o.max_iterations; ++it) {
    const double f = optimiser->step();
    const double gnorm = optimiser->gradient_norm();
    if (!std::isfinite(f) || !std::isfinite(gnorm))
      throw Error("training diverged at iteration " + std::to_string(it) + ": the objective (" + show(f) +
                  ") or its gradient (norm " + show(gnorm) + ") is not finite" +
                  (full_batch ? "" : "; a smaller --learning-rate may help"));
    CrfIteration rec{it, f, gnorm, elapsed(), std::nullopt, std::nullopt};
    history.push_back(f);
    sum.iterations = it;
    bool stop = false;
    if (dev) {
      const ChunkEvaluation ev = evaluate(model, dev_batches);
      rec.dev_accuracy = ev.accuracy();
      const bool chunks = ev.overall.gold > 0;  // chunk labels (B-X, I-X, ...) rather than plain tags
      if (chunks) rec.dev_f1 = ev.overall.f1();
      const double score = chunks ? *rec.dev_f1 : *rec.dev_accuracy;
      if (score > best_score) {
        best_score = score;
        sum.best_iteration = it;
        sum.best_dev_accuracy = rec.dev_accuracy;
        sum.best_dev_f1 = rec.dev_f1;
        best.clear();
        for (auto& p : params) best.push_back(p.detach().clone());
      }
      // No better dev score for a while counts as converged: more iterations would not help.
      if (o.early_stopping > 0 && it - sum.best_iteration >= o.early_stopping) sum.converged = stop = true;
    }
    if (on_iteration) on_iteration(rec);
    if (static_cast<int>(history.size()) > o.period) {
      const double before = history[history.size() - 1 - o.period];
      if ((before - f) / std::max(std::abs(f), 1e-12) < o.tolerance) sum.converged = stop = true;
    }
    // A line search that found no lower point leaves nothing to gain (and each further one costs many evaluations).
    if (full_batch && history.size() > 1 && !(f < history[history.size() - 2])) sum.converged = stop = true;
    if (stop) break;
  }
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params.size(); ++i) params[i] = (best.empty() ? params[i] : best[i]).detach();
  model.weights = params[0], model.transitions = params[1], model.start = params[2], model.end = params[3];
  // The last step may have left the parameters at a point whose objective was never reported.
  for (const auto& p : params)
    if (!at::isfinite(p).all().item<bool>())
      throw Error("training diverged: the trained weights are not finite" +
                  std::string(full_batch ? "" : "; a smaller --learning-rate may help"));
  model.to(at::kCPU);
  for (const auto& p : params) sum.nonzero_parameters += p.count_nonzero().item<int64_t>();
  sum.seconds = elapsed();
  if (summary) *summary = sum;
  return model;
}

}  // namespace trellis
