"""The Python functions over the LLM head's operators pass every argument through: linear_cross_entropy,
token_logprobs and linear_logsumexp against PyTorch on materialised logits (the operators themselves are checked in
depth by tests/head_ops_gradients.py and examples/linear_cross_entropy.py)."""
import pytest
import torch
import torch.nn.functional as F

import trellis

N, D, V = 24, 8, 37


def head(device, bias):
    x = torch.randn(N, D, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(V, D, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, device=device, requires_grad=True) if bias else None
    targets = torch.randint(0, V, (N,), device=device)
    targets[::5] = -1
    return x, w, b, targets


def logits(x, w, b, softcap=None):
    z = x @ w.t() + (0 if b is None else b)
    return softcap * torch.tanh(z / softcap) if softcap else z


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy(device, reduction, bias):
    x, w, b, targets = head(device, bias)
    z = logits(x, w, b, softcap=4.0)
    valid = targets != -1
    expected = F.cross_entropy(z, targets, ignore_index=-1, reduction=reduction, label_smoothing=0.2)
    z_term = 1e-2 * torch.logsumexp(z, 1) ** 2 * valid
    expected = expected + (z_term if reduction == "none" else z_term.sum() / (valid.sum() if reduction == "mean" else 1))
    got = trellis.linear_cross_entropy(x, w, targets, b, ignore_index=-1, reduction=reduction, label_smoothing=0.2,
                                       softcap=4.0, z_loss=1e-2, chunk_bytes=256)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    leaves = [x, w] + ([b] if bias else [])
    for g, e in zip(torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(expected.sum(), leaves)):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10)


def test_linear_cross_entropy_recompute_logits(device):
    x, w, b, targets = head(device, True)
    got = trellis.linear_cross_entropy(x, w, targets, b, ignore_index=-1, recompute_logits=True)
    expected = F.cross_entropy(logits(x, w, b), targets, ignore_index=-1)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(torch.autograd.grad(got, w)[0], torch.autograd.grad(expected, w)[0])


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_linear_cross_entropy_memory_budget(device, reduction):
    # From the least budget the shapes take (the logits formed twice, chunks of a few columns) to a whole slab.
    x, w, b, targets = head(device, True)
    expected = F.cross_entropy(logits(x, w, b), targets, ignore_index=-1, reduction=reduction)
    leaves = [x, w, b]
    expected_grads = torch.autograd.grad(expected.sum(), leaves)
    for budget in [(1 << 20) + 8192, (1 << 20) + 16384, 1 << 30]:
        got = trellis.linear_cross_entropy(x, w, targets, b, ignore_index=-1, reduction=reduction,
                                           memory_budget=budget)
        torch.testing.assert_close(got, expected)
        for g, e in zip(torch.autograd.grad(got.sum(), leaves), expected_grads):
            torch.testing.assert_close(g, e)
    with pytest.raises(RuntimeError, match="memory_budget = 1000 bytes is below the least"):
        trellis.linear_cross_entropy(x, w, targets, b, ignore_index=-1, memory_budget=1000)


def test_token_logprobs(device):
    x, w, b, targets = head(device, True)
    z = logits(x, w, b, softcap=3.0)
    logprobs = trellis.token_logprobs(x, w, targets, b, softcap=3.0, ignore_index=-1)
    assert isinstance(logprobs, torch.Tensor)
    expected = torch.where(targets != -1, z.log_softmax(1).gather(1, targets.clamp(min=0)[:, None])[:, 0], 0)
    torch.testing.assert_close(logprobs, expected)
    logprobs, entropy = trellis.token_logprobs(x, w, targets, b, softcap=3.0, ignore_index=-1, entropy=True)
    torch.testing.assert_close(entropy, torch.distributions.Categorical(logits=z).entropy())
    g = torch.autograd.grad((logprobs + entropy).sum(), x)[0]
    torch.testing.assert_close(g, torch.autograd.grad((expected + torch.distributions.Categorical(logits=z).entropy()).sum(), x)[0])


def test_linear_logsumexp(device):
    x, w, b, _ = head(device, True)
    got = trellis.linear_logsumexp(x, w, b, softcap=5.0, chunk_bytes=512)
    expected = torch.logsumexp(logits(x, w, b, softcap=5.0), 1)
    torch.testing.assert_close(got, expected)
    for g, e in zip(torch.autograd.grad(got.sum(), [x, w, b]), torch.autograd.grad(expected.sum(), [x, w, b])):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("temperature", [0.5, 1.8])
def test_temperature(device, temperature):
    """Every function's results are those of the logits divided by the temperature (after the soft-cap), and so are
    the gradients for x, weight and bias."""
    x, w, b, targets = head(device, True)
    z = logits(x, w, b, softcap=4.0) / temperature
    valid = targets != -1
    log_p = z.log_softmax(1)
    expected = {
        "loss": F.cross_entropy(z, targets, ignore_index=-1, reduction="none", label_smoothing=0.1),
        "logprobs": torch.where(valid, log_p.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0),
        "entropy": -(log_p.exp() * log_p).sum(1),
        "lse": torch.logsumexp(z, 1),
    }
    logprobs, entropy = trellis.token_logprobs(x, w, targets, b, softcap=4.0, ignore_index=-1, entropy=True,
                                               temperature=temperature)
    got = {
        "loss": trellis.linear_cross_entropy(x, w, targets, b, ignore_index=-1, reduction="none", label_smoothing=0.1,
                                             softcap=4.0, temperature=temperature),
        "logprobs": logprobs,
        "entropy": entropy,
        "lse": trellis.linear_logsumexp(x, w, b, softcap=4.0, temperature=temperature),
    }
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-10, msg=name)
        for g, e in zip(torch.autograd.grad(got[name].sum(), [x, w, b], retain_graph=True),
                        torch.autograd.grad(expected[name].sum(), [x, w, b], retain_graph=True)):
            torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10, msg=f"gradient of {name}")


def test_temperature_one_is_the_default(device):
    x, w, b, targets = head(device, True)
    assert torch.equal(trellis.token_logprobs(x, w, targets, b, ignore_index=-1, temperature=1.0),
                       trellis.token_logprobs(x, w, targets, b, ignore_index=-1))


@pytest.mark.parametrize("temperature", [0.0, -0.5, float("nan"), float("inf")])
def test_temperature_must_be_positive_and_finite(temperature):
    x, w, b, targets = head("cpu", False)
    with pytest.raises(RuntimeError, match="linear_cross_entropy: temperature must be a positive finite number"):
        trellis.linear_cross_entropy(x, w, targets, temperature=temperature)
