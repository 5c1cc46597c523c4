# Shared by the data-parallel test scripts, sourced first with the script's arguments (TRELLIS_BINARY WORK_DIR PYTHON
# DATA_DIR): it brings in cli_harness.sh, sets $trellis, $work, $py and $data, makes WORK_DIR afresh and works there,
# and defines the ways of launching trellis over several processes, of reading what each rank printed and of comparing
# outputs with a single process's.
source "$(dirname "${BASH_SOURCE[0]}")/cli_harness.sh" || return 1
trellis=$1
work=$2
py=$3
data=$4
rm -rf "$work" && mkdir -p "$work" && cd "$work" || return 1
# skip_unless PYTHON_CODE REASON: the script ends as skipped (77, CTest's SKIP_RETURN_CODE) unless $py runs the code.
skip_unless() { "$py" -c "$1" 2>/dev/null || { echo "SKIP: $2"; exit 77; }; }
#
# Each rank runs through rank.sh: its stdout goes to out.RANK.txt and its stderr to err.RANK.txt, and with
# MISSING_ON_RANK=r and MISSING_ARG=NAME, rank r gets missing_NAME in place of the argument NAME (a file missing on
# one rank only).
cat >rank.sh <<'EOF'
#!/usr/bin/env bash
args=()
for a in "$@"; do
  if [ "${MISSING_ON_RANK:-}" = "$RANK" ] && [ "$a" = "${MISSING_ARG:-}" ]; then a=missing_$a; fi
  args+=("$a")
done
exec "${args[@]}" >"out.$RANK.txt" 2>"err.$RANK.txt"
EOF
free_port() { "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# torchrun WORLD_SIZE trellis-arguments...: under torchrun (its agent serves the store; it starts in seconds).
torchrun() {
  local world=$1
  shift
  rm -f err.*.txt out.*.txt
  "$py" -m torch.distributed.run --standalone --nproc-per-node="$world" --no-python bash rank.sh "$trellis" "$@" \
    >torchrun.out 2>torchrun.err
}
# run WORLD_SIZE trellis-arguments...: the processes started here with the environment torchrun gives its workers
# (rank 0 serves the store); fails unless every rank succeeds.
run() {
  local world=$1 port rc=0 r
  shift
  rm -f err.*.txt out.*.txt
  port=$(free_port)
  local pids=()
  for ((r = 0; r < world; r++)); do
    RANK=$r WORLD_SIZE=$world LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port bash rank.sh "$trellis" "$@" &
    pids+=($!)
  done
  for r in "${pids[@]}"; do wait "$r" || rc=1; done
  return $rc
}
# same_objectives A B: the "iter" lines of two crf train logs have objectives within 1e-4 relative (float32 sums in
# another order).
same_objectives() {
  paste <(grep '^iter ' "$1" | awk '{print $4}') <(grep '^iter ' "$2" | awk '{print $4}') |
    awk 'NF != 2 { bad = 1 } { d = $1 - $2; if (d < 0) d = -d; if (d > 1e-4 * ($1 < 0 ? -$1 : $1)) bad = 1; n++ }
         END { exit bad || n == 0 }'
}
# same_hdf5 A B: the same datasets (needs h5py); float64 results within 1e-10 relative, float32 ones within 1e-6,
# integers (paths, offsets) identical. The differences go to stdout.
cat >compare.py <<'EOF'
import sys, h5py, numpy as np
a, b = h5py.File(sys.argv[1], "r"), h5py.File(sys.argv[2], "r")
assert sorted(a.keys()) == sorted(b.keys()), (sorted(a.keys()), sorted(b.keys()))
for k in a.keys():
    x, y = a[k][()], b[k][()]
    assert x.shape == y.shape and x.dtype == y.dtype, (k, x.shape, y.shape, x.dtype, y.dtype)
    if x.dtype.kind == "f":
        tol = 1e-6 if x.dtype == np.float32 else 1e-10
        assert np.allclose(x, y, rtol=tol, atol=tol * 1e-3), (k, np.abs(x - y).max())
    else:
        assert (x == y).all(), k
EOF
same_hdf5() { "$py" compare.py "$1" "$2" 2>compare.err || { cat compare.err; return 1; }; }
