"""What trellis.CRF has beyond pytorch-crf, against enumeration of every tag sequence: log-partition, marginals (and
that they are its gradient), k-best, constraints in each accepted form, half-precision emissions,
decode(as_tensor=True)."""
import math

import pytest
import torch

import trellis
from conftest import path_scores, prefix_mask

K = 3
LENGTHS = [4, 1, 3]
T = max(LENGTHS)


def random_crf(batch_first=True, constraints=None, device="cpu", dtype=torch.float64):
    crf = trellis.CRF(K, batch_first=batch_first, constraints=constraints).to(device, dtype)
    with torch.no_grad():
        for p in crf.parameters():
            p.normal_(0, 1.0)
    return crf


def batch(device="cpu", dtype=torch.float64):
    emissions = torch.randn(len(LENGTHS), T, K, dtype=dtype, device=device) * 1.5
    return emissions, prefix_mask(LENGTHS, T, True, device=device)


def enumerate_sample(crf, emissions, b, allowed=None):
    """Paths and scores of sample b (batch-major emissions), only the allowed ones when allowed=(trans, start, end)."""
    paths, scores = path_scores(emissions[b].cpu(), crf.transitions.cpu(), crf.start_transitions.cpu(),
                                crf.end_transitions.cpu(), LENGTHS[b])
    if allowed is not None:
        trans, start, end = allowed
        keep = [start[p[0]] and end[p[-1]] and all(trans[x, y] for x, y in zip(p, p[1:])) for p in paths]
        paths = [p for p, k in zip(paths, keep) if k]
        scores = scores[torch.tensor(keep)]
    return paths, scores.detach()


def test_log_partition_and_marginals_by_enumeration(device):
    crf = random_crf(device=device)
    emissions, mask = batch(device)
    log_z = crf.log_partition(emissions, mask)
    unary, pairwise = crf.marginals(emissions, mask, edges=True)
    assert pairwise.shape == (len(LENGTHS), T - 1, K, K)
    for b, n in enumerate(LENGTHS):
        paths, scores = enumerate_sample(crf, emissions, b)
        assert log_z[b].item() == pytest.approx(torch.logsumexp(scores, 0).item(), rel=1e-12)
        probs = torch.softmax(scores, 0)
        expected = torch.zeros(T, K, dtype=torch.float64)
        expected_pairs = torch.zeros(T - 1, K, K, dtype=torch.float64)
        for path, p in zip(paths, probs):
            for t, y in enumerate(path):
                expected[t, y] += p
            for t, (x, y) in enumerate(zip(path, path[1:])):
                expected_pairs[t, x, y] += p
        torch.testing.assert_close(unary[b].cpu(), expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(pairwise[b].cpu(), expected_pairs, rtol=1e-10, atol=1e-12)


def test_marginals_are_the_gradient_of_the_log_partition(device):
    crf = random_crf(device=device)
    emissions, mask = batch(device)
    e = emissions.clone().requires_grad_()
    crf.log_partition(e, mask).sum().backward()
    torch.testing.assert_close(e.grad, crf.marginals(emissions, mask), rtol=1e-10, atol=1e-12)


def test_log_likelihood_is_score_minus_log_partition():
    crf = random_crf()
    emissions, mask = batch()
    tags = torch.randint(0, K, (len(LENGTHS), T))
    llh = crf(emissions, tags, mask, reduction="none")
    for b, n in enumerate(LENGTHS):
        paths, scores = enumerate_sample(crf, emissions, b)
        gold = scores[paths.index(tuple(tags[b, :n].tolist()))]
        assert llh[b].item() == pytest.approx((gold - torch.logsumexp(scores, 0)).item(), rel=1e-12)


@pytest.mark.parametrize("k", [1, 2, 5, 30])
def test_kbest_by_enumeration(device, k):
    crf = random_crf(device=device)
    emissions, mask = batch(device)
    result = crf.kbest(emissions, k, mask)
    paths, scores = crf.kbest(emissions, k, mask, as_tensor=True)
    assert paths.shape == (len(LENGTHS), k, T) and scores.shape == (len(LENGTHS), k)
    for b, n in enumerate(LENGTHS):
        all_paths, all_scores = enumerate_sample(crf, emissions, b)
        order = torch.argsort(all_scores, descending=True)[:k].tolist()
        assert [tuple(p) for p, _ in result[b]] == [all_paths[i] for i in order]
        assert [s for _, s in result[b]] == pytest.approx([all_scores[i].item() for i in order], rel=1e-12)
        found = len(order)  # fewer than k where fewer sequences exist (3**1 for the length-1 sample)
        assert torch.isinf(scores[b, found:]).all() and (paths[b, found:] == -1).all()


def test_kbest_tensors_time_first():
    crf = random_crf(batch_first=False)
    emissions, mask = batch()
    paths, scores = crf.kbest(emissions.transpose(0, 1), 4, mask.t(), as_tensor=True)
    crf.batch_first = True
    expected_paths, expected_scores = crf.kbest(emissions, 4, mask, as_tensor=True)
    assert paths.shape == (T, len(LENGTHS), 4)
    torch.testing.assert_close(paths, expected_paths.permute(2, 0, 1))
    torch.testing.assert_close(scores, expected_scores)


def test_kbest_needs_k_of_at_least_one():
    crf = random_crf()
    emissions, mask = batch()
    with pytest.raises(ValueError, match="k must be at least 1"):
        crf.kbest(emissions, 0, mask)


@pytest.mark.parametrize("batch_first", [False, True])
def test_decode_as_tensor(device, batch_first):
    crf = random_crf(batch_first=batch_first, device=device)
    emissions, mask = batch(device)
    if not batch_first:
        emissions, mask = emissions.transpose(0, 1), mask.t()
    paths = crf.decode(emissions, mask, as_tensor=True)
    assert paths.dtype == torch.int64 and paths.device == emissions.device and paths.shape == mask.shape
    assert ((paths == -1) == (mask == 0)).all()
    rows = paths.t() if not batch_first else paths
    assert [row[:n].tolist() for row, n in zip(rows, LENGTHS)] == crf.decode(emissions, mask)
    batch_major = emissions if batch_first else emissions.transpose(0, 1)
    for b, path in enumerate(crf.decode(emissions, mask)):
        all_paths, scores = enumerate_sample(crf, batch_major, b)
        assert tuple(path) == all_paths[int(scores.argmax())]


# Constraints: 0 may not follow 1 and 2 may not follow itself; only 0 and 1 start, only 1 and 2 end.
ALLOWED = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)
START = torch.tensor([1, 1, 0], dtype=torch.bool)
END = torch.tensor([0, 1, 1], dtype=torch.bool)
PAIRS = [(i, j) for i in range(K) for j in range(K) if ALLOWED[i, j]] + \
        [(K, j) for j in range(K) if START[j]] + [(i, K + 1) for i in range(K) if END[i]]


@pytest.mark.parametrize("form", ["tuple", "pairs"])
def test_constrained_inference_by_enumeration(device, form):
    constraints = (ALLOWED, START, END) if form == "tuple" else PAIRS
    crf = random_crf(constraints=constraints, device=device)
    assert repr(crf) == "CRF(num_tags=3, constrained)"
    assert crf.allowed_transitions.device.type == torch.device(device).type
    emissions, mask = batch(device)
    log_z = crf.log_partition(emissions, mask)
    decoded = crf.decode(emissions, mask)
    best = crf.kbest(emissions, 4, mask)
    unary = crf.marginals(emissions, mask)
    for b, n in enumerate(LENGTHS):
        paths, scores = enumerate_sample(crf, emissions, b, (ALLOWED, START, END))
        assert log_z[b].item() == pytest.approx(torch.logsumexp(scores, 0).item(), rel=1e-12)
        assert tuple(decoded[b]) == paths[int(scores.argmax())]
        order = torch.argsort(scores, descending=True)[:4].tolist()
        assert [tuple(p) for p, _ in best[b]] == [paths[i] for i in order]
        probs = torch.softmax(scores, 0)
        for t in range(n):
            for y in range(K):
                expected = sum(p for path, p in zip(paths, probs) if path[t] == y)
                assert unary[b, t, y].item() == pytest.approx(float(expected), abs=1e-12)


def test_constraints_as_one_matrix_allow_every_start_and_end():
    crf = random_crf(constraints=ALLOWED)
    emissions, mask = batch()
    log_z = crf.log_partition(emissions, mask)
    everything = torch.ones(K, dtype=torch.bool)
    for b in range(len(LENGTHS)):
        _, scores = enumerate_sample(crf, emissions, b, (ALLOWED, everything, everything))
        assert log_z[b].item() == pytest.approx(torch.logsumexp(scores, 0).item(), rel=1e-12)


def test_forward_is_not_constrained():
    crf = random_crf(constraints=(ALLOWED, START, END))
    free = random_crf()
    free.load_state_dict(crf.state_dict())
    emissions, mask = batch()
    tags = torch.randint(0, K, (len(LENGTHS), T))
    torch.testing.assert_close(crf(emissions, tags, mask, reduction="none"),
                               free(emissions, tags, mask, reduction="none"))
    assert "allowed_transitions" not in crf.state_dict()


def test_set_constraints_and_remove_them():
    crf = random_crf()
    emissions, mask = batch()
    free = crf.log_partition(emissions, mask)
    crf.set_constraints((ALLOWED, START, END))
    assert not torch.allclose(crf.log_partition(emissions, mask), free)
    crf.set_constraints(None)
    assert crf.allowed_transitions is None and repr(crf) == "CRF(num_tags=3)"
    torch.testing.assert_close(crf.log_partition(emissions, mask), free)


def test_no_allowed_sequence():
    """A length-1 sample whose only tags may not both start and end: -inf, path of -1, no k-best entry."""
    crf = random_crf(constraints=(ALLOWED, START, torch.tensor([0, 0, 1], dtype=torch.bool)))
    emissions, mask = batch()
    assert crf.log_partition(emissions, mask)[1].item() == -math.inf
    assert (crf.decode(emissions, mask, as_tensor=True)[1] == -1).all()
    assert crf.kbest(emissions, 3, mask)[1] == []
    assert torch.isfinite(crf.log_partition(emissions, mask)[[0, 2]]).all()


@pytest.mark.parametrize("constraints,message", [
    (torch.ones(2, 2, dtype=torch.bool), r"allowed transitions must have size \(3, 3\), got \(2, 2\)"),
    ((ALLOWED, START, torch.ones(4, dtype=torch.bool)), r"allowed end must have size \(3,\), got \(4,\)"),
    ([(0, 1), (3, 4), (0, 3)], r"invalid constraint \(0, 3\)"),
    ([(4, 0)], r"invalid constraint \(4, 0\)"),
])
def test_bad_constraints(constraints, message):
    with pytest.raises(ValueError, match=message):
        trellis.CRF(K, constraints=constraints)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_emissions(device, dtype):
    """Half-precision emissions give the float32 results of the same (rounded) values, in float32."""
    crf = random_crf(device=device, dtype=torch.float32)
    emissions, mask = batch(device, torch.float32)
    half = emissions.to(dtype)
    tags = torch.randint(0, K, (len(LENGTHS), T), device=device)
    exact = half.float()
    for method, args in (("forward", (tags, mask, "none")), ("log_partition", (mask,)), ("marginals", (mask,))):
        got = getattr(crf, method)(half, *args)
        assert got.dtype == torch.float32, method
        torch.testing.assert_close(got, getattr(crf, method)(exact, *args), rtol=1e-5, atol=1e-5, msg=method)
    assert crf.decode(half, mask) == crf.decode(exact, mask)
    e = half.clone().requires_grad_()
    crf(e, tags, mask).backward()
    assert e.grad.dtype == dtype


def test_float32_emissions_with_float64_parameters():
    crf = random_crf(dtype=torch.float64)
    emissions, mask = batch(dtype=torch.float64)
    got = crf.log_partition(emissions.float(), mask)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, crf.log_partition(emissions.float().double(), mask))


def test_validation_applies_to_every_method():
    crf = random_crf()
    bad_mask = torch.tensor([[0, 1, 1, 1]] * 3, dtype=torch.bool)
    emissions, _ = batch()
    for call in (lambda: crf.log_partition(emissions, bad_mask), lambda: crf.marginals(emissions, bad_mask),
                 lambda: crf.kbest(emissions, 2, bad_mask)):
        with pytest.raises(ValueError, match="mask of the first timestep must all be on"):
            call()
    with pytest.raises(ValueError, match="expected last dimension of emissions is 3, got 4"):
        crf.marginals(torch.randn(2, 3, 4))


@pytest.mark.parametrize("batch_first", [True, False])
def test_mask_checks_in_one_pass(batch_first):
    """Holes and an off first step are found in any sequence, the first-step error first, for bool and uint8 masks."""
    crf = trellis.CRF(3, batch_first=batch_first)
    emissions = torch.randn(4, 5, 3) if batch_first else torch.randn(5, 4, 3)
    for dtype in (torch.bool, torch.uint8):
        hole = prefix_mask([5, 3, 4, 2], 5, True, dtype=dtype)
        hole[1, 4] = 1  # sequence 1 is on at 0-2, off at 3
        first_off = hole.clone()
        first_off[3, 0] = 0
        for mask, message in ((hole, "prefix"), (first_off, "mask of the first timestep must all be on")):
            with pytest.raises(ValueError, match=message):
                crf.decode(emissions, mask if batch_first else mask.t().contiguous())
