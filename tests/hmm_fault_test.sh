#!/usr/bin/env bash
# The HMM commands under faults: a full disk, signals and temporaries left by killed runs. Every failure exits
# non-zero (and not by a crash) with a message naming the output and the cause, and leaves neither a new output nor a
# temporary behind; an output that was there before stays as it was.
# Usage: hmm_fault_test.sh TRELLIS_BINARY WORK_DIR
set -uo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/cli_harness.sh" || exit 1
trellis=$1
work=$2
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1

"$trellis" hmm init --states 3 --symbols 6 --seed 1 -o cat.h5 2>/dev/null || fail "init"
"$trellis" hmm sample -m cat.h5 -o data.h5 -n 2000 -l 100 --seed 2 2>/dev/null || fail "sample"
awk 'BEGIN { for (s = 0; s < 20000; s++) print "the DT\ncat NN\nsat VBD\n" }' >big.conll
"$trellis" hmm convert -i big.conll -o conv.h5 2>/dev/null || fail "convert"

# ---- full disk: writes fail with EFBIG (file size limit, SIGXFSZ ignored) ----
# expect_full_disk NAME OUTPUT KB COMMAND...: with writes limited to KB kilobytes, COMMAND fails with an exit code
# (not a signal) and "cannot write 'OUTPUT': File too large"; OUTPUT, when there was one, is unchanged.
expect_full_disk() {
  local name=$1 output=$2 kb=$3 rc
  shift 3
  [ -e "$output" ] && cp "$output" before.h5 || rm -f before.h5
  (trap '' XFSZ; ulimit -f "$kb"; "$@") >stdout.txt 2>stderr.txt
  rc=$?
  if [ "$rc" = 0 ] || [ "$rc" -ge 128 ]; then fail "$name: exit code $rc: $(tail -3 stderr.txt)"; return; fi
  if ! grep -qF "cannot write '$output': File too large" stderr.txt; then fail "$name: stderr: $(cat stderr.txt)"; return; fi
  if grep -q "H5Dclose failed\|DataSet::~DataSet" stderr.txt; then fail "$name: HDF5 complains from a destructor"; return; fi
  if [ -e before.h5 ]; then
    cmp -s before.h5 "$output" || { fail "$name: the old $output was replaced"; return; }
  elif [ -e "$output" ]; then
    fail "$name: $output was written"; return
  fi
  if ls "$output".tmp.* >/dev/null 2>&1; then fail "$name: a temporary file was left"; return; fi
  ok
}
# Limits below, at and above where the writes of each command end (HDF5 reports some failures only when it flushes or
# closes the file).
for kb in 4 100 1000 2100; do
  expect_full_disk "convert over a good file, ${kb}K" conv.h5 $kb "$trellis" hmm convert -i big.conll -o conv.h5
done
expect_full_disk "convert to a new file" new.h5 100 "$trellis" hmm convert -i big.conll -o new.h5
"$trellis" hmm infer -m cat.h5 -d data.h5 -o inf.h5 --posteriors >/dev/null 2>&1 || fail "infer"
for kb in 8 100 1000; do
  expect_full_disk "infer over a good file, ${kb}K" inf.h5 $kb "$trellis" hmm infer -m cat.h5 -d data.h5 -o inf.h5 --posteriors
done
cp cat.h5 model.h5
for kb in 1 4 8; do
  expect_full_disk "init over a good model, ${kb}K" model.h5 $kb "$trellis" hmm init --states 30 --symbols 600 -o model.h5
done
expect_full_disk "fit over a good model" model.h5 8 "$trellis" hmm fit -d data.h5 -o model.h5 --states 30 --max-iterations 2
expect_full_disk "supervised fit" model.h5 4 "$trellis" hmm fit -d conv.h5 -o model.h5 --supervised --order 2
expect_full_disk "sample" data.h5 100 "$trellis" hmm sample -m cat.h5 -o data.h5 -n 20000 -l 100

# ---- stale temporaries of dead processes go; a live process's stay ----
: >stale.h5.tmp.4194304  # above Linux's largest pid: no such process
sleep 60 &
live=$!
: >stale.h5.tmp.$live
"$trellis" hmm infer -m cat.h5 -d data.h5 -o stale.h5 >/dev/null 2>&1 &&
  [ ! -e stale.h5.tmp.4194304 ] && [ -e stale.h5.tmp.$live ] && ok || fail "stale temporary not removed (or a live one removed)"
kill $live
rm -f stale.h5.tmp.$live

# ---- SIGTERM and SIGINT while the output is being written: no temporary left, the old output intact ----
"$trellis" hmm sample -m cat.h5 -o long.h5 -n 20000 -l 300 --seed 3 2>/dev/null || fail "sample a long dataset"
# A background job of this shell starts with SIGINT ignored until the command installs its handler, so a signal is
# sent only once the command shows it is running (its handler is installed first thing), however loaded the machine.
# wait_for PID COMMAND...: polls COMMAND while process PID lives, up to 300 s; fails if PID ends first or time runs out.
wait_for() {
  local pid=$1
  shift
  for _ in $(seq 3000); do
    "$@" && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
# run_until_temporary OUTPUT COMMAND...: starts COMMAND in the background (its pid in $pid) and returns once OUTPUT's
# temporary exists (fails if it never does).
run_until_temporary() {
  local output=$1
  shift
  "$@" >/dev/null 2>&1 &
  pid=$!
  wait_for $pid ls "$output".tmp.$pid >/dev/null 2>&1
}
for sig in TERM INT; do
  cp inf.h5 sig.h5
  run_until_temporary sig.h5 "$trellis" hmm infer -m cat.h5 -d long.h5 -o sig.h5 --posteriors --memory-budget 20M --threads 1 ||
    fail "SIG$sig during infer: the run ended or wrote no temporary before the signal"
  kill -$sig $pid
  wait $pid
  rc=$?
  [ "$rc" -ne 0 ] && cmp -s inf.h5 sig.h5 && ! ls sig.h5.tmp.* >/dev/null 2>&1 && ok ||
    fail "SIG$sig during infer: rc $rc; old output changed or temporary left: $(ls sig.h5* 2>/dev/null)"
  # fit writes its model only at the end: signalled during EM.
  cp cat.h5 sigfit.h5
  "$trellis" hmm fit -d long.h5 -o sigfit.h5 --states 40 --max-iterations 50 --tolerance 0 --threads 1 >/dev/null \
    2>fit.stderr &
  pid=$!
  wait_for $pid grep -q '^data:' fit.stderr || fail "SIG$sig during fit: the run ended before it printed its data line"
  kill -$sig $pid
  wait $pid
  rc=$?
  [ "$rc" -ne 0 ] && cmp -s cat.h5 sigfit.h5 && ! ls sigfit.h5.tmp.* >/dev/null 2>&1 && ok ||
    fail "SIG$sig during fit: rc $rc; old model changed or temporary left: $(ls sigfit.h5* 2>/dev/null)"
done
# SIGKILL leaves its temporary; the next run writing the same output removes it.
run_until_temporary kill.h5 "$trellis" hmm infer -m cat.h5 -d long.h5 -o kill.h5 --posteriors --memory-budget 20M --threads 1 ||
  fail "SIGKILL during infer: the run ended or wrote no temporary before the signal"
kill -KILL $pid
wait $pid 2>/dev/null
ls kill.h5.tmp.$pid >/dev/null 2>&1 || fail "SIGKILL left no temporary (the test did not kill a run that was writing)"
"$trellis" hmm infer -m cat.h5 -d data.h5 -o kill.h5 >/dev/null 2>&1 && [ -s kill.h5 ] && ! ls kill.h5.tmp.* >/dev/null 2>&1 &&
  ok || fail "SIGKILL's temporary not removed by the next run"

echo "hmm faults: $passed passed, $failed failed"
[ "$failed" = 0 ]
