#!/usr/bin/env bash
# CoNLL-2000 chunking with Trellis: split ../shared/data/conll2000/train.txt into train (first 7,936 sentences) and
# dev (last 1,000), train with the chunking template, tag dev, and score it with Trellis and with conlleval.
# Usage: scripts/experiments/conll2000_experiment.sh [extra trellis crf train options]. Work files go to
# build/conll2000/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
shared="${TRELLIS_SHARED:-$root/../shared}"
build="${TRELLIS_BUILD_DIR:-$root/build}"
out="$build/conll2000"
mkdir -p "$out"
python3 - "$shared/data/conll2000/train.txt" "$out" <<'PY'
import sys
sentences = open(sys.argv[1], encoding="utf-8").read().strip().split("\n\n")
train, dev = sentences[:-1000], sentences[-1000:]
for name, part in (("train", train), ("dev", dev)):
    with open(f"{sys.argv[2]}/{name}.txt", "w", encoding="utf-8") as f:
        f.write("\n\n".join(part) + "\n\n")
print(f"train {len(train)} sentences, dev {len(dev)} sentences")
PY
trellis="$build/apps/trellis"
/usr/bin/time -v "$trellis" crf train --train "$out/train.txt" --dev "$out/dev.txt" --model "$out/chunk.crf" \
  --template "$root/docs/templates/chunking.tpl" "$@" 2> >(tee "$out/train.log" >&2)
"$trellis" crf eval --model "$out/chunk.crf" --gold "$out/dev.txt"
"$trellis" crf tag --model "$out/chunk.crf" "$out/dev.txt" --output "$out/dev.tagged"
echo "conlleval on the tagged dev set:"
python3 "$shared/tools/conlleval.py" < "$out/dev.tagged"
