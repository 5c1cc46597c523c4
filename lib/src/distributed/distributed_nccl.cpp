// The NCCL backend, for --device cuda. USE_C10D_NCCL comes with LibTorch's CUDA targets (a CPU-only LibTorch has no
// NCCL process group); nccl.h from the nvidia-nccl wheel beside it (lib/CMakeLists.txt).
#ifdef USE_C10D_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "lib/src/distributed/distributed_backends.h"
#include "trellis/error.h"

namespace trellis {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout, int device) {
#ifdef USE_C10D_NCCL
  if (device < 0 || device >= c10::cuda::device_count())
    throw Error("LOCAL_RANK " + std::to_string(device) + " names no GPU of this machine's " +
                std::to_string(c10::cuda::device_count()));
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
  (void)store, (void)rank, (void)size, (void)timeout, (void)device;
  throw Error("this LibTorch has no NCCL process group: --device cuda under torchrun needs LibTorch's CUDA build");
#endif
}

}  // namespace trellis
