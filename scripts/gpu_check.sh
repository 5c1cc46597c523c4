#!/usr/bin/env bash
# Build Trellis on the GPU machine and run the GPU tests, compute-sanitizer and the benchmarks, in one command.
# The machine has LibTorch (python3's torch), HDF5, GoogleTest and nvcc; Boost.Program_options travels as .deb
# files in .gpu-debs/ (fetch them once with scripts/fetch_gpu_debs.sh and carry that folder).
# Usage there: bash scripts/gpu_check.sh [bench args...] (then the HMM throughput runs, scripts/hmm_bench.sh, unless
# TRELLIS_HMM_BENCH=0). Logs go to $OUT (or /tmp/trellis-gpu). While working on one kernel, TRELLIS_GPU_FILTER (a
# GoogleTest filter, default *Cuda*) narrows the CUDA tests and memcheck, and TRELLIS_GPU_CTEST=0 skips the full ctest.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-/tmp/trellis-gpu}"
mkdir -p "$out"
sysroot=/tmp/trellis-sysroot
build=/tmp/trellis-build-gpu
status=0
step() {  # step NAME COMMAND...: run, log to $out/NAME.log, remember failure
  local name=$1
  shift
  echo "=== $name: $*"
  local t0=$SECONDS
  if "$@" >"$out/$name.log" 2>&1; then echo "--- $name ok ($((SECONDS - t0)) s)"; else
    echo "--- $name FAILED ($((SECONDS - t0)) s); tail of $name.log:"
    tail -n 40 "$out/$name.log"
    status=1
  fi
}

mkdir -p "$sysroot"
for f in .gpu-debs/*.deb; do dpkg -x "$f" "$sysroot"; done
export LD_LIBRARY_PATH="$sysroot/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
torch_prefix="$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

rm -rf "$build"  # a stale cache silently keeps old paths
step configure cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$sysroot/usr"
step build cmake --build "$build" -j "$(nproc)"
if [ "${TRELLIS_GPU_CTEST:-1}" = 1 ]; then
  step ctest ctest --test-dir "$build" --output-on-failure -j 4
  grep -E "tests passed|tests failed" "$out/ctest.log"
fi
filter="${TRELLIS_GPU_FILTER:-*Cuda*}"
step gpu_tests "$build/tests/trellis_tests" --gtest_filter="$filter"
grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$out/gpu_tests.log"
step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/trellis_tests" --gtest_filter="$filter"
tail -n 3 "$out/memcheck.log"
if [ -x "$build/apps/trellis" ] && "$build/apps/trellis" bench --help >/dev/null 2>&1; then
  step bench "$build/apps/trellis" bench "${@:-all}" --device cuda --json "$out/bench.json"
  cat "$out/bench.log"
fi
if [ -x "$build/apps/trellis" ] && [ "${TRELLIS_HMM_BENCH:-1}" = 1 ]; then
  step hmm_bench bash scripts/hmm_bench.sh "$build/apps/trellis" /tmp/trellis-hmm-bench cuda
  cat "$out/hmm_bench.log"
fi
exit $status
