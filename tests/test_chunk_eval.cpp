#include "trellis/io/chunk_eval.h"

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <utility>
#include <vector>

using trellis::ChunkCounts;
using trellis::ChunkEvaluation;

namespace {

std::vector<std::string> tags(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> out;
  for (std::string tag; in >> tag;) out.push_back(tag);
  return out;
}

// Each pair is one sentence: space-separated gold tags, space-separated guessed tags.
ChunkEvaluation evaluate(const std::vector<std::pair<std::string, std::string>>& sentences) {
  ChunkEvaluation eval;
  for (const auto& [gold, guess] : sentences) eval.add_sentence(tags(gold), tags(guess));
  return eval;
}

void expect_counts(const ChunkCounts& counts, std::size_t correct, std::size_t guessed, std::size_t gold) {
  EXPECT_EQ(counts.correct, correct);
  EXPECT_EQ(counts.guessed, guessed);
  EXPECT_EQ(counts.gold, gold);
}

}  // namespace

TEST(ChunkEval, ExactMatchIsPerfect) {
  const auto eval = evaluate({{"B-NP I-NP O B-VP", "B-NP I-NP O B-VP"}});
  EXPECT_EQ(eval.tokens, 4u);
  EXPECT_EQ(eval.correct_tokens, 4u);
  expect_counts(eval.overall, 2, 2, 2);
  EXPECT_DOUBLE_EQ(eval.overall.precision(), 100.0);
  EXPECT_DOUBLE_EQ(eval.overall.recall(), 100.0);
  EXPECT_DOUBLE_EQ(eval.overall.f1(), 100.0);
  EXPECT_DOUBLE_EQ(eval.accuracy(), 100.0);
}

TEST(ChunkEval, TypeChangeInsideChunkStartsNewChunk) {
  // The guessed I-VP after B-NP closes the NP and opens a VP; the I-NP after it opens another NP.
  const auto eval = evaluate({{"B-NP I-NP I-NP", "B-NP I-VP I-NP"}});
  expect_counts(eval.overall, 0, 3, 1);
  expect_counts(eval.by_type.at("NP"), 0, 2, 1);
  expect_counts(eval.by_type.at("VP"), 0, 1, 0);
  EXPECT_EQ(eval.correct_tokens, 2u);
}

TEST(ChunkEval, InsideTagStartsChunkAfterOutsideOrSentenceStart) {
  // IOB1-style I- at sentence start and after O matches the IOB2 guess chunk for chunk.
  const auto eval = evaluate({{"I-NP I-NP O I-VP", "B-NP I-NP O B-VP"}});
  expect_counts(eval.overall, 2, 2, 2);
  EXPECT_EQ(eval.correct_tokens, 2u);
}

TEST(ChunkEval, BioesTags) {
  const auto eval = evaluate({{"B-NP E-NP S-VP S-NP O", "B-NP E-NP S-VP S-NP O"}});
  expect_counts(eval.overall, 3, 3, 3);
  expect_counts(eval.by_type.at("NP"), 2, 2, 2);
  expect_counts(eval.by_type.at("VP"), 1, 1, 1);
}

TEST(ChunkEval, BioesSameTypeSinglesMergeAsInConlleval) {
  // conlleval has no S- rule: gold "S-NP S-NP" is one two-token chunk, so the guessed single S-NP is wrong.
  const auto eval = evaluate({{"S-NP S-NP", "S-NP O"}, {"B-NP E-NP B-NP E-NP", "B-NP E-NP B-NP E-NP"}});
  expect_counts(eval.overall, 1, 2, 2);
}

TEST(ChunkEval, OutsideOnly) {
  const auto eval = evaluate({{"O O O", "O O O"}});
  expect_counts(eval.overall, 0, 0, 0);
  EXPECT_TRUE(eval.by_type.empty());
  EXPECT_DOUBLE_EQ(eval.accuracy(), 100.0);
  EXPECT_DOUBLE_EQ(eval.overall.precision(), 0.0);
  EXPECT_DOUBLE_EQ(eval.overall.recall(), 0.0);
  EXPECT_DOUBLE_EQ(eval.overall.f1(), 0.0);
}

TEST(ChunkEval, EmptyEvaluationIsAllZero) {
  const ChunkEvaluation eval;
  EXPECT_DOUBLE_EQ(eval.accuracy(), 0.0);
  EXPECT_EQ(eval.report(),
            "processed 0 tokens with 0 phrases; found: 0 phrases; correct: 0.\n"
            "accuracy:   0.00%; precision:   0.00%; recall:   0.00%; FB1:   0.00\n");
}

TEST(ChunkEval, PerTypeCounts) {
  const auto eval = evaluate({
      {"B-NP I-NP B-VP B-PP B-NP", "B-NP I-NP B-VP B-NP I-NP"},
      {"B-NP O B-ADJP", "B-NP B-NP O"},
  });
  expect_counts(eval.overall, 3, 5, 6);
  ASSERT_EQ(eval.by_type.size(), 4u);
  expect_counts(eval.by_type.at("NP"), 2, 4, 3);
  expect_counts(eval.by_type.at("VP"), 1, 1, 1);
  expect_counts(eval.by_type.at("PP"), 0, 0, 1);
  expect_counts(eval.by_type.at("ADJP"), 0, 0, 1);
  EXPECT_DOUBLE_EQ(eval.by_type.at("NP").precision(), 50.0);
  EXPECT_DOUBLE_EQ(eval.by_type.at("NP").recall(), 100.0 * 2 / 3);
}

TEST(ChunkEval, ChunkEndsAtSentenceEnd) {
  // Without the boundary the second sentence's I-NP would continue the first sentence's NP.
  const auto eval = evaluate({{"B-NP I-NP", "B-NP I-NP"}, {"I-NP", "I-NP"}});
  expect_counts(eval.overall, 2, 2, 2);
}

TEST(ChunkEval, MismatchedLengthsThrow) {
  ChunkEvaluation eval;
  try {
    eval.add_sentence(tags("B-NP I-NP O"), tags("B-NP O"));
    FAIL() << "no Error for mismatched lengths";
  } catch (const trellis::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find('3'), std::string::npos) << message;
    EXPECT_NE(message.find('2'), std::string::npos) << message;
  }
  EXPECT_EQ(eval.tokens, 0u);
}

TEST(ChunkEval, ReportLayout) {
  const auto eval = evaluate({{"B-NP I-NP B-VP O", "B-NP O B-VP O"}});
  EXPECT_EQ(eval.report(),
            "processed 4 tokens with 2 phrases; found: 2 phrases; correct: 1.\n"
            "accuracy:  75.00%; precision:  50.00%; recall:  50.00%; FB1:  50.00\n"
            "               NP: precision:   0.00%; recall:   0.00%; FB1:   0.00  1\n"
            "               VP: precision: 100.00%; recall: 100.00%; FB1: 100.00  1\n");
}

// Expected numbers below come from running /work/shared/tools/conlleval.py (which matches conlleval.pl) on these
// sentences written as "w GOLD GUESS" lines with a blank line after each sentence.
TEST(ChunkEval, MatchesConllevalOnGeneratedExample) {
  const auto eval = evaluate({
      {"[-NP S-PP [-NP ]-NP", "E-NP I-PP [-NP E-NP"},
      {"I-PP . B-NP O E-NP I-NP", "I-PP ]-NP O I-VP B B"},
      {"I-PP O", "O O"},
      {"]-NP I-NP", ". I-NP"},
      {"I-PP [-NP I-NP S-PP", "I-PP [-NP I-NP S-PP"},
      {"I-NP I-VP S-PP ]-NP [-NP O", "B-VP S-PP S-PP ]-NP I-VP O"},
      {"I-VP O O", "O O O"},
      {"I-VP I I-VP I-VP", "I-VP . B-VP I-VP"},
      {"O I-VP .", "B-NP I-VP ."},
      {"E-NP", "B-NP"},
  });
  EXPECT_EQ(eval.tokens, 35u);
  EXPECT_EQ(eval.correct_tokens, 17u);
  expect_counts(eval.overall, 12, 21, 24);  // the type-less gold "I" chunk counts overall but has no type line
  ASSERT_EQ(eval.by_type.size(), 3u);
  expect_counts(eval.by_type.at("NP"), 5, 8, 12);
  expect_counts(eval.by_type.at("PP"), 4, 5, 6);
  expect_counts(eval.by_type.at("VP"), 3, 6, 5);
  EXPECT_DOUBLE_EQ(eval.overall.f1(), 53.333333333333336);
  EXPECT_DOUBLE_EQ(eval.by_type.at("PP").f1(), 72.72727272727272);
  EXPECT_EQ(eval.report(),
            "processed 35 tokens with 24 phrases; found: 21 phrases; correct: 12.\n"
            "accuracy:  48.57%; precision:  57.14%; recall:  50.00%; FB1:  53.33\n"
            "               NP: precision:  62.50%; recall:  41.67%; FB1:  50.00  8\n"
            "               PP: precision:  80.00%; recall:  66.67%; FB1:  72.73  5\n"
            "               VP: precision:  50.00%; recall:  60.00%; FB1:  54.55  6\n");
}

// conlleval quirk, checked with conlleval.py: a matching type-less chunk "B S" is not closed by the sentence
// boundary. At the end of input it counts as correct; when another sentence follows, it stays open and is lost.
TEST(ChunkEval, TypelessChunkCarriesOverBoundaryAsInConlleval) {
  ChunkEvaluation eval;
  eval.add_sentence(tags("B S"), tags("B S"));
  expect_counts(eval.overall, 1, 1, 1);
  eval.add_sentence(tags("B-X O"), tags("B-X O"));
  expect_counts(eval.overall, 1, 2, 2);
  expect_counts(eval.by_type.at("X"), 1, 1, 1);
}
