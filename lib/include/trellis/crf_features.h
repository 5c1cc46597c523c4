// Observation features for CRF taggers. A feature extractor turns a token in its sentence into feature strings; it
// knows nothing of labels or training (the model maps strings to ids and learns one weight per label).
#pragma once
#include <memory>
#include <string>
#include <vector>

namespace trellis {

// A sentence's input columns: rows[token][column], the label column already removed.
using TokenRows = std::vector<std::vector<std::string>>;

class FeatureExtractor {
 public:
  virtual ~FeatureExtractor() = default;
  // Appends the features of token t to `out`.
  virtual void extract(const TokenRows& rows, std::size_t t, std::vector<std::string>& out) const = 0;
  // Text that recreates this extractor through from_spec(); stored in model files.
  virtual std::string spec() const = 0;
  // Checks that sentences with this many input columns can be featurised; `source` names the data for messages.
  virtual void validate(std::size_t /*input_columns*/, const std::string& /*source*/) const {}

  static std::unique_ptr<FeatureExtractor> from_spec(const std::string& spec);
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
std::unique_ptr<FeatureExtractor> load_crfpp_template(const std::string& path);

}  // namespace trellis
