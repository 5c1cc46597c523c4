# Shared by the data-parallel test scripts (sourced after cli_harness.sh, in the work directory, with $py and $trellis
# set): launching trellis over several processes and reading what each rank printed.
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
