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

}  // namespace trellis_fuzz
