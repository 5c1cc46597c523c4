// The one place that fills cudaLaunchKernelEx's configuration, for kernels launched with attributes: a thread-block
// cluster along x, or programmatic dependent launch (the kernel may start while the previous one in the stream ends).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace trellis::cuda {

struct LaunchShape {
  dim3 grid, block;
  std::size_t smem = 0;  // dynamic shared memory per block, in bytes
  cudaStream_t stream = nullptr;
  unsigned cluster = 0;    // blocks per cluster along x; 0: no cluster attribute
  bool dependent = false;  // programmatic stream serialization allowed
};

// kernel<<<shape.grid, shape.block, shape.smem, shape.stream>>>(args...) with the attributes `shape` asks for.
template <class... Params, class... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), const LaunchShape& shape, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = shape.grid;
  config.blockDim = shape.block;
  config.dynamicSmemBytes = shape.smem;
  config.stream = shape.stream;
  cudaLaunchAttribute attributes[2] = {};
  unsigned n = 0;
  if (shape.cluster > 0) {
    attributes[n].id = cudaLaunchAttributeClusterDimension;
    attributes[n].val.clusterDim.x = shape.cluster;
    attributes[n].val.clusterDim.y = attributes[n].val.clusterDim.z = 1;
    ++n;
  }
  if (shape.dependent) {
    attributes[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  config.attrs = attributes;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace trellis::cuda
