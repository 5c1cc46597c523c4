#!/usr/bin/env bash
# Kernel-level times of one bench workload under Nsight Compute, on the GPU machine, reusing the build folder of
# scripts/gpu_check.sh when the machine still has it. Usage: bash scripts/gpu/gpu_profile.sh crf|hmm|semiring [regex]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
build=/tmp/trellis-build-gpu
sysroot=/tmp/trellis-sysroot
mkdir -p "$sysroot"
for f in .gpu-debs/*.deb; do dpkg -x "$f" "$sysroot"; done
export LD_LIBRARY_PATH="$sysroot/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_PREFIX_PATH="$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)');$sysroot/usr" >/dev/null
fi
cmake --build "$build" -j "$(nproc)" --target trellis_cli >/dev/null || exit 1
ncu --clock-control none --csv --metrics gpu__time_duration.sum -k "regex:${2:-.}" -c "${3:-40}" \
  "$build/apps/trellis" bench "${1:-crf}" --device cuda --repeats 1 2>/dev/null | python3 -c '
import csv, sys
rows = [r for r in csv.reader(l for l in sys.stdin if l.startswith("\""))]
head, body = rows[0], rows[1:]
k, v = head.index("Kernel Name"), head.index("Metric Value")
total = 0.0
for r in body:
    t = float(r[v].replace(",", ""))
    total += t
    print(f"{t:10.2f} us  {r[k][:110]}")
print(f"{total:10.2f} us  total over {len(body)} kernels")
'
