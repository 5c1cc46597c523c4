#!/usr/bin/env bash
# Runs one libFuzzer target for a while from its seed corpus:
#   run_fuzzer.sh FUZZER SEED_CORPUS WORK_DIR SECONDS [extra libFuzzer flags]
# New inputs go to WORK_DIR/corpus (the committed seeds are read, never written), scratch files to WORK_DIR/tmp, and a
# failing input to tests/fuzz/findings/<target>/ (not committed). Exit status: libFuzzer's (0: nothing found).
set -euo pipefail
fuzzer="$1" seeds="$2" work="$3" seconds="$4"
shift 4
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
target="$(basename "$fuzzer")"
target="${target#fuzz_}"
findings="$here/findings/$target"
mkdir -p "$work/corpus" "$work/tmp" "$findings"
rm -rf "$work/tmp"/*  # a killed fork-mode run leaves its temporary folder

dict=()
[ -f "$here/$target.dict" ] && dict=("-dict=$here/$target.dict")
# LibTorch under ASan: leak checking reports LibTorch's and HDF5's never-freed globals, not our leaks; a small
# quarantine keeps freed memory from counting towards -rss_limit_mb.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:symbolize=1:quarantine_size_mb=64:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
# One core per fuzzer: LibTorch's intra-op pool would otherwise take them all.
export OMP_NUM_THREADS=1 TMPDIR="$work/tmp"
# A huge allocation (a length field trusted before it is checked) is a finding: malloc_limit_mb makes a single one
# fail loudly instead of being served from the machine's memory.
exec "$fuzzer" -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=30 \
  -max_len=65536 -print_final_stats=1 -artifact_prefix="$findings/" "${dict[@]}" "$@" "$work/corpus" "$seeds"
