#!/usr/bin/env bash
# Throughput of the HMM commands on sampled categorical data, V = 10000, lengths uniform in [100, 1000]:
#   hmm infer               log-likelihood + Viterbi (float32 and float64)
#   hmm infer --posteriors  the same and the state posteriors, written out (float32, uncompressed: --compression 0)
#   hmm fit                 one EM iteration from the sampling model (float32)
# at K = 64, 1024 and 4096 (and 16384 with TRELLIS_HMM_BENCH_LARGE=1), on fewer tokens as K grows. Prints one line
# per run and writes every run as a JSON row {workload, shape, device, precision, tokens, seconds, tokens_per_s} to
# JSON_OUT (default WORK_DIR/hmm_bench.json); the forward kernel's rows ("hmm log-lik", `trellis bench hmm`) come from
# that command's --json file. hmmlearn's rate for the same work comes from tests/hmmlearn_compare.py bench (hmmlearn
# is not on the GPU machine).
# Usage: hmm_bench.sh TRELLIS WORK_DIR [DEVICES...]   (devices for K = 64, default cuda; larger K run on cuda)
#   env: JSON_OUT=FILE, TRELLIS_HMM_BENCH_LARGE=1, TRELLIS_HMM_BENCH_TIMEOUT (seconds per command, default 300)
set -euo pipefail
trellis=$1
work=$2
shift 2
devices=("${@:-cuda}")
json=${JSON_OUT:-$work/hmm_bench.json}
limit=${TRELLIS_HMM_BENCH_TIMEOUT:-300}
mkdir -p "$work"
rows=()
row() {  # WORKLOAD K DEVICE PRECISION TOKENS SECONDS
  local rate
  rate=$(awk -v n="$5" -v s="$6" 'BEGIN { printf "%.0f", (s > 0 ? n / s : 0) }')
  printf '%-22s K=%-5s %-5s %-8s tokens %-9s %8s s  %10s tokens/s\n' "$1" "$2" "$3" "$4" "$5" "$6" "$rate"
  rows+=("{\"workload\": \"$1\", \"shape\": \"K=$2 V=10000 T=100..1000\", \"device\": \"$3\", \"precision\": \"$4\", \"tokens\": $5, \"seconds\": $6, \"tokens_per_s\": $rate}")
}
data() {  # K TOKENS: model m$K.h5 and data d$K-$TOKENS.h5
  local n=$(( ($2 + 549) / 550 ))  # 550 positions per sequence on average
  [ -f "$work/m$1.h5" ] || "$trellis" hmm init --states "$1" --symbols 10000 --seed 1 -o "$work/m$1.h5" 2>/dev/null
  "$trellis" hmm sample -m "$work/m$1.h5" -o "$work/d$1-$2.h5" -n "$n" -l 1000 --min-length 100 --seed 2 2>/dev/null
}
infer() {  # K TOKENS DEVICE PRECISION ["--posteriors --compression 0"]
  local out workload="hmm infer${5:+ $5}"
  if ! out=$(timeout "$limit" "$trellis" hmm infer -m "$work/m$1.h5" -d "$work/d$1-$2.h5" -o "$work/o$1.h5" \
    --device "$3" --precision "$4" --memory-budget 8G ${5:-} 2>/dev/null); then
    echo "$workload K=$1 $3 $4: failed or over ${limit} s"
    return
  fi
  # "sequences N  tokens N  log-likelihood X (Y per token)  S s  R tokens/s"
  row "$workload" "$1" "$3" "$4" "$(awk '{print $4}' <<<"$out")" "$(awk '{for (i = 1; i < NF; ++i) if ($(i+1) == "s") print $i}' <<<"$out")"
  rm -f "$work/o$1.h5"
}
fit() {  # K TOKENS DEVICE PRECISION: one EM iteration from the sampling model
  local log
  if ! log=$(timeout "$limit" "$trellis" hmm fit -d "$work/d$1-$2.h5" --init "$work/m$1.h5" -o "$work/f$1.h5" \
    --max-iterations 1 --tolerance 0 --device "$3" --precision "$4" --memory-budget 8G 2>&1 >/dev/null); then
    echo "hmm fit K=$1 $3 $4: failed or over ${limit} s"
    return
  fi
  # "data: N sequences, M tokens" and "iter 0  log-likelihood X  per token Y  S s"
  row "hmm fit" "$1" "$3" "$4" "$(awk '/^data:/ {print $4}' <<<"$log")" "$(awk '/^iter 0/ {print $(NF-1)}' <<<"$log")"
  rm -f "$work/f$1.h5"
}
run() {  # K INFER_TOKENS POSTERIOR_TOKENS FIT_TOKENS DEVICES...
  local K=$1 tokens=$2 small=$3 fit_tokens=$4 dev precision size
  shift 4
  for size in $(printf '%s\n' "$tokens" "$small" "$fit_tokens" | sort -u); do data "$K" "$size"; done
  for dev in "$@"; do
    for precision in float32 float64; do infer "$K" "$tokens" "$dev" "$precision"; done
    infer "$K" "$small" "$dev" float32 "--posteriors --compression 0"
    fit "$K" "$fit_tokens" "$dev" float32
  done
  rm -f "$work/d$K-"*.h5
}
# The posteriors written out are K floats per token (compressed): the --posteriors runs take fewer tokens.
run 64 10000000 500000 2000000 "${devices[@]}"
run 1024 2000000 50000 1000000 cuda  # the CPU would take minutes here
run 4096 1000000 10000 200000 cuda
[ "${TRELLIS_HMM_BENCH_LARGE:-0}" = 1 ] && run 16384 50000 2000 20000 cuda
{
  echo "["
  for ((i = 0; i < ${#rows[@]}; ++i)); do echo "  ${rows[i]}$([ $((i + 1)) -lt ${#rows[@]} ] && echo ,)"; done
  echo "]"
} >"$json"
echo "wrote $json"
