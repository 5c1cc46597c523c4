#!/usr/bin/env bash
# Set up (once), configure and build Trellis into build/. Usage: scripts/build.sh [extra cmake -D options]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh

# nvcc is preinstalled under /usr/local/cuda but not always on PATH (CI runs with a plain environment).
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi

build="${TRELLIS_BUILD_DIR:-$root/build}"
torch_prefix="$("$root/.venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
# ccache lives inside the build folder; pch_defines/time_macros let it cache translation units that use the PCH; paths
# under the source folder are hashed relative to the compiler's folder (base_dir), so that a build beside this one
# (the pip install test's) finds these objects.
export CCACHE_DIR="$build/ccache" CCACHE_BASEDIR="$root"
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -G Ninja \
    -DCMAKE_PREFIX_PATH="$torch_prefix" \
    -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache \
    -DPython3_EXECUTABLE="$root/.venv/bin/python" "$@"
fi
cmake --build "$build" -j "${TRELLIS_JOBS:-$(nproc)}"
