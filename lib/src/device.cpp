#include "trellis/device.h"

#include "cuda/kernels_built.h"

namespace trellis {

void check_device_available(c10::Device device, const std::string& option) {
  if (!device.is_cuda()) return;
  std::string why;
  const int count = cuda::device_count(&why);
  if (count < 0) return;  // a build without the kernels: LibTorch reports a missing device when it is used
  const std::string named = option + " " + device.str();
  if (count == 0)
    throw Error(named + ": this machine has no CUDA device" + (why.empty() ? "" : " (" + why + ")"));
  if (device.has_index() && device.index() >= count)
    throw Error(named + ": this machine has " + std::to_string(count) + " CUDA device" + (count == 1 ? "" : "s") +
                ", cuda:0" + (count == 1 ? "" : " to cuda:" + std::to_string(count - 1)));
}

}  // namespace trellis
