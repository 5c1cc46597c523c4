"""bench/hmm_lm.sh's report: reads its fit-K.log and infer-K.log files, writes OUT_DIR/hmm_lm.json and, where
matplotlib is installed, OUT_DIR/hmm_lm.png (dev perplexity and seconds per EM iteration against the number of states).

Usage: python3 bench/hmm_lm_report.py OUT_DIR COMMIT DEVICE PRECISION SMOOTHING K...
"""
import datetime
import json
import math
import re
import statistics
import sys
from pathlib import Path


def row(out, k, device, precision):
    """One K's results from `hmm fit` ("data: N sequences, M tokens", "iter i  log-likelihood X  per token Y  S s")
    and `hmm infer` ("... log-likelihood X (Y per token) ...")."""
    fit = (out / f"fit-{k}.log").read_text()
    tokens = int(re.search(r"^data: \d+ sequences, (\d+) tokens", fit, re.M).group(1))
    iterations = [(float(per_token), float(seconds)) for per_token, seconds in
                  re.findall(r"^iter \d+\s+log-likelihood \S+\s+per token (\S+)\s+(\S+) s", fit, re.M)]
    # The first iteration also pays for set-up (allocations, the kernels' first launches).
    seconds = statistics.median(s for _, s in iterations[1:]) if len(iterations) > 1 else iterations[0][1]
    dev = float(re.search(r"\((\S+) per token\)", (out / f"infer-{k}.log").read_text()).group(1))
    return {"workload": "hmm fit (EM)", "shape": f"K={k}", "device": device, "precision": precision,
            "iterations": len(iterations), "seconds_per_iteration": seconds, "tokens_per_s": round(tokens / seconds),
            "train_loglik_per_token": iterations[-1][0], "dev_loglik_per_token": dev,
            "dev_perplexity": round(math.exp(-dev), 2)}


def plot(results, target):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    states = [int(r["shape"].removeprefix("K=")) for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.plot(states, [r["dev_perplexity"] for r in rows], "o-")
    left.set(xscale="log", xlabel="states K", ylabel="dev perplexity", title="HMM language model, UD English-EWT")
    right.plot(states, [r["seconds_per_iteration"] for r in rows], "o-")
    right.set(xscale="log", yscale="log", xlabel="states K", ylabel="seconds per EM iteration",
              title=f"{rows[0]['device']}, {rows[0]['precision']}")
    for axis in (left, right):
        axis.set_xticks(states, [str(k) for k in states])
        axis.grid(alpha=0.3)
    fig.suptitle(f"commit {results['commit']}, {results['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=120)


def main(out, commit, device, precision, smoothing, *states):
    out = Path(out)
    results = {"commit": commit, "date": datetime.date.today().isoformat(),
               "data": "UD English-EWT words (train / dev), words seen once as <unk>", "smoothing": float(smoothing),
               "rows": [row(out, int(k), device, precision) for k in states]}
    (out / "hmm_lm.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    try:
        plot(results, out / "hmm_lm.png")
    except ImportError:
        print("no plot: matplotlib is not installed", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
