// The exact counts at which a word gets its own id (min_count) and stops teaching the signature classes
// (Vocabulary::kRareCount, TnT's "seen at most 10 times").
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "trellis/io/vocabulary.h"

using trellis::signature_classes;
using trellis::Vocabulary;

namespace {

using Strings = std::vector<std::string>;

Strings repeated(const std::string& word, int64_t times) { return Strings(times, word); }

Strings concat(Strings a, const Strings& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

bool has_symbol(const Vocabulary& v, const std::string& s) {
  for (const auto& x : v.symbols())
    if (x == s) return true;
  return false;
}

}  // namespace

TEST(VocabularyThresholds, AWordSeenExactlyMinCountTimesKeepsItsOwnId) {
  for (const auto unknown : {Vocabulary::Unknown::single, Vocabulary::Unknown::signatures}) {
    const Vocabulary v = Vocabulary::build(concat(repeated("walking", 3), repeated("talking", 2)), 3, unknown);
    EXPECT_TRUE(v.known("walking"));   // 3 = min_count
    EXPECT_FALSE(v.known("talking"));  // 2 = min_count - 1
    EXPECT_FALSE(has_symbol(v, "talking"));
    EXPECT_EQ(v.symbols().at(v.id("walking")), "walking");
  }
  // The rare word maps to the most specific of its own classes (its last letter is never its first).
  const Vocabulary v =
      Vocabulary::build(concat(repeated("walking", 3), repeated("talking", 2)), 3, Vocabulary::Unknown::signatures);
  EXPECT_EQ(v.symbols().at(v.id("talking")), "<unk-lc-~alking>");
}

TEST(VocabularyThresholds, WordsSeenAtMostTenTimesTeachTheSignatureClasses) {
  ASSERT_EQ(Vocabulary::kRareCount, 10);
  // min_count 1: every word keeps its id; only the rare ones add their classes.
  const Vocabulary ten = Vocabulary::build(repeated("running", 10), 1, Vocabulary::Unknown::signatures);
  EXPECT_TRUE(ten.known("running"));
  for (const auto& c : signature_classes("running")) EXPECT_TRUE(has_symbol(ten, c)) << c;
  EXPECT_EQ(ten.size(), 1 + static_cast<int64_t>(signature_classes("running").size()));

  const Vocabulary eleven = Vocabulary::build(repeated("running", 11), 1, Vocabulary::Unknown::signatures);
  EXPECT_EQ(eleven.symbols(), Strings{"running"});

  // An unknown word finds the class that the word seen 10 times taught.
  const int64_t jumping = ten.id("jumping");
  ASSERT_GE(jumping, 0);
  EXPECT_EQ(ten.symbols().at(jumping), "<unk-lc-~ing>");
}

TEST(VocabularyThresholds, AboveTheRareCountOnlyWordsBelowMinCountTeachClasses) {
  // min_count 12 > kRareCount: a word seen 11 times is below min_count (classes, no id), one seen 12 times is not.
  const Vocabulary v =
      Vocabulary::build(concat(repeated("Seen", 12), repeated("rare", 11)), 12, Vocabulary::Unknown::signatures);
  EXPECT_TRUE(v.known("Seen"));
  EXPECT_FALSE(v.known("rare"));
  for (const auto& c : signature_classes("rare")) EXPECT_TRUE(has_symbol(v, c)) << c;
  for (const auto& c : signature_classes("Seen")) EXPECT_FALSE(has_symbol(v, c)) << c;
  EXPECT_EQ(v.size(), 1 + static_cast<int64_t>(signature_classes("rare").size()));
}
