#!/usr/bin/env bash
# Groups the failing inputs in tests/fuzz/findings/<target>/ by what they trigger (the first report line: a harness
# finding, a sanitizer error, an assertion, libFuzzer's out-of-memory or timeout), replaying each through its fuzzer:
#   tests/fuzz/triage.sh [TARGET...]    (default: every target with findings; fuzzers from build-fuzz/)
# Prints one line per group: count, report line, one example file. "no longer fails" means the bug was fixed.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
targets=("$@")
if ((${#targets[@]} == 0)); then
  for dir in "$here"/findings/*/; do [ -d "$dir" ] && targets+=("$(basename "$dir")"); done
fi
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
export TMPDIR="$scratch" OMP_NUM_THREADS=1
export ASAN_OPTIONS="detect_leaks=0:quarantine_size_mb=64" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
for target in "${targets[@]}"; do
  fuzzer="$root/build-fuzz/tests/fuzz/fuzz_$target"
  [ -x "$fuzzer" ] || continue  # findings/ may hold other files, e.g. reproducers for the command line
  for input in "$here/findings/$target"/*; do
    [ -f "$input" ] || continue
    report=$(timeout 120 "$fuzzer" -rss_limit_mb=2048 -malloc_limit_mb=1024 "$input" 2>&1 |
             grep -m1 -E "FUZZ FINDING|runtime error|Assertion|ERROR: AddressSanitizer|ERROR: libFuzzer: (out-of-memory|timeout)|terminate called" |
             sed -E 's/0x[0-9a-f]+/ADDR/g; s/==[0-9]+==//g') || true
    printf '%s\t%s\n' "${report:-no longer fails}" "${input#"$root"/}"
  done | sort | awk -F'\t' -v target="$target" \
    '{n[$1]++; example[$1] = $2} END {for (r in n) printf "%s: %dx %s (e.g. %s)\n", target, n[r], r, example[r]}'
done
