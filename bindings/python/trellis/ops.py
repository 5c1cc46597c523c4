"""Functions over Trellis' PyTorch operators (``torch.ops.trellis``): semiring matrix products and the fused LLM
output head, on one device or with the vocabulary split over a process group's ranks. Each is a thin call of one
operator, so it works under ``torch.compile`` and on CPU and CUDA tensors."""
from typing import Literal, Optional, Tuple, Union, overload

import torch
from torch import Tensor

__all__ = ["log_matmul", "max_matmul", "linear_cross_entropy", "token_logprobs", "linear_logsumexp",
           "vocab_parallel_linear_cross_entropy", "vocab_parallel_token_logprobs", "vocab_parallel_linear_logsumexp"]

#: A process group, or its ``group_name`` (the form torch.compile traces: pass the name inside compiled code).
GroupLike = Union[str, "torch.distributed.ProcessGroup"]


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
                         recompute_logits: bool = False, temperature: float = 1.0,
                         memory_budget: Optional[int] = None) -> Tensor:
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
        memory_budget: Bytes the training step may hold beyond its inputs, gradients and loss. When given, it picks
            the route (a slab of float32 logits, or the logits formed twice), the slab's size and type for these
            shapes, in place of ``chunk_bytes`` and ``recompute_logits``; a budget below the least the shapes need
            (a few bytes per row and 8 vocabulary columns of a chunk) is an error.

    Returns:
        The loss: a scalar, or size ``(*)`` for ``reduction='none'``; differentiable with respect to ``x``,
        ``weight`` and ``bias``.
    """
    return torch.ops.trellis.linear_cross_entropy(x, weight, targets, bias, ignore_index, reduction, label_smoothing,
                                                  softcap, z_loss, chunk_bytes, recompute_logits, temperature,
                                                  -1 if memory_budget is None else memory_budget)


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


def _group_name(group: GroupLike) -> str:
    return group if isinstance(group, str) else group.group_name


def vocab_parallel_linear_cross_entropy(x: Tensor, weight: Tensor, targets: Tensor, group: GroupLike,
                                        bias: Optional[Tensor] = None, *, ignore_index: int = -100,
                                        reduction: str = "mean", label_smoothing: float = 0.0,
                                        softcap: Optional[float] = None, z_loss: float = 0.0, chunk_bytes: int = 0,
                                        recompute_logits: bool = False, temperature: float = 1.0) -> Tensor:
    """:func:`linear_cross_entropy` with the vocabulary split over the ranks of ``group`` (tensor parallelism).

    Every rank of ``group`` calls it with the same ``x`` and ``targets`` (ids of the whole vocabulary) and its own
    contiguous slice of the output layer's rows, ranks in order, slices of any sizes. The loss and ``x``'s gradient
    (one all-reduce) are the single-device ones on the whole weight, on every rank; ``weight``'s and ``bias``'s
    gradients are this rank's rows of the whole ones. docs/distributed.md describes the communication.

    Args:
        x, targets: As in :func:`linear_cross_entropy`, the same on every rank.
        weight: This rank's rows of the output embedding, ``(V_r, D)``.
        group: A ``torch.distributed`` process group (NCCL for CUDA tensors, Gloo for CPU ones) or its
            ``group_name``; inside torch.compile pass the name, which it traces.
        bias: This rank's entries of the bias, ``(V_r,)``, or None.
        ignore_index, reduction, label_smoothing, softcap, z_loss, chunk_bytes, recompute_logits, temperature: As in
            :func:`linear_cross_entropy`.

    Returns:
        The loss, as :func:`linear_cross_entropy` returns it.
    """
    return torch.ops.trellis.vocab_parallel_linear_cross_entropy(
        x, weight, targets, _group_name(group), bias, ignore_index, reduction, label_smoothing, softcap, z_loss,
        chunk_bytes, recompute_logits, temperature)


def vocab_parallel_token_logprobs(x: Tensor, weight: Tensor, targets: Tensor, group: GroupLike,
                                  bias: Optional[Tensor] = None, *, softcap: Optional[float] = None,
                                  ignore_index: int = -100, entropy: bool = False, chunk_bytes: int = 0,
                                  temperature: float = 1.0) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`token_logprobs` (and the entropies) with the vocabulary split over the ranks of ``group``.

    Args:
        x, targets: As in :func:`token_logprobs`, the same on every rank.
        weight, group, bias: As in :func:`vocab_parallel_linear_cross_entropy`: this rank's slice, the group.
        softcap, ignore_index, entropy, chunk_bytes, temperature: As in :func:`token_logprobs`.

    Returns:
        The whole vocabulary's log-probabilities (and entropies) as :func:`token_logprobs` returns them, on every rank;
        differentiable with respect to ``x`` (one all-reduce in the backward), this rank's ``weight`` rows and
        ``bias`` entries.
    """
    logprobs, row_entropy = torch.ops.trellis.vocab_parallel_token_logprobs(
        x, weight, targets, _group_name(group), bias, softcap, ignore_index, entropy, chunk_bytes, temperature)
    return (logprobs, row_entropy) if entropy else logprobs


def vocab_parallel_linear_logsumexp(x: Tensor, weight: Tensor, group: GroupLike, bias: Optional[Tensor] = None, *,
                                    softcap: Optional[float] = None, chunk_bytes: int = 0,
                                    temperature: float = 1.0) -> Tensor:
    """:func:`linear_logsumexp` over the whole vocabulary, split over the ranks of ``group``.

    Args:
        x: As in :func:`linear_logsumexp`, the same on every rank.
        weight, group, bias: As in :func:`vocab_parallel_linear_cross_entropy`: this rank's slice, the group.
        softcap, chunk_bytes, temperature: As in :func:`linear_logsumexp`.

    Returns:
        The whole vocabulary's log-sum-exp of each row, on every rank; differentiable as
        :func:`vocab_parallel_token_logprobs`.
    """
    return torch.ops.trellis.vocab_parallel_linear_logsumexp(x, weight, _group_name(group), bias, softcap,
                                                             chunk_bytes, temperature)
