// Transition constraints of BIO / BIOES chunk tagging schemes.
#include <ATen/ATen.h>

#include "trellis/error.h"
#include "trellis/crf/linear_chain_crf.h"

namespace trellis {
namespace {

struct Tag {
  char prefix;       // 'O', 'B', 'I', 'E' or 'S'
  std::string type;  // chunk type; empty for O
};

Tag parse_tag(const std::string& label, std::size_t index, TagScheme scheme) {
  if (label == "O") return {'O', ""};
  const std::string allowed = scheme == TagScheme::BIO ? "BI" : "BIES";
  if (label.size() >= 3 && (label[1] == '-' || label[1] == '_') && allowed.find(label[0]) != std::string::npos)
    return {label[0], label.substr(2)};
  throw Error("label " + std::to_string(index) + " '" + label + "' is not a " +
              (scheme == TagScheme::BIO ? "BIO label (O, B-X, I-X)" : "BIOES label (O, B-X, I-X, E-X, S-X)"));
}

// Inside a chunk (after B or I), only I or E of the same type may follow.
bool opens_chunk(char p) { return p == 'B' || p == 'I'; }
bool continues_chunk(char p) { return p == 'I' || p == 'E'; }

bool allowed(const Tag& prev, const Tag& next, TagScheme scheme) {
  if (scheme == TagScheme::BIO) return next.prefix != 'I' || (opens_chunk(prev.prefix) && prev.type == next.type);
  if (continues_chunk(next.prefix)) return opens_chunk(prev.prefix) && prev.type == next.type;
  return !opens_chunk(prev.prefix);
}

}  // namespace

TransitionConstraints tag_scheme_constraints(const std::vector<std::string>& labels, TagScheme scheme) {
  const int64_t K = static_cast<int64_t>(labels.size());
  std::vector<Tag> tags;
  for (std::size_t i = 0; i < labels.size(); ++i) tags.push_back(parse_tag(labels[i], i, scheme));
  TransitionConstraints c{at::zeros({K, K}, at::kBool), at::zeros({K}, at::kBool), at::zeros({K}, at::kBool)};
  auto trans = c.transitions.accessor<bool, 2>();
  auto start = c.start.accessor<bool, 1>();
  auto end = c.end.accessor<bool, 1>();
  for (int64_t i = 0; i < K; ++i) {
    start[i] = !continues_chunk(tags[i].prefix);
    end[i] = scheme == TagScheme::BIO || !opens_chunk(tags[i].prefix);
    for (int64_t j = 0; j < K; ++j) trans[i][j] = allowed(tags[i], tags[j], scheme);
  }
  return c;
}

}  // namespace trellis
