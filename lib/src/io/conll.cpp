#include "trellis/io/conll.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string_view>

#include "trellis/io/atomic_file.h"
#include "lib/src/io/input_file.h"

namespace trellis {

namespace {

constexpr std::string_view kBlanks = " \t";
// Far beyond any real token line; they keep a binary or hostile file from taking the memory with one line, or the
// feature extractors from expanding millions of columns.
constexpr std::size_t kMaxLineBytes = 1 << 20;
constexpr std::size_t kMaxColumns = 1000;

// std::getline, but a line longer than kMaxLineBytes is a ParseError before it is held whole.
bool read_line(std::istream& in, std::string& line, const std::string& source, std::size_t line_no) {
  line.clear();
  std::streambuf* buf = in.rdbuf();
  for (;;) {
    const int c = buf->sbumpc();
    if (c == std::char_traits<char>::eof()) {
      in.setstate(std::ios::eofbit);
      return !line.empty();
    }
    if (c == '\n') return true;
    if (line.size() == kMaxLineBytes)
      throw ParseError(source, line_no,
                       "line longer than " + std::to_string(kMaxLineBytes) + " bytes (not a CoNLL file?)");
    line.push_back(static_cast<char>(c));
  }
}

bool has_blank(const std::string& field) { return field.find_first_of(" \t\r\n\v\f") != std::string::npos; }

std::string row_name(std::size_t s, std::size_t t) {
  return "sentences[" + std::to_string(s) + "].rows[" + std::to_string(t) + "]";
}

// Rejects what write_conll could not write so that read_conll gives it back unchanged.
void check_writable(const std::vector<ConllSentence>& sentences) {
  std::size_t num_columns = 0;
  for (std::size_t s = 0; s < sentences.size(); ++s) {
    const auto& rows = sentences[s].rows;
    if (rows.empty()) throw Error("write_conll: sentences[" + std::to_string(s) + "] has no tokens");
    for (std::size_t t = 0; t < rows.size(); ++t) {
      const auto& row = rows[t];
      if (num_columns == 0) num_columns = row.size();
      if (row.empty()) throw Error("write_conll: " + row_name(s, t) + " has no columns");
      if (row.size() != num_columns)
        throw Error("write_conll: " + row_name(s, t) + " has " + std::to_string(row.size()) + " columns, expected " +
                    std::to_string(num_columns));
      for (std::size_t c = 0; c < row.size(); ++c)
        if (row[c].empty() || has_blank(row[c]))
          throw Error("write_conll: " + row_name(s, t) + "[" + std::to_string(c) + "] is empty or contains whitespace");
      // The file's first bytes: a byte-order mark there is dropped by every reader (read_conll too).
      if (s == 0 && t == 0 && std::string_view(row[0]).substr(0, kBom.size()) == kBom)
        throw Error("write_conll: " + row_name(s, t) + "[0] starts with a byte-order mark, which readers drop");
    }
  }
}

}  // namespace

std::size_t ConllCorpus::num_tokens() const {
  std::size_t n = 0;
  for (const auto& sentence : sentences) n += sentence.rows.size();
  return n;
}

ConllCorpus read_conll(const std::string& path, const ConllReadOptions& options) {
  std::ifstream in = open_input_file(path, "");
  return read_conll(in, path, options);
}

ConllCorpus read_conll(std::istream& in, const std::string& source_name, const ConllReadOptions& options) {
  ConllCorpus corpus;
  corpus.source = source_name;
  ConllSentence sentence;
  auto end_sentence = [&] {
    if (sentence.rows.empty()) return;
    corpus.sentences.push_back(std::move(sentence));
    sentence = ConllSentence();
  };

  std::string buffer;
  std::size_t line_no = 0;
  while (read_line(in, buffer, source_name, line_no + 1)) {
    ++line_no;
    std::string_view line = buffer;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    // Validate before stripping the BOM so that the reported column is the byte's column in the file.
    if (options.validate_utf8) {
      const std::size_t bad = invalid_utf8_offset(line);
      if (bad != std::string_view::npos)
        throw ParseError(source_name, line_no, "invalid UTF-8 byte at column " + std::to_string(bad + 1));
    }
    // A NUL is valid UTF-8 but no text: tokens holding one would not survive the files that store them (C strings).
    if (const std::size_t nul = line.find('\0'); nul != std::string_view::npos)
      throw ParseError(source_name, line_no, "NUL byte at column " + std::to_string(nul + 1));
    if (line_no == 1 && line.substr(0, kBom.size()) == kBom) line.remove_prefix(kBom.size());

    std::size_t pos = line.find_first_not_of(kBlanks);
    if (pos == std::string_view::npos) {
      end_sentence();
      continue;
    }
    if (!options.comment_prefix.empty() && line.substr(pos, options.comment_prefix.size()) == options.comment_prefix)
      continue;

    std::vector<std::string> row;
    row.reserve(corpus.num_columns);
    while (pos != std::string_view::npos) {
      const std::size_t end = std::min(line.find_first_of(kBlanks, pos), line.size());
      row.emplace_back(line.substr(pos, end - pos));
      pos = line.find_first_not_of(kBlanks, end);
    }
    if (row.size() > kMaxColumns)
      throw ParseError(
          source_name, line_no,
          std::to_string(row.size()) + " columns; at most " + std::to_string(kMaxColumns) + " are supported");
    if (corpus.num_columns == 0) corpus.num_columns = row.size();
    if (row.size() != corpus.num_columns)
      throw ParseError(
          source_name, line_no,
          "expected " + std::to_string(corpus.num_columns) + " columns, found " + std::to_string(row.size()));
    if (sentence.rows.empty()) sentence.first_line = line_no;
    sentence.rows.push_back(std::move(row));
  }
  end_sentence();

  if (corpus.sentences.empty() && !options.allow_empty) throw ParseError(source_name, 1, "empty file: no sentences");
  return corpus;
}

void write_conll(std::ostream& out, const std::vector<ConllSentence>& sentences) {
  check_writable(sentences);
  for (const auto& sentence : sentences) {
    for (const auto& row : sentence.rows) {
      for (std::size_t c = 0; c < row.size(); ++c) {
        if (c > 0) out << '\t';
        out << row[c];
      }
      out << '\n';
    }
    out << '\n';
  }
  if (!out) throw Error("write_conll: output stream failed");
}

void write_conll(const std::string& path, const std::vector<ConllSentence>& sentences) {
  write_file_atomically(path, [&](std::ostream& out) { write_conll(out, sentences); });
}

}  // namespace trellis
