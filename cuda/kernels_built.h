// Whether this build of the library has its CUDA kernels. Routes that need a kernel for CUDA tensors but have no
// "supported" query of their own ask this, so that a build without nvcc (cuda/no_kernels.cpp) keeps their ATen route.
// Also what the library reads of LibTorch's CUDA caching allocator, so that no other translation unit needs its
// headers.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace trellis::cuda {

bool kernels_built();

// CUDA devices the runtime sees: 0 with *why set to the runtime's reason where it sees none (no driver, no GPU); -1
// in a build without the kernels (the CUDA runtime is not linked: the caller cannot tell).
int device_count(std::string* why);

// Bytes of tensors LibTorch's caching allocator holds on `device`: now, and at most since the last
// reset_peak_device_memory. Zeros for a CPU device or a build without the kernels.
struct DeviceMemory {
  int64_t current = 0, peak = 0;
};
DeviceMemory device_memory(c10::Device device);
void reset_peak_device_memory(c10::Device device);

}  // namespace trellis::cuda
