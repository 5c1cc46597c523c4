#!/usr/bin/env bash
# Supervised HMM POS taggers on UD English-EWT UPOS (../shared/data/ud-en-ewt): convert train and dev (training
# vocabulary, words seen once become unknown-word signature classes), fit bigram and trigram (second-order) models,
# tag dev, score. Usage: scripts/hmm_pos_experiment.sh [TRELLIS] [DATA_DIR]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
trellis=${1:-$root/build/apps/trellis}
data=${2:-$root/../shared/data/ud-en-ewt}
work=$root/build/ud-pos
mkdir -p "$work"
for split in train dev; do cut -d' ' -f1,2 "$data/$split.txt" >"$work/$split.txt"; done  # FORM UPOS
"$trellis" hmm convert -i "$work/train.txt" -o "$work/train.h5" --min-count 2
"$trellis" hmm convert -i "$work/dev.txt" -o "$work/dev.h5" --vocabulary-from "$work/train.h5"
for order in 1 2; do
  start=$SECONDS
  "$trellis" hmm fit -d "$work/train.h5" -o "$work/pos$order.h5" --supervised --order "$order" --smoothing 0.003
  "$trellis" hmm infer -m "$work/pos$order.h5" -d "$work/dev.h5" -o "$work/pred$order.h5" 2>/dev/null
  echo "order $order: $("$trellis" hmm eval -d "$work/dev.h5" -p "$work/pred$order.h5")  ($((SECONDS - start)) s)"
done
