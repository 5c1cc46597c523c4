"""The structured-prediction operators (bindings/torch/torch_ops_structured.cpp) against plain PyTorch: log_matmul and
max_matmul against logsumexp/max of broadcast sums; the CRF and HMM operators against enumeration of every label
sequence at tiny sizes in float64 (log Z, log-likelihood, marginals, Viterbi, k-best, constraints, masks, lengths,
time-first layouts); gradcheck on the differentiable ones; bfloat16 emissions, mixed dtypes, bad masks; then
torch.library.opcheck on every operator and a CRF loss whose forward is compiled with fullgraph=True and dynamic shapes,
against the same loss run eagerly.

    python tests/torch_ops_structured.py --library build/bindings/libtrellis_ops.so [--device cuda] [--backend inductor]
"""
import argparse
import itertools
import math

import torch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--library", required=True, help="path to libtrellis_ops.so")
parser.add_argument("--device", default="cpu")
parser.add_argument("--backend", default="aot_eager", help="torch.compile backend for the compiled loss")
args = parser.parse_args()
if args.device == "cuda" and not torch.cuda.is_available():
    raise SystemExit(77)  # skipped (CTest's SKIP_RETURN_CODE) where there is no GPU
torch.ops.load_library(args.library)
ops = torch.ops.trellis
dev = args.device
torch.manual_seed(0)
f64 = dict(device=dev, dtype=torch.float64)
# CUDA's float64 atomics may sum in any order: gradcheck's two backward runs then differ in the last bits.
nondet_tol = 1e-12 if dev == "cuda" else 0.0


def close(name, got, expected, tol):
    got, expected = got.detach().double().cpu(), expected.detach().double().cpu()
    if got.shape != expected.shape:
        raise SystemExit(f"{name}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    both_inf = torch.isinf(got) & torch.isinf(expected) & (got.sign() == expected.sign())
    error = torch.where(both_inf, torch.zeros_like(got), (got - expected).abs())
    worst = error.nan_to_num(math.inf).max().item() if error.numel() else 0.0
    if not worst <= tol:
        raise SystemExit(f"{name}: max |difference| {worst:.3e} > {tol:.1e}\n got {got}\n expected {expected}")


def equal(name, got, expected):
    if not torch.equal(got.cpu(), expected.cpu()):
        raise SystemExit(f"{name}: got {got.tolist()}, expected {expected.tolist()}")


def raises(name, message, fn):
    try:
        fn()
    except RuntimeError as e:
        if message not in str(e):
            raise SystemExit(f"{name}: error {str(e)!r} lacks {message!r}")
        return
    raise SystemExit(f"{name}: no error (expected one saying {message!r})")


# ---- semiring matrix products ----

def log_matmul_reference(a, b):
    return torch.logsumexp(a.unsqueeze(-1) + b.unsqueeze(-3), dim=-2)


def max_matmul_reference(a, b):
    return torch.amax(a.unsqueeze(-1) + b.unsqueeze(-3), dim=-2)


shapes = [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((3, 4), (2, 4, 5)), ((2, 1, 3, 4), (5, 4, 6)), ((1, 3, 4), (2, 4, 2)),
          ((2, 3, 1), (2, 1, 3))]
for sa, sb in shapes:
    a, b = torch.randn(*sa, **f64) * 3, torch.randn(*sb, **f64) * 3
    close(f"log_matmul {sa}x{sb}", ops.log_matmul(a, b), log_matmul_reference(a, b), 1e-12)
    close(f"max_matmul {sa}x{sb}", ops.max_matmul(a, b), max_matmul_reference(a, b), 1e-12)
    for op in (ops.log_matmul, ops.max_matmul):
        ga, gb = a.clone().requires_grad_(), b.clone().requires_grad_()
        torch.autograd.gradcheck(op, (ga, gb), nondet_tol=nondet_tol)
# Gradients against PyTorch's: the same upstream gradient through the reference.
a, b = torch.randn(2, 3, 7, **f64, requires_grad=True), torch.randn(7, 4, **f64, requires_grad=True)
g = torch.randn(2, 3, 4, **f64)
for op, ref in ((ops.log_matmul, log_matmul_reference), (ops.max_matmul, max_matmul_reference)):
    got = torch.autograd.grad(op(a, b), (a, b), g)
    expected = torch.autograd.grad(ref(a, b), (a, b), g)
    for name, x, y in zip(("a", "b"), got, expected):
        close(f"{op} gradient w.r.t. {name}", x, y, 1e-12)
# Inner size from 128 on takes the library's scaled GEMM path: still exact.
a, b = torch.randn(3, 5, 130, **f64) * 20, torch.randn(130, 6, **f64) * 20
close("log_matmul K=130", ops.log_matmul(a, b), log_matmul_reference(a, b), 1e-10)
# -inf: rows with nothing allowed give -inf and a zero gradient, never NaN.
a = torch.randn(2, 3, 4, **f64)
a[0, 1] = -math.inf
b = torch.randn(4, 5, **f64)
b[:, 2] = -math.inf
for op, ref in ((ops.log_matmul, log_matmul_reference), (ops.max_matmul, max_matmul_reference)):
    ga = a.clone().requires_grad_()
    c = op(ga, b)
    close(f"{op} with -inf", c, ref(a, b), 1e-12)
    c.sum().backward()
    if not torch.isfinite(ga.grad).all() or ga.grad[0, 1].abs().sum() != 0:
        raise SystemExit(f"{op}: gradient through -inf rows is {ga.grad}")
# Half precision and mixed dtypes: computed in float32 (float64 when either operand is), gradients in each one's dtype.
a32, b32 = torch.randn(2, 3, 4, device=dev), torch.randn(4, 5, device=dev)
ab, bb = a32.bfloat16().requires_grad_(), b32.half().requires_grad_()
c = ops.log_matmul(ab, bb)
if c.dtype != torch.float32:
    raise SystemExit(f"log_matmul of bfloat16 and float16: {c.dtype}, expected float32")
close("log_matmul bfloat16 x float16", c, log_matmul_reference(ab.float(), bb.float()), 1e-5)
c.sum().backward()
if ab.grad.dtype != torch.bfloat16 or bb.grad.dtype != torch.float16:
    raise SystemExit(f"log_matmul gradient dtypes {ab.grad.dtype}, {bb.grad.dtype}")
c = ops.max_matmul(a32, b32.double())
if c.dtype != torch.float64:
    raise SystemExit(f"max_matmul float32 x float64: {c.dtype}")
raises("log_matmul inner sizes", "inner sizes differ", lambda: ops.log_matmul(a32, torch.randn(5, 4, device=dev)))
raises("log_matmul batch", "do not broadcast",
       lambda: ops.log_matmul(torch.randn(2, 3, 4, device=dev), torch.randn(3, 4, 5, device=dev)))
raises("log_matmul integer", "must be float16, bfloat16, float32 or float64",
       lambda: ops.log_matmul(torch.ones(3, 4, dtype=torch.long, device=dev), b32))
print("log_matmul, max_matmul: values, gradients (gradcheck and against PyTorch), -inf, dtypes and errors")


# ---- linear-chain CRF against enumeration ----

def all_paths(K, L):
    return torch.tensor(list(itertools.product(range(K), repeat=L)), dtype=torch.long).view(-1, L)


def path_scores(em, trans, start, end, L):
    """Scores [P] of every label sequence of length L, and the sequences [P,L] (em [T,K] of one sequence)."""
    K = em.shape[-1]
    paths = all_paths(K, L).to(em.device)
    s = em[torch.arange(L, device=em.device), paths].sum(1) + start[paths[:, 0]] + end[paths[:, -1]]
    if L > 1:
        s = s + trans[paths[:, :-1], paths[:, 1:]].sum(1)
    return s, paths


class Reference:
    """Everything the CRF operators return, by enumeration (batch-first float64 inputs, lengths [B])."""

    def __init__(self, em, trans, start, end, lengths, allowed=None, allowed_start=None, allowed_end=None):
        B, T, K = em.shape
        zero = torch.zeros(K, **f64)
        start = zero if start is None else start
        end = zero if end is None else end
        if allowed is not None:
            trans = trans.masked_fill(~allowed, -math.inf)
        if allowed_start is not None:
            start = start.masked_fill(~allowed_start, -math.inf)
        if allowed_end is not None:
            end = end.masked_fill(~allowed_end, -math.inf)
        self.log_z, self.nodes, self.edges, self.best, self.best_score, self.scores, self.paths = [], [], [], [], [], [], []
        for b in range(B):
            L = int(lengths[b])
            s, paths = path_scores(em[b], trans, start, end, L)
            self.scores.append(s)
            self.paths.append(paths)
            log_z = torch.logsumexp(s, 0)
            self.log_z.append(log_z)
            p = torch.exp(s - log_z) if torch.isfinite(log_z) else torch.zeros_like(s)
            nodes = torch.zeros(T, K, **f64)
            edges = torch.zeros(max(T - 1, 0), K, K, **f64)
            for t in range(L):
                nodes[t].index_add_(0, paths[:, t], p)
            for t in range(L - 1):
                edges[t].view(-1).index_add_(0, paths[:, t] * K + paths[:, t + 1], p)
            self.nodes.append(nodes)
            self.edges.append(edges)
            i = int(torch.argmax(s))
            best = torch.full((T,), -1, dtype=torch.long)
            if torch.isfinite(s[i]):
                best[:L] = paths[i].cpu()
            self.best.append(best)
            self.best_score.append(s[i])
        self.log_z, self.nodes, self.edges = torch.stack(self.log_z), torch.stack(self.nodes), torch.stack(self.edges)
        self.best, self.best_score = torch.stack(self.best), torch.stack(self.best_score)

    def gold(self, em, trans, start, end, tags, lengths):
        out = []
        for b in range(em.shape[0]):
            L = int(lengths[b])
            s, paths = path_scores(em[b], trans, start if start is not None else torch.zeros(em.shape[2], **f64),
                                   end if end is not None else torch.zeros(em.shape[2], **f64), L)
            index = int(sum(int(tags[b, t]) * em.shape[2] ** (L - 1 - t) for t in range(L)))
            out.append(s[index])
        return torch.stack(out)

    def kbest(self, k, T):
        paths, scores = [], []
        for s, p in zip(self.scores, self.paths):
            order = torch.argsort(s, descending=True, stable=True)[:k]
            sc = torch.full((k,), -math.inf, **f64)
            pa = torch.full((k, T), -1, dtype=torch.long)
            for r, i in enumerate(order.tolist()):
                if torch.isfinite(s[i]):
                    sc[r] = s[i]
                    pa[r, :p.shape[1]] = p[i].cpu()
            paths.append(pa)
            scores.append(sc)
        return torch.stack(paths), torch.stack(scores)


B, T, K = 4, 4, 3
em = torch.randn(B, T, K, **f64)
trans, start, end = torch.randn(K, K, **f64), torch.randn(K, **f64), torch.randn(K, **f64)
lengths = torch.tensor([4, 2, 1, 3], device=dev)
mask = torch.arange(T, device=dev).unsqueeze(0) < lengths.unsqueeze(1)
tags = torch.randint(0, K, (B, T), device=dev)
ref = Reference(em, trans, start, end, lengths)
# Every way of giving the sequences' extent: lengths, a bool mask, a uint8 mask, and time-first layouts.
extents = [dict(lengths=lengths), dict(mask=mask), dict(mask=mask.to(torch.uint8))]
for extent in extents:
    for batch_first in (True, False):
        def layout(x):
            return x if batch_first else x.transpose(0, 1).contiguous()
        e = layout(em)
        kw = dict(mask=layout(extent["mask"]) if "mask" in extent else None, lengths=extent.get("lengths"),
                  batch_first=batch_first)
        name = f"{'mask ' + str(extent['mask'].dtype) if 'mask' in extent else 'lengths'}, batch_first={batch_first}"
        close(f"crf_log_partition ({name})", ops.crf_log_partition(e, trans, start, end, **kw), ref.log_z, 1e-12)
        close(f"crf_log_likelihood ({name})", ops.crf_log_likelihood(e, layout(tags), trans, start, end, **kw),
              ref.gold(em, trans, start, end, tags, lengths) - ref.log_z, 1e-12)
        nodes, edges = ops.crf_marginals(e, trans, start, end, edges=True, **kw)
        close(f"crf_marginals nodes ({name})", nodes, layout(ref.nodes), 1e-12)
        close(f"crf_marginals edges ({name})", edges, layout(ref.edges), 1e-12)
        nodes_only, no_edges = ops.crf_marginals(e, trans, start, end, **kw)
        if no_edges.numel() != 0:
            raise SystemExit("crf_marginals without edges returned edges")
        paths, scores = ops.crf_viterbi(e, trans, start, end, **kw)
        equal(f"crf_viterbi paths ({name})", paths, layout(ref.best))
        close(f"crf_viterbi scores ({name})", scores, ref.best_score, 1e-12)
        for k in (1, 5, 81):
            kpaths, kscores = ops.crf_kbest(e, trans, start, end, k=k, **kw)
            expected_paths, expected_scores = ref.kbest(k, T)
            equal(f"crf_kbest k={k} paths ({name})", kpaths,
                  expected_paths if batch_first else expected_paths.permute(2, 0, 1))
            close(f"crf_kbest k={k} scores ({name})", kscores, expected_scores, 1e-12)
# Without start/end scores and without a mask: every sequence has all T steps.
full = torch.full((B,), T, device=dev)
ref_plain = Reference(em, trans, None, None, full)
close("crf_log_partition without start/end", ops.crf_log_partition(em, trans, None, None, None, None), ref_plain.log_z,
      1e-12)
close("crf_log_likelihood without start/end", ops.crf_log_likelihood(em, tags, trans, None, None, None, None),
      ref_plain.gold(em, trans, None, None, tags, full) - ref_plain.log_z, 1e-12)
# Constraints: any K×K allowed mask with allowed starts and ends; a sequence that no allowed path fits.
allowed = torch.rand(K, K, device=dev) < 0.6
allowed[0, 0] = True
allowed_start, allowed_end = torch.tensor([True, False, True], device=dev), torch.tensor([True, True, False], device=dev)
ref_c = Reference(em, trans, start, end, lengths, allowed, allowed_start, allowed_end)
ck = dict(lengths=lengths, allowed=allowed, allowed_start=allowed_start, allowed_end=allowed_end)
close("crf_log_partition constrained", ops.crf_log_partition(em, trans, start, end, None, **ck), ref_c.log_z, 1e-12)
nodes, edges = ops.crf_marginals(em, trans, start, end, None, edges=True, **ck)
close("crf_marginals constrained nodes", nodes, ref_c.nodes, 1e-12)
close("crf_marginals constrained edges", edges, ref_c.edges, 1e-12)
paths, scores = ops.crf_viterbi(em, trans, start, end, None, **ck)
equal("crf_viterbi constrained paths", paths, ref_c.best)
close("crf_viterbi constrained scores", scores, ref_c.best_score, 1e-12)
kpaths, kscores = ops.crf_kbest(em, trans, start, end, None, k=10, **ck)
expected_paths, expected_scores = ref_c.kbest(10, T)
equal("crf_kbest constrained paths", kpaths, expected_paths)
close("crf_kbest constrained scores", kscores, expected_scores, 1e-12)
nothing = dict(lengths=lengths, allowed=torch.zeros(K, K, dtype=torch.uint8, device=dev))
paths, scores = ops.crf_viterbi(em, trans, start, end, None, **nothing)
if not (torch.isinf(scores[lengths > 1]).all() and (paths[lengths > 1] == -1).all()):
    raise SystemExit(f"crf_viterbi with every transition forbidden: {paths}, {scores}")
# A BIO mask: I-X only after B-X or I-X (labels O, B-X, I-X), never first.
bio = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool, device=dev)
bio_start = torch.tensor([True, True, False], device=dev)
paths, _ = ops.crf_viterbi(em * 0 + torch.tensor([0.0, -5.0, 5.0], **f64), trans * 0, None, None, None, None,
                           allowed=bio, allowed_start=bio_start)
if (paths[:, 0] == 2).any() or ((paths[:, :-1] == 0) & (paths[:, 1:] == 2)).any():
    raise SystemExit(f"crf_viterbi under BIO constraints: {paths}")
# An empty batch, with a mask or lengths: empty results.
for kw in (dict(mask=mask[:0], lengths=None), dict(mask=None, lengths=lengths[:0])):
    if ops.crf_log_partition(em[:0], trans, start, end, **kw).shape != (0,) or \
            ops.crf_viterbi(em[:0], trans, start, end, **kw)[0].shape != (0, T):
        raise SystemExit(f"an empty batch ({list(kw)}) gave a non-empty result")
print("CRF operators: log Z, log-likelihood, marginals, Viterbi, k-best against enumeration (masks, lengths, "
      "time-first, constraints)")

# Gradients: gradcheck in float64, with lengths and with a time-first mask; log Z under constraints.
def grad_inputs():
    return [t.clone().requires_grad_() for t in (em, trans, start, end)]


e_, t_, s_, n_ = grad_inputs()
torch.autograd.gradcheck(lambda e, t, s, n: ops.crf_log_likelihood(e, tags, t, s, n, None, lengths), (e_, t_, s_, n_),
                         nondet_tol=nondet_tol)
torch.autograd.gradcheck(lambda e, t, s, n: ops.crf_log_likelihood(e, tags.t(), t, s, n, mask.t(), None,
                                                                   batch_first=False),
                         (e_.detach().transpose(0, 1).contiguous().requires_grad_(), t_, s_, n_), nondet_tol=nondet_tol)
torch.autograd.gradcheck(lambda e, t, s, n: ops.crf_log_partition(e, t, s, n, mask, None, allowed=allowed,
                                                                  allowed_start=allowed_start),
                         (e_, t_, s_, n_), nondet_tol=nondet_tol)
torch.autograd.gradcheck(lambda e, t: ops.crf_log_partition(e, t, None, None, None, lengths), (e_, t_),
                         nondet_tol=nondet_tol)
# The gradient of log Z w.r.t. the emissions is the node marginals (and is zero at padding).
e_ = em.clone().requires_grad_()
ops.crf_log_partition(e_, trans, start, end, None, lengths).sum().backward()
close("d log Z / d emissions = marginals", e_.grad, ref.nodes, 1e-12)


def check_reductions(chain, tags, lengths, what):
    """The reductions of the log-likelihood of chain = (emissions, transitions, start, end) against the unreduced one's,
    with its gradients, under an upstream gradient other than 1."""
    mask = torch.arange(chain[0].shape[1], device=dev).unsqueeze(0) < lengths.unsqueeze(1)
    tokens = {"mask": mask.sum(), "lengths": lengths.sum(), "neither": chain[0].shape[0] * chain[0].shape[1]}
    for given in ("mask", "lengths", "neither"):
        kw = dict(mask=mask if given == "mask" else None, lengths=lengths if given == "lengths" else None)
        for reduction, divide in (("sum", 1), ("mean", chain[0].shape[0]), ("token_mean", tokens[given])):
            plain, reduced = ([t.clone().requires_grad_() for t in chain] for _ in range(2))
            ll = ops.crf_log_likelihood(plain[0], tags, *plain[1:], kw["mask"], kw["lengths"])
            expected = ll.sum() / divide
            got = ops.crf_log_likelihood(reduced[0], tags, *reduced[1:], kw["mask"], kw["lengths"],
                                         reduction=reduction)
            if got.shape != ():
                raise SystemExit(f"crf_log_likelihood reduction={reduction} has shape {tuple(got.shape)}")
            close(f"crf_log_likelihood reduction={reduction} ({given}, {what})", got, expected, 1e-12)
            (2.5 * expected).backward()
            (2.5 * got).backward()
            for name, a, b in zip(("emissions", "transitions", "start", "end"), reduced, plain):
                close(f"d crf_log_likelihood(reduction={reduction}, {given}, {what}) / d {name}", a.grad, b.grad,
                      1e-12)


# Reduced log-likelihoods: of short chains, their gradients formed in the forward pass and scaled in the backward;
# of long ones (256 steps or more, or 128 labels or more: on CUDA the shared-memory and the many-label kernels), the
# library's own autograd, whose backward kernels read the upstream gradient.
check_reductions((em, trans, start, end), tags, lengths, "short chains")
for long_b, long_t, long_k in ((3, 260, 4), (2, 6, 130)):
    long_chain = (torch.randn(long_b, long_t, long_k, **f64), torch.randn(long_k, long_k, **f64),
                  torch.randn(long_k, **f64), torch.randn(long_k, **f64))
    check_reductions(long_chain, torch.randint(0, long_k, (long_b, long_t), device=dev),
                     torch.tensor([long_t, 1, long_t - 3][:long_b], device=dev), f"B,T,K = {long_b},{long_t},{long_k}")
e_, t_, s_, n_ = grad_inputs()
torch.autograd.gradcheck(lambda e, t, s, n: ops.crf_log_likelihood(e, tags, t, s, n, mask, None, reduction="token_mean"),
                         (e_, t_, s_, n_), nondet_tol=nondet_tol)
e_ = em.clone().requires_grad_()  # only the emissions differentiated
ops.crf_log_likelihood(e_, tags, trans, start, end, None, lengths, reduction="mean").backward()
e2 = em.clone().requires_grad_()
ops.crf_log_likelihood(e2, tags, trans, start, end, None, lengths).mean().backward()
close("d crf_log_likelihood(reduction=mean) / d emissions alone", e_.grad, e2.grad, 1e-12)
with torch.no_grad():
    close("crf_log_likelihood reduction=sum without autograd",
          ops.crf_log_likelihood(em, tags, trans, start, end, None, lengths, reduction="sum"),
          ops.crf_log_likelihood(em, tags, trans, start, end, None, lengths).sum(), 1e-12)
print("CRF gradients: gradcheck of log-likelihood and log Z w.r.t. emissions, transitions, start and end")

# Half-precision emissions (accumulated and returned in float32), mixed dtypes (promoted), gradients in input dtypes.
em32 = torch.randn(B, T, K, device=dev)
for low in (torch.bfloat16, torch.float16):
    e_low = em32.to(low).requires_grad_()
    t32 = trans.float().requires_grad_()
    ll = ops.crf_log_likelihood(e_low, tags, t32, start.float(), end.float(), mask, None)
    if ll.dtype != torch.float32:
        raise SystemExit(f"crf_log_likelihood of {low} emissions returned {ll.dtype}")
    expected = ops.crf_log_likelihood(e_low.detach().float(), tags, trans.float(), start.float(), end.float(), mask, None)
    close(f"crf_log_likelihood of {low} emissions", ll, expected, 1e-5)
    ll.sum().backward()
    if e_low.grad.dtype != low or t32.grad.dtype != torch.float32:
        raise SystemExit(f"gradient dtypes {e_low.grad.dtype}, {t32.grad.dtype}")
    nodes, _ = ops.crf_marginals(e_low, trans.float(), None, None, mask, None)
    paths, scores = ops.crf_viterbi(e_low, trans.float(), None, None, mask, None)
    if nodes.dtype != torch.float32 or scores.dtype != torch.float32 or paths.dtype != torch.long:
        raise SystemExit(f"crf_marginals/crf_viterbi of {low}: {nodes.dtype}, {scores.dtype}, {paths.dtype}")
mixed = ops.crf_log_partition(em32, trans, start.float(), None, mask, None)
if mixed.dtype != torch.float64:
    raise SystemExit(f"float32 emissions with float64 transitions gave {mixed.dtype}, expected float64")
close("mixed dtypes", mixed, ops.crf_log_partition(em32.double(), trans, start.float().double(), None, mask, None),
      1e-12)
print("CRF dtypes: bfloat16/float16 emissions in float32, mixed float32/float64 promoted, gradients in input dtypes")

# Bad inputs: clear errors naming the operator and the input.
hole = mask.clone()
hole[0, 2] = False
empty_first = mask.clone()
empty_first[1, 0] = False
bad_tags = tags.clone()
bad_tags[0, 1] = K
for name, message, fn in [
        ("empty first step", "mask of the first timestep must all be on",
         lambda: ops.crf_log_partition(em, trans, None, None, empty_first, None)),
        ("hole", "mask[0][3] is on after an off position", lambda: ops.crf_viterbi(em, trans, None, None, hole, None)),
        ("hole, time-first", "mask[3][0] is on after an off position",
         lambda: ops.crf_log_likelihood(em.transpose(0, 1), tags.t(), trans, None, None, hole.t(), None, False)),
        ("float mask", "mask must be a bool or uint8 tensor",
         lambda: ops.crf_marginals(em, trans, None, None, mask.double(), None)),
        ("mask shape", "mask has shape", lambda: ops.crf_log_partition(em, trans, None, None, mask[:, :3], None)),
        ("mask and lengths", "give a mask or lengths, not both",
         lambda: ops.crf_log_partition(em, trans, None, None, mask, lengths)),
        ("length 0", "lengths[2] = 0 is outside",
         lambda: ops.crf_log_partition(em, trans, None, None, None, torch.tensor([4, 2, 0, 3]))),
        ("float lengths", "lengths must be an integer tensor",
         lambda: ops.crf_log_partition(em, trans, None, None, None, lengths.double())),
        ("tags shape", "tags have shape", lambda: ops.crf_log_likelihood(em, tags[:, :3], trans, None, None, None, None)),
        ("reduction", "reduction must be none, sum, mean or token_mean, got 'avg'",
         lambda: ops.crf_log_likelihood(em, tags, trans, None, None, None, None, reduction="avg")),
        ("transitions shape", "transitions has shape",
         lambda: ops.crf_log_partition(em, torch.randn(K + 1, K + 1, **f64), None, None, None, None)),
        ("integer emissions", "emissions must be float16, bfloat16, float32 or float64",
         lambda: ops.crf_log_partition(tags.unsqueeze(-1), trans, None, None, None, None)),
        ("allowed shape", "allowed has shape",
         lambda: ops.crf_viterbi(em, trans, None, None, None, None, allowed=torch.ones(K, dtype=torch.bool, device=dev))),
        ("allowed dtype", "allowed must be a bool or uint8 tensor",
         lambda: ops.crf_viterbi(em, trans, None, None, None, None, allowed=torch.ones(K, K, device=dev))),
        ("k", "k must be at least 1", lambda: ops.crf_kbest(em, trans, None, None, None, None, 0)),
]:
    raises(name, message, fn)
if dev == "cuda":
    raises("devices", "transitions is on cpu", lambda: ops.crf_log_partition(em, trans.cpu(), None, None, None, None))
    # The CUDA kernels check tags themselves, without waiting for the GPU: the sequence scores NaN, the rest stands.
    bad_score = ops.crf_log_likelihood(em, bad_tags, trans, None, None, None, None)
    good_score = ops.crf_log_likelihood(em, tags, trans, None, None, None, None)
    assert torch.isnan(bad_score[0]) and torch.equal(bad_score[1:], good_score[1:]), (bad_score, good_score)
else:
    raises("tags out of range", "tags[0][1] = 3 is outside",
           lambda: ops.crf_log_likelihood(em, bad_tags, trans, None, None, None, None))
print("CRF errors: mask holes and empty first steps, mask/lengths/tags/constraint shapes and dtypes")


# ---- HMMs against enumeration ----

def log_rows(*shape):
    return torch.log_softmax(torch.randn(*shape, **f64), -1)


Kh, V, F = 3, 5, 2
log_start, log_trans, log_emit = log_rows(Kh), log_rows(Kh, Kh), log_rows(Kh, V)
obs = torch.randint(0, V, (B, T), device=dev)
means, variances = torch.randn(Kh, F, **f64), torch.rand(Kh, F, **f64) + 0.5
x = torch.randn(B, T, F, **f64)
cat_em = log_emit.t()[obs]  # [B,T,K]
normal = torch.distributions.Normal(means, variances.sqrt())
gauss_em = normal.log_prob(x.unsqueeze(-2)).sum(-1)
for name, model, em_h in (("categorical", dict(log_emissions=log_emit), cat_em),
                          ("Gaussian", dict(means=means, variances=variances), gauss_em)):
    observations = obs if name == "categorical" else x
    r = Reference(em_h, log_trans, log_start, None, lengths)
    for batch_first in (True, False):
        o = observations if batch_first else observations.transpose(0, 1)
        kw = dict(model, lengths=lengths, batch_first=batch_first)
        close(f"hmm_log_likelihood {name}", ops.hmm_log_likelihood(o, log_start, log_trans, **kw), r.log_z, 1e-12)
        post = ops.hmm_posteriors(o, log_start, log_trans, **kw)
        close(f"hmm_posteriors {name}", post, r.nodes if batch_first else r.nodes.transpose(0, 1), 1e-12)
        states, score = ops.hmm_viterbi(o, log_start, log_trans, **kw)
        equal(f"hmm_viterbi {name}", states, r.best if batch_first else r.best.t())
        close(f"hmm_viterbi {name} score", score, r.best_score, 1e-12)
    m = dict(mask=mask.to(torch.uint8))
    close(f"hmm_log_likelihood {name} with a mask", ops.hmm_log_likelihood(observations, log_start, log_trans, **model, **m),
          r.log_z, 1e-12)
params = [t.clone().requires_grad_() for t in (log_start, log_trans, log_emit)]
torch.autograd.gradcheck(lambda s, t, e: ops.hmm_log_likelihood(obs, s, t, e, lengths=lengths), params,
                         nondet_tol=nondet_tol)
gparams = [t.clone().requires_grad_() for t in (x, log_start, log_trans, means, variances)]
torch.autograd.gradcheck(lambda o, s, t, mu, var: ops.hmm_log_likelihood(o, s, t, means=mu, variances=var, mask=mask),
                         gparams, nondet_tol=nondet_tol)
ll32 = ops.hmm_log_likelihood(x.float(), log_start.float(), log_trans.float(), means=means.bfloat16(),
                              variances=variances.float(), lengths=lengths)
if ll32.dtype != torch.float32:
    raise SystemExit(f"hmm_log_likelihood in float32/bfloat16 gave {ll32.dtype}")
for name, message, fn in [
        ("both emission kinds", "not both",
         lambda: ops.hmm_log_likelihood(obs, log_start, log_trans, log_emit, means, variances)),
        ("no emissions", "give log_emissions (categorical) or means and variances",
         lambda: ops.hmm_log_likelihood(obs, log_start, log_trans)),
        ("means alone", "needs both means and variances", lambda: ops.hmm_viterbi(x, log_start, log_trans, means=means)),
        ("float symbols", "integer symbol ids", lambda: ops.hmm_posteriors(obs.double(), log_start, log_trans, log_emit)),
        ("symbol out of range", "outside the vocabulary",
         lambda: ops.hmm_log_likelihood(obs + V, log_start, log_trans, log_emit)),
        ("hole", "is on after an off position",
         lambda: ops.hmm_log_likelihood(obs, log_start, log_trans, log_emit, mask=hole)),
        ("log_start shape", "log_start has shape [4], expected [K] = [3]",
         lambda: ops.hmm_log_likelihood(obs, torch.zeros(Kh + 1, **f64), log_trans, log_emit)),
        ("means shape", "means has shape [3, 3], expected [K,F] = [3, 2]",
         lambda: ops.hmm_viterbi(x, log_start, log_trans, means=torch.zeros(Kh, F + 1, **f64), variances=variances)),
        ("log_emissions shape", "log_emissions must be [K,V] with K = 3",
         lambda: ops.hmm_posteriors(obs, log_start, log_trans, log_emit.t())),
]:
    raises(f"HMM {name}", message, fn)
print("HMM operators: log-likelihood, posteriors, Viterbi (categorical and Gaussian) against enumeration; gradcheck; "
      "errors")

# ---- opcheck: schemas, Meta kernels against the real ones, autograd registration, AOT dispatch ----

def opcheck(op, args, kwargs=None, **options):
    torch.library.opcheck(op, args, kwargs or {}, **options)


checked = 0
for dtype in (torch.float32, torch.float64, torch.bfloat16):
    for grad in (False, True):
        def leaf(t):
            return t.to(dtype).detach().requires_grad_(grad and t.is_floating_point())
        e, t_, s_, n_ = leaf(em), leaf(trans), leaf(start), leaf(end)
        for batch_first in (True, False):
            ee = e if batch_first else e.detach().transpose(0, 1).contiguous().requires_grad_(grad)
            m = mask if batch_first else mask.t().contiguous()
            y = tags if batch_first else tags.t().contiguous()
            c = dict(batch_first=batch_first)
            opcheck(ops.crf_log_partition.default, (ee, t_, s_, n_, m, None), c)
            opcheck(ops.crf_log_partition.default, (ee, t_, None, n_, None, lengths),
                    dict(c, allowed=allowed, allowed_start=allowed_start, allowed_end=allowed_end))
            opcheck(ops.crf_log_likelihood.default, (ee, y, t_, s_, n_, m, None), c)
            opcheck(ops.crf_log_likelihood.default, (ee, y, t_, None, None, None, lengths), c)
            opcheck(ops.crf_log_likelihood.default, (ee, y, t_, s_, None, m, None), dict(c, reduction="token_mean"))
            for edges in (False, True):
                opcheck(ops.crf_marginals.default, (ee, t_, s_, n_, m, None), dict(c, edges=edges, allowed=allowed))
            opcheck(ops.crf_viterbi.default, (ee, t_, s_, n_, None, lengths), dict(c, allowed_end=allowed_end))
            opcheck(ops.crf_kbest.default, (ee, t_, s_, n_, m, None, 3), c)
            opcheck(ops._crf_mask_lengths.default, (m.to(torch.uint8), batch_first))
            checked += 8
        a_, b_ = leaf(torch.randn(2, 3, 4, **f64)), leaf(torch.randn(4, 5, **f64))
        opcheck(ops.log_matmul.default, (a_, b_))
        opcheck(ops.max_matmul.default, (leaf(torch.randn(3, 1, 2, 4, **f64)), leaf(torch.randn(2, 4, 5, **f64))))
        hk = dict(lengths=lengths)
        opcheck(ops.hmm_log_likelihood.default, (obs, leaf(log_start), leaf(log_trans)), dict(hk, log_emissions=leaf(log_emit)))
        opcheck(ops.hmm_log_likelihood.default, (leaf(x), leaf(log_start), leaf(log_trans)),
                dict(mask=mask, means=leaf(means), variances=leaf(variances)))
        opcheck(ops.hmm_posteriors.default, (obs.t(), leaf(log_start), leaf(log_trans)),
                dict(hk, log_emissions=leaf(log_emit), batch_first=False))
        opcheck(ops.hmm_viterbi.default, (leaf(x), leaf(log_start), leaf(log_trans)),
                dict(hk, means=leaf(means), variances=leaf(variances)))
        checked += 6
# The backward operators themselves (their Meta kernels against the real ones).
g = torch.randn(B, **f64)
opcheck(ops._crf_score_backward.default, (g, em, tags, trans, start, None, mask, None, True, None, None, None,
                                          [True, True, True, False]), test_utils=("test_schema", "test_faketensor"))
opcheck(ops._crf_score_backward.default, (g, em, None, trans, None, end, None, lengths, True, allowed, None, None,
                                          [True, False, False, True]), test_utils=("test_schema", "test_faketensor"))
opcheck(ops._crf_score_and_gradients.default, (em, tags, trans, start, None, mask, None, True, None, None, None,
                                               [True, True, True, False]), test_utils=("test_schema", "test_faketensor"))
# With a reduction the first result is the reduced log-likelihood (a scalar), the gradients still those of the sum.
plain_both = ops._crf_score_and_gradients(em, tags, trans, start, end, None, lengths, True, None, None, None,
                                          [True, True, True, True])
for reduction, divide in (("sum", 1), ("mean", B), ("token_mean", lengths.sum()), ("token_mean", B * T)):
    given = lengths if torch.is_tensor(divide) else None
    both = ops._crf_score_and_gradients(em, tags, trans, start, end, None, given, True, None, None, None,
                                        [True, True, True, True], reduction)
    unreduced = plain_both if given is not None else ops._crf_score_and_gradients(
        em, tags, trans, start, end, None, None, True, None, None, None, [True, True, True, True])
    close(f"_crf_score_and_gradients reduction={reduction}", both[0], unreduced[0].sum() / divide, 1e-12)
    for name, a, b in zip(("emissions", "transitions", "start", "end"), both[1:], unreduced[1:]):
        close(f"_crf_score_and_gradients reduction={reduction}: gradient of the sum for {name}", a, b, 1e-12)
    opcheck(ops._crf_score_and_gradients.default, (em, tags, trans, start, end, None, given, True, None, None, None,
                                                   [True, False, True, True], reduction),
            test_utils=("test_schema", "test_faketensor"))
opcheck(ops._semiring_matmul_backward.default, (torch.randn(2, 3, 5, **f64), torch.randn(2, 3, 4, **f64),
                                                torch.randn(4, 5, **f64), True, [True, True]),
        test_utils=("test_schema", "test_faketensor"))
opcheck(ops._hmm_log_likelihood_backward.default, (g, x, log_start, log_trans, None, means, variances, None, lengths,
                                                   True, [True, True, True, False, True, True]),
        test_utils=("test_schema", "test_faketensor"))
# Inference mode skips autograd: the operators' own kernels (real and Meta) answer.
with torch.inference_mode():
    opcheck(ops.crf_marginals.default, (em, trans, start, end, mask, None), dict(edges=True),
            test_utils=("test_schema", "test_faketensor"))
    opcheck(ops.crf_log_likelihood.default, (em, tags, trans, start, end, mask, None),
            test_utils=("test_schema", "test_faketensor"))
print(f"opcheck: {checked + 6} operator cases passed (float32, float64, bfloat16; with and without gradients)")


# ---- torch.compile(fullgraph=True, dynamic=True): a CRF loss and its backward against eager ----

def crf_loss(emissions, transitions, start, end, tags, mask):
    e = torch.tanh(emissions) * 3
    ll = ops.crf_log_likelihood(e, tags, transitions, start, end, mask, None)
    log_z = ops.crf_log_partition(e, transitions, start, end, mask, None, allowed=allowed)
    paired = ops.log_matmul(e, transitions)
    return -ll.mean() + 0.01 * log_z.sum() + 1e-3 * paired.sum()


compiled = torch.compile(crf_loss, fullgraph=True, dynamic=True, backend=args.backend)
worst = 0.0
for batch, steps in ((4, 6), (3, 9)):  # two shapes: the second runs the same dynamic graph
    for dtype, tol in ((torch.float32, 1e-4), (torch.float64, 1e-10)):
        lens = torch.randint(1, steps + 1, (batch,), device=dev)
        lens[0] = steps
        m = torch.arange(steps, device=dev).unsqueeze(0) < lens.unsqueeze(1)
        y = torch.randint(0, K, (batch, steps), device=dev)
        base = [torch.randn(batch, steps, K, device=dev, dtype=dtype), torch.randn(K, K, device=dev, dtype=dtype),
                torch.randn(K, device=dev, dtype=dtype), torch.randn(K, device=dev, dtype=dtype)]
        eager_in = [t.clone().requires_grad_() for t in base]
        compiled_in = [t.clone().requires_grad_() for t in base]
        expected, got = crf_loss(*eager_in, y, m), compiled(*compiled_in, y, m)
        expected.backward()
        got.backward()
        pairs = [(got, expected)] + [(c.grad, e.grad) for c, e in zip(compiled_in, eager_in)]
        for name, (c, e) in zip(("loss", "d emissions", "d transitions", "d start", "d end"), pairs):
            close(f"compiled {name} ({dtype}, B={batch}, T={steps})", c, e, tol)
            worst = max(worst, (c.detach().double() - e.detach().double()).abs().max().item())
print(f"torch.compile (fullgraph, {args.backend}, dynamic shapes): CRF loss and gradients match eager, "
      f"max |difference| {worst:.2e}")
