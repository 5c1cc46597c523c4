"""trellis.CRF from Python beside pytorch-crf (torchcrf.CRF, 0.7.2) and torch-struct (LinearChainCRF, 0.5) in one
process: the log-likelihood's forward+backward and Viterbi decoding at the shapes of issue 22's table, float32 and
bfloat16 emissions. Each Trellis row also times, in the same process, the library call the module wraps ("library call":
torch.ops.trellis._crf_score_and_gradients with reduction "sum", the summed score and its gradients in one call, the
library's forward and backward kernels without the module or autograd; for decoding the crf_viterbi operator), so that
the module's overhead is the difference of two medians taken back to back (the GPU's speed drifts by a few percent
between processes and minutes); the operator
a user would call without the module (torch.ops.trellis.crf_log_likelihood unreduced, summed and back-propagated, or
crf_viterbi); and, with --trellis-bin, the C++ call underneath (`trellis bench crf --device cuda --json`, run as a
subprocess on the same GPU: the same workloads with the library's log_likelihood_with_gradients, which the module's
reduced log-likelihood calls for short chains, and viterbi on full-length sequences).

    # GPU machine: the peers from .whl (scripts/gpu_check.sh's build tree is build-gpu)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/pytorch_crf-*.whl .whl/torch_struct-*.whl
    PYTHONPATH=/tmp/site python3 bench/crf_python.py --library build-gpu/bindings/libtrellis_ops.so \\
        --trellis-bin build-gpu/apps/trellis --out crf_python.json
    # anywhere: a check of the script itself on tiny shapes, on the CPU
    python bench/crf_python.py --library build/bindings/libtrellis_ops.so --quick

Method: CUDA events around each call (wall-clock time on the CPU) as `trellis bench` does, after untimed warm-up calls
(at least two, and at least --warmup seconds of them, so that a fast call is timed on a GPU kept busy, as each row of
`trellis bench` is by the rows before it); the median of up to --repeats timed calls within about --budget seconds per
implementation (at least 3, so slow peers get fewer). A call is what a training step or a tagger does: fwd+bwd builds
the log-likelihood of leaf parameters and emissions (summed over the batch) and back-propagates it (trellis.CRF's and
pytorch-crf's gradients set to None by zero_grad before the timing starts, as the optimizer does between steps; the C++
call times no such step either); decoding returns the best paths (Trellis and torch-struct as tensors; pytorch-crf
returns lists, its only form, and so does the extra "trellis.CRF decode, lists" row). torch-struct gets the CRF's scores
folded into its edge potentials inside the call, as a model using it would, and its log-likelihood is
LinearChainCRF.log_prob of the gold tags' parts (built once, outside the timing).
Out-of-memory is recorded as such. Errors: each implementation's largest absolute difference from Trellis in float64
(log-likelihoods, or Viterbi scores).
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

REPOSITORY = Path(__file__).resolve().parent.parent

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--library", help="libtrellis_ops.so of a build tree (default: the installed trellis package)")
parser.add_argument("--device", default=None, help="cuda (default when there is a GPU) or cpu")
parser.add_argument("--quick", action="store_true", help="tiny shapes, CPU unless --device says otherwise, 3 repeats")
parser.add_argument("--out", help="write the rows and the machine as JSON here")
parser.add_argument("--trellis-bin", help="the trellis command line, for the C++ timings of the same workloads")
parser.add_argument("--repeats", type=int, default=50, help="most timed calls per implementation")
parser.add_argument("--budget", type=float, default=2.0, help="seconds of timed calls per implementation, about")
parser.add_argument("--warmup", type=float, default=0.1, help="minimum seconds of untimed calls before the timed ones")
parser.add_argument("--no-peers", action="store_true", help="Trellis rows only")
parser.add_argument("--without", nargs="+", default=[], choices=["pytorch-crf", "torch-struct"],
                    help="leave out these peers (torch-struct's parallel scan on a CPU takes seconds per call at "
                         "512,64,23 and more memory than a small machine has at 64,512,50)")
parser.add_argument("--shapes", nargs="+", metavar="B,T,K",
                    help="only the workloads of these shapes (e.g. leave out 256,128,256 on a CPU, where torch-struct's "
                         "edge potentials alone take 8.5 GB)")
parser.add_argument("--commit", default=os.environ.get("TRELLIS_COMMIT"), help="default: git rev-parse HEAD")
args = parser.parse_args()

if args.library:
    os.environ["TRELLIS_OPS_LIBRARY"] = str(Path(args.library).resolve())
    sys.path.insert(0, str(REPOSITORY / "bindings" / "python"))
import trellis  # noqa: E402  (after the library's path is set)

device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu"))
if args.quick:
    args.repeats = min(args.repeats, 3)
    args.warmup = 0.0
    if device.type == "cpu":
        torch.set_num_threads(1)  # a check of the script, often on a busy machine: no workers to wait for


def optional_import(name, peer):
    if args.no_peers or peer in args.without:
        return None
    try:
        return __import__(name)
    except ImportError:
        return None


torchcrf = optional_import("torchcrf", "pytorch-crf")
torch_struct = optional_import("torch_struct", "torch-struct")
# torch-struct 0.5's distributions predate torch.distributions' argument checks, which warn about every one made.
warnings.filterwarnings("ignore", message=".*does not define `arg_constraints`")

# (workload, B, T, K, mask): the issue's table; the BERT-CRF shape has sentences of random lengths (a mask).
WORKLOADS = [
    ("log-likelihood fwd+bwd", 512, 64, 23, False),
    ("log-likelihood fwd+bwd", 64, 512, 50, False),
    ("log-likelihood fwd+bwd", 256, 128, 256, False),
    ("log-likelihood fwd+bwd, BERT-CRF", 32, 384, 9, True),
    ("decode", 32, 384, 9, True),
    ("decode", 512, 64, 23, False),
]
if args.quick:
    WORKLOADS = [("log-likelihood fwd+bwd", 8, 12, 5, False), ("log-likelihood fwd+bwd, BERT-CRF", 4, 16, 9, True),
                 ("decode", 4, 16, 9, True), ("decode", 8, 12, 5, False)]
if args.shapes:
    WORKLOADS = [w for w in WORKLOADS if f"{w[1]},{w[2]},{w[3]}" in args.shapes]
    if not WORKLOADS:
        parser.error(f"no workload has the shapes {' '.join(args.shapes)}")
# The C++ benchmark's names for the same workloads (full-length float32 sequences).
CPP_WORKLOADS = {"log-likelihood fwd+bwd": "crf log-lik fwd+bwd", "decode": "crf viterbi"}


def synchronize():
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_call(fn, setup=None):
    """Median milliseconds of fn() (see the method above), each call after setup() (untimed) where given."""
    warm, started = 0, time.perf_counter()
    while warm < 2 or time.perf_counter() - started < args.warmup:
        if setup:
            setup()
        fn()
        synchronize()
        warm += 1
    times = []
    spent = 0.0
    while len(times) < args.repeats and (len(times) < 3 or spent < args.budget):
        if setup:
            setup()
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        spent += times[-1] / 1e3
    return statistics.median(times)


def measured(fn, setup=None):
    """(milliseconds, None) or (None, why not)."""
    try:
        return time_call(fn, setup), None
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, "out of memory"
    except Exception as e:  # a peer that cannot run this input: recorded, not fatal
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def edge_potentials(emissions, transitions, start, end, lengths):
    """torch-struct's (B, T-1, K, K) potentials, [b, n, j, i] scoring tag i at n followed by tag j at n+1, with the
    start, end and emission scores folded in."""
    edges = transitions.t()[None, None] + emissions[:, 1:, :, None]
    first = edges[:, :1] + (start + emissions[:, 0])[:, None, None, :]
    edges = torch.cat([first, edges[:, 1:]], 1)
    last = torch.nn.functional.one_hot(lengths - 2, edges.shape[1]).to(edges.dtype)  # (B, T-1): each one's last edge
    return edges + last[:, :, None, None] * end[None, None, :, None]


def gold_parts(tags, num_tags, lengths, dtype):
    """torch-struct's parts of the tag sequences (LinearChainCRF.struct.to_parts), built on the tags' device:
    [b, n, tags[b, n+1], tags[b, n]] = 1 for the edges within each sequence's length."""
    B, T = tags.shape
    parts = torch.zeros(B, T - 1, num_tags, num_tags, dtype=dtype, device=tags.device)
    n = torch.arange(T - 1, device=tags.device).expand(B, -1)
    b = torch.arange(B, device=tags.device)[:, None].expand(-1, T - 1)
    inside = n < (lengths[:, None] - 1)
    parts[b[inside], n[inside], tags[:, 1:][inside], tags[:, :-1][inside]] = 1
    return parts


def run_workload(workload, B, T, K, with_mask, dtype):
    torch.manual_seed(0)
    crf = trellis.CRF(K, batch_first=True).to(device)
    with torch.no_grad():
        for p in crf.parameters():
            p.normal_(0, 0.5)
    emissions = torch.randn(B, T, K, device=device).to(dtype)
    tags = torch.randint(0, K, (B, T), device=device)
    if with_mask:  # lengths from a quarter of T to T, the first sequence full
        lengths = torch.randint(max(2, T // 4), T + 1, (B,), device=device)
        lengths[0] = T
        mask = torch.arange(T, device=device)[None, :] < lengths[:, None]
    else:
        lengths = torch.full((B,), T, device=device)
        mask = None
    params = (crf.transitions, crf.start_transitions, crf.end_transitions)
    op_lengths = lengths if with_mask else None
    decoding = workload == "decode"
    times, errors, notes = {}, {}, {}

    if decoding:
        reference = torch.ops.trellis.crf_viterbi(emissions.double(), *(p.double() for p in params), None, op_lengths,
                                                  True)[1]
    else:
        reference = torch.ops.trellis.crf_log_likelihood(emissions.double(), tags, *(p.double() for p in params), None,
                                                         op_lengths, True)

    def error(value):
        return (value.detach().double() - reference).abs().max().item()

    def leaves():  # fresh leaves over the same storage: no copies, and gradients assigned rather than accumulated
        return emissions.detach().requires_grad_(), [p.detach().requires_grad_() for p in params]

    # Trellis: the module, the operator it calls, and (below, from the C++ benchmark) the library.
    if decoding:
        def module_call():
            return crf.decode(emissions, mask, as_tensor=True)

        def op_call():
            return torch.ops.trellis.crf_viterbi(emissions, *params, None, op_lengths, True)

        with torch.no_grad():
            times["trellis.CRF"], notes["trellis.CRF"] = measured(module_call)
            times["torch.ops.trellis"], notes["torch.ops.trellis"] = measured(op_call)
            times["trellis.CRF decode, lists"], notes["trellis.CRF decode, lists"] = measured(
                lambda: crf.decode(emissions, mask))
            errors["trellis"] = error(op_call()[1])
    else:
        module_emissions = emissions.detach().requires_grad_()

        def clear_gradients():  # the optimizer's zero_grad (set to None), outside the timing as in the C++ call's
            crf.zero_grad()
            module_emissions.grad = None

        def module_call():  # a training step's forward and backward
            llh = crf(module_emissions, tags, mask, reduction="sum")
            (-llh).backward()
            return llh

        def op_call():
            e, (tr, st, en) = leaves()
            llh = torch.ops.trellis.crf_log_likelihood(e, tags, tr, st, en, None, op_lengths, True)
            (-llh.sum()).backward()
            return llh

        detached, wanted = [p.detach() for p in params], [True] * 4

        def library_call():  # the summed score and its gradients by the library's kernels, without autograd
            return torch.ops.trellis._crf_score_and_gradients(emissions, tags, *detached, None, op_lengths, True, None,
                                                              None, None, wanted, "sum")

        times["trellis.CRF"], notes["trellis.CRF"] = measured(module_call, clear_gradients)
        times[LIBRARY], notes[LIBRARY] = measured(library_call)
        times["torch.ops.trellis"], notes["torch.ops.trellis"] = measured(op_call)
        errors["trellis"] = error(crf(emissions, tags, mask, reduction="none"))

    if torchcrf is not None:
        peer = torchcrf.CRF(K, batch_first=True).to(device)
        peer.load_state_dict(crf.state_dict())
        peer_mask = mask if with_mask else torch.ones(B, T, dtype=torch.bool, device=device)
        if decoding:
            def peer_call():
                return peer.decode(emissions, peer_mask)
            with torch.no_grad():
                times["pytorch-crf"], notes["pytorch-crf"] = measured(peer_call)
        else:
            peer_emissions = emissions.detach().requires_grad_()

            def clear_peer_gradients():
                peer.zero_grad()
                peer_emissions.grad = None

            def peer_call():
                llh = peer(peer_emissions, tags, peer_mask, reduction="sum")
                (-llh).backward()
                return llh
            times["pytorch-crf"], notes["pytorch-crf"] = measured(peer_call, clear_peer_gradients)
            if times["pytorch-crf"] is not None:
                with torch.no_grad():
                    errors["pytorch-crf"] = error(peer(emissions, tags, peer_mask, reduction="none"))

    if torch_struct is not None:
        struct_lengths = lengths.long()
        if decoding:
            def struct_call():  # argmax differentiates the max-semiring partition: no torch.no_grad here
                dist = torch_struct.LinearChainCRF(edge_potentials(emissions, *params, struct_lengths),
                                                   lengths=struct_lengths)
                return dist.argmax
            times["torch-struct"], notes["torch-struct"] = measured(struct_call)
        else:
            try:
                parts = gold_parts(tags, K, struct_lengths, torch.float32)
            except torch.cuda.OutOfMemoryError:
                parts = None
                torch.cuda.empty_cache()
                times["torch-struct"], notes["torch-struct"] = None, "out of memory"

            def struct_call():
                e, (tr, st, en) = leaves()
                dist = torch_struct.LinearChainCRF(edge_potentials(e, tr, st, en, struct_lengths),
                                                   lengths=struct_lengths)
                llh = dist.log_prob(parts)
                (-llh.sum()).backward()
                return llh
            if parts is not None:
                times["torch-struct"], notes["torch-struct"] = measured(struct_call)
                if times["torch-struct"] is not None:
                    errors["torch-struct"] = error(struct_call())
            del parts
        if device.type == "cuda":
            torch.cuda.empty_cache()

    return times, errors, {k: v for k, v in notes.items() if v}


# The library call trellis.CRF wraps, timed in the same process (the GPU's speed drifts by a few percent between
# processes and minutes): for the log-likelihood the score and its gradients in one call, for decoding its operator.
LIBRARY = "library call"


def library_time(row):
    return row["ms"].get(LIBRARY) or (row["ms"].get("torch.ops.trellis") if row["workload"] == "decode" else None)


# The shapes `trellis bench crf` runs (256,128,256 on CUDA only).
CPP_SHAPES = {(512, 64, 23), (64, 512, 50), (256, 128, 256)}


def cpp_timings():
    """{(cpp workload, B, T, K): (trellis ms, vouched ms)} from `trellis bench crf --json`."""
    if not args.trellis_bin:
        return {}
    if not any((B, T, K) in CPP_SHAPES and not with_mask for _, B, T, K, with_mask in WORKLOADS):
        print(f"{args.trellis_bin} not run: it times none of these shapes")
        return {}
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "crf.json"
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the peers' cached blocks, for the other process
        subprocess.run([args.trellis_bin, "bench", "crf", "--device", device.type, "--json", str(out)], check=True,
                       stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())
    found = {}
    for r in rows:
        shape = dict(part.split("=") for part in r["shape"].split())
        key = (r["workload"], int(shape["B"]), int(shape["T"]), int(shape["K"]))
        found.setdefault(key, {})[r["implementation"]] = r["ms"]
    # The C++ call trellis.CRF wraps: log_likelihood_with_gradients for the log-likelihood (what a reduced one of short
    # chains calls in its forward pass; long chains run the same kernels, the backward ones in the backward pass),
    # viterbi for decoding.
    return {key: [impls.get("trellis, log_likelihood_with_gradients", impls.get("trellis")),
                  impls.get("trellis, values vouched for")] for key, impls in found.items()}


def git_commit():
    if args.commit:
        return args.commit
    try:
        return subprocess.run(["git", "-C", str(REPOSITORY), "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main():
    rows = []
    for workload, B, T, K, with_mask in WORKLOADS:
        for dtype in (torch.float32, torch.bfloat16):
            times, errors, notes = run_workload(workload, B, T, K, with_mask, dtype)
            rows.append({"workload": workload, "shape": [B, T, K], "dtype": str(dtype).removeprefix("torch."),
                         "mask": with_mask, "ms": times, "max_abs_error": errors, "notes": notes})
            print(f"{workload} {B},{T},{K} {rows[-1]['dtype']}: "
                  + ", ".join(f"{k} {'-' if v is None else f'{v:.3f}'}" for k, v in times.items()), flush=True)
    cpp = cpp_timings()
    for r in rows:
        t = r["ms"]
        base = r["workload"].split(",")[0]
        key = (CPP_WORKLOADS.get(base), *r["shape"])
        if r["dtype"] == "float32" and not r["mask"] and key in cpp:
            t["trellis C++"], t["trellis C++, values vouched for"] = cpp[key]
        module = t.get("trellis.CRF")
        r["ratio"] = {k: v / module for k, v in t.items() if module and v and k not in ("trellis.CRF",)}
        r["python_overhead_us"] = {f"vs {k}": (module - v) * 1e3 for k, v in ((LIBRARY, library_time(r)),
                                                                               ("trellis C++", t.get("trellis C++")))
                                   if module and v}

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    report = {"machine": platform.node(), "cpu": platform.processor() or platform.machine(), "gpu": gpu,
              "device": device.type, "torch": torch.__version__, "trellis": trellis.__version__,
              "pytorch_crf": getattr(torchcrf, "__version__", None) if torchcrf else None,
              "torch_struct": "0.5" if torch_struct else None, "commit": git_commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "quick": args.quick, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    def cell(r, k):
        v = r["ms"].get(k)
        if v is None:
            return r["notes"].get(k, "-")
        ratio = r["ratio"].get(k)
        return f"{v:.3f}" + (f" ({ratio:.1f}×)" if ratio and k in ("pytorch-crf", "torch-struct") else "")

    print(f"\n{gpu or device.type}, torch {torch.__version__}, trellis {trellis.__version__}, commit {report['commit']}, "
          f"{report['date']}; milliseconds (× = the peer's time over trellis.CRF's)\n")
    print("| workload | B,T,K | emissions | trellis.CRF | torch.ops.trellis | trellis C++ | module − library µs | "
          "module − C++ µs | pytorch-crf | torch-struct | library call |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        overhead = [r["python_overhead_us"].get(k) for k in (f"vs {LIBRARY}", "vs trellis C++")]
        overhead = ["-" if v is None else f"{v:+.1f}" for v in overhead]
        workload = r["workload"] + (" (mask)" if r["mask"] else "")
        library = library_time(r)
        library = "-" if library is None else f"{library:.3f}"
        print(f"| {workload} | {','.join(map(str, r['shape']))} | {r['dtype']} | {cell(r, 'trellis.CRF')} | "
              f"{cell(r, 'torch.ops.trellis')} | {cell(r, 'trellis C++')} | {overhead[0]} | {overhead[1]} | "
              f"{cell(r, 'pytorch-crf')} | {cell(r, 'torch-struct')} | {library} |")
    lists = [r for r in rows if "trellis.CRF decode, lists" in r["ms"]]
    for r in lists:
        print(f"decode {','.join(map(str, r['shape']))} {r['dtype']}: trellis.CRF.decode returning lists "
              f"{cell(r, 'trellis.CRF decode, lists')} ms")


main()
