#!/usr/bin/env bash
# Regenerates the seed corpora in tests/fuzz/corpus/ (committed; rerun only when an input format changes):
#   tests/fuzz/make_seeds.sh [TRELLIS_CLI]   (default build/apps/trellis; it trains the small CRF models)
# Seeds are small valid inputs; each target's first byte(s) are documented in its source file.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
trellis="${1:-$root/build/apps/trellis}"
corpus="$here/corpus"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
rm -rf "$corpus"
mkdir -p "$corpus"/{conll,crfpp_template,crf_model,neural_model,hmm_dataset,hmm_model}

# ---- conll: mode byte (bit 0: '#' comments, bit 1: no UTF-8 check, bit 2: empty allowed), then the text ----
sample="$root/data/ud-en-ewt-sample/train.txt"
{ printf '\x00'; head -n 40 "$sample"; } > "$corpus/conll/ud_pos"
{ printf '\x01'; printf '# sent_id = 1\n# text = He runs.\n1\tHe\the\tPRON\n2\truns\trun\tVERB\n3\t.\t.\tPUNCT\n\n'; } \
  > "$corpus/conll/conllu_comments"
{ printf '\x00\xEF\xBB\xBF'; printf 'Confidence NN B-NP\r\nin IN B-PP\r\nthe DT B-NP\r\n\r\n\r\npound NN I-NP'; } \
  > "$corpus/conll/bom_crlf_chunks"
{ printf '\x06'; printf '\n \t\n'; } > "$corpus/conll/blank_lines"

# ---- crfpp_template: the text itself ----
cat > "$corpus/crfpp_template/crfpp_chunking" <<'EOF'
# Unigram
U00:%x[-2,0]
U01:%x[-1,0]
U02:%x[0,0]
U03:%x[1,0]
U04:%x[2,0]
U05:%x[-1,0]/%x[0,0]
U06:%x[0,0]/%x[1,0]

U10:%x[-2,1]
U11:%x[-1,1]
U12:%x[0,1]
U15:%x[-2,1]/%x[-1,1]/%x[0,1]

# Bigram
B
EOF
printf 'U0:%%x[0,0]\r\n  U1:pre-%%x[-3,1]-post\t\r\nB\r\n' > "$corpus/crfpp_template/crlf_literals"
printf 'U:%%x[+1,2]%%x[-1,0]\nB\n#end' > "$corpus/crfpp_template/adjacent_macros"

# ---- crf_model: mode byte 0 (the target appends the checksum) + a saved model without its checksum; one model
# ---- as saved (mode byte 1) ----
printf 'The DT B-NP\ncat NN I-NP\nsat VBD B-VP\n\nDogs NNS B-NP\nbark VBP B-VP\n\n' > "$work/train.txt"
printf 'U00:%%x[0,0]\nU01:%%x[-1,1]/%%x[0,1]\nB\n' > "$work/template"
"$trellis" crf train --train "$work/train.txt" --model "$work/builtin.crf" --max-iter 3 > /dev/null 2>&1
"$trellis" crf train --train "$work/train.txt" --model "$work/template.crf" --template "$work/template" --max-iter 3 \
  > /dev/null 2>&1
for model in builtin template; do
  size=$(stat -c %s "$work/$model.crf")
  { printf '\x00'; head -c $((size - 8)) "$work/$model.crf"; } > "$corpus/crf_model/$model"
done
{ printf '\x01'; cat "$work/template.crf"; } > "$corpus/crf_model/template_as_saved"
# A first-format (version 1) model, which later versions still load: magic, version, input columns, feature spec,
# labels, features (each a u64 length + bytes), weights [F,K], transitions [K,K], start [K], end [K] as float32.
python3 - "$corpus/crf_model/version1" <<'EOF_V1'
import struct, sys
def text(s): return struct.pack("<Q", len(s)) + s
labels, features = [b"B-NP", b"I-NP", b"O"], [b"U00:The", b"U00:cat"]
K, F = len(labels), len(features)
body = b"TRELCRF\n" + struct.pack("<IQ", 1, 1) + text(b"crfpp\nU00:%x[0,0]\nB\n")
body += struct.pack("<Q", K) + b"".join(map(text, labels)) + struct.pack("<Q", F) + b"".join(map(text, features))
body += struct.pack(f"<{F * K + K * K + 2 * K}f", *[(i % 7 - 3) / 4 for i in range(F * K + K * K + 2 * K)])
open(sys.argv[1], "wb").write(b"\x00" + body)
EOF_V1

# ---- neural_model: as crf_model, small networks of each kind (BiLSTM with a character BiLSTM and the built-in
# ---- sparse features; dilated CNN with a character CNN, a template and an extra input column) ----
small=(--epochs 1 --embedding-dim 4 --char-dim 4 --char-filters 4 --feature-dim 2 --hidden 4 --layers 2)
"$trellis" crf train --encoder bilstm --train "$work/train.txt" --input-columns 0 --model "$work/bilstm.ncrf" \
  "${small[@]}" > /dev/null 2>&1
"$trellis" crf train --encoder cnn --char-encoder cnn --train "$work/train.txt" --template "$work/template" \
  --model "$work/cnn.ncrf" "${small[@]}" > /dev/null 2>&1
for model in bilstm cnn; do
  size=$(stat -c %s "$work/$model.ncrf")
  { printf '\x00'; head -c $((size - 8)) "$work/$model.ncrf"; } > "$corpus/neural_model/$model"
done
{ printf '\x01'; cat "$work/cnn.ncrf"; } > "$corpus/neural_model/cnn_as_saved"

# ---- hmm_dataset / hmm_model: hdf5_builder.h's encoding; zero bytes keep the natural (well-formed) contents ----
python3 - "$corpus" <<'EOF'
import sys, pathlib
corpus = pathlib.Path(sys.argv[1])
def seed(target, name, values):
    (corpus / target / name).write_bytes(bytes(v % 256 for v in values))

# Dataset: rows-1, sequence lengths-1 (until rows), categorical (byte % 3 != 0), type flag (1: int32/float32),
# [features-1], observations present (0), control (0), values, offsets present, control, labels flag, control,
# values, vocabulary flag, control, label_names flag, control, then symbols, label count, max_tokens-1.
ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
seed("hmm_dataset", "categorical_labels",
     [9, 1, 2, 0, 3, 1, 1, 0, 0, *ids, 0, 0, 1, 0, *[i % 4 for i in ids], 1, 0, 1, 0, 16, 5, 7])
seed("hmm_dataset", "categorical_int64", [5, 5, 1, 0, 0, 0, *ids[:6], 0, 0, 0, 0, 0, 0, 0, 3])
features = [4, 252, 8, 0, 16, 240, 1, 2, 3, 4, 5, 6]
seed("hmm_dataset", "gaussian_float32", [5, 2, 2, 0, 1, 1, 0, 0, *features, 0, 0, 0, 0, 0, 0, 0, 2])
seed("hmm_dataset", "gaussian_float64", [3, 3, 0, 0, 2, 0, 0, *features[:12], 0, 0, 1, 0, 3, 0, 1, 0, 0, 1, 0, 0, 4, 0])

# Model: gaussian flag, K-1, V-1, then for format, version, emission, startprob, transmat: present (0) + control (0);
# 'both kinds' (7 = yes), emissionprob or means + values + covars + values, then the optional datasets' flags.
common = [0, 0] * 5
seed("hmm_model", "categorical", [0, 2, 3, *common, 0, 0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 2])
seed("hmm_model", "categorical_one_state", [0, 0, 0, *common, 0, 0, 0, 0, 0, 0, 0])
seed("hmm_model", "gaussian", [1, 1, 2, *common, 0, 0, 0, 8, 248, 16, 0, 4, 0, 0, 0, 0, 0, 8, 16, 24, 32, 1, 0, 0, 0, 0])
EOF
ls -l "$corpus"/*
