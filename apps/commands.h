// Subcommands of the trellis command line. Each parses its own options and calls the library; exit codes: 0 ok,
// 1 error (message on stderr), 2 bad usage.
#pragma once
#include <string>
#include <vector>

namespace trellis::cli {

int crf_main(const std::vector<std::string>& args);
int hmm_main(const std::vector<std::string>& args);
int bench_main(const std::vector<std::string>& args);

}  // namespace trellis::cli
