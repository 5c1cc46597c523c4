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

  static std::unique_ptr<FeatureExtractor> from_spec(const std::string& spec);
};

// The built-in tagging feature set: bias; word and lowercase word; prefixes and suffixes of 1-4 characters; word
// shape; case, digit and hyphen flags; lowercase words at offsets ±1, ±2 and the bigrams around the token; every
// further input column (POS, ...) at offsets -2..+2 with its bigrams.
std::unique_ptr<FeatureExtractor> builtin_features();

}  // namespace trellis
