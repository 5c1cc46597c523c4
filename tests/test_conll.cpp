#include "trellis/io/conll.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

using trellis::ConllCorpus;
using trellis::ConllReadOptions;
using trellis::ConllSentence;
using trellis::read_conll;
using trellis::write_conll;
using trellis::testing::TempDir;

namespace {

using Rows = std::vector<std::vector<std::string>>;

ConllCorpus parse(const std::string& text, const ConllReadOptions& options = {}) {
  std::istringstream in(text);
  return read_conll(in, "test.txt", options);
}

// The message of the ParseError that parsing `text` throws, and its line.
std::pair<std::string, std::size_t> parse_error(const std::string& text, const ConllReadOptions& options = {}) {
  try {
    parse(text, options);
  } catch (const trellis::ParseError& e) {
    EXPECT_EQ(e.source, "test.txt");
    return {e.what(), e.line};
  }
  ADD_FAILURE() << "no ParseError for: " << text;
  return {"", 0};
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

TEST(Conll, ParsesSentencesColumnsAndFirstLine) {
  const auto corpus = parse(
      "Confidence NN B-NP\n"
      "in IN B-PP\n"
      "\n"
      "He\tPRP  B-NP\n"
      "  left \t VBD\tB-VP  \n");
  EXPECT_EQ(corpus.source, "test.txt");
  EXPECT_EQ(corpus.num_columns, 3u);
  EXPECT_EQ(corpus.num_tokens(), 4u);
  ASSERT_EQ(corpus.sentences.size(), 2u);
  EXPECT_EQ(corpus.sentences[0].rows, (Rows{{"Confidence", "NN", "B-NP"}, {"in", "IN", "B-PP"}}));
  EXPECT_EQ(corpus.sentences[0].first_line, 1u);
  EXPECT_EQ(corpus.sentences[1].rows, (Rows{{"He", "PRP", "B-NP"}, {"left", "VBD", "B-VP"}}));
  EXPECT_EQ(corpus.sentences[1].first_line, 4u);
}

TEST(Conll, HashIsARealTokenByDefault) {
  const auto corpus = parse("# # O\n$ $ O\n");
  ASSERT_EQ(corpus.sentences.size(), 1u);
  EXPECT_EQ(corpus.sentences[0].rows, (Rows{{"#", "#", "O"}, {"$", "$", "O"}}));
}

TEST(Conll, SkipsCommentsWithoutEndingSentences) {
  ConllReadOptions options;
  options.comment_prefix = "#";
  const auto corpus = parse(
      "# sent_id = 1\n"
      "# text = a b\n"
      "1 a\n"
      "  # indented comment inside the sentence\n"
      "2 b\n"
      "\n"
      "#comment\n"
      "1 c\n",
      options);
  ASSERT_EQ(corpus.sentences.size(), 2u);
  EXPECT_EQ(corpus.sentences[0].rows, (Rows{{"1", "a"}, {"2", "b"}}));
  EXPECT_EQ(corpus.sentences[0].first_line, 3u);
  EXPECT_EQ(corpus.sentences[1].rows, (Rows{{"1", "c"}}));
  EXPECT_EQ(corpus.sentences[1].first_line, 8u);
}

TEST(Conll, AcceptsRunsOfBlankAndWhitespaceOnlyLines) {
  const auto corpus = parse("\n\na A\n\n \t \n\n\nb B\nc C\n\n\n");
  ASSERT_EQ(corpus.sentences.size(), 2u);
  EXPECT_EQ(corpus.sentences[0].rows, (Rows{{"a", "A"}}));
  EXPECT_EQ(corpus.sentences[0].first_line, 3u);
  EXPECT_EQ(corpus.sentences[1].rows, (Rows{{"b", "B"}, {"c", "C"}}));
  EXPECT_EQ(corpus.sentences[1].first_line, 8u);
}

TEST(Conll, AcceptsMissingFinalNewline) {
  const auto corpus = parse("a A\n\nb B\nc C");
  ASSERT_EQ(corpus.sentences.size(), 2u);
  EXPECT_EQ(corpus.sentences[1].rows, (Rows{{"b", "B"}, {"c", "C"}}));
}

TEST(Conll, AcceptsCrlfLineEndings) {
  const auto corpus = parse("a A\r\nb B\r\n\r\nc C\r\n");
  ASSERT_EQ(corpus.sentences.size(), 2u);
  EXPECT_EQ(corpus.sentences[0].rows, (Rows{{"a", "A"}, {"b", "B"}}));
  EXPECT_EQ(corpus.sentences[1].rows, (Rows{{"c", "C"}}));
  EXPECT_EQ(corpus.sentences[1].first_line, 4u);
}

TEST(Conll, SkipsLeadingBom) {
  const auto corpus = parse(
      "\xEF\xBB\xBF"
      "a A\nb B\n");
  ASSERT_EQ(corpus.sentences.size(), 1u);
  EXPECT_EQ(corpus.sentences[0].rows, (Rows{{"a", "A"}, {"b", "B"}}));

  // A BOM alone on the first line is a blank line, not a token.
  const auto blank_first = parse("\xEF\xBB\xBF\na A\n");
  ASSERT_EQ(blank_first.sentences.size(), 1u);
  EXPECT_EQ(blank_first.sentences[0].first_line, 2u);
}

TEST(Conll, InconsistentColumnCountNamesTheLine) {
  const auto [what, line] = parse_error("a A X\nb B X\n\nc C\n");
  EXPECT_EQ(line, 4u);
  EXPECT_NE(what.find("test.txt:4:"), std::string::npos) << what;
  EXPECT_NE(what.find("expected 3 columns, found 2"), std::string::npos) << what;
}

TEST(Conll, RowWithMoreColumnsThanTheFirstNamesTheLine) {
  const auto [what, line] = parse_error("a A\nb B\n\nc C X\nd D\n");
  EXPECT_EQ(line, 4u);
  EXPECT_EQ(what, "test.txt:4: expected 2 columns, found 3");
  // Also inside the first sentence, and with the extra column after a tab.
  EXPECT_EQ(parse_error("a A\nb B\tX\n").first, "test.txt:2: expected 2 columns, found 3");
}

TEST(Conll, EmptyFileIsAnErrorUnlessAllowed) {
  const auto [what, line] = parse_error("");
  EXPECT_EQ(line, 1u);
  EXPECT_EQ(what, "test.txt:1: empty file: no sentences");

  ConllReadOptions options;
  options.allow_empty = true;
  const auto corpus = parse("", options);
  EXPECT_TRUE(corpus.sentences.empty());
  EXPECT_EQ(corpus.num_columns, 0u);
  EXPECT_EQ(corpus.num_tokens(), 0u);
}

TEST(Conll, WhitespaceOrCommentOnlyFileIsEmpty) {
  EXPECT_EQ(parse_error("\n  \n\t\n\r\n").first, "test.txt:1: empty file: no sentences");

  ConllReadOptions options;
  options.comment_prefix = "#";
  EXPECT_EQ(parse_error("# only a comment\n\n", options).first, "test.txt:1: empty file: no sentences");
}

TEST(Conll, InvalidUtf8NamesLineAndColumn) {
  const auto [what, line] = parse_error("a A\nab\xFF B\n");
  EXPECT_EQ(line, 2u);
  EXPECT_EQ(what, "test.txt:2: invalid UTF-8 byte at column 3");

  EXPECT_EQ(parse_error("caf\xC3 x\n").first, "test.txt:1: invalid UTF-8 byte at column 4");           // truncated
  EXPECT_EQ(parse_error("x \xC0\x80\n").first, "test.txt:1: invalid UTF-8 byte at column 3");          // overlong
  EXPECT_EQ(parse_error("x \xED\xA0\x80\n").first, "test.txt:1: invalid UTF-8 byte at column 3");      // surrogate
  EXPECT_EQ(parse_error("x \xF4\x90\x80\x80\n").first, "test.txt:1: invalid UTF-8 byte at column 3");  // > U+10FFFF
  EXPECT_EQ(parse_error("x \xE6\x97\n").first, "test.txt:1: invalid UTF-8 byte at column 3");  // cut at line end

  const auto valid = parse("caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80\n");
  EXPECT_EQ(valid.sentences[0].rows, (Rows{{"caf\xC3\xA9", "\xE6\x97\xA5\xE6\x9C\xAC", "\xF0\x9F\x98\x80"}}));

  ConllReadOptions options;
  options.validate_utf8 = false;
  EXPECT_EQ(parse("ab\xFF B\n", options).sentences[0].rows, (Rows{{"ab\xFF", "B"}}));
}

TEST(Conll, WritesTabSeparatedColumns) {
  std::ostringstream out;
  write_conll(out, {ConllSentence{{{"a", "A"}, {"b", "B"}}, 1}, ConllSentence{{{"c", "C"}}, 4}});
  EXPECT_EQ(out.str(), "a\tA\nb\tB\n\nc\tC\n\n");
}

TEST(Conll, WriteRejectsWhatCannotBeReadBack) {
  std::ostringstream out;
  EXPECT_THROW(write_conll(out, {ConllSentence{{{"a b", "A"}}, 1}}), trellis::Error);
  EXPECT_THROW(write_conll(out, {ConllSentence{{{"", "A"}}, 1}}), trellis::Error);
  EXPECT_THROW(write_conll(out, {ConllSentence{{{"a", "A"}, {"b"}}, 1}}), trellis::Error);
  EXPECT_THROW(write_conll(out, {ConllSentence{}}), trellis::Error);
  EXPECT_EQ(out.str(), "");
}

TEST(Conll, WriteThenReadRoundTripsThroughAFile) {
  TempDir dir("trellis_conll_");
  const std::string path = dir / "out.txt";
  const std::vector<ConllSentence> sentences = {
      ConllSentence{{{"Confidence", "NN", "B-NP"}, {"#", "#", "O"}}, 1},
      ConllSentence{{{"caf\xC3\xA9", "NN", "I-NP"}}, 4},
  };
  write_conll(path, sentences);
  const auto corpus = read_conll(path);
  EXPECT_EQ(corpus.source, path);
  EXPECT_EQ(corpus.num_columns, 3u);
  ASSERT_EQ(corpus.sentences.size(), 2u);
  for (std::size_t i = 0; i < sentences.size(); ++i) {
    EXPECT_EQ(corpus.sentences[i].rows, sentences[i].rows);
    EXPECT_EQ(corpus.sentences[i].first_line, sentences[i].first_line);
  }

  // Overwriting replaces the file and leaves no temporary behind.
  write_conll(path, {sentences[1]});
  EXPECT_EQ(read_conll(path).sentences.size(), 1u);
  EXPECT_EQ(TempDir::list_dir(dir.path), std::vector<std::string>{"out.txt"});
}

TEST(Conll, FailedWriteLeavesNothingBehind) {
  TempDir dir("trellis_conll_");
  const std::string missing = dir / "missing";
  const std::vector<ConllSentence> sentences = {ConllSentence{{{"a", "A"}}, 1}};
  EXPECT_THROW(write_conll(missing + "/out.txt", sentences), trellis::Error);
  EXPECT_FALSE(exists(missing));
  EXPECT_TRUE(TempDir::list_dir(dir.path).empty());

  // Invalid content: no temporary and no target either.
  const std::string path = dir / "out.txt";
  EXPECT_THROW(write_conll(path, {ConllSentence{{{"a b", "A"}}, 1}}), trellis::Error);
  EXPECT_TRUE(TempDir::list_dir(dir.path).empty());
}

TEST(Conll, CannotOpenErrorNamesThePath) {
  TempDir dir("trellis_conll_");
  const std::string path = dir / "no_such_file.txt";
  try {
    read_conll(path);
    FAIL() << "no error";
  } catch (const trellis::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cannot open '" + path + "': "), std::string::npos) << what;
    EXPECT_NE(what.find("No such file"), std::string::npos) << what;
  }
}

TEST(Conll, ReadingADirectoryIsAnError) {
  TempDir dir("trellis_conll_");
  try {
    read_conll(dir.path);
    FAIL() << "no error";
  } catch (const trellis::Error& e) {
    EXPECT_EQ(std::string(e.what()), "cannot open '" + dir.path + "': it is a directory");
  }
}
