// Reading and writing CoNLL column files: one token per line, columns separated by spaces or tabs, a blank line
// after each sentence. Plain C++17; no LibTorch.
#pragma once
#include <cstddef>
#include <iosfwd>
#include <string>
#include <vector>

#include "trellis/error.h"

namespace trellis {

// One sentence of a column file: its tokens' fields.
struct ConllSentence {
  std::vector<std::vector<std::string>> rows;  // rows[token][column]
  std::size_t first_line = 0;                  // 1-based line number of the first token in the source
};

// How read_conll reads a file.
struct ConllReadOptions {
  std::string comment_prefix;  // empty: no comment skipping ('#' is a real token in CoNLL-2000); "#" for CoNLL-U
  bool validate_utf8 = true;   // invalid UTF-8 -> ParseError naming file:line
  bool allow_empty = false;    // a file with no sentences is an error unless this is set
};

// A whole column file as read_conll reads it.
struct ConllCorpus {
  std::string source;                    // file name (or the name given for a stream)
  std::size_t num_columns = 0;           // same for every token of the file; 0 when there are no tokens
  std::vector<ConllSentence> sentences;  // in file order
  // The tokens of all sentences.
  std::size_t num_tokens() const;
};

// Columns are separated by any run of spaces and tabs. A blank (or whitespace-only) line ends a sentence; runs of
// blank lines, a missing final newline, CRLF line endings and a leading UTF-8 BOM are accepted. Lines whose first
// non-blank characters are options.comment_prefix (when set) are skipped without ending a sentence.
// Throws ParseError("source:line: ...") when a token line's column count differs from the first token line's, on
// invalid UTF-8 (column = 1-based byte offset in the line), or when there are no tokens and !options.allow_empty.
// The path overload throws Error("cannot open 'path': <strerror>") when the file cannot be opened.
ConllCorpus read_conll(const std::string& path, const ConllReadOptions& options = {});
// The same from a stream; source_name stands for the file name in errors and in ConllCorpus::source.
ConllCorpus read_conll(std::istream& in, const std::string& source_name, const ConllReadOptions& options = {});

// Writes sentences as whitespace-joined columns (tab-separated), a blank line after each sentence.
// Throws Error, before writing anything, for output that would not read back as written: an empty sentence, a
// field that is empty or contains whitespace, or a row whose column count differs from the first row's.
void write_conll(std::ostream& out, const std::vector<ConllSentence>& sentences);

// Atomic: writes to "<path>.tmp.<pid>" in the same directory, then renames; on any error the temporary is removed and
// nothing appears under `path`.
void write_conll(const std::string& path, const std::vector<ConllSentence>& sentences);

}  // namespace trellis
