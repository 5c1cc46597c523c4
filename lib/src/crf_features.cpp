#include "trellis/crf_features.h"

#include <cctype>

#include "trellis/error.h"

namespace trellis {
namespace {

std::string lower(const std::string& s) {
  std::string r = s;
  for (char& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return r;
}

// Character classes with runs collapsed: "McDonald's" -> "XxXx'x", "1,234.5" -> "d,d.d".
std::string shape(const std::string& w) {
  std::string s;
  for (unsigned char c : w) {
    const char k = std::isupper(c) ? 'X' : std::islower(c) ? 'x' : std::isdigit(c) ? 'd' : c >= 0x80 ? 'u' : char(c);
    if (s.empty() || s.back() != k) s.push_back(k);
  }
  return s;
}

// Byte prefixes/suffixes that stop at UTF-8 character boundaries, so multi-byte characters are never cut.
bool is_continuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

std::string prefix_chars(const std::string& w, int n) {
  std::size_t i = 0;
  for (int k = 0; k < n && i < w.size(); ++k)
    for (++i; i < w.size() && is_continuation(w[i]); ++i) {
    }
  return w.substr(0, i);
}

std::string suffix_chars(const std::string& w, int n) {
  std::size_t i = w.size();
  for (int k = 0; k < n && i > 0; ++k)
    for (--i; i > 0 && is_continuation(w[i]); --i) {
    }
  return w.substr(i);
}

class BuiltinFeatures final : public FeatureExtractor {
 public:
  void extract(const TokenRows& rows, std::size_t t, std::vector<std::string>& out) const override {
    const auto at = [&](long pos, std::size_t col) -> std::string {
      if (pos < 0) return "<s>";
      if (pos >= static_cast<long>(rows.size())) return "</s>";
      return col == 0 ? lower(rows[pos][0]) : rows[pos][col];
    };
    const long i = static_cast<long>(t);
    const std::string& w = rows[t][0];
    out.push_back("b");
    out.push_back("w=" + w);
    out.push_back("lw=" + lower(w));
    for (int n = 1; n <= 4; ++n) {
      out.push_back("p" + std::to_string(n) + "=" + prefix_chars(w, n));
      out.push_back("s" + std::to_string(n) + "=" + suffix_chars(w, n));
    }
    out.push_back("shape=" + shape(w));
    bool upper = !w.empty(), digit = false, alldigit = !w.empty(), hyphen = false;
    for (unsigned char c : w) {
      upper = upper && !std::islower(c);
      digit = digit || std::isdigit(c);
      alldigit = alldigit && std::isdigit(c);
      hyphen = hyphen || c == '-';
    }
    if (upper) out.push_back("upper");
    if (!w.empty() && std::isupper(static_cast<unsigned char>(w[0]))) out.push_back(t == 0 ? "title@0" : "title");
    if (digit) out.push_back("digit");
    if (alldigit) out.push_back("alldigit");
    if (hyphen) out.push_back("hyphen");
    for (long d : {-2L, -1L, 1L, 2L}) out.push_back("w[" + std::to_string(d) + "]=" + at(i + d, 0));
    out.push_back("w[-1|0]=" + at(i - 1, 0) + "|" + at(i, 0));
    out.push_back("w[0|1]=" + at(i, 0) + "|" + at(i + 1, 0));
    for (std::size_t c = 1; c < rows[t].size(); ++c) {
      const std::string col = "c" + std::to_string(c);
      for (long d = -2; d <= 2; ++d) out.push_back(col + "[" + std::to_string(d) + "]=" + at(i + d, c));
      for (long d = -2; d <= 1; ++d)
        out.push_back(col + "[" + std::to_string(d) + "|" + std::to_string(d + 1) + "]=" + at(i + d, c) + "|" +
                      at(i + d + 1, c));
    }
  }

  std::string spec() const override { return "builtin"; }
};

}  // namespace

std::unique_ptr<FeatureExtractor> builtin_features() { return std::make_unique<BuiltinFeatures>(); }

std::unique_ptr<FeatureExtractor> FeatureExtractor::from_spec(const std::string& spec) {
  if (spec == "builtin") return builtin_features();
  if (spec.rfind("crfpp\n", 0) == 0) return crfpp_template_features(spec.substr(6), "<model template>");
  throw Error("unknown feature set '" + spec.substr(0, 40) + "'");
}

}  // namespace trellis
