"""The PyTorch operators under torch.compile: torch.library.opcheck on each (schema, fake-tensor Meta kernels against
the real ones, autograd registration, and AOT dispatch with static and dynamic shapes), then a training step whose
forward is compiled with fullgraph=True (operators among other work) against the same step run eagerly.

    python tests/torch_ops_compile.py --library build/bindings/libtrellis_ops.so [--device cuda] [--backend inductor]
"""
import argparse

import torch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--library", required=True, help="path to libtrellis_ops.so")
parser.add_argument("--device", default="cpu")
parser.add_argument("--backend", default="aot_eager", help="torch.compile backend for the training step")
args = parser.parse_args()
if args.device == "cuda" and not torch.cuda.is_available():
    raise SystemExit(77)  # skipped (CTest's SKIP_RETURN_CODE) where there is no GPU
torch.ops.load_library(args.library)
ops = torch.ops.trellis
torch.manual_seed(0)
N, D, V = 24, 20, 103  # V prime, nothing a multiple of a tile
dtypes = [torch.float32, torch.float64] + ([torch.bfloat16] if args.device == "cuda" else [])


def inputs(dtype, bias, grad=True):
    x = torch.randn(2, N // 2, D, device=args.device, dtype=dtype)
    w = (torch.randn(V, D, device=args.device) / D**0.5).to(dtype)
    b = torch.randn(V, device=args.device).to(dtype) if bias else None
    t = torch.randint(0, V, (2, N // 2), device=args.device)
    t[0, ::5] = -100
    for p in (x, w, b):
        if p is not None:
            p.requires_grad_(grad)
    return x, w, t, b


checked = 0
for dtype in dtypes:
    for bias in (False, True):
        x, w, t, b = inputs(dtype, bias)
        xi, wi, bi = x.detach(), w.detach(), None if b is None else b.detach()
        torch.library.opcheck(ops.linear_logsumexp.default, (xi, wi), {"bias": bi, "softcap": 15.0})
        torch.library.opcheck(ops.token_logprobs.default, (xi, wi, t), {"bias": bi, "entropy": True})
        # With inputs that require gradients: the Autograd kernels and _head_statistics_backward.
        torch.library.opcheck(ops.linear_logsumexp.default, (x, w), {"bias": b, "softcap": 15.0})
        # At a sampling temperature: the inputs divided by it (through autograd) before the operator proper.
        torch.library.opcheck(ops.linear_logsumexp.default, (x, w), {"bias": b, "softcap": 15.0, "temperature": 0.7})
        torch.library.opcheck(ops.token_logprobs.default, (xi, wi, t), {"bias": bi, "temperature": 1.5})
        for entropy in (False, True):
            torch.library.opcheck(ops.token_logprobs.default, (x, w, t), {"bias": b, "entropy": entropy})
            torch.library.opcheck(ops.token_logprobs.default, (x, w, t),
                                  {"bias": b, "entropy": entropy, "temperature": 0.7})
        for reduction in ("mean", "sum", "none"):
            for recompute in (False, True):
                kwargs = {"bias": b, "reduction": reduction, "label_smoothing": 0.1, "z_loss": 1e-3,
                          "softcap": 20.0, "recompute_logits": recompute, "temperature": 0.5 if recompute else 1.0}
                torch.library.opcheck(ops.linear_cross_entropy.default, (x, w, t), kwargs)
                # Inference mode skips autograd: the operator's own kernels (real and Meta) answer.
                with torch.inference_mode():
                    torch.library.opcheck(ops.linear_cross_entropy.default, (xi, wi, t), {**kwargs, "bias": bi},
                                          test_utils=("test_schema", "test_faketensor"))
                checked += 1
print(f"opcheck: {checked} linear_cross_entropy cases and both inference operators passed, at temperatures too")


def head(x, w, t, b):
    loss = ops.linear_cross_entropy(x * 0.5, w, t, bias=b, label_smoothing=0.1, z_loss=1e-4)
    logprobs, entropy = ops.token_logprobs(x, w, t, bias=b, entropy=True, temperature=0.8)
    lse = ops.linear_logsumexp(x * 2, w, bias=b)
    return loss * 2 - 0.1 * logprobs.mean() + 0.01 * entropy.mean() + 1e-3 * lse.mean(), logprobs


def step(head, x, w, t, b):  # torch.compile takes the forward; its backward runs the compiled backward graph
    loss, logprobs = head(x, w, t, b)
    loss.backward()
    return loss.detach(), logprobs


compiled = torch.compile(head, fullgraph=True, backend=args.backend, dynamic=True)
worst = 0.0
for dtype in dtypes:
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    eager_inputs, compiled_inputs = inputs(dtype, True), inputs(dtype, True)
    with torch.no_grad():
        for a, c in zip(eager_inputs, compiled_inputs):
            if a is not None and a.is_floating_point():
                c.copy_(a)
    compiled_inputs[2].copy_(eager_inputs[2])
    expected, got = step(head, *eager_inputs), step(compiled, *compiled_inputs)
    pairs = list(zip(expected, got)) + [(a.grad, c.grad) for a, c in zip(eager_inputs, compiled_inputs)
                                        if a is not None and a.is_floating_point()]
    for e, g in pairs:
        error = (e.double() - g.double()).abs().max().item()
        worst = max(worst, error)
        if not error <= tolerance:
            raise SystemExit(f"compiled step differs from eager ({dtype}): {error:.3e} > {tolerance}")
print(f"torch.compile (fullgraph, {args.backend}, dynamic shapes): loss, log-probs and gradients match eager, "
      f"max |difference| {worst:.2e}")
