#include <ATen/Parallel.h>
#include <hdf5.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "fuzz_target.h"

namespace trellis_fuzz {

void initialise_process() {
  at::set_num_threads(1);
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // the readers turn HDF5 failures into trellis::Error messages
}

std::string scratch_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("trellis-fuzz-" + std::to_string(::getpid()) + "-" + name)).string();
}

void write_file(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  if (!out.flush()) finding("cannot write the scratch file '" + path + "' (not a finding in the code under test)");
}

std::string model_file(FuzzInput& in) {
  const bool append_checksum = !(in.byte() & 1);
  std::string file = in.rest();
  if (append_checksum) {
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : file) h = (h ^ c) * 1099511628211ull;
    file.append(reinterpret_cast<const char*>(&h), sizeof h);
  }
  return file;
}

std::vector<std::vector<std::string>> sentence_of(std::size_t columns) {
  std::vector<std::vector<std::string>> sentence;
  for (int t = 0; t < 3; ++t) {
    std::vector<std::string> row;
    for (std::size_t c = 0; c < columns; ++c) row.push_back("w" + std::to_string(t) + "c" + std::to_string(c));
    sentence.push_back(row);
  }
  return sentence;
}

}  // namespace trellis_fuzz
