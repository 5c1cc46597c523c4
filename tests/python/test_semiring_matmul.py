"""trellis.log_matmul and trellis.max_matmul against plain PyTorch: the broadcast sum reduced with logsumexp or amax,
values and gradients, batch broadcasting, -inf entries."""
import pytest
import torch

import trellis


def log_matmul_reference(a, b):
    return torch.logsumexp(a.unsqueeze(-1) + b.unsqueeze(-3), dim=-2)


def max_matmul_reference(a, b):
    return torch.amax(a.unsqueeze(-1) + b.unsqueeze(-3), dim=-2)


SHAPES = [((3, 4), (4, 5)), ((1, 1), (1, 1)), ((2, 3, 7), (2, 7, 2)), ((2, 1, 3, 4), (5, 4, 6)), ((6, 33), (33, 17))]
OPERATIONS = [(trellis.log_matmul, log_matmul_reference), (trellis.max_matmul, max_matmul_reference)]


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("operation,reference", OPERATIONS, ids=["log", "max"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_and_gradients(device, shapes, operation, reference, dtype):
    a = (torch.randn(*shapes[0], dtype=dtype, device=device) * 3).requires_grad_()
    b = (torch.randn(*shapes[1], dtype=dtype, device=device) * 3).requires_grad_()
    a_ref, b_ref = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    got, expected = operation(a, b), reference(a_ref, b_ref)
    assert got.shape == expected.shape and got.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, expected, **tolerance)
    weights = torch.randn_like(expected)
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(a.grad, a_ref.grad, **tolerance)
    torch.testing.assert_close(b.grad, b_ref.grad, **tolerance)


def test_log_matmul_is_matmul_in_log_space(device):
    a = torch.rand(4, 5, dtype=torch.float64, device=device) + 0.1
    b = torch.rand(5, 3, dtype=torch.float64, device=device) + 0.1
    torch.testing.assert_close(trellis.log_matmul(a.log(), b.log()).exp(), a @ b, rtol=1e-12, atol=0)


@pytest.mark.parametrize("operation,reference", OPERATIONS, ids=["log", "max"])
def test_minus_infinity_never_gives_nan(device, operation, reference):
    a = torch.randn(3, 4, dtype=torch.float64, device=device)
    a[0] = -torch.inf  # a row with no path
    a[1, 2] = -torch.inf
    a.requires_grad_()
    b = torch.randn(4, 2, dtype=torch.float64, device=device)
    out = operation(a, b)
    torch.testing.assert_close(out, reference(a.detach(), b))
    assert torch.isneginf(out[0]).all()
    out[torch.isfinite(out)].sum().backward()
    assert torch.isfinite(a.grad).all()
    assert (a.grad[0] == 0).all() and a.grad[1, 2] == 0


def test_log_matmul_gradcheck():
    a = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(trellis.log_matmul, (a, b))
