"""The Python functions over the vocabulary-parallel head's operators pass every argument through, with the group as a
process group or by name: on a one-rank Gloo group (this process, an in-memory store) they equal the single-device
functions with the same non-default arguments, values and gradients. The operators across ranks are checked by
tests/vocab_parallel_head.py."""
import pytest
import torch
import torch.distributed as dist

import trellis

N, D, V = 12, 6, 19


@pytest.fixture(scope="module")
def group():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with Gloo is not available")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def inputs():
    torch.manual_seed(5)
    leaves = [torch.randn(N, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64),
              torch.randn(V, dtype=torch.float64)]
    targets = torch.randint(0, V, (N,))
    targets[::3] = -1
    return [p.requires_grad_() for p in leaves], targets


def results(outputs, leaves):
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    total = sum((o * torch.linspace(0.5, 1.5, o.numel(), dtype=o.dtype).view_as(o)).sum() for o in outputs)
    return [o.detach() for o in outputs] + list(torch.autograd.grad(total, leaves))


CASES = {
    "loss": (lambda x, w, b, t, *g: trellis.vocab_parallel_linear_cross_entropy(
                 x, w, t, *g, b, ignore_index=-1, reduction="sum", label_smoothing=0.1, softcap=3.0, z_loss=1e-2,
                 chunk_bytes=512, recompute_logits=True, temperature=0.7),
             lambda x, w, b, t: trellis.linear_cross_entropy(
                 x, w, t, b, ignore_index=-1, reduction="sum", label_smoothing=0.1, softcap=3.0, z_loss=1e-2,
                 chunk_bytes=512, recompute_logits=True, temperature=0.7)),
    "log-probabilities": (lambda x, w, b, t, *g: trellis.vocab_parallel_token_logprobs(
                              x, w, t, *g, b, softcap=3.0, ignore_index=-1, entropy=True, chunk_bytes=512,
                              temperature=1.3),
                          lambda x, w, b, t: trellis.token_logprobs(
                              x, w, t, b, softcap=3.0, ignore_index=-1, entropy=True, chunk_bytes=512,
                              temperature=1.3)),
    "log-sum-exps": (lambda x, w, b, t, *g: trellis.vocab_parallel_linear_logsumexp(
                         x, w, *g, b, softcap=3.0, chunk_bytes=512, temperature=1.3),
                     lambda x, w, b, t: trellis.linear_logsumexp(x, w, b, softcap=3.0, chunk_bytes=512,
                                                                 temperature=1.3)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("by_name", [False, True])
def test_equals_the_single_device_function(group, case, by_name):
    parallel, single = CASES[case]
    leaves, targets = inputs()
    got = results(parallel(*leaves, targets, group.group_name if by_name else group), leaves)
    expected = results(single(*leaves, targets), leaves)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
