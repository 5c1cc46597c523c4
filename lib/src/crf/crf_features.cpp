#include "trellis/crf/crf_features.h"

#include <cctype>
#include <charconv>

#include "trellis/error.h"

namespace trellis {

FeatureList& FeatureList::operator<<(long n) {
  char digits[24];
  return *this << std::string_view(digits, std::to_chars(digits, digits + sizeof digits, n).ptr - digits);
}

void FeatureExtractor::extract(const TokenRows& rows, std::size_t t, FeatureList& out) const {
  add_features(rows, t, out);
  if (!out.closed()) throw Error("the feature extractor '" + spec().substr(0, 40) + "' left a feature open");
}

namespace {

// Writes w in lowercase (ASCII letters).
FeatureList& lower(FeatureList& out, std::string_view w) {
  for (unsigned char c : w) out << static_cast<char>(std::tolower(c));
  return out;
}

// Character classes with runs collapsed: "McDonald's" -> "XxXx'x", "1,234.5" -> "d,d.d".
FeatureList& shape(FeatureList& out, std::string_view w) {
  int last = -1;  // no class yet
  for (unsigned char c : w) {
    const char k = std::isupper(c) ? 'X' : std::islower(c) ? 'x' : std::isdigit(c) ? 'd' : c >= 0x80 ? 'u' : char(c);
    if (k != last) out << k;
    last = k;
  }
  return out;
}

// Byte prefixes/suffixes that stop at UTF-8 character boundaries, so multi-byte characters are never cut.
bool is_continuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

std::string_view prefix_chars(std::string_view w, int n) {
  std::size_t i = 0;
  for (int k = 0; k < n && i < w.size(); ++k)
    for (++i; i < w.size() && is_continuation(w[i]); ++i) {
    }
  return w.substr(0, i);
}

std::string_view suffix_chars(std::string_view w, int n) {
  std::size_t i = w.size();
  for (int k = 0; k < n && i > 0; ++k)
    for (--i; i > 0 && is_continuation(w[i]); --i) {
    }
  return w.substr(i);
}

class BuiltinFeatures final : public FeatureExtractor {
 public:
  void add_features(const TokenRows& rows, std::size_t t, FeatureList& out) const override {
    // Column col of the token at pos, lowercased for words; sentence boundaries read <s> and </s>.
    const auto at = [&](long pos, std::size_t col) -> FeatureList& {
      if (pos < 0) return out << "<s>";
      if (pos >= static_cast<long>(rows.size())) return out << "</s>";
      return col == 0 ? lower(out, rows[pos][0]) : out << rows[pos][col];
    };
    const long i = static_cast<long>(t);
    const std::string& w = rows[t][0];
    out.add("b");
    (out << "w=" << w).close();
    lower(out << "lw=", w).close();
    for (int n = 1; n <= 4; ++n) {
      (out << 'p' << n << '=' << prefix_chars(w, n)).close();
      (out << 's' << n << '=' << suffix_chars(w, n)).close();
    }
    shape(out << "shape=", w).close();
    bool upper = !w.empty(), digit = false, alldigit = !w.empty(), hyphen = false;
    for (unsigned char c : w) {
      upper = upper && !std::islower(c);
      digit = digit || std::isdigit(c);
      alldigit = alldigit && std::isdigit(c);
      hyphen = hyphen || c == '-';
    }
    if (upper) out.add("upper");
    if (!w.empty() && std::isupper(static_cast<unsigned char>(w[0]))) out.add(t == 0 ? "title@0" : "title");
    if (digit) out.add("digit");
    if (alldigit) out.add("alldigit");
    if (hyphen) out.add("hyphen");
    for (long d : {-2L, -1L, 1L, 2L}) {
      out << "w[" << d << "]=";
      at(i + d, 0).close();
    }
    out << "w[-1|0]=";
    at(i - 1, 0) << '|';
    at(i, 0).close();
    out << "w[0|1]=";
    at(i, 0) << '|';
    at(i + 1, 0).close();
    for (std::size_t c = 1; c < rows[t].size(); ++c) {
      const long col = static_cast<long>(c);
      for (long d = -2; d <= 2; ++d) {
        out << 'c' << col << '[' << d << "]=";
        at(i + d, c).close();
      }
      for (long d = -2; d <= 1; ++d) {
        out << 'c' << col << '[' << d << '|' << d + 1 << "]=";
        at(i + d, c) << '|';
        at(i + d + 1, c).close();
      }
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
