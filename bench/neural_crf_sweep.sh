#!/usr/bin/env bash
# Neural CRF tagger configurations side by side: trains `trellis crf train --encoder bilstm` once per line of a
# configuration file, several processes at a time on one device, and prints one JSON line per configuration with its
# best dev score and epoch. The scores do not depend on what else runs; the times do (report times from
# bench/neural_crf.sh, which trains alone).
#
# Usage: bench/neural_crf_sweep.sh TRELLIS DATA_DIR OUT_DIR CONFIGS
#   TRELLIS   the trellis binary (build/apps/trellis)
#   DATA_DIR  the shared data folder (ud-en-ewt/, conll2000/ as in its README)
#   OUT_DIR   logs, models and sweep.jsonl go here
#   CONFIGS   one configuration per line: TASK FLAGS... (TASK: ewt or conll2000; FLAGS: more `crf train` flags);
#             blank lines and lines starting with # are skipped
# Environment: PARALLEL (processes at once, default 6), THREADS (--threads of each, default 2), DEVICE (default cuda),
#   CONLL2000_DEV (sentences held out of CoNLL-2000's train.txt as its dev set, default 1000, as bench/neural_crf.sh).
set -euo pipefail
trellis=$1
data=$2
out=$3
configs=$4
parallel=${PARALLEL:-6}
threads=${THREADS:-2}
device=${DEVICE:-cuda}
mkdir -p "$out"

# CoNLL-2000's dev set, carved from its training file once, where a configuration asks for it.
if grep -q '^conll2000' "$configs"; then
  held=${CONLL2000_DEV:-1000}
  total=$(awk 'BEGIN { RS = "" } END { print NR }' "$data/conll2000/train.txt")
  awk -v n=$((total - held)) 'BEGIN { RS = ""; ORS = "\n\n" } NR <= n' "$data/conll2000/train.txt" >"$out/conll2000.train.txt"
  awk -v n=$((total - held)) 'BEGIN { RS = ""; ORS = "\n\n" } NR > n' "$data/conll2000/train.txt" >"$out/conll2000.dev.txt"
fi

# run_config INDEX TASK FLAGS...: trains one configuration, prints its JSON line.
run_config() {
  local index=$1 task=$2
  shift 2
  local log="$out/$index-$task.log" task_flags
  case $task in
    ewt) task_flags=(--train "$data/ud-en-ewt/train.txt" --dev "$data/ud-en-ewt/dev.txt" --label-column 1 --input-columns 0) ;;
    conll2000) task_flags=(--train "$out/conll2000.train.txt" --dev "$out/conll2000.dev.txt") ;;
    *) echo "unknown task '$task' (ewt, conll2000)" >&2; return 1 ;;
  esac
  local status=ok
  "$trellis" crf train --encoder bilstm "${task_flags[@]}" -m "$out/$index-$task.ncrf" --device "$device" \
    --threads "$threads" "$@" 2>"$log" || status=failed
  local done_line score best_epoch epochs
  done_line=$(grep '^done:' "$log" || true)
  epochs=$(sed -n 's/^done: \([0-9]*\) epochs.*/\1/p' <<<"$done_line")
  best_epoch=$(sed -n 's/.*best dev (epoch \([0-9]*\), .*/\1/p' <<<"$done_line")
  if [ "$task" = ewt ]; then score=$(sed -n 's/.*): acc \([0-9.]*\)%.*/\1/p' <<<"$done_line")
  else score=$(sed -n 's/.* F1 \([0-9.]*\)$/\1/p' <<<"$done_line"); fi
  printf '{"index": %d, "task": "%s", "flags": "%s", "status": "%s", "best_dev": %s, "best_epoch": %s, "epochs": %s}\n' \
    "$index" "$task" "$*" "$status" "${score:-null}" "${best_epoch:-null}" "${epochs:-null}"
}

index=0
while read -r line; do
  [[ -z "${line// /}" || $line == \#* ]] && continue
  index=$((index + 1))
  read -r -a words <<<"$line"
  while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do wait -n || true; done
  run_config "$index" "${words[@]}" >>"$out/sweep.jsonl" &
done <"$configs"
wait
sort -t: -k2 -n "$out/sweep.jsonl"
