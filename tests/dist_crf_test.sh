#!/usr/bin/env bash
# Data-parallel trellis crf train (Gloo on the CPU) against one process at world sizes 2 and 3: L-BFGS (with a dev
# set), OWL-QN and the minibatch algorithms, whose last minibatch leaves ranks without sentences. The model files must
# hold the same labels and features byte for byte, and weights within float32 reassociation of the single-process
# ones; rank 0 alone writes the model and reports. A training file missing on one rank stops every rank with its
# message and leaves no model.
# Usage: dist_crf_test.sh TRELLIS_BINARY WORK_DIR PYTHON (with torch and numpy) DATA_DIR (data/ud-en-ewt-sample)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/dist_harness.sh" "$@" || exit 1
skip_unless 'import numpy, torch.distributed.run' "$py lacks torch or numpy"
export TRELLIS_DIST_TIMEOUT=30
# One thread per process, whatever the machine: the single-process run then sums in the order each rank does, and
# four L-BFGS iterations compare weights rather than line searches that a last-bit difference sent elsewhere.
export OMP_NUM_THREADS=1

# 401 training sentences (minibatches of 8 end with one sentence: two of three ranks get none of it), 100 dev ones.
awk -v RS= -v ORS='\n\n' 'NR <= 401' "$data/train.txt" >train.txt
awk -v RS= -v ORS='\n\n' 'NR <= 100' "$data/dev.txt" >dev.txt
# same_model A B TOLERANCE: identical up to the weights (the float32 block before the checksum), whose largest
# difference is at most TOLERANCE times the largest weight.
cat >same_model.py <<'EOF'
import sys, numpy as np
a, b, tol = open(sys.argv[1], "rb").read(), open(sys.argv[2], "rb").read(), float(sys.argv[3])
n = int(sys.argv[4])
assert len(a) == len(b), "the files' sizes differ"
head = len(a) - 8 - 4 * n
assert a[:head] == b[:head], "the labels, features or layout differ"
x, y = (np.frombuffer(f[head:-8], np.float32).astype(np.float64) for f in (a, b))
assert np.abs(x - y).max() <= tol * np.abs(x).max(), f"weights differ by {np.abs(x - y).max()} (largest {np.abs(x).max()})"
EOF
parameters() { "$trellis" crf dump "$1" | sed -n 's/^parameters: //p'; }

check() {  # check NAME WORLD LAUNCHER TOLERANCE train-options...
  local name=$1 world=$2 launch=$3 tol=$4
  shift 4
  "$trellis" crf train --train train.txt --model "one_$name.crf" "$@" 2>"one_$name.txt" || { fail "$name: one process"; return; }
  $launch "$world" crf train --train train.txt --model "dist_$name.crf" "$@" ||
    { fail "$name: world size $world: $(cat err.*.txt)"; return; }
  "$py" same_model.py "one_$name.crf" "dist_$name.crf" "$tol" "$(parameters "one_$name.crf")" 2>compare.err && ok ||
    fail "$name at world size $world: $(tail -1 compare.err)"
  same_objectives "one_$name.txt" err.0.txt && ok || fail "$name at world size $world: the objectives differ"
  ! grep -q '^iter \|^done' err.1.txt && grep -q "^model written to dist_$name.crf" err.0.txt && ok ||
    fail "$name at world size $world: rank 0 alone reports"
}
check lbfgs 2 run 1e-3 --max-iter 4
grep -q "^rank 1 of 2 (gloo): sentences [0-9]*-400 ([0-9]* of 401), [0-9]* of [0-9]* tokens" err.1.txt && ok ||
  fail "L-BFGS: rank 1's share line: $(cat err.1.txt)"
check lbfgs_dev 3 torchrun 1e-3 --max-iter 4 --dev dev.txt
grep -q "best dev (iteration [0-9])" err.0.txt && ok || fail "L-BFGS with dev: no best dev iteration: $(cat err.0.txt)"
# OWL-QN projects onto orthants: a weight near 0 whose sign comes out otherwise in another summation order is zeroed.
check owlqn 2 run 1e-2 --max-iter 4 --c1 0.5
check adam 3 run 2e-3 --max-iter 2 --algorithm adam --batch-size 8 --learning-rate 0.02
grep -q "^rank 2 of 3 (gloo): part 3 of each minibatch of 8 sentences" err.2.txt && ok ||
  fail "adam: rank 2's share line: $(cat err.2.txt)"
check sgd 2 run 2e-3 --max-iter 2 --algorithm sgd --batch-size 8 --learning-rate 0.01

# The training file missing on rank 1: every rank stops with rank 1's message, and no model appears.
MISSING_ON_RANK=1 MISSING_ARG=train.txt run 3 crf train --train train.txt --model lost.crf --max-iter 2 &&
  fail "training file missing on rank 1: exit code 0"
for r in 0 1 2; do
  grep -q "rank 1 of 3: .*missing_train.txt" "err.$r.txt" && ok || fail "missing training file: rank $r: $(cat "err.$r.txt")"
done
[ ! -e lost.crf ] && ! ls lost.crf.tmp.* >/dev/null 2>&1 && ok || fail "missing training file: a model was left"

echo "passed $passed, failed $failed"
((failed == 0))
