#!/usr/bin/env bash
# Supervised HMM POS taggers on UD English-EWT UPOS (../shared/data/ud-en-ewt): convert train and dev (training
# vocabulary; words seen once become unknown-word classes, TnT's suffix model), fit, tag dev, score UPOS:
#   bigram       17 UPOS states
#   bigram-fine  102 UPOS|XPOS states (the treebank's two tag columns), scored on the UPOS part
#   trigram      second-order model over UPOS pairs (306 states)
# Usage: scripts/experiments/hmm_pos_experiment.sh [TRELLIS] [DATA_DIR]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
trellis=${1:-$root/build/apps/trellis}
data=${2:-$root/../shared/data/ud-en-ewt}
work=$root/build/ud-pos
mkdir -p "$work"
run() {  # name label-columns order [eval options]
  local name=$1 columns=$2 order=$3 start=$SECONDS
  "$trellis" hmm convert -i "$data/train.txt" -o "$work/train-$name.h5" --label-column "$columns" --min-count 2 2>/dev/null
  # Dev has a few UPOS|XPOS pairs training never saw: kept as labels no model predicts, so they count as errors.
  "$trellis" hmm convert -i "$data/dev.txt" -o "$work/dev-$name.h5" --vocabulary-from "$work/train-$name.h5" \
    --label-column "$columns" --add-labels 2>/dev/null
  "$trellis" hmm fit -d "$work/train-$name.h5" -o "$work/$name.h5" --supervised --order "$order" --smoothing 0.0001
  "$trellis" hmm infer -m "$work/$name.h5" -d "$work/dev-$name.h5" -o "$work/pred-$name.h5" >/dev/null 2>&1
  echo "$name: $("$trellis" hmm eval -d "$work/dev-$name.h5" -p "$work/pred-$name.h5" "${@:4}")  ($((SECONDS - start)) s)"
}
run bigram 1 1
run bigram-fine 1,2 1 --coarse
run trigram 1 2
