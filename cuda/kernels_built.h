// Whether this build of the library has its CUDA kernels. Routes that need a kernel for CUDA tensors but have no
// "supported" query of their own ask this, so that a build without nvcc (cuda/no_kernels.cpp) keeps their ATen route.
#pragma once

namespace trellis::cuda {

bool kernels_built();

}  // namespace trellis::cuda
