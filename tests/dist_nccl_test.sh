#!/usr/bin/env bash
# The NCCL process group (--device cuda under torchrun) at world size 1 against a plain one-process CUDA run: hmm infer
# (float64: identical paths, log-likelihoods within 1e-10), hmm fit (EM) and crf train (L-BFGS), and the share lines
# naming NCCL. Skipped (77) without a GPU. Without h5py the HDF5 outputs are compared through what trellis prints (the
# log-likelihoods to 4 decimals, the accuracy of the paths, the EM iterations).
# Usage: dist_nccl_test.sh TRELLIS_BINARY WORK_DIR PYTHON (with torch, h5py and numpy) DATA_DIR (data/ud-en-ewt-sample)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/dist_harness.sh" "$@" || exit 1
skip_unless 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' "no GPU (or $py lacks torch)"
have_h5py=1
"$py" -c 'import h5py, numpy' 2>/dev/null || have_h5py=0
export TRELLIS_DIST_TIMEOUT=120
# same_output A B [LOG_A LOG_B]: the HDF5 files, or without h5py the logs' log-likelihood lines.
same_output() {
  if ((have_h5py)); then same_hdf5 "$1" "$2"; return; fi
  diff <(grep -o 'log-likelihood -*[0-9.]*' "$3") <(grep -o 'log-likelihood -*[0-9.]*' "$4") >/dev/null
}

"$trellis" hmm convert -i "$data/train.txt" -o train.h5 --label-column 1 2>/dev/null &&
  "$trellis" hmm convert -i "$data/dev.txt" -o dev.h5 --vocabulary-from train.h5 --label-column 1 --add-labels 2>/dev/null &&
  "$trellis" hmm fit -d train.h5 -o sup.h5 --supervised --smoothing 0.1 2>/dev/null || { echo "FAIL: set-up"; exit 1; }

"$trellis" hmm infer -m sup.h5 -d dev.h5 -o one.h5 --posteriors --device cuda >one.txt 2>&1 &&
  torchrun 1 hmm infer -m sup.h5 -d dev.h5 -o nccl.h5 --posteriors --device cuda && same_output one.h5 nccl.h5 one.txt out.0.txt &&
  [ "$("$trellis" hmm eval -d dev.h5 -p one.h5)" = "$("$trellis" hmm eval -d dev.h5 -p nccl.h5)" ] &&
  ok || fail "hmm infer through NCCL differs: $(cat err.0.txt torchrun.err | tail -5)"
grep -q "^rank 0 of 1 (nccl): sequences 0-399 (400 of 400)" err.0.txt && ok || fail "hmm infer: share line: $(cat err.0.txt)"
"$trellis" hmm fit -d dev.h5 -o em_one.h5 --states 8 --max-iterations 5 --tolerance 0 --device cuda 2>em_one.txt &&
  torchrun 1 hmm fit -d dev.h5 -o em_nccl.h5 --states 8 --max-iterations 5 --tolerance 0 --device cuda &&
  same_output em_one.h5 em_nccl.h5 em_one.txt err.0.txt && ok || fail "hmm fit through NCCL differs: $(tail -5 err.0.txt)"
awk -v RS= -v ORS='\n\n' 'NR <= 400' "$data/train.txt" >train.txt
"$trellis" crf train --train train.txt --model one.crf --max-iter 5 --device cuda 2>one.txt &&
  torchrun 1 crf train --train train.txt --model nccl.crf --max-iter 5 --device cuda &&
  same_objectives one.txt err.0.txt &&
  grep -q "^rank 0 of 1 (nccl): sentences 0-399" err.0.txt && ok || fail "crf train through NCCL: $(tail -5 err.0.txt)"

echo "passed $passed, failed $failed"
((failed == 0))
