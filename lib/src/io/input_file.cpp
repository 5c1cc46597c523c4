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

std::size_t invalid_utf8_offset(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    // Allowed range of the second byte; later continuation bytes are always 0x80..0xBF.
    std::size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;       // overlong
      else if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;       // overlong
      else if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return i;
    }
    if (n - i < len || p[i + 1] < lo || p[i + 1] > hi) return i;
    for (std::size_t k = 2; k < len; ++k)
      if ((p[i + k] & 0xC0) != 0x80) return i;
    i += len;
  }
  return std::string_view::npos;
}

}  // namespace trellis
