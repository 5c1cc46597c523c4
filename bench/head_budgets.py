"""The LLM head's training step (mean cross-entropy, forward + backward for x and W) at each memory budget, beside
its GEMM floors, Liger-Kernel's fused linear cross-entropy and Cut Cross-Entropy, on the output-layer shapes of models
people train; one process, one GPU. Writes JSON rows and a Pareto plot (time against memory, one panel per shape).

    python3 bench/head_budgets.py --library build/bindings/libtrellis_ops.so --json head.json --plot head.png

Method (as bench/vocab_parallel_head.py): bf16 inputs; CUDA events around each call, a 256 MB buffer zeroed before
every call to flush L2, one untimed warm-up, the median of up to 25 timed calls within about 400 ms (at least 3).
Memory is the peak allocated during one call beyond what was allocated before it, less the gradients dx and dW
(which every implementation returns): the extra memory beyond the gradients. Ratios are to the GEMM x·Wᵀ of the
shape, timed in the same run; the floors are cuBLAS alone doing the products every design needs (logits once: 3
GEMMs; logits twice, as any design that never holds N×V values must: 4 GEMMs).
Agreement, against float32 logits of the same bf16 inputs (formed a block of rows at a time): the largest per-token
NLL difference (each implementation's reduction='none' forward), and the largest error of dx and dW relative to the
largest reference entry (the training step's gradients).
With --cpu the script checks itself (float32, small shapes, no peers, no timings) and fails where Trellis disagrees.
"""
import argparse
import json
import os
import statistics
import time

import torch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--library", help="libtrellis_ops.so (required unless --from-json)")
parser.add_argument("--json", help="rows are written here (after every shape)")
parser.add_argument("--plot", help="PNG of time against memory, one panel per shape")
parser.add_argument("--shapes", default="llama3-8b,qwen2.5-7b,gemma2-9b,small",
                    help="comma-separated names among " + ", ".join(["llama3-8b", "qwen2.5-7b", "gemma2-9b", "small"]))
parser.add_argument("--rows", default="16384,8192", help="comma-separated N")
parser.add_argument("--peers", default="liger,cce", help="comma-separated: liger, cce (those that import)")
parser.add_argument("--time-limit", type=float, default=1e9,
                    help="seconds: no shape is started after this (the rows so far are kept)")
parser.add_argument("--commit", default=os.environ.get("TRELLIS_COMMIT", "unknown"))
parser.add_argument("--cpu", action="store_true", help="check the script itself on the CPU (float32, small shapes)")
parser.add_argument("--from-json", nargs="+", help="measure nothing: plot the rows of these files (--plot)")
args = parser.parse_args()

# name: (D, V, softcap)
SHAPES = {"llama3-8b": (4096, 128256, None), "qwen2.5-7b": (3584, 152064, None), "gemma2-9b": (3584, 256000, 30.0),
          "small": (2048, 32000, None)}
MiB = 1 << 20
# memory_budget values (bytes beyond the gradients): None is the default (no budget), 64 MiB the O(N) route's.
BUDGETS = [None, 1024 * MiB, 256 * MiB, 128 * MiB, 64 * MiB]

if not args.from_json:
    torch.ops.load_library(args.library)
ops = torch.ops.trellis
device, dtype = ("cpu", torch.float32) if args.cpu else ("cuda", torch.bfloat16)
flush = None if args.cpu or args.from_json else torch.empty(256 << 20, dtype=torch.uint8, device=device)
started = time.monotonic()


def timed(fn, less=0, reset=lambda: None):
    """Median milliseconds and peak extra bytes (less `less`) of fn(), as in the method above; reset() runs before
    each call, outside the timing and the memory count (it frees the last call's gradients)."""
    fn()
    if args.cpu:
        return 1.0, 0
    torch.cuda.synchronize()
    times, peak, spent = [], 0, 0.0
    while len(times) < 25 and (len(times) < 3 or spent < 400):
        reset()
        flush.zero_()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        spent += times[-1]
        peak = max(peak, torch.cuda.max_memory_allocated() - before)
    return statistics.median(times), peak - less


def peers():
    found = {}
    wanted = args.peers.split(",") if args.peers and not args.cpu else []
    if "liger" in wanted:
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
            from importlib.metadata import version as installed
            version = installed("liger-kernel")

            def liger(x, w, t, softcap, reduction="mean"):
                return LigerFusedLinearCrossEntropyLoss(reduction=reduction, softcap=softcap)(w, x, t)
            found["liger-kernel " + version] = liger
        except ImportError as e:
            print("liger-kernel not measured:", e)
    if "cce" in wanted:
        try:
            from cut_cross_entropy import linear_cross_entropy as cce_loss

            def cce(x, w, t, softcap, reduction="mean"):
                return cce_loss(x, w, t, softcap=softcap, reduction=reduction)
            found["cut-cross-entropy 25.1.1"] = cce
        except ImportError as e:
            print("cut-cross-entropy not measured:", e)
    return found


def reference(x, w, t, softcap, block):
    """Per-token NLL, dx and dW of the mean loss from float32 logits, a block of rows at a time."""
    N = x.shape[0]
    xf, wf = x.float(), w.float().requires_grad_()
    nll = torch.empty(N, device=x.device)
    dx = torch.empty_like(xf)
    dw = torch.zeros_like(wf, requires_grad=False)
    for r0 in range(0, N, block):
        xs = xf[r0:r0 + block].clone().requires_grad_()
        z = xs @ wf.t()
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        rows = torch.nn.functional.cross_entropy(z, t[r0:r0 + block], reduction="none")
        nll[r0:r0 + block] = rows.detach()
        gx, gw = torch.autograd.grad(rows.sum() / N, (xs, wf))
        dx[r0:r0 + block] = gx
        dw += gw
    return nll, dx, dw


def relative(a, b):
    return ((a.float() - b).abs().max() / b.abs().max()).item()


def trellis_loss(budget):
    def loss(x, w, t, softcap, reduction="mean"):
        if budget is None:
            return ops.linear_cross_entropy(x, w, t, softcap=softcap, reduction=reduction)
        return ops.linear_cross_entropy(x, w, t, softcap=softcap, reduction=reduction, memory_budget=budget)
    return loss


rows = []


def write():
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def measure_shape(name, N, D, V, softcap, peer_losses):
    torch.manual_seed(0)
    x0 = torch.randn(N, D, device=device).to(dtype)
    w0 = (torch.randn(V, D, device=device) * (2 / D**0.5)).to(dtype)
    t = torch.randint(0, V, (N,), device=device)
    ref_nll, ref_dx, ref_dw = reference(x0, w0, t, softcap, 1024 if args.cpu else 2048)
    gradient_bytes = x0.numel() * x0.element_size() + w0.numel() * w0.element_size()
    common = {"shape": name, "N": N, "D": D, "V": V, "softcap": softcap, "dtype": str(dtype).replace("torch.", ""),
              "device": "cpu" if args.cpu else torch.cuda.get_device_name(), "commit": args.commit}
    with torch.no_grad():
        gemm_ms, _ = timed(lambda: x0 @ w0.t())
        # dz of the mean loss's sign pattern and size (it sets the GEMMs' power draw), made outside the timing.
        dz = torch.empty(N, V, device=device, dtype=dtype)
        for r0 in range(0, N, 2048):
            p = torch.softmax((x0[r0:r0 + 2048] @ w0.t()).float(), 1)
            p[torch.arange(p.shape[0], device=device), t[r0:r0 + 2048]] -= 1
            dz[r0:r0 + 2048] = (p / N).to(dtype)
        del p

        def products(logit_products):
            for _ in range(logit_products):
                x0 @ w0.t()
            dz @ w0
            dz.t() @ x0
        floors = {"floor: 3 GEMMs (logits once)": timed(lambda: products(1))[0],
                  "floor: 4 GEMMs (logits twice)": timed(lambda: products(2))[0]}
        del dz
    for floor, ms in floors.items():
        rows.append(dict(common, implementation=floor, budget=None, fwd_bwd_ms=ms, ratio=ms / gemm_ms,
                         extra_bytes=None, gemm_ms=gemm_ms))
    candidates = [("trellis" + ("" if b is None else f", memory_budget {b // MiB} MiB"), b, trellis_loss(b))
                  for b in BUDGETS]
    candidates.append(("trellis, recompute_logits", None,
                       lambda x, w, t, softcap, reduction="mean": ops.linear_cross_entropy(
                           x, w, t, softcap=softcap, reduction=reduction, recompute_logits=True)))
    candidates += [(peer, None, loss) for peer, loss in peer_losses.items()]
    for implementation, budget, loss_fn in candidates:
        with torch.no_grad():
            nll = loss_fn(x0, w0, t, softcap, reduction="none").float()
            fwd_ms, fwd_bytes = timed(lambda: loss_fn(x0, w0, t, softcap))
        x = x0.detach().clone().requires_grad_()
        w = w0.detach().clone().requires_grad_()

        def clear():
            x.grad = w.grad = None

        def step():
            clear()
            loss_fn(x, w, t, softcap).backward()
        step_ms, step_bytes = timed(step, less=gradient_bytes, reset=clear)
        step()
        row = dict(common, implementation=implementation, budget=budget, fwd_bwd_ms=step_ms, ratio=step_ms / gemm_ms,
                   extra_bytes=step_bytes, fwd_ms=fwd_ms, fwd_ratio=fwd_ms / gemm_ms, fwd_extra_bytes=fwd_bytes,
                   gemm_ms=gemm_ms, nll_error=(nll - ref_nll).abs().max().item(),
                   dx_error=relative(x.grad, ref_dx), dw_error=relative(w.grad, ref_dw),
                   within_budget=None if budget is None or args.cpu else step_bytes <= budget)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.cpu and not (row["nll_error"] < 1e-4 and row["dx_error"] < 1e-4 and row["dw_error"] < 1e-4):
            raise SystemExit(f"{implementation} disagrees with the reference at {name} N={N}: {row}")
        del x, w
    write()


def plot(path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({(r["shape"], r["N"]) for r in rows}, key=lambda p: (list(SHAPES).index(p[0]), -p[1]))
    columns = min(4, len(panels))
    figure, axes = plt.subplots((len(panels) + columns - 1) // columns, columns, squeeze=False,
                                figsize=(4.2 * columns, 3.6 * ((len(panels) + columns - 1) // columns)))
    for axis, (shape, N) in zip(axes.flat, panels):
        here = [r for r in rows if r["shape"] == shape and r["N"] == N]
        # Rows of several runs (--from-json with several files) are told apart by their commit.
        runs = sorted({r["commit"] for r in here})
        named = (lambda name, r: name) if len(runs) == 1 else (lambda name, r: f"{name} ({r['commit']})")
        for commit in runs:
            ours = sorted((r for r in here if r["implementation"].startswith("trellis") and r["commit"] == commit),
                          key=lambda r: r["extra_bytes"])
            if ours:
                axis.plot([max(r["extra_bytes"], 1) / 1e6 for r in ours], [r["ratio"] for r in ours], "o-",
                          label=named("Trellis", ours[0]))
        floors = set()
        for r in here:
            if r["extra_bytes"] is not None and not r["implementation"].startswith("trellis"):
                axis.plot(max(r["extra_bytes"], 1) / 1e6, r["ratio"], "s", label=named(r["implementation"], r))
            elif r["implementation"].startswith("floor"):
                axis.axhline(r["ratio"], linestyle=":", color="grey")
                floor = r["implementation"].split("(")[0].replace("floor: ", "")
                if floor not in floors:
                    floors.add(floor)
                    axis.annotate(floor, (0.02, r["ratio"]), xycoords=("axes fraction", "data"), fontsize=7,
                                  color="grey", va="bottom")
        axis.set_xscale("log")
        axis.set_title(f"{shape} N={N} D={here[0]['D']} V={here[0]['V']}", fontsize=9)
        axis.set_xlabel("memory beyond the gradients (MB)")
        axis.set_ylabel("fwd+bwd ÷ GEMM x·Wᵀ")
        axis.legend(fontsize=7)
    for axis in list(axes.flat)[len(panels):]:
        axis.axis("off")
    device_name = rows[0]["device"] if rows else ""
    commits = ", ".join(sorted({r["commit"] for r in rows}))
    title = f"LLM head training step, bf16, {device_name}, {commits}"
    figure.suptitle(title if columns > 1 else title.replace(", ", "\n", 1), fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if args.from_json:
    wanted_shapes, wanted_rows = set(args.shapes.split(",")), {int(n) for n in args.rows.split(",")}
    rows = [r for path in args.from_json for r in json.load(open(path))
            if r["shape"] in wanted_shapes and r["N"] in wanted_rows]
    plot(args.plot)
    raise SystemExit(0)
peer_losses = peers()
shapes = [(n, int(N)) for N in args.rows.split(",") for n in args.shapes.split(",")]
if args.cpu:
    SHAPES = {k: (64, 1000 + 7 * i, c) for i, (k, (_, _, c)) in enumerate(SHAPES.items())}
    shapes = [(n, 300) for n in args.shapes.split(",")]
    BUDGETS = [None, 8 << 20, (1 << 20) + (160 << 10)]  # a whole slab; the recompute route
for name, N in shapes:
    if time.monotonic() - started > args.time_limit:
        print(f"time limit: {name} N={N} not measured")
        continue
    D, V, softcap = SHAPES[name]
    measure_shape(name, N, D, V, softcap, peer_losses)
    if not args.cpu:
        torch.cuda.empty_cache()
if args.plot and rows:
    plot(args.plot)
