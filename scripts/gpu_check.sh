#!/usr/bin/env bash
# Build Trellis on the GPU machine and run the GPU tests, compute-sanitizer (memcheck, racecheck, synccheck) and the
# benchmarks, in one command.
# The machine has LibTorch (python3's torch), HDF5, GoogleTest and nvcc; Boost.Program_options travels as .deb
# files in .gpu-debs/ (fetch them once with scripts/gpu/fetch_gpu_debs.sh and carry that folder).
# Usage there: bash scripts/gpu_check.sh [sanitize|bench] [bench args...]
#   no mode    everything: build, the whole ctest suite, the CUDA tests, the three sanitizers, the benchmarks
#              (bench args, default all) and the HMM throughput runs (scripts/gpu/hmm_bench.sh, unless TRELLIS_HMM_BENCH=0)
#   sanitize   build, the CUDA tests and the three sanitizers: no ctest, no benchmarks
#   bench      build, the whole ctest suite, the CUDA tests and the benchmarks: no sanitizers
#   scale      build the operator library and the command line and run the multi-GPU benchmarks under torchrun at
#              every world size from 1 to the GPUs present: bench/vocab_parallel_head.py (rows into $OUT/scale.json),
#              then bench/data_parallel_scale.sh (hmm infer/fit, crf train; $OUT/scale_data_parallel.json; needs
#              .gpu-data/conll2000 carried; TRELLIS_SCALE_DATA_PARALLEL=0 skips it, TRELLIS_SCALE_HEAD=0 the head). Peers' wheels
#              (liger-kernel) travel in .whl/ (carry it). NVLink multicast stays off in every process.
#   package    build, the CUDA tests, the CTest suite but the scratch-venv pip install (the Python package's and the
#              distributed commands' tests, now with a GPU), then the Python benchmarks beside their peers
#              (bench/crf_python.py, bench/hmm_estimator.py; wheels of pytorch-crf, torch-struct and hmmlearn in
#              .whl/) and the neural CRF tagger (bench/neural_crf.sh on the corpora carried in .gpu-data/, when
#              there); results in $OUT/*.json. TRELLIS_PACKAGE_STEPS (default "tests bench neural") picks parts,
#              TRELLIS_CTEST_REGEX narrows the CTest suite, TRELLIS_BENCHES (default "crf_python hmm_estimator") the
#              benchmarks.
# TRELLIS_BUILD_TARGETS (e.g. "trellis_tests trellis_ops trellis_cli") builds those targets alone, for a call that runs
# only what needs them (the examples' and the install tests' CTest cases then fail: narrow TRELLIS_CTEST_REGEX too).
# TRELLIS_GPU_KEEP_BUILD=1 keeps the build folder of an earlier call on a still-warm machine (incremental build).
# Where one command may run at most 600 s (the lent GPU machines), run `sanitize` and `bench` as two commands.
# Logs go to $OUT (or /tmp/trellis-gpu), one per step; each sanitizer's summary line is printed. The exit status is 1
# when any step failed (the benchmarks still run after a failure). While working on one kernel, TRELLIS_GPU_FILTER (a
# GoogleTest filter, default *Cuda*) narrows the CUDA tests and the sanitizers, and TRELLIS_GPU_CTEST=0/1 skips or
# runs the full ctest whatever the mode.
# The three sanitizers run at once. memcheck runs every test the filter selects. racecheck and synccheck, 10-100 times slower on shared memory, skip
# the head's large-shape tests (LinearCrossEntropyCuda.*): LinearCrossEntropySmallCuda.* reaches the same kernels at
# small shapes (TRELLIS_GPU_SANITIZE_FILTER replaces their filter). Each sanitizer stops after
# TRELLIS_SANITIZER_TIMEOUT seconds (default 460), which counts as a failure.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 1
mode=all
case "${1:-}" in
  sanitize | bench | scale | package) mode=$1; shift ;;
esac
out="${OUT:-/tmp/trellis-gpu}"
mkdir -p "$out"
sysroot=/tmp/trellis-sysroot
build=/tmp/trellis-build-gpu
failed=()
step_rc=0
step() {  # step NAME COMMAND...: run, log to $out/NAME.log, remember failure
  local name=$1
  shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" >"$out/$name.log" 2>&1
  step_rc=$?
  if [ "$step_rc" = 0 ]; then echo "--- $name ok ($((SECONDS - t0)) s)"; else
    echo "--- $name FAILED (exit $step_rc, $((SECONDS - t0)) s); tail of $name.log:"
    tail -n 40 "$out/$name.log"
    failed+=("$name")
  fi
}

mkdir -p "$sysroot"
for f in .gpu-debs/*.deb; do dpkg -x "$f" "$sysroot"; done
export LD_LIBRARY_PATH="$sysroot/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
torch_prefix="$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
echo "mode: $mode"

if [ "$mode" = scale ] || [ "$mode" = package ]; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
[ "${TRELLIS_GPU_KEEP_BUILD:-0}" = 1 ] || rm -rf "$build"  # a stale cache silently keeps old paths
step configure cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$sysroot/usr"
if [ "$mode" = scale ]; then
  step build cmake --build "$build" -j "$(nproc)" --target trellis_ops trellis_cli
  gpus=$(nvidia-smi --list-gpus | wc -l)
  commit=${TRELLIS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  for ((p = 1; p <= gpus && ${TRELLIS_SCALE_HEAD:-1}; p++)); do
    step "scale_p$p" env TRELLIS_COMMIT="$commit" timeout -k 30 "${TRELLIS_SCALE_TIMEOUT:-240}" \
      torchrun --standalone --nproc-per-node="$p" bench/vocab_parallel_head.py \
      --library "$build/bindings/libtrellis_ops.so" --json "$out/scale.json"
    grep '^{' "$out/scale_p$p.log"
  done
  # hmm infer/fit and crf train under torchrun at every world size (bench/data_parallel_scale.sh; sizes from
  # TRELLIS_SCALE_HMM_SIZES where the full ones do not fit the call).
  if [ "${TRELLIS_SCALE_DATA_PARALLEL:-1}" = 1 ] && [ -f .gpu-data/conll2000/train.txt ]; then
    step data_parallel env TRELLIS_COMMIT="$commit" timeout -k 30 "${TRELLIS_DATA_PARALLEL_TIMEOUT:-400}" \
      bash bench/data_parallel_scale.sh "$build/apps/trellis" /tmp/trellis-scale "$out/scale_data_parallel.json" \
      .gpu-data/conll2000/train.txt
    cat "$out/data_parallel.log"
  fi
  [ ${#failed[@]} -gt 0 ] && { echo "=== FAILED steps: ${failed[*]} ($SECONDS s in all)"; exit 1; }
  echo "=== every step ok ($SECONDS s in all)"
  exit 0
fi
# shellcheck disable=SC2086  # TRELLIS_BUILD_TARGETS is a list of words
step build cmake --build "$build" -j "$(nproc)" ${TRELLIS_BUILD_TARGETS:+--target $TRELLIS_BUILD_TARGETS}
if [ "$mode" = package ]; then
  parts=" ${TRELLIS_PACKAGE_STEPS:-tests bench neural} "
  commit=${TRELLIS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  export TRELLIS_COMMIT=$commit PYTHONPATH="$root/bindings/python${PYTHONPATH:+:$PYTHONPATH}" \
    TRELLIS_OPS_LIBRARY="$build/bindings/libtrellis_ops.so" PYTHONUNBUFFERED=1
  if [[ $parts == *" tests "* ]]; then
    step gpu_tests "$build/tests/trellis_tests" --gtest_filter="${TRELLIS_GPU_FILTER:-*Cuda*}"
    grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$out/gpu_tests.log"
    step ctest ctest --test-dir "$build" --output-on-failure -j 8 -E '^python_package_pip_install$' \
      ${TRELLIS_CTEST_REGEX:+-R "$TRELLIS_CTEST_REGEX"}
    grep -E "tests passed|tests failed|\(Failed\)|\(Skipped\)|Not Run" "$out/ctest.log"
  fi
  if [[ $parts == *" bench "* ]]; then
    benches=" ${TRELLIS_BENCHES:-crf_python hmm_estimator} "
    if [[ $benches == *" crf_python "* ]]; then
      step crf_python python3 bench/crf_python.py --library "$build/bindings/libtrellis_ops.so" --trellis-bin "$build/apps/trellis" \
        --out "$out/crf_python.json"
      cat "$out/crf_python.log"
    fi
    if [[ $benches == *" hmm_estimator "* ]]; then
      step hmm_estimator python3 bench/hmm_estimator.py --out "$out/hmm_estimator.json" ${TRELLIS_HMM_ESTIMATOR_ARGS:-}
      cat "$out/hmm_estimator.log"
    fi
  fi
  if [[ $parts == *" neural "* ]] && [ -d .gpu-data/ud-en-ewt ]; then
    step neural_crf bash bench/neural_crf.sh "$build/apps/trellis" .gpu-data "$out/neural" ${TRELLIS_NEURAL_TASKS:-ewt}
    cat "$out/neural_crf.log"
  fi
  [ ${#failed[@]} -gt 0 ] && { echo "=== FAILED steps: ${failed[*]} ($SECONDS s in all)"; exit 1; }
  echo "=== every step ok ($SECONDS s in all)"
  exit 0
fi
ctest_default=1
[ "$mode" = sanitize ] && ctest_default=0
if [ "${TRELLIS_GPU_CTEST:-$ctest_default}" = 1 ]; then
  step ctest ctest --test-dir "$build" --output-on-failure -j 4
  grep -E "tests passed|tests failed" "$out/ctest.log"
fi
filter="${TRELLIS_GPU_FILTER:-*Cuda*}"
step gpu_tests "$build/tests/trellis_tests" --gtest_filter="$filter"
grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$out/gpu_tests.log"

if [ "$mode" != bench ]; then
  # The filter's own negative patterns, if any, stand; otherwise the head's large-shape tests are left out.
  case "$filter" in
    *-*) sanitize_filter=$filter ;;
    *) sanitize_filter="$filter-LinearCrossEntropyCuda.*" ;;
  esac
  sanitize_filter="${TRELLIS_GPU_SANITIZE_FILTER:-$sanitize_filter}"
  sanitizer_timeout="${TRELLIS_SANITIZER_TIMEOUT:-460}"
  # The three tools run at once (separate processes on the one GPU): the slowest, racecheck, sets the time. racecheck
  # leaves out LibTorch's own reduce_kernel, whose shared-memory hazard is PyTorch's (pytorch/pytorch#162995), not a
  # Trellis kernel's.
  declare -A tool_args=([memcheck]="" [racecheck]="--kernel-name-exclude kns=reduce_kernel" [synccheck]="")
  declare -A tool_pid
  for tool in memcheck racecheck synccheck; do
    tool_filter=$sanitize_filter
    [ "$tool" = memcheck ] && tool_filter=$filter
    echo "=== $tool (in the background): compute-sanitizer --tool $tool ${tool_args[$tool]} --gtest_filter=$tool_filter"
    # shellcheck disable=SC2086  # the tool's extra arguments are words
    timeout -k 30 "$sanitizer_timeout" compute-sanitizer --tool "$tool" ${tool_args[$tool]} --error-exitcode 1 \
      "$build/tests/trellis_tests" --gtest_filter="$tool_filter" >"$out/$tool.log" 2>&1 &
    tool_pid[$tool]=$!
  done
  for tool in memcheck racecheck synccheck; do
    wait "${tool_pid[$tool]}"
    rc=$?
    if [ "$rc" = 0 ]; then echo "--- $tool ok"; else
      echo "--- $tool FAILED (exit $rc); tail of $tool.log:"
      tail -n 40 "$out/$tool.log"
      failed+=("$tool")
    fi
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "$tool: stopped after $sanitizer_timeout s"
    summary=$(grep -E "(ERROR|RACECHECK|SYNCCHECK) SUMMARY" "$out/$tool.log" | tr -s '= ' ' ' | paste -sd ';' -)
    echo "$tool summary:${summary:- none in $tool.log (the run did not finish)}"
    grep -E "^\[  (PASSED|FAILED) " "$out/$tool.log"
  done
fi

if [ "$mode" != sanitize ]; then
  if [ -x "$build/apps/trellis" ] && "$build/apps/trellis" bench --help >/dev/null 2>&1; then
    step bench "$build/apps/trellis" bench "${@:-all}" --device cuda --json "$out/bench.json"
    cat "$out/bench.log"
  fi
  if [ -x "$build/apps/trellis" ] && [ "${TRELLIS_HMM_BENCH:-1}" = 1 ]; then
    step hmm_bench bash scripts/gpu/hmm_bench.sh "$build/apps/trellis" /tmp/trellis-hmm-bench cuda
    cat "$out/hmm_bench.log"
  fi
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "=== FAILED steps: ${failed[*]} ($SECONDS s in all)"
  exit 1
fi
echo "=== every step ok ($SECONDS s in all)"
