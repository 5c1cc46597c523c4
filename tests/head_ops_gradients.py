"""Gradients of the head's PyTorch operators against PyTorch on materialised logits (float64, random inputs):
linear_logsumexp, token_logprobs (log-probabilities and entropy, with ignored targets, bias, soft-cap and a sampling
temperature), each with respect to x, weight and bias, through the slab route and small slabs (chunk_bytes);
linear_cross_entropy at a temperature, values and gradients under each reduction; temperatures that are not positive
finite numbers refused; the vocabulary-parallel operators at a temperature (one Gloo rank, CPU) against the
single-device ones; torch.autograd.gradcheck on tiny cases.

    python tests/head_ops_gradients.py --library build/bindings/libtrellis_ops.so [--device cuda]
"""
import argparse
import itertools

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


def reference_logits(x, w, b, softcap, temperature=1.0):
    z = x @ w.t()
    if b is not None:
        z = z + b
    return (softcap * torch.tanh(z / softcap) if softcap else z) / temperature


def compare(name, got, expected, tolerance):
    error = (got - expected).abs().max().item() / max(1.0, expected.abs().max().item())
    if not error <= tolerance:
        raise SystemExit(f"{name}: relative error {error:.3e} > {tolerance}")
    return error


worst = 0.0
targets = torch.randint(0, V, (N,), device=args.device)
targets[::4] = -100
cases = 0
for bias, softcap, chunk_bytes, temperature in itertools.product(
        (False, True), (None, 3.0), (0, 3 * V * 4), (1.0, 0.6, 1.7)):  # slabs: the default, and three rows
    # Random upstream gradients for each output, so that every term of every gradient counts.
    g_lse, g_lp, g_h = (torch.randn(N, dtype=torch.float64, device=args.device) for _ in range(3))
    for what in ("lse", "logprob", "entropy", "logprob+entropy"):
        x, w, b = leaves(torch.float64, bias)
        if what == "lse":
            out = (ops.linear_logsumexp(x, w, bias=b, softcap=softcap, chunk_bytes=chunk_bytes,
                                        temperature=temperature) * g_lse).sum()
        else:
            lp, h = ops.token_logprobs(x, w, targets, bias=b, softcap=softcap, entropy="entropy" in what,
                                       chunk_bytes=chunk_bytes, temperature=temperature)
            out = (lp * g_lp).sum() if "logprob" in what else 0
            if "entropy" in what:
                out = out + (h * g_h).sum()
        out.backward()
        got = [p.grad for p in (x, w, b) if p is not None]
        rx, rw, rb = (p.detach().clone().requires_grad_() if p is not None else None for p in (x, w, b))
        z = reference_logits(rx, rw, rb, softcap, temperature)
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
            worst = max(worst, compare(f"{what} d{name} (bias={bias}, softcap={softcap}, chunk={chunk_bytes}, "
                                       f"temperature={temperature})", g, e, 1e-10))
        cases += 1

# The loss at a temperature: F.cross_entropy (with label smoothing, soft-cap and z-loss) of the tempered logits.
for bias, reduction, recompute, temperature in itertools.product((False, True), ("none", "sum", "mean"), (False, True),
                                                                 (0.6, 1.7)):
    x, w, b = leaves(torch.float64, bias)
    kwargs = {"reduction": reduction, "label_smoothing": 0.1, "softcap": 4.0, "z_loss": 1e-2,
              "chunk_bytes": 3 * V * 4, "recompute_logits": recompute, "temperature": temperature}
    loss = ops.linear_cross_entropy(x, w, targets, bias=b, **kwargs)
    rx, rw, rb = (p.detach().clone().requires_grad_() if p is not None else None for p in (x, w, b))
    z = reference_logits(rx, rw, rb, 4.0, temperature)
    valid = targets != -100
    z_term = 1e-2 * torch.logsumexp(z, -1) ** 2 * valid
    ref = torch.nn.functional.cross_entropy(z, targets, reduction=reduction, label_smoothing=0.1)
    ref = ref + (z_term if reduction == "none" else z_term.sum() / (valid.sum() if reduction == "mean" else 1))
    g_out = torch.randn_like(ref)
    where = f"linear_cross_entropy (bias={bias}, {reduction}, recompute={recompute}, temperature={temperature})"
    worst = max(worst, compare(f"{where} loss", loss.detach(), ref.detach(), 1e-10))
    (loss * g_out).sum().backward()
    (ref * g_out).sum().backward()
    for name, p, r in zip(("x", "weight", "bias"), (x, w, b), (rx, rw, rb)):
        if p is not None:
            worst = max(worst, compare(f"{where} d{name}", p.grad, r.grad, 1e-10))
    cases += 1

# A temperature that is not a positive finite number is an error naming it, from every operator and its Meta kernel.
x, w, b = leaves(torch.float64, True)
for device in (args.device, "meta"):
    xd, wd = x.detach().to(device), w.detach().to(device)
    td = targets.to(device)
    for temperature in (0.0, -1.0, float("nan"), float("inf")):
        for call in (lambda: ops.linear_logsumexp(xd, wd, temperature=temperature),
                     lambda: ops.token_logprobs(xd, wd, td, temperature=temperature),
                     lambda: ops.linear_cross_entropy(xd, wd, td, temperature=temperature)):
            try:
                call()
            except RuntimeError as e:
                if "temperature must be a positive finite number" not in str(e):
                    raise
            else:
                raise SystemExit(f"temperature {temperature} was accepted on {device}")

# The vocabulary-parallel operators take the temperature the same way: one Gloo rank holding the whole vocabulary
# against the single-device operators (checked above against the reference).
if args.device == "cpu":
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD.group_name
    x, w, b = leaves(torch.float64, True)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    for temperature in (0.6, 1.7):
        pairs = [(ops.vocab_parallel_linear_logsumexp(xd, wd, group, bias=bd, softcap=3.0, temperature=temperature),
                  ops.linear_logsumexp(xd, wd, bias=bd, softcap=3.0, temperature=temperature))]
        pairs += zip(ops.vocab_parallel_token_logprobs(xd, wd, targets, group, bias=bd, entropy=True,
                                                       temperature=temperature),
                     ops.token_logprobs(xd, wd, targets, bias=bd, entropy=True, temperature=temperature))
        for reduction in ("none", "mean"):
            grads = []
            for loss, group_arg in ((ops.vocab_parallel_linear_cross_entropy, (group,)),
                                    (ops.linear_cross_entropy, ())):
                leaf = [p.detach().clone().requires_grad_() for p in (x, w, b)]
                value = loss(leaf[0], leaf[1], targets, *group_arg, bias=leaf[2], reduction=reduction, softcap=3.0,
                             temperature=temperature)
                grads.append([value.detach()] + list(torch.autograd.grad(value.sum(), leaf)))
            pairs += zip(*grads)
        for i, (got, expected) in enumerate(pairs):
            worst = max(worst, compare(f"vocabulary-parallel result {i} (temperature={temperature})", got, expected,
                                       1e-12))
            cases += 1
    dist.destroy_process_group()

# gradcheck: finite differences of the operators themselves.
x = torch.randn(3, 4, dtype=torch.float64, device=args.device, requires_grad=True)
w = torch.randn(7, 4, dtype=torch.float64, device=args.device, requires_grad=True)
b = torch.randn(7, dtype=torch.float64, device=args.device, requires_grad=True)
small_targets = torch.tensor([1, -100, 6], device=args.device)
torch.autograd.gradcheck(lambda x, w, b: ops.linear_logsumexp(x, w, bias=b, softcap=2.0), (x, w, b))
torch.autograd.gradcheck(lambda x, w, b: ops.token_logprobs(x, w, small_targets, bias=b, entropy=True), (x, w, b))
torch.autograd.gradcheck(lambda x, w, b: ops.token_logprobs(x, w, small_targets, bias=b, softcap=2.0, entropy=True,
                                                            temperature=0.7), (x, w, b))
torch.autograd.gradcheck(lambda x, w, b: ops.linear_cross_entropy(x, w, small_targets, bias=b, reduction="none",
                                                                  temperature=1.3), (x, w, b))
print(f"head operator gradients: {cases} cases match PyTorch on materialised logits (max relative error {worst:.1e}); "
      "gradcheck passed")
