// Chunk-level evaluation that reproduces conlleval.pl (CoNLL shared task script, 2004 version, default mode):
// the same chunk start/end rules, counts, precision/recall/FB1 and report layout. Plain C++17; no LibTorch.
//
// Tags are split at the first '-' into a prefix and a type ("B-NP" -> "B", "NP"; "O" -> "O", ""). As in conlleval,
// chunk boundaries follow its IOB1/IOB2/IOE rules only: there is no special handling of "S-", so adjacent
// same-type "S-X S-X" (or "E-X B-X") form one chunk, exactly as conlleval counts them. Each sentence is followed by
// the boundary row conlleval makes of a blank line (tags O/O, not a token), so chunks end with their sentence.
#pragma once
#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "trellis/error.h"

namespace trellis {

// Chunk counts of one type (or of all): chunks found in both, in the guesses, in the gold tags.
struct ChunkCounts {
  std::size_t correct = 0;  // chunks with the same span and type in the gold and the guessed tags
  std::size_t guessed = 0;  // chunks in the guessed tags
  std::size_t gold = 0;     // chunks in the gold tags
  // Percentages (0..100) as conlleval computes them; 0 when the denominator is 0.
  double precision() const;
  // Percentage of gold chunks found (0..100); 0 when there are none.
  double recall() const;
  // The harmonic mean of precision and recall (0..100); 0 when both are 0.
  double f1() const;
};

// conlleval's scores over sentences added one at a time.
struct ChunkEvaluation {
  std::size_t tokens = 0;                      // tokens added
  std::size_t correct_tokens = 0;              // a token is correct when gold and guessed prefix and type match
  ChunkCounts overall;                         // includes chunks of tags with an empty type ("B", "I" without '-')
  std::map<std::string, ChunkCounts> by_type;  // every non-empty chunk type that started a gold or guessed chunk

  double accuracy() const;  // percentage of correct tokens; 0 when there are no tokens

  // Adds one sentence. Throws Error naming both lengths when gold.size() != guess.size().
  void add_sentence(const std::vector<std::string>& gold, const std::vector<std::string>& guess);

  // conlleval's output with per-type lines:
  //   processed N tokens with G phrases; found: F phrases; correct: C.
  //   accuracy: %6.2f%%; precision: %6.2f%%; recall: %6.2f%%; FB1: %6.2f
  //   %17s: precision: %6.2f%%; recall: %6.2f%%; FB1: %6.2f  <guessed>     (one line per type, sorted)
  std::string report() const;

 private:
  // conlleval's "inCorrect": a matching chunk still open. Normally closed by the sentence boundary, but with
  // type-less tags it can stay open into the next sentence, and conlleval then carries it over.
  bool open_correct_ = false;
};

}  // namespace trellis
