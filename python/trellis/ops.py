"""Functions over Trellis' PyTorch operators (``torch.ops.trellis``): semiring matrix products and the fused LLM
output head. Each is a thin call of one operator, so it works under ``torch.compile`` and on CPU and CUDA tensors."""
from typing import Literal, Optional, Tuple, Union, overload

import torch
from torch import Tensor

__all__ = ["log_matmul", "max_matmul", "linear_cross_entropy", "token_logprobs", "linear_logsumexp"]


def log_matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product in the log semiring: ``log(exp(a) @ exp(b))``, computed stably.

    ``out[..., i, j] = logsumexp_k(a[..., i, k] + b[..., k, j])``. Batch dimensions broadcast as in
    :func:`torch.matmul`; ``-inf`` entries (zero probability) never produce NaN, in values or gradients.

    Args:
        a: Tensor of size ``(*, n, k)``.
        b: Tensor of size ``(*, k, m)``.

    Returns:
        Tensor of size ``(*, n, m)``, differentiable with respect to ``a`` and ``b`` (the gradient is the softmax
        weight of each term).
    """
    return torch.ops.trellis.log_matmul(a, b)


def max_matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product in the max-plus (Viterbi) semiring: ``out[..., i, j] = max_k(a[..., i, k] + b[..., k, j])``.

    Batch dimensions broadcast as in :func:`torch.matmul`.

    Args:
        a: Tensor of size ``(*, n, k)``.
        b: Tensor of size ``(*, k, m)``.

    Returns:
        Tensor of size ``(*, n, m)``; its gradient flows to the maximising term of each entry.
    """
    return torch.ops.trellis.max_matmul(a, b)


def linear_cross_entropy(x: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         softcap: Optional[float] = None, z_loss: float = 0.0, chunk_bytes: int = 0,
                         recompute_logits: bool = False, temperature: float = 1.0) -> Tensor:
    """Cross-entropy of the logits ``x @ weight.T + bias`` against ``targets``, without materialising the logits.

    Equal to ``F.cross_entropy(x @ weight.T + bias, targets, ignore_index=..., reduction=...,
    label_smoothing=...)`` plus ``z_loss * mean(logsumexp(logits)**2)`` over the counted rows, with the logits
    formed a slab at a time (at most ``chunk_bytes``, 1 GiB by default) instead of whole.

    Args:
        x: Hidden states of size ``(*, D)`` (bfloat16, float16, float32 or float64).
        weight: Output embedding of size ``(V, D)``.
        targets: Class indices of size ``(*)``; ``ignore_index`` rows count for nothing.
        bias: Optional bias of size ``(V,)``.
        ignore_index: Target value of rows to ignore (padding).
        reduction: ``none|mean|sum``, as in :func:`torch.nn.functional.cross_entropy`.
        label_smoothing: Weight of the uniform distribution mixed into the target, in ``[0, 1]``.
        softcap: When given, logits are ``softcap * tanh(logits / softcap)``.
        z_loss: Weight of the squared log-partition term.
        chunk_bytes: Size of one slab of float32 logits; 0 for the default.
        recompute_logits: Form the logits a second time in the backward instead of keeping a slab (O(N) extra
            memory, more time).
        temperature: Sampling temperature ``τ > 0``: the loss is that of the logits divided by ``τ`` (after the
            soft-cap); gradients flow through the division.

    Returns:
        The loss: a scalar, or size ``(*)`` for ``reduction='none'``; differentiable with respect to ``x``,
        ``weight`` and ``bias``.
    """
    return torch.ops.trellis.linear_cross_entropy(x, weight, targets, bias, ignore_index, reduction, label_smoothing,
                                                  softcap, z_loss, chunk_bytes, recompute_logits, temperature)


@overload
def token_logprobs(x: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor] = ..., *,
                   softcap: Optional[float] = ..., ignore_index: int = ..., entropy: Literal[False] = ...,
                   chunk_bytes: int = ..., temperature: float = ...) -> Tensor: ...


@overload
def token_logprobs(x: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor] = ..., *,
                   softcap: Optional[float] = ..., ignore_index: int = ..., entropy: Literal[True],
                   chunk_bytes: int = ..., temperature: float = ...) -> Tuple[Tensor, Tensor]: ...


def token_logprobs(x: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor] = None, *,
                   softcap: Optional[float] = None, ignore_index: int = -100, entropy: bool = False,
                   chunk_bytes: int = 0, temperature: float = 1.0) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Log-probability of each target token under ``softmax((x @ weight.T + bias) / temperature)``, without
    materialising the logits.

    With ``temperature``, the log-probabilities (and entropies) are those of the distribution a sampler draws from at
    that temperature, as RL frameworks need them.

    Args:
        x: Hidden states of size ``(*, D)``.
        weight: Output embedding of size ``(V, D)``.
        targets: Token ids of size ``(*)``; rows equal to ``ignore_index`` get 0.
        bias: Optional bias of size ``(V,)``.
        softcap: When given, logits are ``softcap * tanh(logits / softcap)``.
        ignore_index: Target value of rows to ignore.
        entropy: Also return the entropy of each row's distribution.
        chunk_bytes: Size of one slab of float32 logits; 0 for the default.
        temperature: Sampling temperature ``τ > 0``: the logits are divided by ``τ`` (after the soft-cap).

    Returns:
        Log-probabilities of size ``(*)`` (float32, float64 for float64 inputs), and with ``entropy=True`` the
        entropies of the same size, as a tuple. Both are differentiable with respect to ``x``, ``weight`` and ``bias``.
    """
    logprobs, row_entropy = torch.ops.trellis.token_logprobs(x, weight, targets, bias, softcap, ignore_index, entropy,
                                                             chunk_bytes, temperature)
    return (logprobs, row_entropy) if entropy else logprobs


def linear_logsumexp(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, softcap: Optional[float] = None,
                     chunk_bytes: int = 0, temperature: float = 1.0) -> Tensor:
    """``logsumexp((x @ weight.T + bias) / temperature, dim=-1)`` without materialising the logits.

    Args:
        x: Hidden states of size ``(*, D)``.
        weight: Output embedding of size ``(V, D)``.
        bias: Optional bias of size ``(V,)``.
        softcap: When given, logits are ``softcap * tanh(logits / softcap)``.
        chunk_bytes: Size of one slab of float32 logits; 0 for the default.
        temperature: Sampling temperature ``τ > 0``: the logits are divided by ``τ`` (after the soft-cap).

    Returns:
        Tensor of size ``(*)`` (float32, float64 for float64 inputs), differentiable with respect to ``x``, ``weight``
        and ``bias``.
    """
    return torch.ops.trellis.linear_logsumexp(x, weight, bias, softcap, chunk_bytes, temperature)
