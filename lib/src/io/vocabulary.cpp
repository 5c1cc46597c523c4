#include "trellis/io/vocabulary.h"

#include <algorithm>
#include <cctype>

#include "trellis/error.h"

namespace trellis {

bool Vocabulary::is_unknown_class(const std::string& s) { return s == "<unk>" || s.rfind("<unk-", 0) == 0; }

int64_t Vocabulary::add(const std::string& symbol) {
  const auto [it, inserted] = index_.emplace(symbol, size());
  if (inserted) symbols_.push_back(symbol);
  return it->second;
}

Vocabulary Vocabulary::build(const std::vector<std::string>& tokens, int64_t min_count, Unknown unknown) {
  std::unordered_map<std::string, int64_t> counts;
  for (const auto& t : tokens) ++counts[t];
  Vocabulary v;
  v.unknown_ = unknown;
  if (unknown == Unknown::single) v.add("<unk>");  // always present, even if every word is frequent
  // Ids in first-seen order, so that the same data always gives the same vocabulary.
  for (const auto& t : tokens) {
    const int64_t n = counts.at(t);
    if (n >= min_count || unknown == Unknown::error) v.add(t);
    if (unknown == Unknown::signatures && (n < min_count || n <= kRareCount))
      for (const auto& c : signature_classes(t)) v.add(c);
  }
  return v;
}

Vocabulary Vocabulary::from_symbols(std::vector<std::string> symbols) {
  Vocabulary v;
  for (const auto& s : symbols) {
    if (v.index_.count(s)) throw Error("vocabulary: symbol '" + s + "' appears twice");
    if (s == "<unk>") v.unknown_ = Unknown::single;
    else if (is_unknown_class(s) && v.unknown_ == Unknown::error) v.unknown_ = Unknown::signatures;
    v.add(s);
  }
  return v;
}

bool Vocabulary::known(const std::string& word) const {
  const int64_t i = id(word);
  return i >= 0 && !is_unknown_class(symbols_[i]);
}

int64_t Vocabulary::id(const std::string& word) const {
  if (const auto it = index_.find(word); it != index_.end() && !is_unknown_class(word)) return it->second;
  if (unknown_ == Unknown::error) return -1;
  // A capitalised form of a known word (sentence-initial "The") is that word.
  std::string lower(word);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (const auto it = index_.find(lower); it != index_.end() && lower != word) return it->second;
  if (unknown_ == Unknown::signatures) {
    // The most specific class training saw; a shape never seen backs off to the first class.
    const std::vector<std::string> classes = signature_classes(word);
    for (auto c = classes.rbegin(); c != classes.rend(); ++c)
      if (const auto it = index_.find(*c); it != index_.end()) return it->second;
    for (const auto& s : symbols_)
      if (is_unknown_class(s)) return index_.at(s);
  }
  const auto it = index_.find("<unk>");
  return it != index_.end() ? it->second : -1;
}

namespace {

constexpr std::size_t kMaxSuffix = 10;  // TnT's longest suffix
constexpr const char* kSuffixMark = "-~";

}  // namespace

std::vector<std::string> signature_classes(const std::string& word) {
  bool upper = false, lower = false, digit = false, dash = false;
  for (unsigned char c : word) {
    upper |= std::isupper(c) != 0;
    lower |= std::islower(c) != 0;
    digit |= std::isdigit(c) != 0;
    dash |= c == '-';
  }
  std::string shape = "<unk";
  if (!upper && !lower) shape += digit ? "-num" : (word[0] & 0x80) ? "-other" : "-punct";
  else if (std::isupper(static_cast<unsigned char>(word[0]))) shape += lower ? "-Cap" : "-CAPS";
  else shape += "-lc";
  if (digit && (upper || lower)) shape += "-num";
  if (dash && (upper || lower)) shape += "-dash";
  std::vector<std::string> classes{shape + ">"};
  if (!lower) return classes;
  // English morphology lives in the last letters. ASCII letters only, so that a class name stays valid UTF-8.
  std::string suffix;
  for (std::size_t i = word.size(); i-- > 1 && suffix.size() < kMaxSuffix;) {
    const unsigned char c = word[i];
    if (!std::isalpha(c)) break;
    suffix.insert(suffix.begin(), static_cast<char>(std::tolower(c)));
    classes.push_back(shape + kSuffixMark + suffix + ">");
  }
  return classes;
}

std::vector<std::string> class_chain(const std::string& name) {
  const std::size_t mark = name.find(kSuffixMark);
  if (!Vocabulary::is_unknown_class(name) || mark == std::string::npos || name.back() != '>') return {name};
  const std::string shape = name.substr(0, mark), suffix = name.substr(mark + 2, name.size() - mark - 3);
  std::vector<std::string> chain{shape + ">"};
  for (std::size_t n = 1; n <= suffix.size(); ++n)
    chain.push_back(shape + kSuffixMark + suffix.substr(suffix.size() - n) + ">");
  return chain;
}

}  // namespace trellis
