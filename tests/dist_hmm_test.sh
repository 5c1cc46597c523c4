#!/usr/bin/env bash
# Data-parallel trellis hmm infer and fit under torchrun (Gloo on the CPU) against single-process runs, at world sizes
# 2 and 3 (uneven shares, and a rank with no sequences at all), and the failure behaviour: a dataset missing on one
# rank stops every rank quickly with that rank's message and leaves no output; a rank that never joins makes the
# others fail at the timeout instead of hanging.
# Usage: dist_hmm_test.sh TRELLIS_BINARY WORK_DIR PYTHON (with torch and h5py) DATA_DIR (data/ud-en-ewt-sample)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/dist_harness.sh" "$@" || exit 1
skip_unless 'import h5py, numpy, torch.distributed.run' "$py lacks torch or h5py"
export TRELLIS_DIST_TIMEOUT=30

"$trellis" hmm convert -i "$data/train.txt" -o train.h5 --label-column 1 2>/dev/null &&
  "$trellis" hmm convert -i "$data/dev.txt" -o dev.h5 --vocabulary-from train.h5 --label-column 1 --add-labels 2>/dev/null &&
  "$trellis" hmm init --states 3 --features 2 --seed 4 -o gauss.h5 2>/dev/null &&
  "$trellis" hmm sample -m gauss.h5 -o gdata.h5 -n 40 -l 30 --min-length 2 --seed 5 2>/dev/null &&
  "$trellis" hmm sample -m gauss.h5 -o two.h5 -n 2 -l 5 --seed 6 2>/dev/null || { echo "FAIL: set-up"; exit 1; }

# Single-process references.
"$trellis" hmm fit -d train.h5 -o sup.h5 --supervised --smoothing 0.1 2>/dev/null &&
  "$trellis" hmm fit -d train.h5 -o sup2.h5 --supervised --order 2 --smoothing 0.1 2>/dev/null &&
  "$trellis" hmm infer -m sup.h5 -d dev.h5 -o infer.h5 --posteriors >/dev/null 2>&1 &&
  "$trellis" hmm fit -d dev.h5 -o em.h5 --states 4 --max-iterations 3 --tolerance 0 2>/dev/null &&
  "$trellis" hmm fit -d gdata.h5 -o gem.h5 --states 3 --max-iterations 3 --tolerance 0 2>/dev/null &&
  "$trellis" hmm infer -m gauss.h5 -d two.h5 -o two_ref.h5 >/dev/null 2>&1 || { echo "FAIL: single-process runs"; exit 1; }

for world in 2 3; do
  launch=run
  ((world == 3)) && launch=torchrun
  $launch "$world" hmm infer -m sup.h5 -d dev.h5 -o "infer$world.h5" --posteriors && same_hdf5 infer.h5 "infer$world.h5" && ok ||
    fail "infer at world size $world differs from one process"
  grep -q "^sequences 400  tokens 6729 " out.0.txt && [ ! -s out.1.txt ] && ok ||
    fail "infer at world $world: rank 0 alone prints the summary: $(cat out.*.txt)"
  # Every rank names itself, the world and its share; the shares cover the dataset once.
  for ((r = 0; r < world; r++)); do
    grep -q "^rank $r of $world (gloo): sequences [0-9]*-[0-9]* ([0-9]* of 400), [0-9]* of 6729 tokens" "err.$r.txt" && ok ||
      fail "infer at world $world: rank $r's share line: $(cat "err.$r.txt")"
  done
  cat err.*.txt | sed -n 's/^rank [0-9]* of [0-9]* (gloo): sequences \([0-9]*\)-\([0-9]*\) .*/\1 \2/p' | sort -n |
    awk 'BEGIN { next_first = 0 } { if ($1 != next_first) bad = 1; next_first = $2 + 1 } END { exit bad || next_first != 400 }' &&
    ok || fail "infer at world $world: the shares do not cover the 400 sequences once"
  run "$world" hmm fit -d dev.h5 -o "em$world.h5" --states 4 --max-iterations 3 --tolerance 0 && same_hdf5 em.h5 "em$world.h5" &&
    ok || fail "EM at world size $world differs from one process"
  [ "$(grep -c '^iter ' err.0.txt)" = 3 ] && ! grep -q '^iter ' err.1.txt && ok ||
    fail "EM at world $world: rank 0 alone prints the 3 iterations"
done
run 3 hmm fit -d train.h5 -o sup_3.h5 --supervised --smoothing 0.1 && same_hdf5 sup.h5 sup_3.h5 && ok ||
  fail "supervised fit at world size 3 differs"
run 3 hmm fit -d train.h5 -o sup2_3.h5 --supervised --order 2 --smoothing 0.1 && same_hdf5 sup2.h5 sup2_3.h5 && ok ||
  fail "second-order supervised fit at world size 3 differs"
run 2 hmm fit -d gdata.h5 -o gem_2.h5 --states 3 --max-iterations 3 --tolerance 0 && same_hdf5 gem.h5 gem_2.h5 && ok ||
  fail "Gaussian EM at world size 2 differs"
# Two sequences over three ranks: one rank has none and still takes part.
run 3 hmm infer -m gauss.h5 -d two.h5 -o two_3.h5 && same_hdf5 two_ref.h5 two_3.h5 && grep -q "sequences none (0 of 2)" err.*.txt &&
  ok || fail "a rank with an empty share"

# A dataset missing on rank 1: every rank exits with rank 1's message, quickly, and no output appears.
start=$SECONDS
MISSING_ON_RANK=1 MISSING_ARG=dev.h5 torchrun 3 hmm infer -m sup.h5 -d dev.h5 -o lost.h5 && fail "missing dataset on rank 1: exit code 0"
((SECONDS - start < 20)) && ok || fail "missing dataset on rank 1: took $((SECONDS - start)) s"
for r in 0 1 2; do
  grep -q "rank 1 of 3: .*missing_dev.h5" "err.$r.txt" && ok || fail "missing dataset: rank $r's error: $(cat "err.$r.txt")"
done
[ ! -e lost.h5 ] && ! ls lost.h5.tmp.* >/dev/null 2>&1 && ok || fail "missing dataset: an output was left"
MISSING_ON_RANK=2 MISSING_ARG=dev.h5 run 3 hmm fit -d dev.h5 -o lost.h5 --states 4 --max-iterations 2 && fail "fit, dataset missing: exit code 0"
grep -q "rank 2 of 3: .*missing_dev.h5" err.0.txt && [ ! -e lost.h5 ] && ok || fail "fit, dataset missing on rank 2: $(cat err.0.txt)"

# Launched without torchrun's agent (rank 0 serves the store), a rank that never starts: the others stop at the
# timeout with a message naming it, instead of waiting for ever.
port=$(free_port)
start=$SECONDS
for r in 0 1; do
  TRELLIS_DIST_TIMEOUT=3 RANK=$r WORLD_SIZE=3 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$trellis" hmm infer -m sup.h5 -d dev.h5 -o never.h5 >/dev/null 2>"never.$r.txt" &
done
wait %1; rc0=$?
wait %2; rc1=$?
((rc0 != 0 && rc1 != 0)) && ok || fail "a rank that never joins: exit codes $rc0 $rc1"
((SECONDS - start < 30)) && ok || fail "a rank that never joins: took $((SECONDS - start)) s"
grep -q "rank 0 of 3: cannot join the process group at 127.0.0.1:$port within 3 s" never.0.txt && ok ||
  fail "a rank that never joins: rank 0's message: $(cat never.0.txt)"
[ ! -e never.h5 ] && ok || fail "a rank that never joins: an output was written"

# Waits longer than the timeout are fine while the awaited rank makes progress: rank 2, slowed down by SIGSTOP and
# SIGCONT (0.4 s stopped, 0.1 s running), computes its share long after the others, which wait for it with a timeout of
# 2 s, and rank 0's output is still the single-process one.
"$trellis" hmm init --states 16 --symbols 1000 --seed 7 -o wide.h5 2>/dev/null &&
  "$trellis" hmm sample -m wide.h5 -o wide_data.h5 -n 1500 -l 200 --min-length 50 --seed 8 2>/dev/null &&
  "$trellis" hmm infer -m wide.h5 -d wide_data.h5 -o wide_ref.h5 --posteriors >/dev/null 2>&1 || fail "wide model set-up"
port=$(free_port)
pids=()
for r in 0 1 2; do
  TRELLIS_DIST_TIMEOUT=2 OMP_NUM_THREADS=1 RANK=$r WORLD_SIZE=3 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$trellis" hmm infer -m wide.h5 -d wide_data.h5 -o wide_3.h5 --posteriors --memory-budget 300k >/dev/null \
    2>"slow.$r.txt" &
  pids+=($!)
done
for ((i = 0; i < 200; i++)); do grep -q "^rank 2 of 3" slow.2.txt 2>/dev/null && break; sleep 0.05; done
( while kill -STOP "${pids[2]}" 2>/dev/null; do sleep 0.4; kill -CONT "${pids[2]}" 2>/dev/null; sleep 0.1; done ) &
throttle=$!
start=$SECONDS
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
kill "$throttle" 2>/dev/null; wait "$throttle" 2>/dev/null
((rc == 0)) && same_hdf5 wide_ref.h5 wide_3.h5 && ok ||
  fail "a slow rank that makes progress: $(tail -n 1 slow.*.txt)"
((SECONDS - start > 3)) && ok || fail "the slow rank was not slowed down enough to test the wait ($((SECONDS - start)) s)"

# A rank killed or stopped (SIGSTOP) in the middle of EM (launched without torchrun, whose agent would stop the others
# itself): the others stop within the timeout, with an error naming the failed collective (the connection closed, or
# the timeout) or the rank that made no progress while they waited for it.
for signal in KILL STOP; do
  port=$(free_port)
  pids=()
  for r in 0 1 2; do
    TRELLIS_DIST_TIMEOUT=5 RANK=$r WORLD_SIZE=3 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$trellis" hmm fit -d dev.h5 -o dead.h5 --states 4 --max-iterations 1000000 --tolerance 0 >/dev/null 2>"dead.$r.txt" &
    pids+=($!)
  done
  ( sleep 60 && kill -KILL "${pids[@]}" ) 2>/dev/null &
  watchdog=$!
  # In the middle of EM: once rank 0 has finished an iteration (the group formed), not after a fixed time, which a
  # loaded machine can spend starting the processes.
  for ((i = 0; i < 600; i++)); do grep -q "^iter 1 " dead.0.txt 2>/dev/null && break; sleep 0.1; done
  kill -"$signal" "${pids[2]}"
  start=$SECONDS
  wait "${pids[0]}"; rc0=$?
  wait "${pids[1]}"; rc1=$?
  kill -KILL "${pids[2]}" 2>/dev/null; wait "${pids[2]}" 2>/dev/null
  kill "$watchdog" 2>/dev/null
  ((rc0 != 0 && rc1 != 0 && SECONDS - start < 20)) && ok ||
    fail "rank 2 stopped by SIG$signal: the others exited $rc0 $rc1 after $((SECONDS - start)) s"
  grep -q "rank 0 of 3: \(.* over the process group failed (another rank has probably stopped\|rank [12] made no progress in 5 s\)" \
    dead.0.txt && ok ||
    fail "rank 2 stopped by SIG$signal: rank 0's message: $(cat dead.0.txt)"
  [ ! -e dead.h5 ] && ok || fail "rank 2 stopped by SIG$signal: a model was written"
done

echo "passed $passed, failed $failed"
((failed == 0))
