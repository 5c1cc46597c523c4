#!/usr/bin/env python3
"""Side-by-side check and benchmark of `trellis hmm` against hmmlearn.

    tests/hmmlearn_compare.py --trellis build/apps/trellis            # check (default)
    tests/hmmlearn_compare.py --trellis build/apps/trellis bench --cuda --json bench.json

check: for a categorical (K=5, V=12) and a diagonal-Gaussian (K=4, F=3) model, trellis
init/sample/infer/fit results are compared with hmmlearn run on the same model and data
(log-likelihood, Viterbi path and log-prob, posteriors, 10 Baum-Welch iterations).
bench: tokens/s of `trellis hmm infer` (log-likelihood + Viterbi) against hmmlearn
score + decode, for categorical K=64, V=10000.

Exit status: 0 all good, 1 a mismatch or a failed trellis run, 77 hmmlearn or h5py cannot
be imported (CTest's SKIP_RETURN_CODE).
"""
import argparse
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import numpy as np
    import h5py
    import hmmlearn
    from hmmlearn import hmm
except ImportError as e:  # CTest treats 77 as "skipped", not "failed"
    print(f"SKIP: {e}", file=sys.stderr)
    sys.exit(77)

SKIP, FAIL = 77, 1

# Tolerances of the check mode.
LL_RTOL = 1e-5      # per-sequence log-likelihood and Viterbi log-prob
TIE_RTOL = 1e-9     # a differing Viterbi path is a tie only if it scores the same as hmmlearn's
POST_ATOL = 1e-4    # posteriors are stored as float32
HIST_RTOL = 1e-5    # EM log-likelihood history
PARAM_ATOL = 1e-6   # parameters after EM


class TrellisError(RuntimeError):
    pass


def run_trellis(exe, *args):
    """Run `trellis hmm ...`; returns (stdout+stderr, wall seconds)."""
    cmd = [exe, "hmm", *map(str, args)]
    print("$ " + shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise TrellisError(f"cannot run {exe}: {e}") from e
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.stdout.write(p.stdout)
        sys.stdout.write(p.stderr)
        raise TrellisError(f"{shlex.join(cmd)} exited with status {p.returncode}")
    return p.stdout + p.stderr, wall


def as_str(v):
    return v.decode() if isinstance(v, bytes) else str(v)


# ---------------------------------------------------------------- hmmlearn side

def read_model(path):
    """Model file -> (emission kind, dict of natural-unit parameters)."""
    with h5py.File(path, "r") as f:
        kind = as_str(f.attrs["emission"])
        names = ["startprob", "transmat"] + (
            ["emissionprob"] if kind == "categorical" else ["means", "covars"])
        params = {n: np.asarray(f[n][()], dtype=np.float64) for n in names}
        if "log_likelihood_history" in f:
            params["log_likelihood_history"] = np.asarray(f["log_likelihood_history"][()], np.float64)
    return kind, params


def make_hmmlearn(kind, p, n_iter=10):
    """hmmlearn model with the given parameters; init_params='' keeps them as the EM start.

    tol=-inf: hmmlearn stops when history[-1] - history[-2] < tol, so this runs all n_iter.
    The Gaussian priors are hmmlearn's defaults, spelled out because trellis mirrors them.
    """
    K = p["startprob"].shape[0]
    if kind == "categorical":
        m = hmm.CategoricalHMM(n_components=K, n_features=p["emissionprob"].shape[1],
                               params="ste", init_params="", n_iter=n_iter, tol=-np.inf)
        m.emissionprob_ = p["emissionprob"].copy()
    elif kind == "gaussian":
        m = hmm.GaussianHMM(n_components=K, covariance_type="diag",
                            means_prior=0, means_weight=0, covars_prior=1e-2, covars_weight=1,
                            params="stmc", init_params="", n_iter=n_iter, tol=-np.inf)
        m.n_features = p["means"].shape[1]
        m.means_ = p["means"].copy()
        m.covars_ = p["covars"].copy()  # 'diag': [K, F] variances
    else:
        raise ValueError(f"unknown emission {kind!r}")
    m.startprob_ = p["startprob"].copy()
    m.transmat_ = p["transmat"].copy()
    return m


def hmmlearn_params(kind, m):
    out = {"startprob": m.startprob_, "transmat": m.transmat_}
    if kind == "categorical":
        out["emissionprob"] = m.emissionprob_
    else:
        out["means"] = m.means_
        out["covars"] = np.diagonal(m.covars_, axis1=1, axis2=2)  # covars_ reads back as full matrices
    return out


def read_data(path, upto=None):
    """Data file -> (X in hmmlearn's layout, offsets, labels); `upto` reads only the first rows."""
    with h5py.File(path, "r") as f:
        off = np.asarray(f["offsets"][()], dtype=np.int64)
        end = int(off[-1]) if upto is None else int(upto)
        obs = f["observations"][:end]
        labels = f["labels"][:end] if "labels" in f else None
    # CategoricalHMM wants integer symbols as an [T, 1] column; float32 features are
    # widened exactly so both sides see the same values.
    X = obs.reshape(-1, 1).astype(np.int64) if obs.ndim == 1 else obs.astype(np.float64)
    return X, off, labels


def log_emission(kind, p, X):
    """[T, K] emission log-densities, written out independently of hmmlearn."""
    with np.errstate(divide="ignore"):
        if kind == "categorical":
            return np.log(p["emissionprob"][:, X[:, 0]].T)
        mu, var = p["means"], p["covars"]
        return -0.5 * (mu.shape[1] * np.log(2 * np.pi) + np.log(var).sum(1)
                       + (((X[:, None, :] - mu) ** 2) / var).sum(2))


def path_log_prob(kind, p, X, states):
    """log P(path, X): used to tell a Viterbi tie from a wrong path."""
    with np.errstate(divide="ignore"):
        ls, lt = np.log(p["startprob"]), np.log(p["transmat"])
    le = log_emission(kind, p, X)
    s = np.asarray(states, dtype=np.int64)
    return float(ls[s[0]] + lt[s[:-1], s[1:]].sum() + le[np.arange(len(s)), s].sum())


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return math.inf
    if a.size == 0:
        return 0.0
    if np.any(np.isnan(a) | np.isnan(b)):
        return math.inf
    same = a == b  # covers equal infinities
    d = np.abs(a - b) / np.maximum(np.maximum(np.abs(a), np.abs(b)), 1e-300)
    return float(np.where(same, 0.0, d).max())


def abs_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return math.inf
    return float(np.abs(a - b).max()) if a.size else 0.0


# ---------------------------------------------------------------- check mode

class Table:
    def __init__(self):
        self.rows = []

    def add(self, case, what, value, limit, ok, note=""):
        self.rows.append((case, what, value, limit, bool(ok), note))
        return ok

    def print(self):
        def fmt(v):
            return v if isinstance(v, str) else f"{v:.2e}"
        hdr = ("case", "quantity", "worst", "limit", "result", "note")
        body = [(c, w, fmt(v), fmt(l), "ok" if ok else "FAIL", n) for c, w, v, l, ok, n in self.rows]
        widths = [max(len(r[i]) for r in [hdr] + body) for i in range(len(hdr))]
        line = lambda r: "  ".join(s.ljust(w) for s, w in zip(r, widths)).rstrip()
        print("\n" + line(hdr))
        print("  ".join("-" * w for w in widths))
        for r in body:
            print(line(r))

    @property
    def ok(self):
        return all(r[4] for r in self.rows)


def check_sample(t, case, data_path, kind, p, n_seq, max_len, min_len):
    X, off, labels = read_data(data_path)
    K = p["startprob"].shape[0]
    lengths = np.diff(off)
    problems = []
    if len(lengths) != n_seq:
        problems.append(f"{len(lengths)} sequences, asked for {n_seq}")
    if off[0] != 0 or lengths.min() < min_len or lengths.max() > max_len:
        problems.append(f"lengths {lengths.min()}..{lengths.max()}, asked for {min_len}..{max_len}")
    if off[-1] != len(X):
        problems.append("offsets[N] != number of observations")
    if kind == "categorical" and (X.min() < 0 or X.max() >= p["emissionprob"].shape[1]):
        problems.append("symbol out of range")
    if kind == "gaussian" and (X.shape[1] != p["means"].shape[1] or not np.isfinite(X).all()):
        problems.append("bad feature rows")
    if labels is None or labels.shape != (len(X),) or labels.min() < 0 or labels.max() >= K:
        problems.append("labels missing or out of range")
    t.add(case, "sample file", 0.0 if not problems else 1.0, 0.0, not problems, "; ".join(problems))


def check_infer(t, case, kind, p, data_path, out_path):
    X, off, _ = read_data(data_path)
    m = make_hmmlearn(kind, p)
    with h5py.File(out_path, "r") as f:
        o_off = f["offsets"][()]
        ll = f["log_likelihood"][()]
        vlp = f["viterbi_log_prob"][()]
        states = f["states"][()]
        post = f["posteriors"][()] if "posteriors" in f else None
    N = len(off) - 1
    shape_ok = (np.array_equal(o_off, off) and ll.shape == (N,) and vlp.shape == (N,)
                and states.shape == (len(X),) and post is not None and post.shape == (len(X), m.n_components))
    if not t.add(case, "infer output layout", 0.0 if shape_ok else 1.0, 0.0, shape_ok,
                 "" if shape_ok else "offsets/shapes differ from the format doc"):
        return

    ll_h, vlp_h = np.empty(N), np.empty(N)
    mismatched, ties, wrong, post_err, self_err = 0, 0, 0, 0.0, 0.0
    for i in range(N):
        a, b = off[i], off[i + 1]
        Xi = X[a:b]
        ll_h[i] = m.score(Xi)
        vlp_h[i], path_h = m.decode(Xi, algorithm="viterbi")
        post_err = max(post_err, abs_err(post[a:b], m.predict_proba(Xi)))
        path_t = states[a:b]
        # trellis' reported Viterbi log-prob must be the score of the path it returned
        self_err = max(self_err, rel_err(path_log_prob(kind, p, Xi, path_t), vlp[i]))
        if not np.array_equal(path_t, path_h):
            mismatched += 1
            if rel_err(path_log_prob(kind, p, Xi, path_t), vlp_h[i]) <= TIE_RTOL:
                ties += 1
            else:
                wrong += 1
    t.add(case, "log-likelihood (rel)", rel_err(ll, ll_h), LL_RTOL, rel_err(ll, ll_h) <= LL_RTOL)
    t.add(case, "viterbi log-prob (rel)", rel_err(vlp, vlp_h), LL_RTOL, rel_err(vlp, vlp_h) <= LL_RTOL)
    t.add(case, "viterbi path = its log-prob (rel)", self_err, LL_RTOL, self_err <= LL_RTOL)
    t.add(case, "viterbi paths differing", float(wrong), 0.0, wrong == 0,
          f"{N - mismatched}/{N} identical, {ties} ties")
    t.add(case, "posteriors (abs)", post_err, POST_ATOL, post_err <= POST_ATOL)


def check_fit(t, case, kind, init_path, data_path, fitted_path, iterations):
    X, off, _ = read_data(data_path)
    _, p0 = read_model(init_path)
    m = make_hmmlearn(kind, p0, n_iter=iterations)
    m.fit(X, lengths=np.diff(off))
    hist_h = np.array(m.monitor_.history, dtype=np.float64)  # log P(data) before each M-step
    _, pt = read_model(fitted_path)
    hist_t = pt.get("log_likelihood_history", np.empty(0))
    e = rel_err(hist_t, hist_h)
    t.add(case, "EM log_likelihood_history (rel)", e, HIST_RTOL, e <= HIST_RTOL,
          f"{len(hist_t)} vs {len(hist_h)} entries, last {hist_h[-1]:.6f}")
    for name, v in hmmlearn_params(kind, m).items():
        e = abs_err(pt[name], v)
        t.add(case, f"EM {name} (abs)", e, PARAM_ATOL, e <= PARAM_ATOL)


def check_mode(args, wd):
    t = Table()
    cases = [("categorical", ["--symbols", 12], 5), ("gaussian", ["--features", 3], 4)]
    n_seq, max_len, min_len, iters = 40, 60, 1, 10
    devices = ["cpu"] + (["cuda"] if args.cuda else [])
    for kind, shape, K in cases:
        model, init = wd / f"{kind}_model.h5", wd / f"{kind}_init.h5"
        data, fitted = wd / f"{kind}_data.h5", wd / f"{kind}_fitted.h5"
        run_trellis(args.trellis, "init", "--states", K, *shape, "--seed", args.seed, "--output", model)
        run_trellis(args.trellis, "sample", "--model", model, "--output", data, "--sequences", n_seq,
                    "--length", max_len, "--min-length", min_len, "--seed", args.seed + 1)
        k, p = read_model(model)
        with h5py.File(model, "r") as f:
            fmt = as_str(f.attrs.get("format", ""))
        good = k == kind and fmt == "trellis-hmm"
        if not t.add(kind, "model attrs", 0.0 if good else 1.0, 0.0, good, f"format={fmt} emission={k}"):
            continue
        check_sample(t, kind, data, kind, p, n_seq, max_len, min_len)
        for dev in devices:
            out = wd / f"{kind}_infer_{dev}.h5"
            run_trellis(args.trellis, "infer", "--model", model, "--data", data, "--output", out,
                        "--posteriors", "--device", dev)
            check_infer(t, f"{kind}/{dev}", kind, p, data, out)
        # EM from a different random model, so that it has something to learn
        run_trellis(args.trellis, "init", "--states", K, *shape, "--seed", args.seed + 100, "--output", init)
        run_trellis(args.trellis, "fit", "--data", data, "--output", fitted, "--init", init,
                    "--max-iterations", iters, "--tolerance", 0)
        check_fit(t, kind, kind, init, data, fitted, iters)
    t.print()
    print("\nall checks passed" if t.ok else "\nSOME CHECKS FAILED")
    return 0 if t.ok else FAIL


# ---------------------------------------------------------------- bench mode

_RATE = re.compile(r"([0-9][0-9,]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([kKMG]?)\s*tokens/s")


def parse_rate(text):
    """Last `<number>[k|M|G] tokens/s` in trellis' output, or None."""
    found = _RATE.findall(text)
    if not found:
        return None
    num, unit = found[-1]
    return float(num.replace(",", "")) * {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9}[unit]


def machine_info(with_gpu):
    cpu = None
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"platform": platform.platform(), "cpu": cpu, "nproc": os.cpu_count(),
            "python": platform.python_version()}
    if with_gpu and shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        info["gpu"] = q.stdout.strip() or None
    return info


def versions(exe):
    import scipy
    v = {"hmmlearn": hmmlearn.__version__, "numpy": np.__version__, "scipy": scipy.__version__,
         "h5py": h5py.__version__, "trellis": None}
    try:
        q = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
        if q.returncode == 0:
            v["trellis"] = q.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return v


def bench_mode(args, wd):
    devices = ["cpu"] + (["cuda"] if args.cuda else [])
    min_len, max_len = 100, 1000
    n_seq = max(1, math.ceil(args.tokens / ((min_len + max_len) / 2)))
    results = []
    for K in args.states:
        model, data = wd / f"bench_K{K}_model.h5", wd / f"bench_K{K}_data.h5"
        run_trellis(args.trellis, "init", "--states", K, "--symbols", args.symbols,
                    "--seed", args.seed, "--output", model)
        run_trellis(args.trellis, "sample", "--model", model, "--output", data, "--sequences", n_seq,
                    "--length", max_len, "--min-length", min_len, "--seed", args.seed + 1)
        with h5py.File(data, "r") as f:
            off = np.asarray(f["offsets"][()], np.int64)
        total = int(off[-1])

        trellis_rows = {}
        for dev in devices:
            out = wd / f"bench_K{K}_infer_{dev}.h5"
            cmd = ["infer", "--model", model, "--data", data, "--output", out, "--device", dev]
            if args.threads:
                cmd += ["--threads", args.threads]
            best = None
            for _ in range(args.repeat):  # best of N: the first run also pays for page cache / GPU init
                text, wall = run_trellis(args.trellis, *cmd)
                rate = parse_rate(text)
                if best is None or wall < best[0]:
                    best = (wall, rate, text.strip().splitlines()[-1:] if text.strip() else [])
            wall, rate, last = best
            row = {"implementation": f"trellis-{dev}", "states": K, "symbols": args.symbols,
                   "tokens": total, "sequences": len(off) - 1, "threads": args.threads,
                   "wall_s": wall, "tokens_per_s_wall": total / wall,
                   "tokens_per_s_reported": rate, "summary": last[0] if last else None}
            trellis_rows[dev] = (row, out)
            results.append(row)

        # hmmlearn on a prefix of whole sequences (it is single-threaded and slow)
        n_sub = int(np.searchsorted(off, min(args.hmmlearn_tokens, total), side="left"))
        n_sub = max(1, min(n_sub, len(off) - 1))
        X, _, _ = read_data(data, upto=off[n_sub])
        m = make_hmmlearn(*read_model(model))
        seqs = [X[off[i]:off[i + 1]] for i in range(n_sub)]
        t0 = time.perf_counter()
        ll_h = np.array([m.score(s) for s in seqs])
        t1 = time.perf_counter()
        vlp_h = np.array([m.decode(s, algorithm="viterbi")[0] for s in seqs])
        t2 = time.perf_counter()
        sub_tokens = int(off[n_sub])
        h_rate = sub_tokens / (t2 - t0)
        results.append({"implementation": "hmmlearn", "states": K, "symbols": args.symbols,
                        "tokens": sub_tokens, "sequences": n_sub, "threads": 1,
                        "score_s": t1 - t0, "decode_s": t2 - t1, "tokens_per_s": h_rate})

        # Speed is only meaningful if the answers agree; reported, not enforced (see check mode).
        for dev, (row, out) in trellis_rows.items():
            with h5py.File(out, "r") as f:
                row["ll_rel_err_vs_hmmlearn"] = rel_err(f["log_likelihood"][:n_sub], ll_h)
                row["viterbi_rel_err_vs_hmmlearn"] = rel_err(f["viterbi_log_prob"][:n_sub], vlp_h)
            basis = row["tokens_per_s_reported"] or row["tokens_per_s_wall"]
            row["ratio_vs_hmmlearn"] = basis / h_rate
            row["ratio_basis"] = "reported" if row["tokens_per_s_reported"] else "wall"
            if max(row["ll_rel_err_vs_hmmlearn"], row["viterbi_rel_err_vs_hmmlearn"]) > LL_RTOL:
                print(f"WARNING: trellis-{dev} K={K} disagrees with hmmlearn beyond {LL_RTOL:g} (relative)")

    print(f"\n{'implementation':<14} {'K':>5} {'tokens':>11} {'tokens/s':>12} {'wall tok/s':>12} "
          f"{'x hmmlearn':>10} {'LL rel err':>10} {'Vit rel err':>11}")
    for r in results:
        if r["implementation"] == "hmmlearn":
            print(f"{'hmmlearn':<14} {r['states']:>5} {r['tokens']:>11} {r['tokens_per_s']:>12.4g} "
                  f"{'':>12} {'1':>10} {'':>10}")
        else:
            rep = r["tokens_per_s_reported"]
            print(f"{r['implementation']:<14} {r['states']:>5} {r['tokens']:>11} "
                  f"{(f'{rep:.4g}' if rep else '-'):>12} {r['tokens_per_s_wall']:>12.4g} "
                  f"{r['ratio_vs_hmmlearn']:>10.3g} {r['ll_rel_err_vs_hmmlearn']:>10.1e} "
                  f"{r['viterbi_rel_err_vs_hmmlearn']:>11.1e}")
    print("(trellis tokens/s: as reported by `trellis hmm infer`; wall: whole process incl. file I/O;"
          " hmmlearn: score + decode, one thread, data in memory)")

    if args.json:
        doc = {"machine": machine_info(args.cuda), "versions": versions(args.trellis),
               "config": {"symbols": args.symbols, "tokens": args.tokens, "lengths": [min_len, max_len],
                          "hmmlearn_tokens": args.hmmlearn_tokens, "seed": args.seed, "repeat": args.repeat},
               "results": results}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", choices=["check", "bench"], default="check")
    ap.add_argument("--trellis", required=True, help="path to the trellis binary")
    ap.add_argument("--workdir", help="where to keep the HDF5 files (default: a temporary directory, removed)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cuda", action="store_true", help="also run `infer --device cuda`")
    b = ap.add_argument_group("bench")
    b.add_argument("--states", type=int, nargs="+", default=[64], help="K values to benchmark")
    b.add_argument("--symbols", type=int, default=10_000)
    b.add_argument("--tokens", type=int, default=10_000_000, help="tokens sampled for trellis")
    b.add_argument("--hmmlearn-tokens", type=int, default=200_000, help="prefix scored by hmmlearn")
    b.add_argument("--threads", type=int, help="passed to `trellis hmm infer --threads`")
    b.add_argument("--repeat", type=int, default=1, help="trellis runs per device, best kept")
    b.add_argument("--json", help="write the bench results here")
    args = ap.parse_args()
    args.trellis = str(Path(args.trellis).resolve()) if os.sep in args.trellis else args.trellis

    wd = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="trellis-hmmlearn-"))
    wd.mkdir(parents=True, exist_ok=True)
    try:
        return (check_mode if args.mode == "check" else bench_mode)(args, wd)
    except TrellisError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return FAIL
    finally:
        if not args.workdir:
            shutil.rmtree(wd, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
