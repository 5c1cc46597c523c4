#!/usr/bin/env bash
# Throughput of `trellis hmm infer` (log-likelihood + Viterbi, no posteriors) on sampled categorical data, V = 10000:
# K = 64 on 10M tokens, K = 1024 and K = 4096 on fewer. Prints one line per run; hmmlearn's rate for the same work
# comes from scripts/hmmlearn_compare.py bench (hmmlearn is not on the GPU machine).
# Usage: hmm_bench.sh TRELLIS WORK_DIR [DEVICES...]   (devices for K = 64, default cuda; larger K run on cuda)
set -euo pipefail
trellis=$1
work=$2
shift 2
devices=("${@:-cuda}")
mkdir -p "$work"
run() {  # K TOKENS DEVICES...
  local K=$1 tokens=$2 n
  shift 2
  n=$(( (tokens + 549) / 550 ))  # lengths uniform in [100, 1000]: 550 on average
  "$trellis" hmm init --states "$K" --symbols 10000 --seed 1 -o "$work/m$K.h5" 2>/dev/null
  "$trellis" hmm sample -m "$work/m$K.h5" -o "$work/d$K.h5" -n "$n" -l 1000 --min-length 100 --seed 2 2>/dev/null
  for dev in "$@"; do
    for precision in float32 float64; do
      printf 'K=%-5s %-5s %-8s ' "$K" "$dev" "$precision"
      "$trellis" hmm infer -m "$work/m$K.h5" -d "$work/d$K.h5" -o "$work/o$K.h5" --device "$dev" \
        --precision "$precision" --memory-budget 8G 2>/dev/null
    done
  done
  rm -f "$work/d$K.h5" "$work/o$K.h5"
}
run 64 10000000 "${devices[@]}"
run 1024 1000000 cuda  # the CPU would take minutes here
run 4096 200000 cuda
