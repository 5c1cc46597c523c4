#!/usr/bin/env bash
# CRF training speed on the CoNLL-2000 split of scripts/experiments/conll2000_experiment.sh: L2 L-BFGS, L1 OWL-QN and
# Adam, each with its iteration log, whole-command wall time and the time at which dev F1 first reaches the other
# trainers' final scores (CRFsuite 94.05, CRF++ 94.24, Wapiti 94.49 on this split; docs/benchmarks.md).
# Usage: scripts/experiments/crf_train_speed.sh TRELLIS DATA_DIR(with train.txt, dev.txt) DEVICE [OUT_DIR]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
trellis=$1 data=$2 device=$3 out=${4:-/tmp/crf-train-speed}
mkdir -p "$out"
run() {  # name options...
  local name=$1
  shift
  /usr/bin/time -f "wall %e s, peak RSS %M KB" "$trellis" crf train --train "$data/train.txt" --dev "$data/dev.txt" \
    --model "$out/$name.crf" --template "$root/docs/templates/chunking.tpl" --device "$device" "$@" >"$out/$name.log" 2>&1
  echo "== $name ($device): $*"
  grep -E "^done|^wall" "$out/$name.log"
  # Whole-command time to an F1: the iteration's time into training plus the command's time outside training
  # (process start, reading, saving, exit) = wall - the training time on the done line.
  local outside
  outside=$(awk '/^done:/ { for (i = 1; i < NF; ++i) if ($(i + 1) == "s" && $(i + 2) == "(set-up") t = $i }
                 /^wall/ { w = $2 } END { printf "%.2f", w - t }' "$out/$name.log")
  echo "  outside training: $outside s"
  for f1 in 94.05 94.24 94.49; do
    awk -v t="$f1" -v o="$outside" '/^iter/ { for (i = 1; i <= NF; ++i) if ($i == "F1" && $(i + 1) + 0 >= t) {
      printf "  dev F1 >= %s first at iteration %s, %s s into training, %.2f s whole command (%.1fx CRFsuite 74.5 s)\n",
        t, $2, $(NF - 1), $(NF - 1) + o, 74.5 / ($(NF - 1) + o); exit } }' "$out/$name.log"
  done
}
run l2-lbfgs --c2 1 --max-iter 200
run l1-owlqn --c1 0.5 --c2 0.0001 --max-iter 100
run adam --algorithm adam --learning-rate 0.02 --batch-size 64 --max-iter 8
