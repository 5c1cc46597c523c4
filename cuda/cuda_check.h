// Error checking for CUDA runtime calls and kernel launches: failures become trellis::Error, never exit().
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "trellis/error.h"

namespace trellis::cuda {

inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(status));
}

// After a launch: reports configuration errors at once (asynchronous faults surface at the next synchronisation).
inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

inline unsigned grid_dim(int64_t n, int64_t per_block) {
  return static_cast<unsigned>((n + per_block - 1) / per_block);
}

}  // namespace trellis::cuda
