"""trellis.CRF against pytorch-crf's torchcrf.CRF (0.7.2): construction, parameters, log-likelihoods and their
gradients under every reduction, Viterbi paths, masks, batch_first, and the same ValueErrors for the same bad input."""
import pytest
import torch
import torchcrf

import trellis
from conftest import prefix_mask


def pair(num_tags: int, batch_first: bool, device: str, dtype=torch.float32):
    """A torchcrf.CRF and a trellis.CRF with the same (random, not small) parameters."""
    reference = torchcrf.CRF(num_tags, batch_first=batch_first)
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 1.5)
    crf = trellis.CRF(num_tags, batch_first=batch_first)
    crf.load_state_dict(reference.state_dict())
    return reference.to(device, dtype), crf.to(device, dtype)


def inputs(seq_length, batch_size, num_tags, batch_first, device, dtype=torch.float32, lengths=None):
    shape = (batch_size, seq_length) if batch_first else (seq_length, batch_size)
    emissions = torch.randn(*shape, num_tags, dtype=dtype, device=device) * 2
    tags = torch.randint(0, num_tags, shape, device=device)
    mask = None if lengths is None else prefix_mask(lengths, seq_length, batch_first, device=device)
    return emissions, tags, mask


def leaf(t):
    return t.detach().clone().requires_grad_()


def test_same_parameters_from_the_same_seed():
    torch.manual_seed(7)
    reference = torchcrf.CRF(6)
    torch.manual_seed(7)
    crf = trellis.CRF(6)
    assert [n for n, _ in crf.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert list(crf.state_dict()) == list(reference.state_dict())
    for (_, a), (_, b) in zip(crf.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b)


def test_attributes_and_repr():
    crf, reference = trellis.CRF(5, batch_first=True), torchcrf.CRF(5, batch_first=True)
    assert repr(crf) == repr(reference) == "CRF(num_tags=5)"
    assert (crf.num_tags, crf.batch_first) == (reference.num_tags, reference.batch_first)
    assert crf.start_transitions.shape == (5,) and crf.end_transitions.shape == (5,)
    assert crf.transitions.shape == (5, 5)
    assert isinstance(crf.transitions, torch.nn.Parameter)
    assert trellis.CRF(3).batch_first is False


def test_state_dicts_load_both_ways():
    reference = torchcrf.CRF(4)
    crf = trellis.CRF(4)
    crf.load_state_dict(reference.state_dict())
    back = torchcrf.CRF(4)
    back.load_state_dict(crf.state_dict())
    for a, b in zip(back.parameters(), reference.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "token_mean"])
@pytest.mark.parametrize("lengths", [None, [7, 1, 4, 7, 2]])
def test_log_likelihood_and_gradients(device, batch_first, reduction, lengths):
    reference, crf = pair(5, batch_first, device)
    emissions, tags, mask = inputs(7, 5, 5, batch_first, device, lengths=lengths)
    e_ref, e = leaf(emissions), leaf(emissions)
    expected = reference(e_ref, tags, mask, reduction=reduction)
    got = crf(e, tags, mask, reduction=reduction)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)

    weights = torch.randn_like(expected)  # a gradient that differs per sample
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    torch.testing.assert_close(e.grad, e_ref.grad, rtol=1e-4, atol=1e-5)
    for name in ("start_transitions", "end_transitions", "transitions"):
        torch.testing.assert_close(getattr(crf, name).grad, getattr(reference, name).grad, rtol=1e-4, atol=1e-4,
                                   msg=name)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("reduction", ["sum", "mean", "token_mean"])
@pytest.mark.parametrize("frozen", ["emissions", "parameters"])
def test_gradients_of_one_side(device, batch_first, reduction, frozen):
    """Frozen emissions (a fixed encoder) or frozen CRF parameters: the other side's gradients alone, under an upstream
    gradient other than 1, with int32 tags."""
    reference, crf = pair(5, batch_first, device)
    emissions, tags, _ = inputs(6, 4, 5, batch_first, device)
    tags = tags.int()
    e_ref, e = (emissions, emissions) if frozen == "emissions" else (leaf(emissions), leaf(emissions))
    for module in (reference, crf):
        module.requires_grad_(frozen != "parameters")
    upstream = torch.tensor(-2.5, device=device)
    reference(e_ref, tags.long(), reduction=reduction).backward(upstream)
    crf(e, tags, reduction=reduction).backward(upstream)
    if frozen == "emissions":
        for name in ("start_transitions", "end_transitions", "transitions"):
            torch.testing.assert_close(getattr(crf, name).grad, getattr(reference, name).grad, rtol=1e-4, atol=1e-4,
                                       msg=name)
    else:
        torch.testing.assert_close(e.grad, e_ref.grad, rtol=1e-4, atol=1e-5)
        assert all(p.grad is None for p in crf.parameters())


@pytest.mark.parametrize("batch_first", [False, True])
def test_default_reduction_is_sum(batch_first):
    reference, crf = pair(4, batch_first, "cpu")
    emissions, tags, _ = inputs(5, 3, 4, batch_first, "cpu")
    torch.testing.assert_close(crf(emissions, tags), reference(emissions, tags))
    assert crf(emissions, tags).dim() == 0


def test_float64(device):
    reference, crf = pair(4, False, device, torch.float64)
    emissions, tags, mask = inputs(6, 3, 4, False, device, torch.float64, lengths=[6, 3, 1])
    got = crf(emissions, tags, mask, reduction="none")
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, reference(emissions, tags, mask, reduction="none"), rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("mask_dtype", [torch.uint8, torch.bool, torch.int64, torch.float32])
def test_mask_types(mask_dtype):
    reference, crf = pair(3, True, "cpu")
    emissions, tags, _ = inputs(6, 4, 3, True, "cpu")
    mask = prefix_mask([6, 2, 5, 1], 6, True, dtype=mask_dtype)
    torch.testing.assert_close(crf(emissions, tags, mask, reduction="none"),
                               reference(emissions, tags, mask.bool(), reduction="none"))
    assert crf.decode(emissions, mask) == reference.decode(emissions, mask.bool())


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("lengths", [None, [9, 1, 3, 9, 6, 2]])
def test_decode(device, batch_first, lengths):
    reference, crf = pair(6, batch_first, device)
    emissions, _, mask = inputs(9, 6, 6, batch_first, device, lengths=lengths)
    paths = crf.decode(emissions, mask)
    assert paths == reference.decode(emissions, mask)
    assert [len(p) for p in paths] == (lengths or [9] * 6)
    assert all(type(t) is int for p in paths for t in p)


@pytest.mark.parametrize("seq_length,batch_size,num_tags", [(1, 1, 1), (1, 3, 4), (5, 1, 1), (2, 2, 2), (40, 2, 9)])
def test_small_and_degenerate_shapes(seq_length, batch_size, num_tags):
    reference, crf = pair(num_tags, False, "cpu")
    emissions, tags, _ = inputs(seq_length, batch_size, num_tags, False, "cpu")
    torch.testing.assert_close(crf(emissions, tags, reduction="none"),
                               reference(emissions, tags, reduction="none"), rtol=1e-5, atol=1e-4)
    assert crf.decode(emissions) == reference.decode(emissions)


def test_training_steps_follow_pytorch_crf():
    """The same optimiser on the same batches moves both layers' parameters the same way."""
    reference, crf = pair(4, True, "cpu")
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (reference, crf)]
    for step in range(5):
        emissions, tags, mask = inputs(8, 6, 4, True, "cpu", lengths=[8, 3, 5, 1, 8, 2])
        for model, optimiser in zip((reference, crf), optimisers):
            optimiser.zero_grad()
            (-model(emissions, tags, mask, reduction="mean")).backward()
            optimiser.step()
    for a, b in zip(crf.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_padding_tags_are_not_read():
    """Tags under the mask's padding do not change the likelihood (pytorch-crf multiplies them by 0)."""
    _, crf = pair(3, True, "cpu")
    emissions, tags, _ = inputs(5, 2, 3, True, "cpu")
    mask = prefix_mask([5, 2], 5, True)
    other = tags.clone()
    other[1, 2:] = (other[1, 2:] + 1) % 3
    torch.testing.assert_close(crf(emissions, tags, mask, reduction="none"),
                               crf(emissions, other, mask, reduction="none"))


def raised(call):
    with pytest.raises(Exception) as info:
        call()
    return info.value


BAD_CALLS = {
    # name: (batch_first, call(crf) -> None)
    "emissions of dimension 2": (False, lambda c: c(torch.randn(3, 4), torch.zeros(3, 2, dtype=torch.long))),
    "emissions of dimension 4": (False, lambda c: c.decode(torch.randn(3, 2, 4, 1))),
    "wrong number of tags": (False, lambda c: c(torch.randn(3, 2, 5), torch.zeros(3, 2, dtype=torch.long))),
    "wrong number of tags, decode": (True, lambda c: c.decode(torch.randn(3, 2, 3))),
    "tags of another shape": (False, lambda c: c(torch.randn(3, 2, 4), torch.zeros(2, 3, dtype=torch.long))),
    "mask of another shape": (False, lambda c: c(torch.randn(3, 2, 4), torch.zeros(3, 2, dtype=torch.long),
                                                 torch.ones(3, 3, dtype=torch.uint8))),
    "mask of another shape, decode": (True, lambda c: c.decode(torch.randn(3, 2, 4), torch.ones(2, 2, dtype=torch.bool))),
    "first timestep off": (False, lambda c: c(torch.randn(3, 2, 4), torch.zeros(3, 2, dtype=torch.long),
                                              torch.tensor([[1, 0], [1, 0], [0, 0]], dtype=torch.uint8))),
    "first timestep off, batch_first": (True, lambda c: c.decode(torch.randn(2, 3, 4),
                                                                 torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool))),
    "first timestep off, time-major mask read as batch-major": (
        True, lambda c: c.decode(torch.randn(2, 2, 4), torch.tensor([[1, 1], [0, 1]], dtype=torch.bool))),
    "invalid reduction": (False, lambda c: c(torch.randn(3, 2, 4), torch.zeros(3, 2, dtype=torch.long),
                                             reduction="max")),
    "bad tags and bad reduction: tags first": (False, lambda c: c(torch.randn(3, 2, 4),
                                                                  torch.zeros(3, 3, dtype=torch.long), reduction="x")),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_same_errors_as_pytorch_crf(name):
    batch_first, call = BAD_CALLS[name]
    expected = raised(lambda: call(torchcrf.CRF(4, batch_first=batch_first)))
    got = raised(lambda: call(trellis.CRF(4, batch_first=batch_first)))
    assert isinstance(expected, ValueError)
    assert type(got) is type(expected)
    assert str(got) == str(expected)


@pytest.mark.parametrize("num_tags", [0, -3])
def test_same_constructor_error(num_tags):
    expected = raised(lambda: torchcrf.CRF(num_tags))
    got = raised(lambda: trellis.CRF(num_tags))
    assert type(got) is type(expected) is ValueError
    assert str(got) == str(expected) == f"invalid number of tags: {num_tags}"


def test_mask_resuming_after_padding_is_refused():
    # pytorch-crf accepts it and scores a mixture of readings; Trellis' sequences are prefixes.
    crf = trellis.CRF(3)
    mask = torch.tensor([[1, 1], [0, 1], [1, 1]], dtype=torch.uint8)
    with pytest.raises(ValueError, match="prefix"):
        crf.decode(torch.randn(3, 2, 3), mask)


@pytest.mark.parametrize("reduction", ["sum", "max"])
def test_bad_masks_in_training_calls(device, reduction):
    # The log-likelihood checks a mask's values after it has queued its work (on a GPU the host then waits for the
    # check alone): still pytorch-crf's error, before a bad reduction's, and the prefix rule; a good mask passes.
    emissions = torch.randn(3, 2, 4, device=device)
    tags = torch.zeros(3, 2, dtype=torch.long, device=device)
    first_off = torch.tensor([[1, 0], [1, 0], [0, 0]], dtype=torch.uint8, device=device)
    expected = raised(lambda: torchcrf.CRF(4).to(device)(emissions, tags, first_off, reduction=reduction))
    got = raised(lambda: trellis.CRF(4).to(device)(emissions, tags, first_off, reduction=reduction))
    assert type(got) is type(expected) is ValueError
    assert str(got) == str(expected) == "mask of the first timestep must all be on"
    hole = torch.tensor([[1, 1], [0, 1], [1, 1]], dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match="prefix"):
        trellis.CRF(4).to(device)(emissions, tags, hole, reduction=reduction)
    prefix = torch.tensor([[1, 1], [1, 0], [1, 0]], dtype=torch.bool, device=device)
    if reduction == "sum":
        assert torch.isfinite(trellis.CRF(4).to(device)(emissions, tags, prefix))
    else:
        with pytest.raises(ValueError, match="invalid reduction"):
            trellis.CRF(4).to(device)(emissions, tags, prefix, reduction=reduction)
