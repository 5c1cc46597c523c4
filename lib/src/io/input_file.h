// Opening input files with messages a user can act on: the path, what the file was meant to be, and the cause.
#pragma once
#include <fstream>
#include <string>
#include <string_view>

namespace trellis {

// Opens `path` for binary reading. Throws an Error "cannot open <what> '<path>': <cause>" when it cannot be opened
// or is a directory (`what` may be empty: "cannot open '<path>'").
std::ifstream open_input_file(const std::string& path, const std::string& what);

// The whole content of `path`, opened as above; an Error naming it when it is larger than max_bytes (checked before
// reading, or while reading for files whose size is not known in advance, such as pipes and devices).
std::string read_input_file(const std::string& path, const std::string& what, std::size_t max_bytes);

// A UTF-8 byte order mark, which text files may start with (accepted and skipped by every text reader).
constexpr std::string_view kBom = "\xEF\xBB\xBF";

// Offset of the first byte of the first ill-formed UTF-8 sequence in `s`, or npos. Strict (RFC 3629): overlong
// forms, surrogates and code points above U+10FFFF are rejected.
std::size_t invalid_utf8_offset(std::string_view s);

}  // namespace trellis
