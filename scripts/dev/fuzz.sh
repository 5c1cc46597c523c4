#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz: clang, ASan, UBSan) into build-fuzz/ and fuzzes each in turn, one at a
# time on one core. Usage: scripts/dev/fuzz.sh [SECONDS_PER_TARGET (default 600)] [TARGET...]
# Targets: conll crfpp_template crf_model neural_model hmm_dataset hmm_model (default: all). Runs continue past a finding
# (libFuzzer -fork=1 -ignore_crashes=1); every failing input is kept in tests/fuzz/findings/<target>/ and the new ones
# are listed at the end. Set FUZZ_FLAGS for other libFuzzer flags (e.g. FUZZ_FLAGS= to stop at the first finding instead).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
seconds="${1:-600}"
shift || true
targets=("$@")
((${#targets[@]})) || targets=(conll crfpp_template crf_model neural_model hmm_dataset hmm_model)

bash scripts/setup.sh  # the venv's LibTorch, HDF5 and the other packages the library needs
if ! command -v clang++ >/dev/null || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
  echo "[fuzz] installing clang and its libFuzzer/sanitizer runtimes"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends clang libclang-rt-dev >/dev/null
fi

# Builds share the machine with every other build through one lock (see scripts/build.sh's callers).
flock /tmp/trellis-build.lock bash -c '
  set -e
  [ -f build-fuzz/CMakeCache.txt ] || cmake --preset fuzz
  cmake --build --preset fuzz -j "${TRELLIS_JOBS:-$(nproc)}"'

status=0
started="$(mktemp)"
trap 'rm -f "$started"' EXIT
for target in "${targets[@]}"; do
  echo "[fuzz] $target: $seconds s"
  if ! bash tests/fuzz/run_fuzzer.sh "build-fuzz/tests/fuzz/fuzz_$target" "tests/fuzz/corpus/$target" \
      "build-fuzz/tests/fuzz/runs/$target" "$seconds" ${FUZZ_FLAGS--fork=1 -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1}; then
    status=1
  fi
done
findings=$(find tests/fuzz/findings -type f -newer "$started" 2>/dev/null | sort)
if [ -n "$findings" ]; then
  echo "[fuzz] new failing inputs (reproduce: build-fuzz/tests/fuzz/fuzz_TARGET FILE):"
  echo "$findings"
  echo "[fuzz] grouped by what they trigger:"
  bash tests/fuzz/triage.sh "${targets[@]}"
  status=1
fi
exit $status
