// Feature templates in CRF++'s format: "U<id>:<text with %x[row,col] macros>" lines expand to one observation
// feature string per token; a plain "B" line asks for label bigrams, which Trellis' CRF always models.
#include <cctype>
#include <sstream>

#include "lib/src/io/input_file.h"
#include "trellis/crf/crf_features.h"
#include "trellis/error.h"

namespace trellis {
namespace {

struct Piece {
  std::string literal;  // text before the macro (or the whole tail when there is no macro)
  bool macro = false;
  int row = 0;
  std::size_t column = 0;
  std::size_t line = 0;  // of the template file, for errors
};

using UnigramTemplate = std::vector<Piece>;

// Far beyond any useful context or column; larger numbers in a macro are an error rather than an overflow.
constexpr long kMaxMacroIndex = 100000;
constexpr std::size_t kMaxTemplateBytes = 1 << 24;

// Parses the integer at text[pos...] (optional sign), advancing pos. False when there are no digits or the value is
// beyond ±kMaxMacroIndex.
bool parse_int(const std::string& text, std::size_t& pos, long& out) {
  const std::size_t start = pos;
  const bool negative = pos < text.size() && text[pos] == '-';
  if (pos < text.size() && (text[pos] == '-' || text[pos] == '+')) ++pos;
  const std::size_t digits = pos;
  long value = 0;
  for (; pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos])); ++pos) {
    value = value * 10 + (text[pos] - '0');
    if (value > kMaxMacroIndex) return false;
  }
  if (pos == digits) {
    pos = start;
    return false;
  }
  out = negative ? -value : value;
  return true;
}

UnigramTemplate parse_unigram(const std::string& text, const std::string& source, std::size_t line) {
  UnigramTemplate pieces;
  std::string literal;
  for (std::size_t pos = 0; pos < text.size();) {
    if (text[pos] != '%') {
      literal += text[pos++];
      continue;
    }
    // As in CRF++, '%' always starts a macro, and %x[row,column] is the only one a unigram template can use
    // (%y[...] would read the labels, which only CRF++'s bigram templates may).
    if (text.compare(pos, 3, "%x[") != 0)
      throw ParseError(
          source, line,
          "unsupported macro at '" + text.substr(pos, 4) + "' in '" + text + "': '%' must start %x[row,column]");
    std::size_t p = pos + 3;
    long row = 0, col = 0;
    if (!parse_int(text, p, row) || p >= text.size() || text[p++] != ',' || !parse_int(text, p, col) ||
        p >= text.size() || text[p++] != ']')
      throw ParseError(source, line,
                       "malformed macro in '" + text + "': expected %x[row,column] with integers within ±" +
                           std::to_string(kMaxMacroIndex));
    if (col < 0) throw ParseError(source, line, "negative column in '" + text + "'");
    pieces.push_back({literal, true, static_cast<int>(row), static_cast<std::size_t>(col), line});
    literal.clear();
    pos = p;
  }
  pieces.push_back({literal, false, 0, 0, line});
  return pieces;
}

class TemplateFeatures final : public FeatureExtractor {
 public:
  TemplateFeatures(const std::string& text, const std::string& source)
      : text_(text.compare(0, kBom.size(), kBom) == 0 ? text.substr(kBom.size()) : text), source_(source) {
    std::istringstream in(text_);
    std::string raw;
    for (std::size_t line = 1; std::getline(in, raw); ++line) {
      if (!raw.empty() && raw.back() == '\r') raw.pop_back();
      if (const std::size_t bad = invalid_utf8_offset(raw); bad != std::string::npos)
        throw ParseError(source, line, "invalid UTF-8 byte at column " + std::to_string(bad + 1));
      const std::size_t first = raw.find_first_not_of(" \t");
      if (first == std::string::npos || raw[first] == '#') continue;
      const std::string t = raw.substr(first, raw.find_last_not_of(" \t") - first + 1);
      if (t[0] == 'U') {
        units_.push_back(parse_unigram(t, source, line));
      } else if (t[0] == 'B') {
        if (t.find('%') != std::string::npos)
          throw ParseError(source, line,
                           "bigram templates with macros are not supported; a plain 'B' line is enough (label "
                           "bigrams are always modelled)");
      } else {
        throw ParseError(source, line, "expected a 'U...' (unigram) or 'B' (bigram) template, found '" + t + "'");
      }
    }
    if (units_.empty()) throw ParseError(source, 1, "no unigram ('U...') templates");
  }

  void validate(std::size_t input_columns, const std::string& source) const override {
    for (const auto& u : units_)
      for (const Piece& p : u)
        if (p.macro && p.column >= input_columns)
          throw Error(source_ + ":" + std::to_string(p.line) + ": column " + std::to_string(p.column) +
                      " is out of range: '" + source + "' has " + std::to_string(input_columns) +
                      " input columns (numbered from 0, the label column not counted)");
  }

  void add_features(const TokenRows& rows, std::size_t t, FeatureList& out) const override {
    const long n = static_cast<long>(rows.size());
    for (const auto& u : units_) {
      for (const Piece& p : u) {
        out << p.literal;
        if (!p.macro) continue;
        const long r = static_cast<long>(t) + p.row;
        // CRF++'s names for positions outside the sentence.
        if (r < 0) out << "_B" << r;
        else if (r >= n) out << "_B+" << r - n + 1;
        else out << rows[r][p.column];
      }
      out.close();
    }
  }

  std::string spec() const override { return "crfpp\n" + text_; }

 private:
  std::string text_;
  std::vector<UnigramTemplate> units_;
  std::string source_;  // the template's file, for errors found once the data is known
};

}  // namespace

std::unique_ptr<FeatureExtractor> crfpp_template_features(const std::string& text, const std::string& source) {
  return std::make_unique<TemplateFeatures>(text, source);
}

std::unique_ptr<FeatureExtractor> load_crfpp_template(const std::string& path) {
  return crfpp_template_features(read_input_file(path, "template", kMaxTemplateBytes), path);
}

}  // namespace trellis
