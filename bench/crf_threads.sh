#!/usr/bin/env bash
# Thread scaling of full-batch CRF training (trellis crf train, L2 L-BFGS, built-in features, no dev set) on
# CoNLL-2000: a fixed number of iterations at each thread count, as JSON rows with the training time (whole, set-up,
# iterations), the last iteration's objective and gradient norm, the speed-up over one thread and whether the
# objective is the same bits as with one thread (training is meant to be independent of the thread count).
# Usage: bench/crf_threads.sh TRELLIS TRAIN_FILE [OUT_JSON] [ITERATIONS] [THREAD_COUNTS]
#   e.g. bench/crf_threads.sh build/apps/trellis .gpu-data/conll2000/train.txt /tmp/crf_threads.json 30 "1 2 4 8 16"
set -euo pipefail
trellis=$1 train=$2 out=${3:-/tmp/crf_threads.json} iterations=${4:-30} counts=${5:-"1 2 4 8 16"}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rows=()
base_seconds="" base_objective=""
for threads in $counts; do
  log="$work/train-$threads.log"
  /usr/bin/time -f "wall %e peak_kb %M" "$trellis" crf train --train "$train" --model "$work/model-$threads.crf" \
    --threads "$threads" --max-iter "$iterations" --tolerance 0 >"$log" 2>&1
  # "iter N  objective F  |g| G  S s" and "done: ..., T s (set-up U s)"; the objective at full precision is not
  # printed, so the last iteration's line is compared as printed (objective to 3 decimals, |g| to 3).
  read -r objective gnorm < <(awk '/^iter / { o = $4; g = $6 } END { print o, g }' "$log")
  read -r seconds setup < <(awk '/^done:/ { for (i = 1; i < NF; ++i) { if ($(i + 1) == "s" && $(i + 2) == "(set-up") t = $i
                                               if ($i == "(set-up") u = $(i + 1) } } END { print t, u }' "$log")
  read -r wall peak < <(awk '/^wall/ { print $2, $4 }' "$log")
  if [ -z "$base_seconds" ]; then base_seconds=$seconds base_iter=$(awk -v t="$seconds" -v u="$setup" 'BEGIN { print t - u }') base_objective="$objective $gnorm"; fi
  row=$(awk -v n="$threads" -v t="$seconds" -v u="$setup" -v w="$wall" -v p="$peak" -v o="$objective" -v g="$gnorm" \
          -v bt="$base_seconds" -v bi="$base_iter" -v same="$([ "$objective $gnorm" = "$base_objective" ] && echo true || echo false)" \
          -v it="$iterations" 'BEGIN {
            printf "{\"threads\": %d, \"iterations\": %d, \"seconds\": %.2f, \"setup_seconds\": %.2f, \"iteration_seconds\": %.2f, \"wall_seconds\": %.2f, \"peak_rss_mb\": %.0f, \"objective\": %s, \"gradient_norm\": %s, \"speedup\": %.2f, \"iteration_speedup\": %.2f, \"same_as_1_thread\": %s}",
                   n, it, t, u, t - u, w, p / 1024, o, g, bt / t, bi / (t - u), same }')
  echo "$row" >&2
  rows+=("$row")
done
{
  echo "["
  for i in "${!rows[@]}"; do
    sep=","
    [ "$i" -eq $((${#rows[@]} - 1)) ] && sep=""
    echo "  ${rows[$i]}$sep"
  done
  echo "]"
} | tee "$out"
