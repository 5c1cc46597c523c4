"""Where one training step of the LLM head spends its GPU time: CUDA time per kernel (torch.profiler) of
linear_cross_entropy's forward+backward, with and without recompute_logits.

    python3 scripts/profile_head.py BUILD/lib/libtrellis_ops.so [N D V]
"""
import sys

import torch
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
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"=== N={N} D={D} V={V} bf16, recompute_logits={recompute}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
