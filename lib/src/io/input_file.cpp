#include "lib/src/io/input_file.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "trellis/error.h"

namespace trellis {
namespace {

std::string describe(const std::string& path, const std::string& what) {
  return what.empty() ? "'" + path + "'" : what + " '" + path + "'";
}

}  // namespace

std::ifstream open_input_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw Error("cannot open " + describe(path, what) + ": " + std::strerror(errno));
  if (S_ISDIR(st.st_mode)) throw Error("cannot open " + describe(path, what) + ": it is a directory");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot open " + describe(path, what) + ": " + std::strerror(errno));
  return in;
}

std::string read_input_file(const std::string& path, const std::string& what, std::size_t max_bytes) {
  std::ifstream in = open_input_file(path, what);
  struct stat st {};
  const auto too_large = [&] {
    return Error(describe(path, what) + " is larger than " + std::to_string(max_bytes) + " bytes: not a " +
                 (what.empty() ? "valid input" : what));
  };
  if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && static_cast<std::size_t>(st.st_size) > max_bytes)
    throw too_large();
  std::string data;
  char chunk[1 << 16];
  while (in.read(chunk, sizeof chunk) || in.gcount() > 0) {
    data.append(chunk, in.gcount());
    if (data.size() > max_bytes) throw too_large();
  }
  if (in.bad()) throw Error("error reading " + describe(path, what) + ": " + std::strerror(errno));
  return data;
}

}  // namespace trellis
