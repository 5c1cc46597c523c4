// trellis::read_conll on arbitrary text, then the writer's promise: what write_conll accepts reads back unchanged.
#include <sstream>

#include "fuzz_target.h"
#include "trellis/io/conll.h"

TRELLIS_FUZZ_TARGET(conll) {
  trellis_fuzz::FuzzInput in(data, size);
  const uint8_t mode = in.byte();
  trellis::ConllReadOptions options;
  if (mode & 1) options.comment_prefix = "#";
  options.validate_utf8 = !(mode & 2);
  options.allow_empty = mode & 4;
  std::istringstream text(in.rest());

  trellis::ConllCorpus corpus;
  if (!trellis_fuzz::succeeds_or_throws_error("read_conll", [&] { corpus = trellis::read_conll(text, "fuzz", options); }))
    return;
  if (corpus.sentences.empty() && !options.allow_empty) trellis_fuzz::finding("read_conll returned no sentences");
  std::size_t last_line = 0;
  for (const auto& sentence : corpus.sentences) {
    if (sentence.rows.empty()) trellis_fuzz::finding("read_conll returned an empty sentence");
    if (sentence.first_line <= last_line) trellis_fuzz::finding("sentence line numbers do not increase");
    last_line = sentence.first_line;
    for (const auto& row : sentence.rows) {
      if (row.size() != corpus.num_columns) trellis_fuzz::finding("a row's column count differs from num_columns");
      for (const auto& field : row)
        if (field.empty() || field.find_first_of(" \t") != std::string::npos)
          trellis_fuzz::finding("read_conll returned an empty field or one holding a separator");
    }
  }

  std::ostringstream written;
  if (!trellis_fuzz::succeeds_or_throws_error("write_conll", [&] { trellis::write_conll(written, corpus.sentences); }))
    return;
  trellis::ConllReadOptions reread;
  reread.validate_utf8 = options.validate_utf8;
  reread.allow_empty = true;
  std::istringstream back_text(written.str());
  trellis::ConllCorpus back;
  if (!trellis_fuzz::succeeds_or_throws_error("read_conll of write_conll's output",
                                              [&] { back = trellis::read_conll(back_text, "written", reread); }))
    trellis_fuzz::finding("write_conll wrote text that read_conll rejects");
  bool same = back.sentences.size() == corpus.sentences.size();
  for (std::size_t s = 0; same && s < back.sentences.size(); ++s) same = back.sentences[s].rows == corpus.sentences[s].rows;
  if (!same) trellis_fuzz::finding("write_conll's output reads back different from what was written");
}
