#!/usr/bin/env bash
# The CRF commands under faults and hostile input: a full disk, signals, stale temporaries, crafted model files,
# hostile templates and absurd flags. Each case names what it checks; every failure exits non-zero with a message a
# user can act on, and leaves neither the output nor a temporary behind (an existing output stays as it was).
# Usage: crf_fault_test.sh TRELLIS_BINARY WORK_DIR PYTHON
set -uo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/cli_harness.sh" || exit 1
trellis=$1
work=$2
python=$3
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1

printf 'the DT DT0 B-NP\ncat NN NN0 I-NP\nsat VBD VBD0 B-VP\n\na DT DT0 B-NP\ndog NN NN0 I-NP\n\n' >train.txt
"$trellis" crf train --train train.txt --model model.crf --max-iter 5 2>/dev/null || fail "training on good data"

# ---- full disk (writes fail with EFBIG: file size limit, SIGXFSZ ignored) ----
full_disk() { (trap '' XFSZ; ulimit -f 1; "$@"); }
cp model.crf keep.crf
awk 'BEGIN { for (i = 0; i < 3000; i++) print "w" i " NN NN0 B-NP"; print "" }' >wide.txt
expect_error "full disk: train" "cannot write 'big.crf': File too large" big.crf \
  full_disk "$trellis" crf train --train wide.txt --model big.crf --max-iter 1
cp keep.crf over.crf
if full_disk "$trellis" crf train --train wide.txt --model over.crf --max-iter 1 2>stderr.txt; then
  fail "full disk over an existing model: exit 0"
else
  cmp -s keep.crf over.crf && ! ls over.crf.tmp.* >/dev/null 2>&1 && ok || fail "full disk: old model not intact or temporary left"
fi
expect_error "full disk: tag output" "cannot write 'tagged.txt': File too large" tagged.txt \
  full_disk "$trellis" crf tag --model model.crf wide.txt -o tagged.txt

# ---- stale temporaries of dead processes go; a live process's stay ----
: >model2.crf.tmp.4194304  # above Linux's largest pid: no such process
sleep 60 & live=$!
: >model2.crf.tmp.$live
"$trellis" crf train --train train.txt --model model2.crf --max-iter 2 2>/dev/null &&
  [ ! -e model2.crf.tmp.4194304 ] && [ -e model2.crf.tmp.$live ] && ok || fail "stale temporary not removed (or a live one removed)"
kill $live; rm -f model2.crf.tmp.$live

# ---- SIGTERM and SIGINT while the output is being written: no temporary left, the old output intact ----
awk 'BEGIN { for (s = 0; s < 30000; s++) { for (i = 0; i < 20; i++) print "w" (i * s % 97) " NN NN0 B-NP"; print "" } }' >many.txt
for sig in TERM INT; do
  cp keep.crf sig.crf
  "$trellis" crf tag --model model.crf many.txt -o sig.out &
  pid=$!
  for _ in $(seq 200); do ls sig.out.tmp.$pid >/dev/null 2>&1 && break; sleep 0.05; done
  kill -$sig $pid
  wait $pid
  rc=$?
  [ "$rc" -ne 0 ] && [ ! -e sig.out ] && ! ls sig.out.tmp.* >/dev/null 2>&1 && ok ||
    fail "SIG$sig during tag: rc $rc, output or temporary left: $(ls sig.out* 2>/dev/null)"
done
# SIGKILL leaves its temporary; the next run of the same output removes it.
"$trellis" crf tag --model model.crf many.txt -o kill.out &
pid=$!
for _ in $(seq 200); do ls kill.out.tmp.$pid >/dev/null 2>&1 && break; sleep 0.05; done
kill -KILL $pid; wait $pid 2>/dev/null
"$trellis" crf tag --model model.crf train.txt -o kill.out && [ -s kill.out ] && ! ls kill.out.tmp.* >/dev/null 2>&1 && ok ||
  fail "SIGKILL's temporary not removed by the next run"

# ---- output location checked before the work ----
expect_error "train into a missing directory" "cannot write 'no/such/dir/m.crf': directory 'no/such/dir': No such file" none \
  "$trellis" crf train --train train.txt --model no/such/dir/m.crf
grep -q "^iter" stderr.txt && fail "train into a missing directory: trained first" || ok
mkdir -p adir
expect_error "train onto a directory" "cannot write 'adir': it is a directory" none "$trellis" crf train --train train.txt --model adir

# ---- outputs that are devices, pipes or links are written in place; an output never replaces an input ----
# Device nodes of this folder's own (as root), never the system's /dev/full or /dev/null.
if mknod -m 666 full c 1 7 2>/dev/null && mknod -m 666 null c 1 3 2>/dev/null; then
  expect_error "tag -o a full device" "cannot write 'full': No space left on device" none \
    "$trellis" crf tag --model model.crf train.txt -o full
  "$trellis" crf tag --model model.crf train.txt -o null && [ -c null ] && [ -c full ] && ok ||
    fail "a device output was replaced by a file"
  expect_error "train --model a full device" "cannot write 'full': No space left on device" none \
    "$trellis" crf train --train train.txt --model full --max-iter 1
  [ -c full ] && ok || fail "train replaced a device by a file"
fi
mkfifo pipe && { cat pipe >from_pipe.txt & } &&
  "$trellis" crf tag --model model.crf train.txt -o pipe && wait && [ -p pipe ] && [ -s from_pipe.txt ] && ok ||
  fail "tag -o a FIFO: not written through it"
echo old >target.txt && ln -s target.txt link.txt &&
  "$trellis" crf tag --model model.crf train.txt -o link.txt && [ -L link.txt ] && grep -q "^cat" target.txt && ok ||
  fail "tag -o a symbolic link: the link replaced, or its target not written"
cp model.crf private.crf && chmod 600 private.crf &&
  "$trellis" crf train --train train.txt --model private.crf --max-iter 2 2>/dev/null &&
  [ "$(stat -c %a private.crf)" = 600 ] && ok || fail "a replaced model lost its permissions"
"$trellis" crf tag --model model.crf train.txt >/dev/full 2>stderr.txt && fail "tag to a full standard output: exit 0" ||
  { grep -q "cannot write standard output: No space left on device" stderr.txt && [ "$(wc -l <stderr.txt)" = 1 ] && ok ||
    fail "stdout error (once, with its cause): $(cat stderr.txt)"; }
"$trellis" crf dump model.crf >/dev/full 2>stderr.txt && fail "dump to a full standard output: exit 0" ||
  { grep -q "cannot write standard output" stderr.txt && ok || fail "dump stdout error: $(cat stderr.txt)"; }
cp train.txt same.txt && cp model.crf same.crf
"$trellis" crf train --train same.txt --model same.txt --max-iter 1 2>stderr.txt && fail "--model the --train file: exit 0" ||
  { grep -q "'same.txt' is the --train file" stderr.txt && cmp -s same.txt train.txt && ok || fail "--model the --train file"; }
"$trellis" crf tag --model same.crf train.txt -o same.crf 2>stderr.txt && fail "tag -o the model: exit 0" ||
  { grep -q "'same.crf' is the --model file" stderr.txt && cmp -s same.crf model.crf && ok || fail "tag -o the model"; }

# ---- inputs that are not what they claim ----
expect_error "directory as model" "cannot open model 'adir': it is a directory" out1.txt "$trellis" crf tag --model adir train.txt -o out1.txt
expect_error "directory as data" "cannot open 'adir': it is a directory" m1.crf "$trellis" crf train --train adir --model m1.crf
expect_error "directory as template" "cannot open template 'adir': it is a directory" m2.crf \
  "$trellis" crf train --train train.txt --template adir --model m2.crf
# /dev/zero as a model is rejected by its first bytes, not read whole (the time limit catches a read without end).
expect_error "device as model" "'/dev/zero' is not a Trellis CRF model" out2.txt timeout 20 "$trellis" crf tag --model /dev/zero train.txt -o out2.txt
expect_error "device as data" "line longer than 1048576 bytes" m3.crf timeout 20 "$trellis" crf train --train /dev/zero --model m3.crf
awk 'BEGIN { for (i = 0; i < 5000; i++) printf "c%d ", i; print "L" }' >columns.txt
expect_error "5001 columns" "columns.txt:1: 5001 columns; at most 1000" m4.crf "$trellis" crf train --train columns.txt --model m4.crf

# ---- crafted model files (valid checksum, hostile content) ----
# craft.py MODEL OUT WHAT: rewrites a model with a NaN/inf weight or a huge label count, checksum recomputed.
cat >craft.py <<'PY'
import struct, sys
src, out, what = sys.argv[1:]
d = bytearray(open(src, "rb").read()[:-8])
def fnv(b):
    h = 1469598103934665603
    for c in b: h = ((h ^ c) * 1099511628211) & (2**64 - 1)
    return h
if what in ("nan", "inf", "-inf"):
    d[-4:] = struct.pack("<f", float(what))  # the last end weight
elif what == "labels":
    # magic, version, input columns, layout (columns, label, inputs), spec: the label count follows the spec
    pos = 8 + 4
    inputs = struct.unpack_from("<Q", d, pos)[0]; pos += 8 + 16 + 8 * inputs
    pos += 8 + struct.unpack_from("<Q", d, pos)[0]
    struct.pack_into("<Q", d, pos, 10**8)
open(out, "wb").write(bytes(d) + struct.pack("<Q", fnv(d)))
PY
for w in nan inf -inf; do
  "$python" craft.py model.crf "w$w.crf" $w
  expect_error "model with a $w weight" "corrupt model file (end weights entry" "o$w.txt" "$trellis" crf tag --model "w$w.crf" train.txt -o "o$w.txt"
done
"$python" craft.py model.crf labels.crf labels
expect_error "model claiming 10^8 labels" "label count 100000000 exceeds the file" o5.txt \
  bash -c "ulimit -v 4000000; '$trellis' crf tag --model labels.crf train.txt -o o5.txt"

# ---- templates CRF++ rejects ----
for t in 'U00:%y[0,0]' 'U00:100%' 'U00:%x[0,0]%' 'B01:%y[-1]' 'U00:%x[99999999999999999999,0]'; do
  printf '%s\n' "$t" >hostile.tpl
  expect_error "template '$t'" "hostile.tpl:1:" m5.crf "$trellis" crf train --train train.txt --template hostile.tpl --model m5.crf
done

# ---- absurd flags ----
expect_error "--kbest -1" "--kbest must be >= 0" o6.txt "$trellis" crf tag --model model.crf train.txt --kbest -1 -o o6.txt
awk 'BEGIN { for (i = 0; i < 400; i++) print "the DT DT0 B-NP"; print "" }' >long.txt
expect_error "--kbest 1000000" "ask for fewer" o7.txt \
  bash -c "ulimit -v 8000000; '$trellis' crf tag --model model.crf long.txt --kbest 1000000 -o o7.txt"
for flag in "--batch-size -1 --algorithm sgd" "--c2 nan" "--c2 inf" "--c2 -1" "--c1 nan" "--max-iter 0" "--max-iter -5" "--learning-rate nan --algorithm adam"; do
  expect_error "train $flag" "${flag%% *}" m6.crf "$trellis" crf train --train train.txt --model m6.crf $flag
done
expect_error "--model -" "--model '-': a model is written to a file" - \
  "$trellis" crf train --train train.txt --model -
# Training data from standard input: the same model as from the file (CRFsuite and Wapiti read it so too).
"$trellis" crf train --train - --model stdin.crf --max-iter 5 <train.txt 2>/dev/null &&
  "$trellis" crf train --train train.txt --model file.crf --max-iter 5 2>/dev/null && cmp -s stdin.crf file.crf && ok ||
  fail "--train - (standard input) gives another model than the file"
expect_error "--train - --dev -" "--train and --dev are both '-': standard input can be read only once" m6.crf \
  "$trellis" crf train --train - --dev - --model m6.crf
expect_error "neural --train - --dev -" "--train and --dev are both '-'" m6.ncrf \
  "$trellis" crf train --encoder bilstm --train - --dev - --model m6.ncrf
expect_error "--batch-size with lbfgs" "--batch-size and --learning-rate are for --algorithm sgd" m6.crf \
  "$trellis" crf train --train train.txt --model m6.crf --batch-size 5
expect_error "--early-stopping without --dev" "--early-stopping stops on the dev score: it needs --dev" m6.crf \
  "$trellis" crf train --train train.txt --model m6.crf --early-stopping 3
expect_error "--threads beyond the machine" "--threads '100000': takes 0 (all) to" m6.crf \
  "$trellis" crf train --train train.txt --model m6.crf --threads 100000
expect_error "--seed -1" "--seed '-1': takes an integer >= 0" m6.crf "$trellis" crf train --train train.txt --model m6.crf --seed -1
expect_error "--device cuda:99" "--device cuda:99: this machine has" m6.crf \
  "$trellis" crf train --train train.txt --model m6.crf --device cuda:99
grep -q "^train:" stderr.txt && fail "--device cuda:99: read the data first" || ok
expect_error "--kbest with --probability" "--kbest and --probability cannot be combined" o6.txt \
  "$trellis" crf tag --model model.crf train.txt --kbest 2 --probability -o o6.txt
"$trellis" crf dump model.crf --top -1 >stdout.txt 2>stderr.txt && fail "dump --top -1: exit 0" ||
  { grep -q -- "--top must be >= 0, not -1" stderr.txt && [ ! -s stdout.txt ] && ok || fail "dump --top -1: $(cat stderr.txt)"; }
expect_error "--label-column 7" "--label-column 7 is out of range: 'train.txt' has 4 columns" m7.crf \
  "$trellis" crf train --train train.txt --model m7.crf --label-column 7
expect_error "--input-columns naming the label" "--input-columns names the label column 1" m8.crf \
  "$trellis" crf train --train train.txt --model m8.crf --label-column 1 --input-columns 0,1

# ---- the column layout travels with the model: a second tag column never becomes an input ----
"$trellis" crf train --train train.txt --model upos.crf --label-column 1 --max-iter 5 2>/dev/null &&
  prints "columns: 4 columns: input 0, label 1, ignored 2,3" "$trellis" crf dump upos.crf && ok || fail "layout not stored"
# Tagging the training layout and the same file without its label column give the same labels.
"$trellis" crf tag --model upos.crf train.txt | awk 'NF { print $NF }' >with.txt &&
  cut -d' ' -f1,3,4 train.txt | "$trellis" crf tag --model upos.crf - | awk 'NF { print $NF }' >without.txt &&
  cmp -s with.txt without.txt && [ "$(head -1 with.txt)" = DT ] && ok || fail "tagging with and without the label column"
prints "token accuracy: 100.00% (5/5)" "$trellis" crf eval --model upos.crf --gold train.txt && ok ||
  fail "eval reads the label column"
cut -d' ' -f1,2 train.txt >two.txt
expect_error "a file of another layout" "the model was trained on 4 columns: input 0, label 1, ignored 2,3" o8.txt \
  "$trellis" crf tag --model upos.crf two.txt -o o8.txt

# ---- gold labels the model never saw count as errors ----
printf 'the DT DT0 B-NP\ncat NN NN0 I-LST\n\n' >unseen.txt
"$trellis" crf eval --model model.crf --gold unseen.txt >eval.txt 2>eval.err &&
  grep -q "token accuracy: 50.00% (1/2)" eval.txt && grep -q "1 gold tokens have labels the model was not trained on.*I-LST (1)" eval.err &&
  ok || fail "eval with an unseen gold label: $(cat eval.txt eval.err)"

# ---- training that stops at --max-iter says so ----
"$trellis" crf train --train train.txt --model m9.crf --max-iter 1 2>train.err && grep -q "did not converge" train.err && ok ||
  fail "non-convergence not reported"

echo "crf faults: $passed passed, $failed failed"
[ "$failed" = 0 ]
