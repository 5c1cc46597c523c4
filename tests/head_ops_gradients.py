"""Gradients of the head's PyTorch operators against PyTorch on materialised logits (float64, random inputs):
linear_logsumexp, token_logprobs (log-probabilities and entropy, with ignored targets, bias and soft-cap), each with
respect to x, weight and bias, through the slab route and small slabs (chunk_bytes); torch.autograd.gradcheck on a
tiny case.

    python tests/head_ops_gradients.py --library build/lib/libtrellis_ops.so [--device cuda]
"""
import argparse

import torch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--library", required=True, help="path to libtrellis_ops.so")
parser.add_argument("--device", default="cpu")
args = parser.parse_args()
if args.device == "cuda" and not torch.cuda.is_available():
    raise SystemExit(77)
torch.ops.load_library(args.library)
ops = torch.ops.trellis
torch.manual_seed(1)
N, D, V = 37, 16, 211


def leaves(dtype, bias):
    x = torch.randn(N, D, dtype=dtype, device=args.device, requires_grad=True)
    w = (torch.randn(V, D, dtype=dtype, device=args.device) * 0.7).requires_grad_()
    b = torch.randn(V, dtype=dtype, device=args.device, requires_grad=True) if bias else None
    return x, w, b


def reference_logits(x, w, b, softcap):
    z = x @ w.t()
    if b is not None:
        z = z + b
    return softcap * torch.tanh(z / softcap) if softcap else z


def compare(name, got, expected, tolerance):
    error = (got - expected).abs().max().item() / max(1.0, expected.abs().max().item())
    if not error <= tolerance:
        raise SystemExit(f"{name}: relative error {error:.3e} > {tolerance}")
    return error


worst = 0.0
targets = torch.randint(0, V, (N,), device=args.device)
targets[::4] = -100
cases = 0
for bias in (False, True):
    for softcap in (None, 3.0):
        for chunk_bytes in (0, 3 * V * 4):  # the default slab, and slabs of three rows
            # Random upstream gradients for each output, so that every term of every gradient counts.
            g_lse, g_lp, g_h = (torch.randn(N, dtype=torch.float64, device=args.device) for _ in range(3))
            for what in ("lse", "logprob", "entropy", "logprob+entropy"):
                x, w, b = leaves(torch.float64, bias)
                if what == "lse":
                    out = (ops.linear_logsumexp(x, w, bias=b, softcap=softcap, chunk_bytes=chunk_bytes) * g_lse).sum()
                else:
                    lp, h = ops.token_logprobs(x, w, targets, bias=b, softcap=softcap, entropy="entropy" in what,
                                               chunk_bytes=chunk_bytes)
                    out = (lp * g_lp).sum() if "logprob" in what else 0
                    if "entropy" in what:
                        out = out + (h * g_h).sum()
                out.backward()
                got = [p.grad for p in (x, w, b) if p is not None]
                rx, rw, rb = (p.detach().clone().requires_grad_() if p is not None else None for p in (x, w, b))
                z = reference_logits(rx, rw, rb, softcap)
                log_p = torch.log_softmax(z, -1)
                if what == "lse":
                    ref = (torch.logsumexp(z, -1) * g_lse).sum()
                else:
                    valid = targets != -100
                    lp = log_p.gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1) * valid
                    ref = (lp * g_lp).sum() if "logprob" in what else 0
                    if "entropy" in what:
                        ref = ref + (-(log_p.exp() * log_p).sum(-1) * g_h).sum()
                ref.backward()
                expected = [p.grad for p in (rx, rw, rb) if p is not None]
                for name, g, e in zip(("x", "weight", "bias"), got, expected):
                    worst = max(worst, compare(f"{what} d{name} (bias={bias}, softcap={softcap}, chunk={chunk_bytes})",
                                               g, e, 1e-10))
                cases += 1

# gradcheck: finite differences of the operators themselves.
x = torch.randn(3, 4, dtype=torch.float64, device=args.device, requires_grad=True)
w = torch.randn(7, 4, dtype=torch.float64, device=args.device, requires_grad=True)
b = torch.randn(7, dtype=torch.float64, device=args.device, requires_grad=True)
small_targets = torch.tensor([1, -100, 6], device=args.device)
torch.autograd.gradcheck(lambda x, w, b: ops.linear_logsumexp(x, w, bias=b, softcap=2.0), (x, w, b))
torch.autograd.gradcheck(lambda x, w, b: ops.token_logprobs(x, w, small_targets, bias=b, entropy=True), (x, w, b))
print(f"head operator gradients: {cases} cases match PyTorch on materialised logits (max relative error {worst:.1e}); "
      "gradcheck passed")
