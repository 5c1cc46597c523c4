#include "trellis/crf/crf_tagger.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include "lib/src/train/encoded_batch.h"
#include "lib/src/io/input_file.h"
#include "lib/src/io/model_file.h"
#include "lib/src/io/string_index.h"
#include "trellis/io/atomic_file.h"
#include "trellis/error.h"

namespace trellis {
namespace {

constexpr char kMagic[8] = {'T', 'R', 'E', 'L', 'C', 'R', 'F', '\n'};
constexpr uint32_t kFirstFormatVersion = 1;  // no column layout: inputs first, the label last
constexpr uint32_t kDensePairsVersion = 2;   // every feature with every label: written for such models
constexpr uint32_t kFormatVersion = 3;       // version 2 with the seen (feature, label) pairs before the weights
constexpr int64_t kTagChunk = 1024;          // sentences decoded per batch

// Weights of -inf (set through the API; model files hold finite ones) can forbid every label sequence of a sentence:
// its probabilities would be NaN, so it is an error instead. best_scores [B] of the sentences first, first + 1, ...
void check_some_path(const at::Tensor& best_scores, std::size_t first) {
  const at::Tensor none = ~at::isfinite(best_scores.cpu());
  if (none.any().item<bool>())
    throw Error("sentence " + std::to_string(first + none.nonzero()[0][0].item<int64_t>()) +
                ": the model allows no label sequence (every path has a weight of -inf)");
}

}  // namespace

ColumnLayout ColumnLayout::resolve(std::size_t columns, int label_column, const std::vector<int>& input_columns,
                                   const std::string& source) {
  const auto index = [&](int c, const char* option) {
    const long resolved = c < 0 ? static_cast<long>(columns) + c : c;
    if (resolved < 0 || resolved >= static_cast<long>(columns))
      throw Error(std::string(option) + " " + std::to_string(c) + " is out of range: '" + source + "' has " +
                  std::to_string(columns) + " columns (0.." + std::to_string(static_cast<long>(columns) - 1) +
                  ", or -1 for the last)");
    return static_cast<std::size_t>(resolved);
  };
  if (columns < 2)
    throw Error("'" + source + "' has " + std::to_string(columns) +
                " column; a tagger needs an input and a label column");
  ColumnLayout l;
  l.columns = columns;
  l.label = index(label_column, "--label-column");
  if (input_columns.empty()) {
    for (std::size_t c = 0; c < l.label; ++c) l.inputs.push_back(c);
    if (l.inputs.empty())
      throw Error("'" + source + "': the label column is the first; name the input columns with --input-columns");
  }
  for (int c : input_columns) {
    const std::size_t i = index(c, "--input-columns");
    if (i == l.label) throw Error("--input-columns names the label column " + std::to_string(i));
    if (std::find(l.inputs.begin(), l.inputs.end(), i) != l.inputs.end())
      throw Error("--input-columns names column " + std::to_string(i) + " twice");
    l.inputs.push_back(i);
  }
  return l;
}

ColumnLayout ColumnLayout::inputs_then_label(std::size_t inputs) {
  ColumnLayout l;
  l.columns = inputs + 1;
  l.label = inputs;
  for (std::size_t c = 0; c < inputs; ++c) l.inputs.push_back(c);
  return l;
}

std::vector<std::size_t> ColumnLayout::ignored() const {
  std::vector<std::size_t> out;
  for (std::size_t c = 0; c < columns; ++c)
    if (c != label && std::find(inputs.begin(), inputs.end(), c) == inputs.end()) out.push_back(c);
  return out;
}

std::string ColumnLayout::describe() const {
  const auto list = [](const std::vector<std::size_t>& v) {
    std::string s;
    for (std::size_t c : v) s += (s.empty() ? "" : ",") + std::to_string(c);
    return s;
  };
  std::string s = std::to_string(columns) + " columns: input" + (inputs.size() > 1 ? "s " : " ") + list(inputs) +
                  ", label " + std::to_string(label);
  if (const auto skip = ignored(); !skip.empty()) s += ", ignored " + list(skip);
  return s;
}

ConllCorpus ColumnLayout::project(const ConllCorpus& corpus, bool* has_labels) const {
  const bool labelled = corpus.num_columns == columns;
  if (!labelled && corpus.num_columns + 1 != columns)
    throw Error("'" + corpus.source + "' has " + std::to_string(corpus.num_columns) +
                " columns; the model was trained on " + describe() + " (a file without the label column has " +
                std::to_string(columns - 1) + ")");
  // Without the label column, the columns after it sit one place to the left.
  const auto at = [&](std::size_t c) { return labelled || c < label ? c : c - 1; };
  ConllCorpus out;
  out.source = corpus.source;
  out.num_columns = inputs.size() + (labelled ? 1 : 0);
  out.sentences.reserve(corpus.sentences.size());
  for (const ConllSentence& s : corpus.sentences) {
    ConllSentence p;
    p.first_line = s.first_line;
    p.rows.reserve(s.rows.size());
    for (const auto& row : s.rows) {
      std::vector<std::string> r;
      r.reserve(out.num_columns);
      for (std::size_t c : inputs) r.push_back(row[at(c)]);
      if (labelled) r.push_back(row[label]);
      p.rows.push_back(std::move(r));
    }
    out.sentences.push_back(std::move(p));
  }
  if (has_labels) *has_labels = labelled;
  return out;
}

FeaturePairs parse_feature_pairs(const std::string& name) {
  if (name == "all") return FeaturePairs::All;
  if (name == "seen") return FeaturePairs::Seen;
  throw Error(
      "--feature-pairs must be all (every feature with every label) or seen (the pairs seen in training), not '" +
      name + "'");
}

std::string feature_pairs_name(FeaturePairs pairs) { return pairs == FeaturePairs::Seen ? "seen" : "all"; }

CrfTagger::CrfTagger(std::vector<std::string> labels, std::vector<std::string> features,
                     std::unique_ptr<FeatureExtractor> extractor, std::size_t input_columns,
                     const std::vector<std::vector<int64_t>>* seen_labels)
    : labels_(std::move(labels)), features_(std::make_shared<const StringIndex>(std::move(features), "feature")),
      extractor_(std::move(extractor)), input_columns_(input_columns),
      layout_(ColumnLayout::inputs_then_label(input_columns)) {
  if (labels_.empty()) throw Error("a CRF tagger needs at least one label");
  for (std::size_t i = 0; i < labels_.size(); ++i)
    if (!label_ids_.emplace(labels_[i], i).second) throw Error("duplicate label '" + labels_[i] + "'");
  const int64_t K = labels_.size(), F = features_->size();
  if (seen_labels) {
    if (static_cast<int64_t>(seen_labels->size()) != F)
      throw Error("seen feature pairs for " + std::to_string(seen_labels->size()) + " features, not " +
                  std::to_string(F));
    std::vector<int64_t> offsets{0}, pair_labels;
    for (int64_t f = 0; f < F; ++f) {
      for (std::size_t i = 0; i < (*seen_labels)[f].size(); ++i) {
        const int64_t y = (*seen_labels)[f][i];
        if (y < 0 || y >= K || (i > 0 && y <= (*seen_labels)[f][i - 1]))
          throw Error("feature " + std::to_string(f) + ": seen label ids must increase within [0, " +
                      std::to_string(K) + ")");
        pair_labels.push_back(y);
      }
      offsets.push_back(static_cast<int64_t>(pair_labels.size()));
    }
    pair_offsets_ = at::tensor(offsets, at::kLong);
    pair_labels_ = at::tensor(pair_labels, at::kLong);
    weights = at::zeros({static_cast<int64_t>(pair_labels.size())}, at::kFloat);
  } else {
    weights = at::zeros({F, K}, at::kFloat);
  }
  transitions = at::zeros({K, K}, at::kFloat);
  start = at::zeros({K}, at::kFloat);
  end = at::zeros({K}, at::kFloat);
}

const std::vector<std::string>& CrfTagger::features() const { return features_->keys(); }

std::pair<int64_t, int64_t> CrfTagger::weight_pair(int64_t j) const {
  const int64_t K = static_cast<int64_t>(labels_.size());
  if (!pair_labels_.defined()) return {j / K, j % K};
  const int64_t* offsets = pair_offsets_.data_ptr<int64_t>();
  const int64_t f = std::upper_bound(offsets, offsets + pair_offsets_.numel(), j) - offsets - 1;
  return {f, pair_labels_.data_ptr<int64_t>()[j]};
}

int64_t CrfTagger::label_id(const std::string& label) const {
  const auto it = label_ids_.find(label);
  return it == label_ids_.end() ? -1 : it->second;
}

void CrfTagger::set_layout(ColumnLayout layout) {
  if (layout.inputs.size() != input_columns_ || layout.label >= layout.columns)
    throw Error("a column layout with " + std::to_string(layout.inputs.size()) + " inputs (" + layout.describe() +
                ") does not fit a model of " + std::to_string(input_columns_) + " input columns");
  layout_ = std::move(layout);
}

void CrfTagger::to(const at::Device& device) {
  for (at::Tensor* t : {&weights, &transitions, &start, &end}) *t = t->detach().to(device);
}

EncodedBatch CrfTagger::encode(const std::vector<const TokenRows*>& sentences,
                               const std::vector<const std::vector<std::string>*>* gold) const {
  EncodedBatch e;
  e.batch = static_cast<int64_t>(sentences.size());
  for (const TokenRows* s : sentences) e.max_length = std::max<int64_t>(e.max_length, s->size());
  // Feature extraction (string work) runs for the sentences in parallel; the results are concatenated in order.
  std::vector<std::vector<int64_t>> ids(e.batch), counts(e.batch);
  std::vector<int64_t> tags(gold ? e.batch * e.max_length : 0, 0);
  at::parallel_for(0, e.batch, 16, [&](int64_t b0, int64_t b1) {
    FeatureList feats;
    for (int64_t b = b0; b < b1; ++b) {
      const TokenRows& rows = *sentences[b];
      if (rows.empty()) throw Error("sentence " + std::to_string(b) + " is empty");
      if (gold && (*gold)[b]->size() != rows.size())
        throw Error("sentence " + std::to_string(b) + ": " + std::to_string(rows.size()) + " tokens but " +
                    std::to_string((*gold)[b]->size()) + " labels");
      for (std::size_t t = 0; t < rows.size(); ++t) {
        if (rows[t].size() != input_columns_)
          throw Error("sentence " + std::to_string(b) + ", token " + std::to_string(t) + ": expected " +
                      std::to_string(input_columns_) + " input columns, found " + std::to_string(rows[t].size()));
        feats.clear();
        extractor_->extract(rows, t, feats);
        const std::size_t before = ids[b].size();
        for (const std::string_view f : feats)
          if (const int64_t id = features_->find(f); id >= 0) ids[b].push_back(id);
        counts[b].push_back(static_cast<int64_t>(ids[b].size() - before));
        if (gold) {
          const std::string& label = (*(*gold)[b])[t];
          const int64_t y = label_id(label);
          if (y < 0)
            throw Error("sentence " + std::to_string(b) + ", token " + std::to_string(t) + ": label '" + label +
                        "' was not seen in training");
          tags[b * e.max_length + t] = y;
        }
      }
    }
  });
  std::vector<const std::vector<int64_t>*> id_ptrs, count_ptrs;
  for (int64_t b = 0; b < e.batch; ++b) id_ptrs.push_back(&ids[b]), count_ptrs.push_back(&counts[b]);
  return assemble_batch(id_ptrs, count_ptrs, tags);
}

EncodedBatch assemble_batch(const std::vector<const std::vector<int64_t>*>& ids,
                            const std::vector<const std::vector<int64_t>*>& counts, const std::vector<int64_t>& tags) {
  EncodedBatch e;
  e.batch = static_cast<int64_t>(ids.size());
  for (const auto* c : counts) e.max_length = std::max<int64_t>(e.max_length, c->size());
  std::vector<int64_t> flat, offsets, positions, lengths;
  for (int64_t b = 0; b < e.batch; ++b) {
    lengths.push_back(static_cast<int64_t>(counts[b]->size()));
    int64_t offset = static_cast<int64_t>(flat.size());
    for (std::size_t t = 0; t < counts[b]->size(); ++t) {
      positions.push_back(b * e.max_length + static_cast<int64_t>(t));
      offsets.push_back(offset);
      offset += (*counts[b])[t];
    }
    flat.insert(flat.end(), ids[b]->begin(), ids[b]->end());
  }
  const auto tensor = [](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong); };
  e.feature_ids = tensor(flat);
  e.offsets = tensor(offsets);
  e.positions = tensor(positions);
  e.lengths = tensor(lengths);
  if (!tags.empty()) e.tags = tensor(tags).view({e.batch, e.max_length});
  return e;
}

ChainPotentials CrfTagger::potentials(const EncodedBatch& e) const {
  const at::Device dev = weights.device();
  const int64_t K = static_cast<int64_t>(labels_.size());
  at::Tensor token_scores;
  if (pair_labels_.defined()) {
    // Each feature occurrence adds its pairs' weights to its token's scores for their labels: one index_add of the
    // pairs' weights over the batch, differentiable in them.
    const at::Tensor ids = e.feature_ids.cpu(), offsets = e.offsets.cpu();
    const int64_t* id = ids.data_ptr<int64_t>();
    const int64_t* offset = offsets.data_ptr<int64_t>();
    const int64_t* pair_offset = pair_offsets_.data_ptr<int64_t>();
    const int64_t* pair_label = pair_labels_.data_ptr<int64_t>();
    const int64_t tokens = offsets.numel(), nnz = ids.numel();
    std::vector<int64_t> pairs, targets;
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t i = offset[t]; i < (t + 1 < tokens ? offset[t + 1] : nnz); ++i)
        for (int64_t p = pair_offset[id[i]]; p < pair_offset[id[i] + 1]; ++p)
          pairs.push_back(p), targets.push_back(t * K + pair_label[p]);
    token_scores = at::zeros({tokens * K}, weights.options())
                       .index_add(0, at::tensor(targets, at::kLong).to(dev),
                                  weights.index_select(0, at::tensor(pairs, at::kLong).to(dev)))
                       .view({tokens, K});
  } else {
    // Σ of each token's feature weights: one embedding_bag over the whole batch.
    token_scores = std::get<0>(at::embedding_bag(weights, e.feature_ids.to(dev), e.offsets.to(dev)));
  }
  ChainPotentials p;
  p.emissions = at::zeros({e.batch * e.max_length, K}, weights.options())
                    .index_copy(0, e.positions.to(dev), token_scores)
                    .view({e.batch, e.max_length, K});
  p.transitions = transitions;
  p.start = start;
  p.end = end;
  p.lengths = e.lengths.to(dev);
  return p;
}

std::vector<TaggedSentence> CrfTagger::tag(const std::vector<const TokenRows*>& sentences, bool with_marginals) const {
  at::NoGradGuard no_grad;
  std::vector<TaggedSentence> out;
  out.reserve(sentences.size());
  for (std::size_t first = 0; first < sentences.size(); first += kTagChunk) {
    const std::vector<const TokenRows*> chunk(sentences.begin() + first,
                                              sentences.begin() + std::min(sentences.size(), first + kTagChunk));
    const ChainPotentials p = potentials(encode(chunk));
    const ViterbiResult v = viterbi(p);
    check_some_path(v.score, first);
    const at::Tensor path = v.path.cpu();
    at::Tensor chosen, seq_prob;
    if (with_marginals) {
      const Marginals m = marginals(p);
      chosen = m.nodes.gather(2, v.path.clamp_min(0).unsqueeze(2)).squeeze(2).to(at::kCPU, at::kDouble);
      seq_prob = (v.score - m.log_partition).exp().to(at::kCPU, at::kDouble);
    }
    const auto best = path.accessor<int64_t, 2>();
    for (std::size_t b = 0; b < chunk.size(); ++b) {
      TaggedSentence s;
      for (std::size_t t = 0; t < chunk[b]->size(); ++t) {
        s.labels.push_back(labels_[best[b][t]]);
        if (with_marginals) s.marginals.push_back(chosen.accessor<double, 2>()[b][t]);
      }
      if (with_marginals) s.probability = seq_prob.data_ptr<double>()[b];
      out.push_back(std::move(s));
    }
  }
  return out;
}

std::vector<std::vector<TaggedSentence>> CrfTagger::tag_kbest(const std::vector<const TokenRows*>& sentences,
                                                              int64_t k) const {
  if (k < 1) throw Error("k-best tagging needs k >= 1, not " + std::to_string(k));
  at::NoGradGuard no_grad;
  const int64_t K = static_cast<int64_t>(labels_.size());
  // The k-best tables hold a score and a back-pointer per sentence, position, label and rank (padded to the batch's
  // longest sentence): batches are cut to stay within kMaxKBestBytes.
  const auto table_bytes = [&](int64_t sentences_in_batch, int64_t longest) {
    return static_cast<double>(sentences_in_batch) * longest * K * k * (sizeof(int64_t) + sizeof(double));
  };
  std::vector<std::vector<TaggedSentence>> out;
  out.reserve(sentences.size());
  for (std::size_t first = 0; first < sentences.size();) {
    std::size_t last = first;
    int64_t longest = 0;
    while (last < sentences.size() && last - first < static_cast<std::size_t>(kTagChunk)) {
      const int64_t grown = std::max<int64_t>(longest, sentences[last]->size());
      if (table_bytes(last - first + 1, grown) > kMaxKBestBytes) break;
      longest = grown;
      ++last;
    }
    if (last == first)
      throw Error("sentence " + std::to_string(first) + ": " + std::to_string(k) + "-best tables of its " +
                  std::to_string(sentences[first]->size()) + " tokens and " + std::to_string(K) + " labels need " +
                  std::to_string(static_cast<int64_t>(table_bytes(1, sentences[first]->size()) / (1 << 20))) +
                  " MiB, more than the " + std::to_string(kMaxKBestBytes >> 20) + " MiB allowed: ask for fewer");
    const std::vector<const TokenRows*> chunk(sentences.begin() + first, sentences.begin() + last);
    const ChainPotentials p = potentials(encode(chunk));
    const KBestResult kb = kbest_viterbi(p, k);
    check_some_path(kb.scores.select(1, 0), first);
    const at::Tensor prob = (kb.scores - log_partition(p).cpu().unsqueeze(1)).exp().to(at::kDouble);
    const auto paths = kb.paths.accessor<int64_t, 3>();
    const auto P = prob.accessor<double, 2>();
    for (std::size_t b = 0; b < chunk.size(); ++b) {
      std::vector<TaggedSentence> alternatives;
      for (int64_t n = 0; n < k && paths[b][n][0] >= 0; ++n) {
        TaggedSentence s;
        for (std::size_t t = 0; t < chunk[b]->size(); ++t) s.labels.push_back(labels_[paths[b][n][t]]);
        s.probability = P[b][n];
        alternatives.push_back(std::move(s));
      }
      out.push_back(std::move(alternatives));
    }
    first = last;
  }
  return out;
}

void CrfTagger::save(const std::string& path) const {
  ModelWriter w;
  w.buffer().append(kMagic, sizeof kMagic);
  w.pod<uint32_t>(pair_labels_.defined() ? kFormatVersion : kDensePairsVersion);
  w.pod<uint64_t>(input_columns_);
  w.pod<uint64_t>(layout_.columns);
  w.pod<uint64_t>(layout_.label);
  for (std::size_t c : layout_.inputs) w.pod<uint64_t>(c);
  w.str(extractor_->spec());
  w.pod<uint64_t>(labels_.size());
  for (const auto& l : labels_) w.str(l);
  w.pod<uint64_t>(features_->size());
  for (const auto& f : features_->keys()) w.str(f);
  if (pair_labels_.defined()) {  // the pairs: their count, each feature's number of them, their labels
    w.pod<uint64_t>(pair_labels_.numel());
    const int64_t* offsets = pair_offsets_.data_ptr<int64_t>();
    for (int64_t f = 0; f + 1 < pair_offsets_.numel(); ++f)
      w.pod<uint32_t>(static_cast<uint32_t>(offsets[f + 1] - offsets[f]));
    const int64_t* labels = pair_labels_.data_ptr<int64_t>();
    for (int64_t p = 0; p < pair_labels_.numel(); ++p) w.pod<uint32_t>(static_cast<uint32_t>(labels[p]));
  }
  for (const at::Tensor& t : parameters()) w.floats(t);
  w.pod<uint64_t>(fnv1a(w.buffer().data(), w.buffer().size()));
  write_file_atomically(path, [&](std::ostream& out) { out.write(w.buffer().data(), w.buffer().size()); });
}

CrfTagger CrfTagger::load(const std::string& path) {
  std::ifstream in = open_input_file(path, "model");
  // The magic first: a large file that is not a model (or a device) is never read whole.
  std::string data(sizeof kMagic, '\0');
  if (!in.read(data.data(), sizeof kMagic) || std::memcmp(data.data(), kMagic, sizeof kMagic) != 0)
    throw Error("'" + path + "' is not a Trellis CRF model");
  char chunk[1 << 16];
  while (in.read(chunk, sizeof chunk) || in.gcount() > 0) data.append(chunk, in.gcount());
  if (in.bad()) throw Error("error reading model '" + path + "': " + std::strerror(errno));
  if (data.size() < sizeof kMagic + sizeof(uint32_t) + sizeof(uint64_t))
    throw Error("'" + path + "': corrupt model file (truncated)");
  ModelReader r(data, sizeof kMagic, data.size() - sizeof(uint64_t), path, "model file");
  const auto version = r.pod<uint32_t>();
  if (version < kFirstFormatVersion || version > kFormatVersion)
    throw Error("'" + path + "': model format version " + std::to_string(version) +
                " is not supported (this Trellis reads versions " + std::to_string(kFirstFormatVersion) + " to " +
                std::to_string(kFormatVersion) + ")");
  uint64_t stored;
  std::memcpy(&stored, data.data() + data.size() - sizeof stored, sizeof stored);
  if (stored != fnv1a(data.data(), data.size() - sizeof stored)) r.corrupt("checksum mismatch: truncated or modified");
  const uint64_t columns = r.count(sizeof(uint64_t), "input column");
  ColumnLayout layout = ColumnLayout::inputs_then_label(columns);
  if (version >= 2) {
    layout.columns = r.pod<uint64_t>();
    layout.label = r.pod<uint64_t>();
    if (layout.columns <= columns || layout.label >= layout.columns) r.corrupt("column layout");
    for (auto& c : layout.inputs) {
      c = r.pod<uint64_t>();
      if (c >= layout.columns || c == layout.label) r.corrupt("column layout");
    }
  }
  const std::string spec = r.str();
  std::vector<std::string> labels(r.count(sizeof(uint64_t), "label"));
  for (auto& l : labels) l = r.str();
  const uint64_t F = r.count(sizeof(uint64_t), "feature");
  std::vector<std::string> features(F);
  for (auto& f : features) f = r.str();
  const int64_t K = static_cast<int64_t>(labels.size());
  std::optional<std::vector<std::vector<int64_t>>> seen_labels;
  if (version >= 3) {
    const uint64_t pairs = r.count(sizeof(uint32_t), "feature pair");
    seen_labels.emplace(F);
    uint64_t listed = 0;
    for (auto& l : *seen_labels) {
      const uint32_t n = r.pod<uint32_t>();
      if (n > static_cast<uint64_t>(K) || n > pairs - listed) r.corrupt("feature pair counts");
      l.resize(n);
      listed += n;
    }
    if (listed != pairs) r.corrupt("feature pair counts");
    for (auto& l : *seen_labels)
      for (std::size_t i = 0; i < l.size(); ++i) {
        l[i] = r.pod<uint32_t>();
        if (l[i] >= K || (i > 0 && l[i] <= l[i - 1])) r.corrupt("feature pair labels");
      }
  }
  auto extractor = FeatureExtractor::from_spec(spec);
  // The feature set must read only columns the model has (a template naming column 5 of 2 would read past the rows).
  extractor->validate(columns, path);
  CrfTagger m(std::move(labels), std::move(features), std::move(extractor), columns,
              seen_labels ? &*seen_labels : nullptr);
  m.set_layout(std::move(layout));
  m.weights =
      seen_labels ? r.floats({m.weights.numel()}, "weights") : r.floats({static_cast<int64_t>(F), K}, "weights");
  m.transitions = r.floats({K, K}, "transitions");
  m.start = r.floats({K}, "start weights");
  m.end = r.floats({K}, "end weights");
  if (!r.done()) r.corrupt("trailing bytes");
  return m;
}

}  // namespace trellis
