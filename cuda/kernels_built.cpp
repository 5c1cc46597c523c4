// Built with the kernels (cuda/CMakeLists.txt); cuda/no_kernels.cpp answers for a build without them.
#include "cuda/kernels_built.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

#include <cstddef>

namespace trellis::cuda {
namespace {

c10::DeviceIndex index_of(c10::Device device) {
  return device.has_index() ? device.index() : c10::cuda::current_device();
}

}  // namespace

bool kernels_built() { return true; }

int device_count(std::string* why) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaSuccess) return count;
  int driver = 0;  // 0: no driver installed, which the runtime reports as a driver too old for it
  *why = cudaDriverGetVersion(&driver) == cudaSuccess && driver == 0 ? "no NVIDIA driver is installed"
                                                                     : cudaGetErrorString(status);
  cudaGetLastError();  // the error is reported here, not left for the next call to find
  return 0;
}

DeviceMemory device_memory(c10::Device device) {
  if (!device.is_cuda()) return {};
  namespace alloc = c10::cuda::CUDACachingAllocator;
  const auto stats = alloc::getDeviceStats(index_of(device));  // a copy: the statistics come by value
  const auto& all = stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  return {all.current, all.peak};
}

void reset_peak_device_memory(c10::Device device) {
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(index_of(device));
}

}  // namespace trellis::cuda
