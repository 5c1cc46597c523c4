// Symbol vocabularies for categorical models: an id per known word, and for the rest either one unknown symbol or
// "signature" classes (capitalisation, digits, hyphen, last letters) that rare training words teach the model about,
// the classic unknown-word model of HMM taggers (TnT's suffix model). Plain C++17.
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace trellis {

// Word ids for a model's observations, with unknown words mapped to "<unk>" or to signature classes ("<unk-...>": TnT's
// capitalisation, digit and suffix shapes).
class Vocabulary {
 public:
  // What an unseen word becomes: an error (id -1), the one "<unk>" symbol, or its most specific signature class.
  enum class Unknown { error, single, signatures };

  // Words seen at most this often teach the signature classes (TnT's choice), whether or not they keep their own id.
  static constexpr int64_t kRareCount = 10;

  // From every training token: words seen at least min_count times get their own id; with Unknown::single or
  // ::signatures the rarer ones are counted under "<unk>" or their most specific signature class instead. With
  // ::signatures every class of every rare word (seen < min_count or <= kRareCount times) is a symbol.
  static Vocabulary build(const std::vector<std::string>& tokens, int64_t min_count, Unknown unknown);
  // As stored in a file: symbols named "<unk>" or "<unk-...>" are the unknown classes, which sets the scheme.
  static Vocabulary from_symbols(std::vector<std::string> symbols);

  // The id of a word; an unknown word maps to its most specific class in the vocabulary, or is -1 with
  // Unknown::error.
  int64_t id(const std::string& word) const;
  // Whether the word maps to a word of the vocabulary (itself or its lowercase form), not to an unknown class.
  bool known(const std::string& word) const;
  // Every symbol, in id order (words and unknown classes).
  const std::vector<std::string>& symbols() const { return symbols_; }
  // The number of symbols.
  int64_t size() const { return static_cast<int64_t>(symbols_.size()); }
  // The unknown-word scheme.
  Unknown unknown() const { return unknown_; }

  // Whether a symbol names an unknown class ("<unk>" or "<unk-...>").
  static bool is_unknown_class(const std::string& symbol);

 private:
  std::vector<std::string> symbols_;
  std::unordered_map<std::string, int64_t> index_;
  Unknown unknown_ = Unknown::error;
  int64_t add(const std::string& symbol);
};

// The signature classes of a word, from the most general (its shape: "<unk-Cap>", "<unk-num>", "<unk-lc-dash>") to
// the most specific, which add its last 1, 2, ... up to 10 letters ("<unk-Cap-~g>", "<unk-Cap-~ng>", ...,
// "<unk-Cap-~unning>" for "Running"). A word's last letter is never its first, and only ASCII letters count.
std::vector<std::string> signature_classes(const std::string& word);
// The classes a class name stands under, most general first and ending with itself ("<unk-lc-~ng>" gives
// "<unk-lc>", "<unk-lc-~g>", "<unk-lc-~ng>"). A name that is not a signature class gives just itself.
std::vector<std::string> class_chain(const std::string& class_name);

}  // namespace trellis
