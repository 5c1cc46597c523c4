#!/usr/bin/env bash
# An HMM language model over UD English-EWT words, trained with `trellis hmm fit` at several state counts: held-out
# perplexity on the dev words against K, and the time of one EM iteration. The training words seen once become one
# <unk> symbol (so do the dev words not in that vocabulary); EM starts from a random model (seed 1), runs a fixed
# number of iterations and adds a small count to every start, transition and emission count (so that no dev word has
# probability 0). Writes OUT_DIR/hmm_lm.json (one row per K: workload, shape, device, precision, iterations,
# seconds_per_iteration (median after the first), tokens_per_s of EM, train and dev log-likelihood per token, dev
# perplexity) and, where matplotlib is installed, OUT_DIR/hmm_lm.png (perplexity and seconds per iteration against K).
#
# Usage: bench/hmm_lm.sh TRELLIS DATA_DIR OUT_DIR [K...]      (default K: 64 256 1024 4096 16384)
#   TRELLIS   the trellis binary; DATA_DIR holds ud-en-ewt/{train,dev}.txt (../shared/data, or .gpu-data on the GPU
#   machine)
# Environment: DEVICE (cuda), PRECISION (float32), ITERATIONS (10), MEMORY_BUDGET (8G), SMOOTHING (0.01),
#   TRELLIS_COMMIT (written into the JSON; default: git rev-parse)
set -euo pipefail
trellis=$1
data=$2
out=$3
shift 3
if [ $# -gt 0 ]; then states=("$@"); else states=(64 256 1024 4096 16384); fi
device=${DEVICE:-cuda}
precision=${PRECISION:-float32}
iterations=${ITERATIONS:-10}
budget=${MEMORY_BUDGET:-8G}
smoothing=${SMOOTHING:-0.01}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
commit=${TRELLIS_COMMIT:-$(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$out"

"$trellis" hmm convert -i "$data/ud-en-ewt/train.txt" -o "$out/train.h5" --no-labels --comment-prefix '#' \
  --unknown single >&2
"$trellis" hmm convert -i "$data/ud-en-ewt/dev.txt" -o "$out/dev.h5" --no-labels --comment-prefix '#' \
  --vocabulary-from "$out/train.h5" >&2

for K in "${states[@]}"; do
  echo "K=$K ..." >&2
  "$trellis" hmm fit -d "$out/train.h5" -o "$out/model-$K.h5" -k "$K" --seed 1 --max-iterations "$iterations" \
    --tolerance 0 --smoothing "$smoothing" --device "$device" --precision "$precision" --memory-budget "$budget" \
    2>"$out/fit-$K.log"
  "$trellis" hmm infer -m "$out/model-$K.h5" -d "$out/dev.h5" -o "$out/dev-out-$K.h5" --device "$device" \
    --precision "$precision" --memory-budget "$budget" >"$out/infer-$K.log" 2>&1
  rm -f "$out/dev-out-$K.h5" "$out/model-$K.h5"
  tail -n 2 "$out/fit-$K.log" >&2
done
python3 "$here/hmm_lm_report.py" "$out" "$commit" "$device" "$precision" "$smoothing" "${states[@]}"
