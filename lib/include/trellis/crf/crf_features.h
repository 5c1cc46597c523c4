// Observation features for CRF taggers. A feature extractor turns a token in its sentence into feature strings; it
// knows nothing of labels or training (the model maps strings to ids and learns one weight per label).
#pragma once
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace trellis {

// A sentence's input columns: rows[token][column], the label column already removed.
using TokenRows = std::vector<std::vector<std::string>>;

// A token's feature strings packed back to back in one buffer, so extracting millions of them allocates nothing once
// the buffer has grown: append a feature's text piece by piece, then close() it.
class FeatureList {
 public:
  // Removes every feature (the buffer keeps its capacity).
  void clear() { text_.clear(), ends_.clear(); }
  // Appends a piece of text to the open feature.
  FeatureList& operator<<(std::string_view piece) { return text_.append(piece), *this; }
  // Appends one character to the open feature.
  FeatureList& operator<<(char c) { return text_.push_back(c), *this; }
  // Appends a number in decimal to the open feature.
  FeatureList& operator<<(long n);
  // Appends a number in decimal to the open feature.
  FeatureList& operator<<(int n) { return *this << static_cast<long>(n); }
  // Ends the open feature: the text appended since the last close() is one feature.
  void close() { ends_.push_back(text_.size()); }
  // Appends a whole feature.
  void add(std::string_view feature) { *this << feature, close(); }

  // The number of closed features.
  std::size_t size() const { return ends_.size(); }
  bool closed() const { return text_.size() == (ends_.empty() ? 0 : ends_.back()); }  // no feature left open
  // Feature i (valid until the list changes).
  std::string_view operator[](std::size_t i) const {
    const std::size_t from = i == 0 ? 0 : ends_[i - 1];
    return std::string_view(text_).substr(from, ends_[i] - from);
  }
  // Copies of the features, in order.
  std::vector<std::string> strings() const { return {begin(), end()}; }

  // An input iterator over the closed features, yielding string views.
  class iterator {
   public:
    using value_type = std::string_view;                // a feature
    using difference_type = std::ptrdiff_t;             // a distance between positions
    using reference = std::string_view;                 // features are yielded by value
    using pointer = void;                               // no pointer to a feature
    using iterator_category = std::input_iterator_tag;  // one pass
    // Position i of list l.
    iterator(const FeatureList* l, std::size_t i) : l_(l), i_(i) {}
    // The feature at this position.
    std::string_view operator*() const { return (*l_)[i_]; }
    // The next position.
    iterator& operator++() { return ++i_, *this; }
    // Whether the positions differ (iterators of one list).
    bool operator!=(const iterator& o) const { return i_ != o.i_; }
    // Whether the positions are equal (iterators of one list).
    bool operator==(const iterator& o) const { return i_ == o.i_; }

   private:
    const FeatureList* l_;
    std::size_t i_;
  };
  // The first feature.
  iterator begin() const { return {this, 0}; }
  // Past the last feature.
  iterator end() const { return {this, size()}; }

 private:
  std::string text_;
  std::vector<std::size_t> ends_;
};

// Turns a token in its sentence into feature strings: the built-in set or a CRF++ template. Implementations are
// immutable once built, so extract() may run on many threads at once.
class FeatureExtractor {
 public:
  virtual ~FeatureExtractor() = default;
  // Appends the features of token t to `out`. A feature left open (an add_features that forgot close()) is an Error:
  // it would run into the next token's first feature where callers pack many tokens into one list.
  void extract(const TokenRows& rows, std::size_t t, FeatureList& out) const;
  // Text that recreates this extractor through from_spec(); stored in model files.
  virtual std::string spec() const = 0;
  // Checks that sentences with this many input columns can be featurised; `source` names the data for messages.
  virtual void validate(std::size_t /*input_columns*/, const std::string& /*source*/) const {}

  // The extractor that spec() described (as stored in a model file); Error for text that names none.
  static std::unique_ptr<FeatureExtractor> from_spec(const std::string& spec);

 private:
  // What extract() appends, each feature closed.
  virtual void add_features(const TokenRows& rows, std::size_t t, FeatureList& out) const = 0;
};

// The built-in tagging feature set: bias; word and lowercase word; prefixes and suffixes of 1-4 characters; word
// shape; case, digit and hyphen flags; lowercase words at offsets ±1, ±2 and the bigrams around the token; every
// further input column (POS, ...) at offsets -2..+2 with its bigrams.
std::unique_ptr<FeatureExtractor> builtin_features();

// Features from a CRF++ template (its documented format, e.g. CRF++'s example/chunking/template):
//   # comment
//   U00:%x[-1,0]            one feature string per token, "U00:" + the word one row up
//   U05:%x[-1,0]/%x[0,0]    macros %x[row,column]: row relative to the token, column among the input columns
//   B                       label bigrams (always modelled by Trellis' CRF; B lines with macros are an error)
// Rows outside the sentence read as CRF++ names them: _B-1, _B-2, ... before, _B+1, _B+2, ... after.
// Syntax errors name source:line.
std::unique_ptr<FeatureExtractor> crfpp_template_features(const std::string& text,
                                                          const std::string& source = "<template>");
// crfpp_template_features of the file at `path` (errors name it); Error when it cannot be read.
std::unique_ptr<FeatureExtractor> load_crfpp_template(const std::string& path);

}  // namespace trellis
