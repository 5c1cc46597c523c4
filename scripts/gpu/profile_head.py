"""Where one training step of the LLM head spends its GPU time: CUDA time per kernel (torch.profiler) of
linear_cross_entropy's forward+backward, with and without recompute_logits; the step's time by CUDA events, the GPU's
idle gaps between kernels, and the host operations that took longest.

    python3 scripts/gpu/profile_head.py BUILD/bindings/libtrellis_ops.so [N D V]
"""
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

torch.ops.load_library(sys.argv[1])
N, D, V = (int(a) for a in sys.argv[2:5]) if len(sys.argv) >= 5 else (16384, 4096, 128256)
x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(V, D, device="cuda") / D**0.5).to(torch.bfloat16).requires_grad_()
t = torch.randint(0, V, (N,), device="cuda")

for recompute in (False, True):
    def step():
        x.grad = w.grad = None
        torch.ops.trellis.linear_cross_entropy(x, w, t, recompute_logits=recompute).backward()
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
    print(f"=== N={N} D={D} V={V} bf16, recompute_logits={recompute}; profiled step {start.elapsed_time(stop):.3f} ms")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
    # Where the GPU waited: gaps between consecutive kernels, and the host operations that took longest.
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == DeviceType.CUDA)
    gaps = sorted(((b[0] - a[1], a[2][:50], b[2][:50]) for a, b in zip(kernels, kernels[1:])), reverse=True)
    print(f"kernels span {(kernels[-1][1] - kernels[0][0]) / 1e3:.3f} ms; idle between them {sum(max(g[0], 0) for g in gaps) / 1e3:.3f} ms")
    for g in gaps[:5]:
        print(f"  gap {g[0] / 1e3:.3f} ms after {g[1]} before {g[2]}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=50))
