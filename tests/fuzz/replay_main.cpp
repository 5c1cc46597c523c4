// Runs fuzz targets over files without libFuzzer: `trellis_fuzz_replay TARGET FILE_OR_DIRECTORY...`. The test suite
// replays each target's seed corpus this way, so the targets build and keep their contract with any compiler.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <sstream>

#include "fuzz_target.h"

namespace trellis_fuzz {
namespace {
std::map<std::string, TargetFunction>& targets() {
  static std::map<std::string, TargetFunction> all;
  return all;
}
}  // namespace

bool register_target(const char* name, TargetFunction f) { return targets().emplace(name, f).second; }

}  // namespace trellis_fuzz

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  const auto& targets = trellis_fuzz::targets();
  const auto target = argc >= 3 ? targets.find(argv[1]) : targets.end();
  if (target == targets.end()) {
    std::cerr << "usage: " << argv[0] << " TARGET FILE_OR_DIRECTORY...\ntargets:";
    for (const auto& t : targets) std::cerr << ' ' << t.first;
    std::cerr << '\n';
    return 2;
  }
  std::vector<fs::path> files;
  for (int i = 2; i < argc; ++i) {
    if (fs::is_directory(argv[i])) {
      for (const auto& entry : fs::directory_iterator(argv[i]))
        if (entry.is_regular_file()) files.push_back(entry.path());
    } else {
      files.emplace_back(argv[i]);
    }
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    std::cerr << "no inputs\n";
    return 2;
  }
  trellis_fuzz::initialise_process();
  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) {
      std::cerr << "cannot open " << file << '\n';
      return 2;
    }
    const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::cerr << "replaying " << file.string() << " (" << data.size() << " bytes)\n";
    target->second(reinterpret_cast<const uint8_t*>(data.data()), data.size());
  }
  std::cout << target->first << ": " << files.size() << " inputs replayed\n";
  return 0;
}
