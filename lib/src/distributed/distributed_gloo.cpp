// The Gloo backend. LibTorch's wheel ships ProcessGroupGloo.hpp but not the Gloo headers it includes; Debian's
// libgloo-dev provides them (scripts/setup.sh). Gloo itself is linked inside libtorch_cpu, and this file only calls
// LibTorch's out-of-line functions (Options::create_default, the constructor): it never instantiates a Gloo class
// inline, so the Debian headers' version cannot change what runs. The class's own members that involve Gloo are all
// smart pointers, so its size does not depend on them either. Without the headers (lib/CMakeLists.txt), a CPU process
// group is an error.
#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include "lib/src/distributed/distributed_backends.h"
#include "trellis/error.h"

namespace trellis {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout) {
#ifdef USE_C10D_GLOO
  // The default device: GLOO_SOCKET_IFNAME's interface if set, else this host's name, else the loopback.
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size,
                                                     c10d::ProcessGroupGloo::Options::create_default(timeout));
#else
  (void)store, (void)rank, (void)size, (void)timeout;
  throw Error(
      "this Trellis was built without Gloo's headers (Debian: libgloo-dev), so it has no CPU process group: "
      "run --device cpu as one process, or rebuild with them");
#endif
}

}  // namespace trellis
