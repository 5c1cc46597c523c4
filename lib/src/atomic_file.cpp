#include "trellis/atomic_file.h"

#include <unistd.h>  // getpid, for the temporary file's name

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "trellis/error.h"

namespace trellis {

void write_file_atomically(const std::string& path, const std::function<void(std::ostream&)>& write) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  if (!out) throw Error("cannot open '" + tmp + "' for writing: " + std::strerror(errno));
  try {
    write(out);
    out.close();  // flushes; a full disk shows up here
    if (!out) throw Error("error writing '" + tmp + "'");
    if (std::rename(tmp.c_str(), path.c_str()) != 0)
      throw Error("cannot rename '" + tmp + "' to '" + path + "': " + std::strerror(errno));
  } catch (...) {
    out.close();
    std::remove(tmp.c_str());
    throw;
  }
}

}  // namespace trellis
