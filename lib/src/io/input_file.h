// Opening input files with messages a user can act on: the path, what the file was meant to be, and the cause.
#pragma once
#include <fstream>
#include <string>

namespace trellis {

// Opens `path` for binary reading. Throws an Error "cannot open <what> '<path>': <cause>" when it cannot be opened
// or is a directory (`what` may be empty: "cannot open '<path>'").
std::ifstream open_input_file(const std::string& path, const std::string& what);

// The whole content of `path`, opened as above; an Error naming it when it is larger than max_bytes (checked before
// reading, or while reading for files whose size is not known in advance, such as pipes and devices).
std::string read_input_file(const std::string& path, const std::string& what, std::size_t max_bytes);

}  // namespace trellis
