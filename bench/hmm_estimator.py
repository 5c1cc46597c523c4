"""HMM estimators from Python: trellis.hmm (CPU, and CUDA where there is a GPU) beside hmmlearn on the same models and
data, score + predict (log-likelihood and Viterbi states of every sequence), categorical and diagonal-Gaussian.

    PYTHONPATH=bindings/python TRELLIS_OPS_LIBRARY=build/bindings/libtrellis_ops.so \
        python bench/hmm_estimator.py --out hmm.json
    ... --quick          # small sizes: a check of the script itself

Method: one random model per kind (K states; V symbols or F features; Dirichlet(1) start and transition rows), data
sampled from it (sequence lengths uniform in [100, 1000], TOKENS tokens in all), the same X and lengths for every
implementation. Each row times `model.score(X, lengths)` and `model.predict(X, lengths)` by the wall clock, from
numpy in to numpy out (validation, transfers and batching included); trellis' calls are warmed up once and the median
of --repeats is reported, hmmlearn's (one thread, its default "log" implementation) are timed once. With
--hmmlearn-tokens, hmmlearn runs on the first sequences up to that many tokens and its times are scaled to the whole
data (the row says so). Every row checks its results against hmmlearn's on the data hmmlearn ran on: the relative
difference of the log-likelihoods and the fraction of Viterbi states that agree. Rows go to --out as JSON and are
printed as a table.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--out", required=True, help="JSON file for the rows")
parser.add_argument("--quick", action="store_true", help="small sizes (50k tokens), to check the script")
parser.add_argument("--states", type=int, default=64)
parser.add_argument("--tokens", type=int, default=2_000_000)
parser.add_argument("--symbols", type=int, default=1000, help="V of the categorical model")
parser.add_argument("--features", type=int, default=4, help="F of the Gaussian model")
parser.add_argument("--kinds", default="categorical,gaussian")
parser.add_argument("--repeats", type=int, default=3, help="timed calls of each trellis row (median)")
parser.add_argument("--hmmlearn-tokens", type=int, default=0,
                    help="time hmmlearn on about this many tokens and scale (0: all of them)")
parser.add_argument("--no-hmmlearn", action="store_true")
parser.add_argument("--library", help="libtrellis_ops.so of a build tree (else TRELLIS_OPS_LIBRARY or the package)")
parser.add_argument("--commit", default=os.environ.get("TRELLIS_COMMIT"))
args = parser.parse_args()
if args.quick:
    args.tokens = min(args.tokens, 50_000)
if args.library:
    os.environ["TRELLIS_OPS_LIBRARY"] = args.library
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bindings" / "python"))

import torch  # noqa: E402

from trellis import hmm as trellis_hmm  # noqa: E402

try:
    from hmmlearn import __version__ as hmmlearn_version
    from hmmlearn import hmm as hmmlearn_hmm
    hmmlearn_error = None
except ImportError as e:  # hmmlearn needs scipy and scikit-learn
    hmmlearn_hmm, hmmlearn_version, hmmlearn_error = None, None, str(e)


def random_model(kind, rs):
    K = args.states
    p = {"startprob_": rs.dirichlet(np.ones(K)), "transmat_": rs.dirichlet(np.ones(K), size=K)}
    if kind == "categorical":
        p["emissionprob_"] = rs.dirichlet(np.ones(args.symbols), size=K)
    else:
        p["means_"] = rs.randn(K, args.features) * 2
        p["covars_"] = rs.uniform(0.5, 2.0, size=(K, args.features))
    return p


def sample(kind, p, rs):
    """Sequences of lengths uniform in [100, 1000] (shorter for --quick) up to args.tokens in all, drawn from p: the
    chains advance together, one step for every sequence at a time."""
    low, high = (20, 200) if args.quick else (100, 1000)
    lengths = []
    while sum(lengths) < args.tokens:
        lengths.append(int(rs.randint(low, high + 1)))
    lengths[-1] -= sum(lengths) - args.tokens
    if lengths[-1] < 1:
        lengths.pop()
    lengths = np.array(lengths)
    n, T = len(lengths), lengths.max()
    states = np.empty((n, T), dtype=np.int64)
    states[:, 0] = (np.cumsum(p["startprob_"])[None, :] > rs.rand(n)[:, None]).argmax(1)
    cdf = np.cumsum(p["transmat_"], axis=1)
    for t in range(1, T):
        states[:, t] = (cdf[states[:, t - 1]] > rs.rand(n)[:, None]).argmax(1)
    Z = states[np.arange(T)[None, :] < lengths[:, None]]  # concatenated in sequence order
    if kind == "categorical":
        X = np.empty(len(Z), dtype=np.int64)
        emission_cdf = np.cumsum(p["emissionprob_"], axis=1)
        for k in range(args.states):
            at = np.flatnonzero(Z == k)
            X[at] = np.minimum(np.searchsorted(emission_cdf[k], rs.rand(len(at)), side="right"), args.symbols - 1)
        return X[:, None], lengths
    return p["means_"][Z] + np.sqrt(p["covars_"][Z]) * rs.randn(len(Z), args.features), lengths


def make(module, kind, p, **kwargs):
    if kind == "categorical":
        model = module.CategoricalHMM(n_components=args.states, n_features=args.symbols, init_params="", **kwargs)
        model.emissionprob_ = p["emissionprob_"]
    else:
        model = module.GaussianHMM(n_components=args.states, init_params="", **kwargs)
        model.means_ = p["means_"]
        model.covars_ = p["covars_"]
    model.startprob_ = p["startprob_"]
    model.transmat_ = p["transmat_"]
    return model


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def run_trellis(model, X, lengths):
    model.score(X, lengths), model.predict(X, lengths)  # warm-up: CUDA context, kernels, allocator
    score_s, predict_s, results = [], [], None
    for _ in range(args.repeats):
        s, log_prob = timed(lambda: model.score(X, lengths))
        t, states = timed(lambda: model.predict(X, lengths))
        score_s.append(s)
        predict_s.append(t)
        results = (log_prob, states)
    return statistics.median(score_s), statistics.median(predict_s), results


def main():
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    meta = {
        "benchmark": "hmm_estimator", "states": args.states, "tokens": args.tokens, "symbols": args.symbols,
        "features": args.features, "quick": args.quick, "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "cpu": cpu_name(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "hmmlearn": hmmlearn_version, "commit": args.commit or git_commit(),
    }
    rows = []
    for kind in args.kinds.split(","):
        rs = np.random.RandomState(0)
        p = random_model(kind, rs)
        X, lengths = sample(kind, p, rs)
        reference, reference_rows = None, None
        if hmmlearn_hmm is not None and not args.no_hmmlearn:
            count = len(lengths)
            if args.hmmlearn_tokens:
                count = max(1, int(np.searchsorted(np.cumsum(lengths), args.hmmlearn_tokens)) + 1)
            sub_lengths = lengths[:count]
            reference_rows = int(sub_lengths.sum())
            sub_X = X[:reference_rows]
            model = make(hmmlearn_hmm, kind, p)
            score_s, log_prob = timed(lambda: model.score(sub_X, sub_lengths))
            predict_s, states = timed(lambda: model.predict(sub_X, sub_lengths))
            reference = (log_prob, states, sub_lengths)
            scale = len(X) / reference_rows
            rows.append(row(kind, "hmmlearn", "cpu", "float64", score_s * scale, predict_s * scale,
                            measured_tokens=reference_rows, agreement=(0.0, 1.0)))
        for device in devices:
            for dtype in ([torch.float64] if device == "cpu" else [torch.float32, torch.float64]):
                model = make(trellis_hmm, kind, p, device=device, dtype=dtype)
                score_s, predict_s, (log_prob, states) = run_trellis(model, X, lengths)
                agreement = None
                if reference is not None:
                    sub_log_prob = model.score(X[:reference_rows], reference[2]) if reference_rows < len(X) \
                        else log_prob
                    agreement = (abs(sub_log_prob - reference[0]) / abs(reference[0]),
                                 float((states[:reference_rows] == reference[1]).mean()))
                rows.append(row(kind, "trellis", device, str(dtype).replace("torch.", ""), score_s, predict_s,
                                measured_tokens=len(X), agreement=agreement))
    baseline = {r["kind"]: r["total_s"] for r in rows if r["implementation"] == "hmmlearn"}
    for r in rows:
        r["speedup_vs_hmmlearn"] = baseline[r["kind"]] / r["total_s"] if r["kind"] in baseline else None
    print_table(meta, rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


def row(kind, implementation, device, dtype, score_s, predict_s, measured_tokens, agreement):
    total = score_s + predict_s
    return {"kind": kind, "implementation": implementation, "device": device, "dtype": dtype,
            "states": args.states, "tokens": args.tokens, "score_s": score_s, "predict_s": predict_s,
            "total_s": total, "tokens_per_s": args.tokens / total, "measured_tokens": measured_tokens,
            "scaled": measured_tokens != args.tokens,
            "loglik_rel_diff": None if agreement is None else agreement[0],
            "viterbi_agreement": None if agreement is None else agreement[1]}


def print_table(meta, rows):
    print(f"K={meta['states']}, {meta['tokens']} tokens (V={meta['symbols']}, F={meta['features']}); torch "
          f"{meta['torch']} ({meta['torch_threads']} CPU threads), GPU {meta['gpu']}, hmmlearn {meta['hmmlearn']}"
          + (f" (not importable: {hmmlearn_error})" if hmmlearn_error else ""))
    header = f"{'kind':<12}{'impl':<10}{'device':<7}{'dtype':<8}{'score s':>9}{'predict s':>10}{'total s':>9}" \
             f"{'Mtok/s':>8}{'vs hmmlearn':>12}{'loglik diff':>12}{'viterbi eq':>11}"
    print(header)
    print("-" * len(header))
    for r in rows:
        speedup = f"{r['speedup_vs_hmmlearn']:.1f}x" if r["speedup_vs_hmmlearn"] else "-"
        diff = f"{r['loglik_rel_diff']:.1e}" if r["loglik_rel_diff"] is not None else "-"
        equal = f"{r['viterbi_agreement']:.4f}" if r["viterbi_agreement"] is not None else "-"
        print(f"{r['kind']:<12}{r['implementation']:<10}{r['device']:<7}{r['dtype']:<8}{r['score_s']:>9.3f}"
              f"{r['predict_s']:>10.3f}{r['total_s']:>9.3f}{r['tokens_per_s'] / 1e6:>8.2f}{speedup:>12}{diff:>12}"
              f"{equal:>11}" + (f"   (measured on {r['measured_tokens']} tokens, scaled)" if r["scaled"] else ""))


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    main()
