// trellis: structured prediction from the command line.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include <new>

#include "commands.h"
#include "trellis/io/atomic_file.h"
#include "trellis/error.h"
#include "trellis/version.h"

namespace {

constexpr const char* kUsage = R"(usage: trellis <command> [options]

commands:
  crf     train, tag, evaluate and inspect linear-chain CRF taggers (trellis crf --help)
  hmm     HMM training, inference and sampling on HDF5 datasets (trellis hmm --help)
  bench   time Trellis beside plain LibTorch and cuBLAS on the same work (trellis bench --help)

options:
  -h, --help     this message
  --version      print the version
)";

int run(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    (args.empty() ? std::cerr : std::cout) << kUsage;  // without a command: a usage error
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "--version") {
    std::cout << "trellis " << TRELLIS_VERSION_STRING << " (LibTorch " << TRELLIS_TORCH_VERSION_STRING
              << (TRELLIS_CUDA_KERNELS ? ", CUDA kernels" : ", CPU only") << ")\n";
    return 0;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  try {
    if (args[0] == "crf") return trellis::cli::crf_main(rest);
    if (args[0] == "hmm") return trellis::cli::hmm_main(rest);
    if (args[0] == "bench") return trellis::cli::bench_main(rest);
  } catch (const c10::Error& e) {
    // LibTorch's own checks (a device that is not there, an allocation that fails): the message without its C++
    // stack trace, which tells a user nothing.
    std::cerr << "trellis: error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::bad_alloc&) {
    std::cerr << "trellis: error: out of memory\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "trellis: error: " << e.what() << "\n";
    return 1;
  }
  std::cerr << "trellis: unknown command '" << args[0] << "'\n" << kUsage;
  return 2;
}

// rc, or a failure where standard output could not be written (a full disk, a closed descriptor): what a command
// printed there is its result, so a lost write fails the command, as a file's would.
int with_standard_output_written(int rc) {
  errno = 0;
  std::cout.flush();
  int cause = errno;
  bool failed = std::cout.fail();
  if (std::fflush(stdout) != 0) {
    failed = true;
    cause = errno;
  }
  if (!failed && !std::ferror(stdout)) return rc;
  std::cerr << "trellis: error: cannot write standard output: " << (cause ? std::strerror(cause) : "a write failed")
            << "\n";
  return rc == 0 ? 1 : rc;
}

}  // namespace

int main(int argc, char** argv) {
  trellis::remove_temporaries_on_signals();
  const int rc = with_standard_output_written(run(std::vector<std::string>(argv + 1, argv + argc)));
  // Every command has written and closed its files by now. What is left is LibTorch's static destructors
  // (unregistering thousands of operators) and freeing the run's memory, a quarter of a second after a training
  // run: leave without them, as compilers do.
  std::fflush(nullptr);
  std::_Exit(rc);
}
