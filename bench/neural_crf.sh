#!/usr/bin/env bash
# Neural CRF tagger benchmark: trains `trellis crf train --encoder ...` on UD English-EWT (UPOS), CoNLL-2000 chunking
# and WNUT-17 NER, and reports per task the best dev score, the wall time to the best dev epoch, and tagging
# throughput (`crf tag --timing` on DEVICE for dev and train, on the CPU for dev: tokens per second of the tagging
# phase, after the model is loaded and one sentence tagged) beside the whole `crf tag` command's wall time on DEVICE
# (loading, device start and output included), as JSON. WNUT-17 also trains the feature CRF (L-BFGS) for comparison.
#
# Usage: bench/neural_crf.sh TRELLIS DATA_DIR OUT_DIR [TASK...]
#   TRELLIS   the trellis binary (build/apps/trellis)
#   DATA_DIR  the shared data folder (ud-en-ewt/, conll2000/, wnut17/ as in its README)
#   OUT_DIR   models, logs, tagged files and results-TASKS.json go here
#   TASK      ewt, conll2000, wnut17 (default: all three)
# Environment: DEVICE (default cuda), ENCODER (bilstm), FLAGS (more `crf train` flags, e.g. "--hybrid=false --layers 1";
#   none: the documented defaults), TRELLIS_COMMIT (the commit recorded in the JSON; default: git's HEAD),
#   CONLL2000_DEV (sentences held out of CoNLL-2000's train.txt as its dev set, default 1000: the folder has no dev).
set -euo pipefail
trellis=$1
data=$2
out=$3
shift 3
shopt -s inherit_errexit  # a failing step inside $(run_task ...) stops the script
if [ $# -gt 0 ]; then tasks=("$@"); else tasks=(ewt conll2000 wnut17); fi
device=${DEVICE:-cuda}
encoder=${ENCODER:-bilstm}
read -r -a flags <<<"${FLAGS:-}"
mkdir -p "$out"

now() { date +%s.%N; }
json_number() { [ -n "$1" ] && echo "$1" || echo null; }

# run_task NAME TRAIN DEV TRAIN_FLAGS...: trains, tags dev and train with --timing, prints one JSON object.
run_task() {
  local name=$1 train=$2 dev=$3
  shift 3
  local model="$out/$name.ncrf" log="$out/$name.train.log"
  local start end
  start=$(now)
  if ! "$trellis" crf train --encoder "$encoder" --train "$train" --dev "$dev" -m "$model" --device "$device" \
    "$@" "${flags[@]}" 2>"$log"; then
    tail -5 "$log" >&2
    return 1
  fi
  end=$(now)
  local train_seconds
  train_seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }')
  local done_line best_epoch to_best acc f1 epochs
  done_line=$(grep '^done:' "$log")
  epochs=$(sed -n 's/^done: \([0-9]*\) epochs.*/\1/p' <<<"$done_line")
  best_epoch=$(sed -n 's/.*best dev (epoch \([0-9]*\), .*/\1/p' <<<"$done_line")
  to_best=$(sed -n 's/.*best dev (epoch [0-9]*, \([0-9.]*\) s).*/\1/p' <<<"$done_line")
  acc=$(sed -n 's/.*): acc \([0-9.]*\)%.*/\1/p' <<<"$done_line")
  f1=$(sed -n 's/.* F1 \([0-9.]*\)$/\1/p' <<<"$done_line")
  local dev_tps train_tps cpu_tps dev_command train_command
  start=$(now)
  "$trellis" crf tag -m "$model" "$dev" -o "$out/$name.dev.tagged" --device "$device" --timing 2>"$out/$name.tag-dev.log"
  end=$(now)
  dev_command=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.3f", b - a }')
  start=$(now)
  "$trellis" crf tag -m "$model" "$train" -o "$out/$name.train.tagged" --device "$device" --timing 2>"$out/$name.tag-train.log"
  end=$(now)
  train_command=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.3f", b - a }')
  "$trellis" crf tag -m "$model" "$dev" -o "$out/$name.dev.cpu.tagged" --device cpu --timing 2>"$out/$name.tag-dev-cpu.log"
  dev_tps=$(sed -n 's/.* (\([0-9]*\) tokens\/s.*/\1/p' "$out/$name.tag-dev.log")
  cpu_tps=$(sed -n 's/.* (\([0-9]*\) tokens\/s.*/\1/p' "$out/$name.tag-dev-cpu.log")
  train_tps=$(sed -n 's/.* (\([0-9]*\) tokens\/s.*/\1/p' "$out/$name.tag-train.log")
  printf '{"epochs": %s, "best_epoch": %s, "best_dev_accuracy": %s, "best_dev_f1": %s, "seconds_to_best_dev": %s, "train_process_seconds": %.1f, "tag_tokens_per_second_dev": %s, "tag_tokens_per_second_train": %s, "tag_tokens_per_second_dev_cpu": %s, "tag_command_seconds_dev": %s, "tag_command_seconds_train": %s}' \
    "$(json_number "$epochs")" "$(json_number "$best_epoch")" "$(json_number "$acc")" "$(json_number "$f1")" \
    "$(json_number "$to_best")" "$train_seconds" "$(json_number "$dev_tps")" \
    "$(json_number "$train_tps")" "$(json_number "$cpu_tps")" "$dev_command" "$train_command"
}

results=()
for task in "${tasks[@]}"; do
  case $task in
    ewt)
      # FORM UPOS XPOS: the label is UPOS, the input the word (XPOS would give the answer away).
      echo "ewt ..." >&2
      result=$(run_task ewt "$data/ud-en-ewt/train.txt" "$data/ud-en-ewt/dev.txt" --label-column 1 --input-columns 0)
      results+=("\"ewt_upos\": $result")
      ;;
    conll2000)
      # word POS chunk; the last CONLL2000_DEV sentences of train.txt are the dev set.
      echo "conll2000 ..." >&2
      held=${CONLL2000_DEV:-1000}
      total=$(awk 'BEGIN { RS = "" } END { print NR }' "$data/conll2000/train.txt")
      awk -v n=$((total - held)) 'BEGIN { RS = ""; ORS = "\n\n" } NR <= n' "$data/conll2000/train.txt" >"$out/conll2000.train.txt"
      awk -v n=$((total - held)) 'BEGIN { RS = ""; ORS = "\n\n" } NR > n' "$data/conll2000/train.txt" >"$out/conll2000.dev.txt"
      result=$(run_task conll2000 "$out/conll2000.train.txt" "$out/conll2000.dev.txt")
      results+=("\"conll2000_chunking\": $result")
      ;;
    wnut17)
      echo "wnut17 ..." >&2
      neural=$(run_task wnut17 "$data/wnut17/train.txt" "$data/wnut17/dev.txt")
      "$trellis" crf train --train "$data/wnut17/train.txt" --dev "$data/wnut17/dev.txt" -m "$out/wnut17.crf" \
        --device "$device" 2>"$out/wnut17.feature-crf.log"
      feature_f1=$(sed -n 's/.*best dev.* F1 \([0-9.]*\)$/\1/p' "$out/wnut17.feature-crf.log")
      results+=("\"wnut17_ner\": ${neural%\}}, \"feature_crf_best_dev_f1\": $(json_number "$feature_f1")}")
      ;;
    *)
      echo "unknown task '$task' (ewt, conll2000, wnut17)" >&2
      exit 2
      ;;
  esac
done

{
  printf '{"device": "%s", "gpu": "%s", "encoder": "%s", "flags": "%s", "commit": "%s",\n' "$device" \
    "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" "$encoder" "${FLAGS:-}" \
    "${TRELLIS_COMMIT:-$(git -C "$(dirname "$0")" rev-parse --short HEAD 2>/dev/null)}"
  for i in "${!results[@]}"; do
    printf ' %s%s\n' "${results[$i]}" "$([ "$i" -lt $((${#results[@]} - 1)) ] && echo ,)"
  done
  echo "}"
} | tee "$out/results-$(IFS=-; echo "${tasks[*]}").json"
