#!/usr/bin/env bash
# Throughput of the HMM commands on sampled categorical data, V = 10000, lengths uniform in [100, 1000]:
#   hmm infer               log-likelihood + Viterbi (float32 and float64)
#   hmm infer --posteriors  the same and the state posteriors, written out (float32, uncompressed: --compression 0;
#                           and at the default gzip level 1)
#   hmm fit                 one EM iteration from the sampling model (float32): the second of two, the first also
#                           paying for the process's CUDA start (its seconds are first_iteration_seconds)
# at K = 64, 1024 and 4096, on fewer tokens as K grows. Prints one line per run and writes every run as a JSON row
# {workload, shape, device, precision, tokens, seconds, tokens_per_s} to JSON_OUT (default WORK_DIR/hmm_bench.json;
# rewritten after each row);
# infer rows add the command's own split of its seconds (setup_seconds: the model put on the device and the output
# made; read_, compute_ and write_seconds: the batches', posteriors_seconds the posteriors' share of compute_seconds;
# finish_seconds: the writes still under way at the end and the flush to the disk), --posteriors rows the file
# system written to (output_fs; the command's seconds include flushing the file to it). The forward kernel's rows
# ("hmm log-lik", `trellis bench hmm`) come from that command's --json file. hmmlearn's rate for the same work comes from tests/hmmlearn_compare.py
# bench (hmmlearn is not on the GPU machine).
# With TRELLIS_HMM_BENCH_LARGE=1, also the transition-read floor at K = 16384 (and the K listed in
# TRELLIS_HMM_BENCH_LARGE_K, e.g. "16384 32768"): `hmm infer` over 16 sequences of 1000 (K >= 32768: 500)
# observations, one batch, so the command runs that many steps; the floor counts two reads of the transitions per step
# (the forward's and the Viterbi's, as two separate recursions read them; a batch of at most 32 float32 sequences
# takes one step kernel that reads them once for both); the row "hmm infer floor" gives compute_seconds ÷ (steps × 2 ×
# 4·K² bytes ÷ TRELLIS_HMM_BENCH_BANDWIDTH, default 3.0e12 bytes/s, an H100's measured copy rate).
# Usage: hmm_bench.sh TRELLIS WORK_DIR [DEVICES...]   (devices for K = 64, default cuda; larger K run on cuda)
#   env: JSON_OUT=FILE, TRELLIS_HMM_BENCH_LARGE=1, TRELLIS_HMM_BENCH_LARGE_K, TRELLIS_HMM_BENCH_BANDWIDTH,
#        TRELLIS_HMM_BENCH_TIMEOUT (seconds per command, default 300), TRELLIS_HMM_BENCH_K (the throughput rows' K,
#        default "64 1024 4096"; "" runs the floor rows alone), TRELLIS_HMM_BENCH_POSTERIORS_OUT (folders the
#        --posteriors runs write to, one row each, default WORK_DIR; e.g. "WORK_DIR /dev/shm" adds a row on tmpfs)
set -euo pipefail
trellis=$1
work=$2
shift 2
devices=("${@:-cuda}")
json=${JSON_OUT:-$work/hmm_bench.json}
limit=${TRELLIS_HMM_BENCH_TIMEOUT:-300}
mkdir -p "$work"
rows=()
write_json() {  # every row so far: a run cut short by a time limit keeps the rows it finished
  {
    echo "["
    for ((i = 0; i < ${#rows[@]}; ++i)); do echo "  ${rows[i]}$([ $((i + 1)) -lt ${#rows[@]} ] && echo ,)"; done
    echo "]"
  } >"$json"
}
row() {  # WORKLOAD K DEVICE PRECISION TOKENS SECONDS
  local rate
  rate=$(awk -v n="$5" -v s="$6" 'BEGIN { printf "%.0f", (s > 0 ? n / s : 0) }')
  printf '%-22s K=%-5s %-5s %-8s tokens %-9s %8s s  %10s tokens/s\n' "$1" "$2" "$3" "$4" "$5" "$6" "$rate"
  rows+=("{\"workload\": \"$1\", \"shape\": \"K=$2 V=10000 T=${shape_t:-100..1000}\", \"device\": \"$3\", \"precision\": \"$4\", \"tokens\": $5, \"seconds\": $6, \"tokens_per_s\": $rate${7:+, $7}}")
  write_json
}
data() {  # K TOKENS: model m$K.h5 and data d$K-$TOKENS.h5
  local n=$(( ($2 + 549) / 550 ))  # 550 positions per sequence on average
  [ -f "$work/m$1.h5" ] || "$trellis" hmm init --states "$1" --symbols 10000 --seed 1 -o "$work/m$1.h5" 2>/dev/null
  "$trellis" hmm sample -m "$work/m$1.h5" -o "$work/d$1-$2.h5" -n "$n" -l 1000 --min-length 100 --seed 2 2>/dev/null
}
infer() {  # K TOKENS DEVICE PRECISION ["--posteriors --compression 0" [OUTPUT_DIR]]
  local out workload="hmm infer${5:+ $5}" dir=${6:-$work} fs=
  [ -n "${5:-}" ] && fs="\"output_fs\": \"$(stat -f -c %T "$dir")\", "
  if ! out=$(timeout "$limit" "$trellis" hmm infer -m "$work/m$1.h5" -d "$work/d$1-$2.h5" -o "$dir/o$1.h5" \
    --device "$3" --precision "$4" --memory-budget 8G ${5:-} 2>/dev/null); then
    echo "$workload K=$1 $3 $4: failed or over ${limit} s"
    return
  fi
  # "sequences N  tokens N  log-likelihood X (Y per token)  S s  R tokens/s  (set-up A, reading B, computing C[, of
  # which posteriors P], writing D, finishing F)"
  local split
  split=$(awk '{gsub(/[(),]/, ""); for (i = 1; i < NF; ++i) if ($i ~ /^(set-up|reading|computing|posteriors|writing|finishing)$/) {
    name = $i == "set-up" ? "setup" : $i == "reading" ? "read" : $i == "computing" ? "compute" : $i == "writing" ? "write" : $i == "finishing" ? "finish" : "posteriors"
    printf "%s\"%s_seconds\": %s", sep, name, $(i+1); sep = ", " } }' <<<"$out")
  compute=$(awk '{gsub(/[(),]/, ""); for (i = 1; i < NF; ++i) if ($i == "computing") print $(i+1)}' <<<"$out")
  row "$workload" "$1" "$3" "$4" "$(awk '{print $4}' <<<"$out")" "$(awk '{for (i = 1; i < NF; ++i) if ($(i+1) == "s") print $i}' <<<"$out")" "$fs$split"
  rm -f "$dir/o$1.h5"
}
fit() {  # K TOKENS DEVICE PRECISION: EM iterations from the sampling model
  local log
  if ! log=$(timeout "$limit" "$trellis" hmm fit -d "$work/d$1-$2.h5" --init "$work/m$1.h5" -o "$work/f$1.h5" \
    --max-iterations 2 --tolerance 0 --device "$3" --precision "$4" --memory-budget 8G 2>&1 >/dev/null); then
    echo "hmm fit K=$1 $3 $4: failed or over ${limit} s"
    return
  fi
  # "data: N sequences, M tokens" and "iter I  log-likelihood X  per token Y  S s"
  row "hmm fit" "$1" "$3" "$4" "$(awk '/^data:/ {print $4}' <<<"$log")" "$(awk '/^iter 1/ {print $(NF-1)}' <<<"$log")" \
    "\"first_iteration_seconds\": $(awk '/^iter 0/ {print $(NF-1)}' <<<"$log")"
  rm -f "$work/f$1.h5"
}
run() {  # K INFER_TOKENS POSTERIOR_TOKENS FIT_TOKENS DEVICES...
  local K=$1 tokens=$2 small=$3 fit_tokens=$4 dev precision size dir
  shift 4
  for size in $(printf '%s\n' "$tokens" "$small" "$fit_tokens" | sort -u); do data "$K" "$size"; done
  for dev in "$@"; do
    for precision in float32 float64; do infer "$K" "$tokens" "$dev" "$precision"; done
    for dir in ${TRELLIS_HMM_BENCH_POSTERIORS_OUT:-$work}; do
      infer "$K" "$small" "$dev" float32 "--posteriors --compression 0" "$dir"
    done
    # The default: gzip level 1, chunks compressed on every host core (fewer bytes to the disk, more work before them).
    infer "$K" "$small" "$dev" float32 "--posteriors --compression 1"
    fit "$K" "$fit_tokens" "$dev" float32
  done
  rm -f "$work/d$K-"*.h5
}
# The posteriors written out are K floats per token (uncompressed: 4 KB a token at K=1024, 16 KB at 4096), so the
# --posteriors runs take fewer tokens (the fit rows' data), yet enough for several batches, so that writing one
# batch overlaps computing the next, and for the command's set-up to be a small share of its time.
for K in ${TRELLIS_HMM_BENCH_K-64 1024 4096}; do
  case $K in
    64) run 64 10000000 500000 2000000 "${devices[@]}" ;;
    1024) run 1024 2000000 1000000 1000000 cuda ;;  # the CPU would take minutes here
    4096) run 4096 1000000 200000 200000 cuda ;;
    *) echo "TRELLIS_HMM_BENCH_K: $K is not one of 64, 1024, 4096" >&2; exit 2 ;;
  esac
done
floor() {  # K LENGTH: infer over 16 sequences of LENGTH in one batch, beside the transitions' read floor
  local K=$1 L=$2 bandwidth=${TRELLIS_HMM_BENCH_BANDWIDTH:-3.0e12} shape_t=$2
  "$trellis" hmm init --states "$K" --symbols 10000 --seed 1 -o "$work/m$K.h5" 2>/dev/null
  "$trellis" hmm sample -m "$work/m$K.h5" -o "$work/d$K-floor.h5" -n 16 -l "$L" --min-length "$L" --seed 2 2>/dev/null
  compute=
  infer "$K" floor cuda float32
  if [ -n "$compute" ]; then
    awk -v K="$K" -v L="$L" -v c="$compute" -v bw="$bandwidth" 'BEGIN {
      f = L * 2 * 4 * K * K / bw
      printf "hmm infer floor        K=%-5s steps %d  compute %s s  floor %.3f s  ratio %.2f\n", K, L, c, f, c / f }'
    rows+=("$(awk -v K="$K" -v L="$L" -v c="$compute" -v bw="$bandwidth" 'BEGIN {
      f = L * 2 * 4 * K * K / bw
      printf "{\"workload\": \"hmm infer floor\", \"shape\": \"K=%s V=10000 B=16 T=%s\", \"device\": \"cuda\", ", K, L
      printf "\"precision\": \"float32\", \"steps\": %d, \"compute_seconds\": %s, \"floor_seconds\": %.4f, ", L, c, f
      printf "\"bandwidth\": %s, \"ratio\": %.3f}", bw, c / f }')")
  fi
  rm -f "$work/d$K-floor.h5" "$work/m$K.h5"
}
if [ "${TRELLIS_HMM_BENCH_LARGE:-0}" = 1 ]; then
  for K in ${TRELLIS_HMM_BENCH_LARGE_K:-16384}; do floor "$K" "$([ "$K" -ge 32768 ] && echo 500 || echo 1000)"; done
fi
write_json
echo "wrote $json"
