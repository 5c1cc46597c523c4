#include "trellis/vocabulary.h"

#include <algorithm>
#include <cctype>
#include <map>

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
    if (counts.at(t) >= min_count || unknown == Unknown::error)
      v.add(t);
    else
      v.add(unknown == Unknown::single ? "<unk>" : unknown_signature(t));
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
    // A signature never seen in training backs off to a more general one: drop its last part until one is known.
    std::string sig = unknown_signature(word);
    while (true) {
      if (const auto it = index_.find(sig); it != index_.end()) return it->second;
      const std::size_t dash = sig.rfind('-');
      if (dash == std::string::npos || dash < 4) break;
      sig = sig.substr(0, dash) + ">";
    }
    for (const auto& s : symbols_)
      if (is_unknown_class(s)) return index_.at(s);
  }
  const auto it = index_.find("<unk>");
  return it != index_.end() ? it->second : -1;
}

std::string unknown_signature(const std::string& word) {
  bool upper = false, lower = false, digit = false, dash = false, first_upper = std::isupper(static_cast<unsigned char>(word[0]));
  for (unsigned char c : word) {
    upper |= std::isupper(c) != 0;
    lower |= std::islower(c) != 0;
    digit |= std::isdigit(c) != 0;
    dash |= c == '-';
  }
  std::string sig = "<unk";
  if (!upper && !lower) sig += digit ? "-num" : (word[0] & 0x80) ? "-other" : "-punct";
  else if (first_upper) sig += lower ? "-Cap" : "-CAPS";
  else sig += "-lc";
  if (digit && (upper || lower)) sig += "-num";
  if (dash && (upper || lower)) sig += "-dash";
  if (lower) {
    std::string lc(word);
    std::transform(lc.begin(), lc.end(), lc.begin(), [](unsigned char c) { return std::tolower(c); });
    // The last three letters (two for short words) carry most of English morphology; the id lookup backs off to
    // the shape alone when a suffix class was never seen. ASCII only, so that a class name stays valid UTF-8.
    const std::size_t n = lc.size() > 4 ? 3 : lc.size() > 2 ? 2 : 0;
    const std::string suffix = lc.substr(lc.size() - n);
    if (n && std::all_of(suffix.begin(), suffix.end(), [](unsigned char c) { return c < 0x80; }))
      return sig + "-~" + suffix + ">";
  }
  return sig + ">";
}

}  // namespace trellis
