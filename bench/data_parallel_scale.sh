#!/usr/bin/env bash
# Data-parallel scaling of the command line under torchrun: `trellis hmm infer` and `hmm fit` (5 EM iterations) at
# K = 64, 1024 and 4096, and `trellis crf train` (L-BFGS) on CoNLL-2000's training set repeated 10 times, at world sizes
# 1 .. P (one process per GPU with --device cuda, NCCL; Gloo CPU processes with --device cpu). Every run at P > 1 is
# checked against P = 1 (HMM outputs: identical Viterbi paths and float64 results within 1e-10; CRF models: the same
# labels and features, weights within 1e-3 of the largest). Rows (one JSON object per line, each with world_size) go
# to OUT_JSON and a table to stdout.
#
# Usage: bench/data_parallel_scale.sh TRELLIS WORK_DIR OUT_JSON CONLL2000_TRAIN [--quick]
#   TRELLIS_SCALE_RANKS  world sizes (default: 1 to the GPUs present, or 1 2 on the CPU)
#   TRELLIS_SCALE_DEVICE cuda (default when nvidia-smi lists a GPU) or cpu
#   TRELLIS_COMMIT       recorded in every row
# --quick: small sizes (seconds, also on the CPU), to check the script.
# Times are wall-clock seconds of the whole torchrun command (start-up, reading and writing included): tokens/s is
# tokens (times EM iterations for fit) over that. Beside them, work_seconds is the part that divides among the ranks,
# from the command's own report: infer's seconds (reading, computing, writing), the sum of fit's EM iterations, and
# for train the L-BFGS iterations after the first (which also starts the device) scaled to all of them; work_tokens_per_s
# is tokens over that.
set -euo pipefail
trellis=$(realpath "$1")
work=$2
out=$3
conll=$4
quick=${5:-}
mkdir -p "$work"
: >"$out"
if [ -n "${TRELLIS_SCALE_DEVICE:-}" ]; then device=$TRELLIS_SCALE_DEVICE
elif nvidia-smi --list-gpus >/dev/null 2>&1; then device=cuda
else device=cpu; fi
if [ -n "${TRELLIS_SCALE_RANKS:-}" ]; then read -r -a ranks <<<"$TRELLIS_SCALE_RANKS"
elif [ "$device" = cuda ]; then mapfile -t ranks < <(seq 1 "$(nvidia-smi --list-gpus | wc -l)")
else ranks=(1 2); fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
commit=${TRELLIS_COMMIT:-unknown}
python=${PYTHON:-python3}

if [ "$quick" = --quick ]; then hmm_sizes=("8 20000" "32 5000"); crf_copies=1; crf_sentences=300; crf_iterations=3
else hmm_sizes=("64 100000000" "1024 10000000" "4096 2000000"); crf_copies=10; crf_sentences=0; crf_iterations=10; fi
# TRELLIS_SCALE_HMM_SIZES="K:TOKENS ..." replaces the HMM sizes (e.g. to fit a time limit).
if [ -n "${TRELLIS_SCALE_HMM_SIZES:-}" ]; then
  read -r -a pairs <<<"$TRELLIS_SCALE_HMM_SIZES"
  hmm_sizes=()
  for pair in "${pairs[@]}"; do hmm_sizes+=("${pair/:/ }"); done
fi

now() { date +%s.%N; }
minus() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a - b }'; }
launch() {  # launch P ARGS...: the trellis command under torchrun with P processes
  local p=$1
  shift
  "$python" -m torch.distributed.run --standalone --nproc-per-node="$p" --no-python "$trellis" "$@"
}
row() {  # row WORKLOAD SHAPE P SECONDS TOKENS SAME WORK_SECONDS
  local work=${7:-0}
  printf '{"workload": "%s", "shape": "%s", "world_size": %d, "device": "%s", "seconds": %.3f, "tokens": %d, "tokens_per_s": %.1f, "work_seconds": %.3f, "work_tokens_per_s": %.1f, "same_as_world_size_1": %s, "commit": "%s"}\n' \
    "$1" "$2" "$3" "$device" "$4" "$5" "$(awk -v t="$5" -v s="$4" 'BEGIN { printf "%.1f", t / s }')" "$work" \
    "$(awk -v t="$5" -v s="$work" 'BEGIN { printf "%.1f", (s > 0 ? t / s : 0) }')" "$6" "$commit" | tee -a "$out"
}
# The divisible work of a run, from its log (0 where the log has no such report).
infer_work() { sed -n 's/.*  \([0-9.]*\) s  [0-9]* tokens\/s.*/\1/p' "$1" | tail -1 | grep . || echo 0; }
fit_work() { awk '/^iter [0-9]+ .* s$/ { sum += $(NF - 1) } END { printf "%.3f", sum }' "$1"; }
train_work() {  # cumulative seconds at each iteration: (last - first) / (n - 1) per iteration, times n
  awk '/^iter [0-9]+ .* s$/ { n++; if (n == 1) first = $(NF - 1); last = $(NF - 1) }
       END { printf "%.3f", (n > 1 ? (last - first) / (n - 1) * n : 0) }' "$1"
}
same_hdf5() {  # same_hdf5 A B: identical integer datasets, floating ones within 1e-10 relative
  "$python" - "$1" "$2" <<'EOF'
import sys, h5py, numpy as np
a, b = h5py.File(sys.argv[1], "r"), h5py.File(sys.argv[2], "r")
assert sorted(a.keys()) == sorted(b.keys())
for k in a.keys():
    x, y = a[k][()], b[k][()]
    if np.issubdtype(x.dtype, np.floating):
        assert np.allclose(x, y, rtol=1e-10, atol=0), k
    else:
        assert np.array_equal(x, y), k
EOF
}
same_crf_model() {  # same_crf_model A B PARAMETERS: the dist_crf test's comparison
  "$python" - "$1" "$2" "$3" <<'EOF'
import sys, numpy as np
a, b, n = open(sys.argv[1], "rb").read(), open(sys.argv[2], "rb").read(), int(sys.argv[3])
head = len(a) - 8 - 4 * n
assert len(a) == len(b) and a[:head] == b[:head]
x, y = (np.frombuffer(f[head:-8], np.float32).astype(np.float64) for f in (a, b))
assert np.abs(x - y).max() <= 1e-3 * np.abs(x).max()
EOF
}

for size in "${hmm_sizes[@]}"; do
  read -r K tokens <<<"$size"
  n=$(((tokens + 549) / 550))  # lengths uniform in [100, 1000]
  "$trellis" hmm init --states "$K" --symbols 10000 --seed 1 -o "$work/m$K.h5" 2>/dev/null
  "$trellis" hmm sample -m "$work/m$K.h5" -o "$work/d$K.h5" -n "$n" -l 1000 --min-length 100 --seed 2 2>/dev/null
  total=$("$trellis" hmm infer -m "$work/m$K.h5" -d "$work/d$K.h5" -o "$work/check.h5" --device "$device" 2>/dev/null |
    sed -n 's/.*tokens \([0-9]*\) .*/\1/p')
  for p in "${ranks[@]}"; do
    t0=$(now)
    launch "$p" hmm infer -m "$work/m$K.h5" -d "$work/d$K.h5" -o "$work/infer$K.p$p.h5" --device "$device" \
      --memory-budget 8G >"$work/infer$K.p$p.log" 2>&1
    t1=$(now)
    same=true
    [ "$p" = "${ranks[0]}" ] || same_hdf5 "$work/infer$K.p${ranks[0]}.h5" "$work/infer$K.p$p.h5" 2>/dev/null || same=false
    row "hmm infer" "K=$K, V=10000, $total tokens" "$p" "$(minus "$t1" "$t0")" "$total" "$same" \
      "$(infer_work "$work/infer$K.p$p.log")"
    t0=$(now)
    launch "$p" hmm fit -d "$work/d$K.h5" -o "$work/fit$K.p$p.h5" --init "$work/m$K.h5" --max-iterations 5 \
      --tolerance 0 --device "$device" --memory-budget 8G >"$work/fit$K.p$p.log" 2>&1
    t1=$(now)
    same=true
    [ "$p" = "${ranks[0]}" ] || same_hdf5 "$work/fit$K.p${ranks[0]}.h5" "$work/fit$K.p$p.h5" 2>/dev/null || same=false
    row "hmm fit" "K=$K, V=10000, $total tokens, 5 EM iterations" "$p" "$(minus "$t1" "$t0")" \
      "$((5 * total))" "$same" "$(fit_work "$work/fit$K.p$p.log")"
  done
  rm -f "$work"/d"$K".h5 "$work"/infer"$K".p*.h5
done

if [ "$crf_sentences" -gt 0 ]; then
  awk -v RS= -v ORS='\n\n' -v n="$crf_sentences" 'NR <= n' "$conll" >"$work/corpus.txt"
else
  for ((i = 0; i < crf_copies; i++)); do cat "$conll"; echo; done >"$work/corpus.txt"
fi
crf_tokens=$(grep -c . "$work/corpus.txt")
for p in "${ranks[@]}"; do
  t0=$(now)
  launch "$p" crf train --train "$work/corpus.txt" --model "$work/crf.p$p.crf" --max-iter "$crf_iterations" \
    --device "$device" >"$work/crf.p$p.log" 2>&1
  t1=$(now)
  same=true
  parameters=$("$trellis" crf dump "$work/crf.p${ranks[0]}.crf" | sed -n 's/^parameters: //p')
  [ "$p" = "${ranks[0]}" ] ||
    same_crf_model "$work/crf.p${ranks[0]}.crf" "$work/crf.p$p.crf" "$parameters" 2>/dev/null || same=false
  row "crf train" "CoNLL-2000 x$crf_copies, $crf_iterations L-BFGS iterations" "$p" "$(minus "$t1" "$t0")" \
    "$((crf_iterations * crf_tokens))" "$same" "$(train_work "$work/crf.p$p.log")"
done
