#include "trellis/crf_tagger.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "trellis/atomic_file.h"
#include "trellis/error.h"

namespace trellis {
namespace {

constexpr char kMagic[8] = {'T', 'R', 'E', 'L', 'C', 'R', 'F', '\n'};
constexpr uint32_t kFormatVersion = 1;
constexpr int64_t kTagChunk = 1024;  // sentences decoded per batch

uint64_t fnv1a(const char* data, std::size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 1099511628211ull;
  return h;
}

class Writer {
 public:
  template <class T>
  void pod(T v) { buf_.append(reinterpret_cast<const char*>(&v), sizeof v); }
  void str(const std::string& s) {
    pod<uint64_t>(s.size());
    buf_ += s;
  }
  void floats(const at::Tensor& t) {
    const at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
    buf_.append(reinterpret_cast<const char*>(c.data_ptr<float>()), c.numel() * sizeof(float));
  }
  std::string& buffer() { return buf_; }

 private:
  std::string buf_;
};

class Reader {
 public:
  Reader(const std::string& data, std::size_t end, std::string source) : d_(data), end_(end), src_(std::move(source)) {}
  template <class T>
  T pod() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, d_.data() + pos_, sizeof v);
    pos_ += sizeof v;
    return v;
  }
  std::string str() {
    const uint64_t n = pod<uint64_t>();
    need(n);
    std::string s = d_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  at::Tensor floats(std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    need(n * sizeof(float));
    at::Tensor t = at::empty(shape, at::kFloat);
    std::memcpy(t.data_ptr<float>(), d_.data() + pos_, n * sizeof(float));
    pos_ += n * sizeof(float);
    return t;
  }
  void skip(std::size_t n) { pos_ += n; }
  bool done() const { return pos_ == end_; }
  [[noreturn]] void corrupt(const std::string& why) const { throw Error("'" + src_ + "': corrupt model file (" + why + ")"); }

 private:
  void need(uint64_t n) const {
    if (n > end_ - pos_) corrupt("truncated");
  }
  const std::string& d_;
  std::size_t end_, pos_ = 0;
  std::string src_;
};

}  // namespace

CrfTagger::CrfTagger(std::vector<std::string> labels, std::vector<std::string> features,
                     std::unique_ptr<FeatureExtractor> extractor, std::size_t input_columns)
    : labels_(std::move(labels)),
      features_(std::move(features), "feature"),
      extractor_(std::move(extractor)),
      input_columns_(input_columns) {
  if (labels_.empty()) throw Error("a CRF tagger needs at least one label");
  for (std::size_t i = 0; i < labels_.size(); ++i)
    if (!label_ids_.emplace(labels_[i], i).second) throw Error("duplicate label '" + labels_[i] + "'");
  const int64_t K = labels_.size(), F = features_.size();
  weights = at::zeros({F, K}, at::kFloat);
  transitions = at::zeros({K, K}, at::kFloat);
  start = at::zeros({K}, at::kFloat);
  end = at::zeros({K}, at::kFloat);
}

int64_t CrfTagger::label_id(const std::string& label) const {
  const auto it = label_ids_.find(label);
  return it == label_ids_.end() ? -1 : it->second;
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
          if (const int64_t id = features_.find(f); id >= 0) ids[b].push_back(id);
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
  // Σ of each token's feature weights: one embedding_bag over the whole batch.
  const at::Tensor token_scores = std::get<0>(at::embedding_bag(weights, e.feature_ids.to(dev), e.offsets.to(dev)));
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
  at::NoGradGuard no_grad;
  std::vector<std::vector<TaggedSentence>> out;
  out.reserve(sentences.size());
  for (std::size_t first = 0; first < sentences.size(); first += kTagChunk) {
    const std::vector<const TokenRows*> chunk(sentences.begin() + first,
                                              sentences.begin() + std::min(sentences.size(), first + kTagChunk));
    const ChainPotentials p = potentials(encode(chunk));
    const KBestResult kb = kbest_viterbi(p, k);
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
  }
  return out;
}

void CrfTagger::save(const std::string& path) const {
  Writer w;
  w.buffer().append(kMagic, sizeof kMagic);
  w.pod<uint32_t>(kFormatVersion);
  w.pod<uint64_t>(input_columns_);
  w.str(extractor_->spec());
  w.pod<uint64_t>(labels_.size());
  for (const auto& l : labels_) w.str(l);
  w.pod<uint64_t>(features_.size());
  for (const auto& f : features_.keys()) w.str(f);
  for (const at::Tensor& t : parameters()) w.floats(t);
  w.pod<uint64_t>(fnv1a(w.buffer().data(), w.buffer().size()));
  write_file_atomically(path, [&](std::ostream& out) { out.write(w.buffer().data(), w.buffer().size()); });
}

CrfTagger CrfTagger::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot open model '" + path + "': " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string data = ss.str();
  if (data.size() < sizeof kMagic || std::memcmp(data.data(), kMagic, sizeof kMagic) != 0)
    throw Error("'" + path + "' is not a Trellis CRF model");
  Reader r(data, data.size() - sizeof(uint64_t), path);
  if (data.size() < sizeof kMagic + sizeof(uint32_t) + sizeof(uint64_t)) r.corrupt("truncated");
  r.skip(sizeof kMagic);
  const auto version = r.pod<uint32_t>();
  if (version != kFormatVersion)
    throw Error("'" + path + "': model format version " + std::to_string(version) + " is not supported (this Trellis reads version " +
                std::to_string(kFormatVersion) + ")");
  uint64_t stored;
  std::memcpy(&stored, data.data() + data.size() - sizeof stored, sizeof stored);
  if (stored != fnv1a(data.data(), data.size() - sizeof stored)) r.corrupt("checksum mismatch: truncated or modified");
  const auto columns = r.pod<uint64_t>();
  const std::string spec = r.str();
  std::vector<std::string> labels(r.pod<uint64_t>());
  for (auto& l : labels) l = r.str();
  const uint64_t F = r.pod<uint64_t>();
  if (F > data.size()) r.corrupt("feature count");
  std::vector<std::string> features(F);
  for (auto& f : features) f = r.str();
  CrfTagger m(std::move(labels), std::move(features), FeatureExtractor::from_spec(spec), columns);
  const int64_t K = m.labels_.size();
  m.weights = r.floats({static_cast<int64_t>(F), K});
  m.transitions = r.floats({K, K});
  m.start = r.floats({K});
  m.end = r.floats({K});
  if (!r.done()) r.corrupt("trailing bytes");
  return m;
}

}  // namespace trellis
