"""Where one training step of the LLM head spends its GPU time: CUDA time per kernel (torch.profiler) of
linear_cross_entropy's forward+backward, with and without recompute_logits (or at the memory budgets given); the
step's time by CUDA events, the GPU's idle gaps between kernels, and the host operations that took longest.

    python3 scripts/gpu/profile_head.py BUILD/bindings/libtrellis_ops.so [N D V] [--memory-budget MIB ...]

With --memory-budget each budget's route is profiled instead of the two modes (e.g. --memory-budget 128 256 1024).
Kernels on several streams (the slab routes' dW product runs beside dx's) overlap: the idle time counts only the time
no kernel ran.
"""
import argparse

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("library")
parser.add_argument("shape", nargs="*", type=int, help="N D V (default 16384 4096 128256)")
parser.add_argument("--memory-budget", nargs="+", type=int, default=[], help="MiB")
args = parser.parse_args()
torch.ops.load_library(args.library)
N, D, V = args.shape if len(args.shape) == 3 else (16384, 4096, 128256)
x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(V, D, device="cuda") / D**0.5).to(torch.bfloat16).requires_grad_()
t = torch.randint(0, V, (N,), device="cuda")
settings = [{"memory_budget": mib << 20} for mib in args.memory_budget] or [{"recompute_logits": False},
                                                                           {"recompute_logits": True}]

for setting in settings:
    def step():
        x.grad = w.grad = None
        torch.ops.trellis.linear_cross_entropy(x, w, t, **setting).backward()
    step()
    # The step's time on the GPU without the profiler, beside the kernels' sum below: the difference is idle time.
    times = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    print(f"step (median of 5, CUDA events): {sorted(times)[2]:.3f} ms")
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        step()
        stop.record()
        torch.cuda.synchronize()
    print(f"=== N={N} D={D} V={V} bf16, {setting}; profiled step {start.elapsed_time(stop):.3f} ms")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
    # Where the GPU waited: gaps between consecutive kernels, and the host operations that took longest.
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == DeviceType.CUDA)
    # A gap: the time from the latest end so far to the next kernel's start (kernels of two streams overlap).
    gaps, latest = [], kernels[0]
    for k in kernels[1:]:
        gaps.append((k[0] - latest[1], latest[2][:50], k[2][:50]))
        latest = max(latest, k, key=lambda e: e[1])
    gaps.sort(reverse=True)
    print(f"kernels span {(kernels[-1][1] - kernels[0][0]) / 1e3:.3f} ms; idle between them {sum(max(g[0], 0) for g in gaps) / 1e3:.3f} ms")
    for g in gaps[:5]:
        print(f"  gap {g[0] / 1e3:.3f} ms after {g[1]} before {g[2]}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=50))
