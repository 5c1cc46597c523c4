#!/usr/bin/env bash
# trellis crf train --encoder bilstm|cnn and neural model files from the command line: training on a slice of the
# bundled UD sample learns, tag (--marginals, --probability, --kbest, --timing), eval and dump read the neural file,
# --encoder none is the feature CRF exactly as without it, the same --seed writes the same file, and bad flags and
# corrupt models are errors naming the option or the file, writing nothing; bench/neural_crf_sweep.sh reports each
# configuration.
# Usage: neural_crf_test.sh TRELLIS_BINARY WORK_DIR DATA_DIR
set -uo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/cli_harness.sh" || exit 1
trellis=$1
work=$2
data=$3
sweep_script="$(cd "$(dirname "${BASH_SOURCE[0]}")/../bench" && pwd)/neural_crf_sweep.sh"
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1

# The first sentences of the sample (paragraph mode: a blank line ends each).
awk -v n=150 'BEGIN { RS = ""; ORS = "\n\n" } NR <= n' "$data/train.txt" >train.txt
# Dev sentences whose labels all occur in train.txt (a label training never saw is an error).
labels=$(awk 'NF { print $2 }' train.txt | sort -u | tr '\n' ' ')
awk -v n=60 -v labels="$labels" 'BEGIN { RS = ""; ORS = "\n\n"; split(labels, l, " "); for (i in l) seen[l[i]] = 1 }
  { ok = 1; k = split($0, line, "\n"); for (i = 1; i <= k; i++) { split(line[i], f, " "); if (!(f[2] in seen)) ok = 0 } }
  ok && kept < n { print; kept++ }' "$data/dev.txt" >dev.txt
small=(--embedding-dim 16 --char-dim 8 --char-filters 8 --feature-dim 4 --hidden 16 --layers 1 --batch-size 8
       --lr 0.01 --threads 1)

"$trellis" crf train --encoder bilstm --train train.txt --dev dev.txt -m model.ncrf --epochs 4 "${small[@]}" 2>train.log &&
  [ "$(grep -c '^epoch [0-9].*tokens/s.*dev acc' train.log)" = 4 ] && grep -q '^done: 4 epochs.*best dev' train.log &&
  ok || fail "training with --dev: $(cat train.log)"
# The loss falls from the first epoch to the last.
awk '/^epoch/ { loss[n++] = $4 + 0 } END { exit !(n == 4 && loss[3] < 0.7 * loss[0]) }' train.log && ok || fail "loss did not fall"
"$trellis" crf dump model.ncrf >dump.txt && grep -q '^kind: neural CRF' dump.txt && grep -q '^encoder: bilstm' dump.txt &&
  grep -q '^hybrid sparse features' dump.txt && grep -q 'characters .* -> BiLSTM' dump.txt &&
  ok || fail "dump (the default is the hybrid with a character BiLSTM): $(cat dump.txt)"
"$trellis" crf train --encoder bilstm --train train.txt -m network.ncrf --epochs 1 --hybrid=false "${small[@]}" 2>/dev/null &&
  "$trellis" crf dump network.ncrf >dump2.txt && ! grep -q 'hybrid sparse features' dump2.txt && ok ||
  fail "--hybrid=false"

# eval: above the majority tag's accuracy on dev.
majority=$(awk 'NF { n[$2]++; all++ } END { for (l in n) if (n[l] > best) best = n[l]; printf "%.2f", 100 * best / all }' dev.txt)
"$trellis" crf eval -m model.ncrf --gold dev.txt >eval.txt &&
  awk -v m="$majority" '/^token accuracy/ { a = $3 + 0 } END { exit !(a > m + 10) }' eval.txt &&
  ok || fail "eval: $(cat eval.txt), majority $majority%"

# tag: a label per token; marginals, probabilities and k-best in the feature CRF's formats; --timing leaves the
# output alone.
cut -d' ' -f1 dev.txt | sed 's/^$//' >words.txt
"$trellis" crf tag -m model.ncrf words.txt -o tagged.txt && [ "$(grep -c . tagged.txt)" = "$(grep -c . dev.txt)" ] &&
  ok || fail "tag"
"$trellis" crf tag -m model.ncrf words.txt -o timed.txt --timing 2>timing.log && grep -q "tokens/s" timing.log &&
  cmp -s tagged.txt timed.txt && ok || fail "tag --timing: $(cat timing.log)"
"$trellis" crf tag -m model.ncrf dev.txt --marginals -o marginals.txt &&
  [ "$(grep -c $'\t[A-Z]*:[01]\\.[0-9]*$' marginals.txt)" = "$(grep -c . dev.txt)" ] && ok || fail "tag --marginals"
"$trellis" crf tag -m model.ncrf dev.txt --probability -o prob.txt && [ "$(grep -c '^@probability' prob.txt)" = 60 ] &&
  ok || fail "tag --probability"
"$trellis" crf tag -m model.ncrf dev.txt --kbest 2 -o kbest.txt && [ "$(grep -c '^@kbest' kbest.txt)" = 120 ] &&
  ok || fail "tag --kbest"

# The same seed writes the same file; the CNN encoder and the hybrid (template features) train too.
"$trellis" crf train --encoder bilstm --train train.txt -m again.ncrf --epochs 4 "${small[@]}" 2>/dev/null &&
  "$trellis" crf train --encoder bilstm --train train.txt -m again2.ncrf --epochs 4 "${small[@]}" 2>/dev/null &&
  cmp -s again.ncrf again2.ncrf && ok || fail "same --seed, different model files"
"$trellis" crf train --encoder bilstm --train train.txt -m seed2.ncrf --epochs 4 "${small[@]}" --seed 2 2>/dev/null &&
  ! cmp -s again.ncrf seed2.ncrf && ok || fail "another --seed, the same model file"
printf 'U00:%%x[0,0]\nU01:%%x[-1,0]\nB\n' >words.tpl
"$trellis" crf train --encoder cnn --template words.tpl --train train.txt -m cnn.ncrf --epochs 1 "${small[@]}" 2>cnn.log &&
  grep -q 'sparse features' cnn.log && prints 'hybrid sparse features' "$trellis" crf dump cnn.ncrf &&
  "$trellis" crf tag -m cnn.ncrf words.txt -o cnn.txt && ok || fail "cnn + template: $(cat cnn.log)"

# bench/neural_crf_sweep.sh: one JSON line per configuration with its best dev score, in the configurations' order.
mkdir -p sweep-data/ud-en-ewt && cp train.txt dev.txt sweep-data/ud-en-ewt/
# (the flags of `small` but --threads, which the script gives)
tiny="--embedding-dim 16 --char-dim 8 --char-filters 8 --feature-dim 4 --hidden 16 --layers 1 --batch-size 8"
printf '# two configurations\newt --epochs 2 %s\n\newt --epochs 1 %s --seed 3\n' "$tiny" "$tiny" >sweep.txt
DEVICE=cpu PARALLEL=2 THREADS=1 bash "$sweep_script" "$trellis" sweep-data sweep sweep.txt \
  >sweep.out 2>sweep.err &&
  [ "$(grep -c '"task": "ewt".*"status": "ok", "best_dev": [0-9.]*, "best_epoch": [12], "epochs": [12]}' sweep.out)" = 2 ] &&
  head -1 sweep.out | grep -q '"index": 1, .*"epochs": 2}' && ok || fail "neural_crf_sweep.sh: $(cat sweep.out sweep.err)"

# --encoder none is the feature CRF, byte for byte.
"$trellis" crf train --train train.txt -m plain.crf --max-iter 5 2>/dev/null &&
  "$trellis" crf train --encoder none --train train.txt -m none.crf --max-iter 5 2>/dev/null && cmp -s plain.crf none.crf &&
  "$trellis" crf tag -m none.crf words.txt -o none.txt && ok || fail "--encoder none"

# Bad flags name the option; nothing is written.
expect_error "unknown encoder" "--encoder must be bilstm, cnn or none, not 'rnn'" m1.ncrf \
  "$trellis" crf train --encoder rnn --train train.txt -m m1.ncrf
expect_error "dropout" "--dropout must be in [0, 1), not 2" m2.ncrf \
  "$trellis" crf train --encoder bilstm --train train.txt -m m2.ncrf --dropout 2
expect_error "epochs" "--epochs must be at least 1, not 0" m3.ncrf \
  "$trellis" crf train --encoder bilstm --train train.txt -m m3.ncrf --epochs 0
expect_error "batch size" "--batch-size must be at least 1, not -1" m4.ncrf \
  "$trellis" crf train --encoder cnn --train train.txt -m m4.ncrf --batch-size -1
expect_error "unknown option" "unrecognised option '--bogus'" m5.ncrf \
  "$trellis" crf train --encoder bilstm --train train.txt -m m5.ncrf --bogus 1
expect_error "neural option without --encoder" "unrecognised option '--hidden'" m6.crf \
  "$trellis" crf train --train train.txt -m m6.crf --hidden 10
expect_error "precision on the CPU" "--precision bf16 needs --device cuda" m7.ncrf \
  "$trellis" crf train --encoder bilstm --train train.txt -m m7.ncrf --precision bf16
expect_error "a width beyond any tagger's" "--hidden must be at most 16384, not 100000000" m9.ncrf \
  "$trellis" crf train --encoder bilstm --train train.txt -m m9.ncrf --hidden 100000000
printf 'U00:%%x[0,0]\n' >words.tpl
expect_error "--template with --hybrid=false" "it cannot be combined with --hybrid=false" m10.ncrf \
  "$trellis" crf train --encoder bilstm --train train.txt -m m10.ncrf -t words.tpl --hybrid=false
expect_error "--patience without --dev" "--patience stops on the dev score: it needs --dev" m11.ncrf \
  "$trellis" crf train --encoder bilstm --train train.txt -m m11.ncrf --patience 3
expect_error "missing embeddings" "cannot open embeddings 'no-such.vec'" m8.ncrf \
  "$trellis" crf train --encoder bilstm --train train.txt -m m8.ncrf --embeddings no-such.vec
expect_error "kbest with marginals" "--kbest and --marginals cannot be combined" out0.txt \
  "$trellis" crf tag -m model.ncrf words.txt --kbest 2 --marginals -o out0.txt

# Corrupt and truncated neural models name the file.
cp model.ncrf flipped.ncrf && printf '\x7f' | dd of=flipped.ncrf bs=1 seek=3000 conv=notrunc 2>/dev/null
expect_error "corrupt model" "'flipped.ncrf': corrupt neural CRF model file (checksum mismatch" out1.txt \
  "$trellis" crf tag -m flipped.ncrf words.txt -o out1.txt
head -c 2000 model.ncrf >truncated.ncrf
expect_error "truncated model, eval" "'truncated.ncrf': corrupt neural CRF model file" out2.txt \
  "$trellis" crf eval -m truncated.ncrf --gold dev.txt
expect_error "wrong columns" "has 3 columns; the model was trained on 2 columns" out3.txt \
  "$trellis" crf tag -m model.ncrf <(sed 's/$/ X/' dev.txt | sed 's/^ X$//') -o out3.txt

echo "neural crf cli: $passed passed, $failed failed"
[ "$failed" = 0 ]
