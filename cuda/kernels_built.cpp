// Built with the kernels (cuda/CMakeLists.txt); cuda/no_kernels.cpp answers for a build without them.
#include "cuda/kernels_built.h"

namespace trellis::cuda {

bool kernels_built() { return true; }

}  // namespace trellis::cuda
