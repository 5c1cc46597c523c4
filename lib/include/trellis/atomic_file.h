// Whole-file writes that never leave a partial file under the final name.
#pragma once
#include <functional>
#include <ostream>
#include <string>

namespace trellis {

// Calls write(stream) on "<path>.tmp.<pid>" in the same directory, then renames it to `path`. On any error (or an
// exception from write) the temporary is removed and an Error naming the file is thrown; `path` is untouched.
void write_file_atomically(const std::string& path, const std::function<void(std::ostream&)>& write);

}  // namespace trellis
