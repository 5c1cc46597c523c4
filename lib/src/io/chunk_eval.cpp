#include "trellis/io/chunk_eval.h"

#include <iomanip>
#include <sstream>

namespace trellis {
namespace {

struct Tag {
  std::string prefix, type;
};

Tag split_tag(const std::string& tag) {
  const auto dash = tag.find('-');
  if (dash == std::string::npos) return {tag, ""};
  return {tag.substr(0, dash), tag.substr(dash + 1)};
}

// conlleval's endOfChunk: whether a chunk ended at `prev`, given the tag that follows it.
bool end_of_chunk(const Tag& prev, const Tag& tag) {
  const std::string& p = prev.prefix;
  const std::string& t = tag.prefix;
  return ((p == "B" || p == "I") && (t == "B" || t == "O")) || (p == "E" && (t == "E" || t == "I" || t == "O")) ||
         (p != "O" && p != "." && prev.type != tag.type) || p == "[" || p == "]";
}

// conlleval's startOfChunk: whether a chunk starts at `tag`, given the tag before it.
bool start_of_chunk(const Tag& prev, const Tag& tag) {
  const std::string& p = prev.prefix;
  const std::string& t = tag.prefix;
  return ((p == "B" || p == "I" || p == "O") && t == "B") || (p == "O" && (t == "I" || t == "E")) ||
         (p == "E" && (t == "E" || t == "I")) || (t != "O" && t != "." && prev.type != tag.type) || t == "[" ||
         t == "]";
}

double percent(std::size_t part, std::size_t whole) {
  return whole == 0 ? 0.0 : 100.0 * static_cast<double>(part) / static_cast<double>(whole);
}

std::string fixed2(double value) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(2) << std::setw(6) << value;
  return out.str();
}

}  // namespace

double ChunkCounts::precision() const { return percent(correct, guessed); }
double ChunkCounts::recall() const { return percent(correct, gold); }

double ChunkCounts::f1() const {
  const double p = precision(), r = recall();
  return p + r == 0.0 ? 0.0 : 2 * p * r / (p + r);
}

double ChunkEvaluation::accuracy() const { return percent(correct_tokens, tokens); }

void ChunkEvaluation::add_sentence(const std::vector<std::string>& gold, const std::vector<std::string>& guess) {
  if (gold.size() != guess.size())
    throw Error("chunk evaluation: gold sentence has " + std::to_string(gold.size()) + " tags but guess has " +
                std::to_string(guess.size()));

  // conlleval reports per-type counts for non-empty types only; type-less chunks still count overall.
  const auto count = [this](std::size_t ChunkCounts::*field, const std::string& type) {
    ++(overall.*field);
    if (!type.empty()) ++(by_type[type].*field);
  };

  // Undo the provisional count below: conlleval carries the open chunk on instead.
  if (open_correct_) --overall.correct;

  const Tag outside{"O", ""};
  Tag last_gold = outside, last_guess = outside;
  // The extra last step is the sentence boundary, which conlleval reads as an O/O row that is not a token.
  for (std::size_t i = 0; i <= gold.size(); ++i) {
    const bool boundary = i == gold.size();
    const Tag c = boundary ? outside : split_tag(gold[i]);
    const Tag g = boundary ? outside : split_tag(guess[i]);

    if (open_correct_) {
      const bool gold_ends = end_of_chunk(last_gold, c), guess_ends = end_of_chunk(last_guess, g);
      if (gold_ends && guess_ends && last_guess.type == last_gold.type) {
        open_correct_ = false;
        count(&ChunkCounts::correct, last_gold.type);
      } else if (gold_ends != guess_ends || g.type != c.type) {
        open_correct_ = false;
      }
    }
    const bool gold_starts = start_of_chunk(last_gold, c), guess_starts = start_of_chunk(last_guess, g);
    if (gold_starts && guess_starts && g.type == c.type) open_correct_ = true;
    if (gold_starts) count(&ChunkCounts::gold, c.type);
    if (guess_starts) count(&ChunkCounts::guessed, g.type);

    if (!boundary) {
      ++tokens;
      if (c.prefix == g.prefix && c.type == g.type) ++correct_tokens;
    }
    last_gold = c;
    last_guess = g;
  }
  // conlleval counts a chunk still open at the end of its input (type "" after a boundary), so until another
  // sentence arrives this one is counted as correct.
  if (open_correct_) ++overall.correct;
}

std::string ChunkEvaluation::report() const {
  std::ostringstream out;
  out << "processed " << tokens << " tokens with " << overall.gold << " phrases; found: " << overall.guessed
      << " phrases; correct: " << overall.correct << ".\n";
  out << "accuracy: " << fixed2(accuracy()) << "%; precision: " << fixed2(overall.precision())
      << "%; recall: " << fixed2(overall.recall()) << "%; FB1: " << fixed2(overall.f1()) << "\n";
  for (const auto& [type, counts] : by_type)
    out << std::setw(17) << type << ": precision: " << fixed2(counts.precision())
        << "%; recall: " << fixed2(counts.recall()) << "%; FB1: " << fixed2(counts.f1()) << "  " << counts.guessed
        << "\n";
  return out.str();
}

}  // namespace trellis
