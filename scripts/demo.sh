#!/usr/bin/env bash
# The main job on bundled data: set up and build (first run only), train a part-of-speech CRF tagger on a sample of
# UD English-EWT, tag its held-out sentences, and score them.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/build.sh" >/dev/null
build="${TRELLIS_BUILD_DIR:-$root/build}"
trellis="$build/apps/trellis"
data="$root/data/ud-en-ewt-sample"
out="$build/demo"
mkdir -p "$out"
"$trellis" crf train --train "$data/train.txt" --dev "$data/dev.txt" --model "$out/pos.crf" --max-iter 40 --c2 0.5
"$trellis" crf tag --model "$out/pos.crf" --marginals "$data/dev.txt" --output "$out/dev.tagged"
echo "tagged $data/dev.txt -> $out/dev.tagged; first sentence:"
sed -n '1,/^$/p' "$out/dev.tagged"
"$trellis" crf eval --model "$out/pos.crf" --gold "$data/dev.txt"
