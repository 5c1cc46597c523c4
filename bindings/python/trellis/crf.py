"""A linear-chain conditional random field layer with pytorch-crf's interface, on Trellis' operators."""
import threading
from typing import Iterable, List, Literal, Optional, Tuple, Union, overload

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["CRF"]

Constraints = Union[Tensor, Tuple[Tensor, Tensor, Tensor], Iterable[Tuple[int, int]]]
_REDUCTIONS = frozenset(('none', 'sum', 'mean', 'token_mean'))


class CRF(nn.Module):
    """Conditional random field.

    This module implements a linear-chain conditional random field [LMP01]_ over ``num_tags`` tags. Its forward
    computation returns the log likelihood of given tag sequences under given emission scores; :meth:`~CRF.decode`
    finds the most likely tag sequence with the `Viterbi algorithm`_. It is a drop-in replacement for
    ``torchcrf.CRF`` from pytorch-crf: the same constructor, attributes, parameter names (so state dicts load either
    way), results and errors; replacing the import is the whole migration. The dynamic programs run as Trellis' C++ and
    CUDA operators instead of Python loops over time steps.

    Beyond pytorch-crf: :meth:`~CRF.marginals` (posterior tag and transition probabilities), :meth:`~CRF.kbest` (the
    k most likely sequences), :meth:`~CRF.log_partition`, decoding constrained to allowed transitions
    (``constraints=``), bfloat16 and float16 emissions, and ``decode(..., as_tensor=True)`` (one padded tensor instead
    of lists).

    Args:
        num_tags: Number of tags.
        batch_first: Whether the first dimension corresponds to the size of a minibatch.
        constraints: Allowed transitions for decoding, marginals, k-best and the log-partition (``forward``, the
            training objective, is never constrained: as in AllenNLP's ``ConditionalRandomField``). One of

            - a boolean tensor of size ``(num_tags, num_tags)``: entry ``[i, j]`` allows tag ``i`` followed by tag
              ``j``; every tag may start and end a sequence;
            - a tuple ``(transitions, start, end)`` of boolean tensors of sizes ``(num_tags, num_tags)``,
              ``(num_tags,)`` and ``(num_tags,)``;
            - an iterable of allowed ``(from_tag, to_tag)`` pairs in AllenNLP's convention: ``from_tag == num_tags``
              stands for the start of the sequence and ``to_tag == num_tags + 1`` for its end, and only the listed
              starts and ends are allowed (``allennlp.modules.conditional_random_field.allowed_transitions`` gives
              such a list for BIO, BIOUL, BMES and IOB1 labels).

    Attributes:
        start_transitions (`~torch.nn.Parameter`): Start transition score tensor of size ``(num_tags,)``.
        end_transitions (`~torch.nn.Parameter`): End transition score tensor of size ``(num_tags,)``.
        transitions (`~torch.nn.Parameter`): Transition score tensor of size ``(num_tags, num_tags)``;
            ``transitions[i, j]`` scores tag ``i`` followed by tag ``j``.
        allowed_transitions, allowed_start, allowed_end (`~torch.Tensor` or None): The constraints as boolean
            buffers (not part of the state dict), None when unconstrained.

    Shapes: with ``batch_first=False`` emissions are ``(seq_length, batch_size, num_tags)`` and tags and mask
    ``(seq_length, batch_size)``; with ``batch_first=True``, ``(batch_size, seq_length, num_tags)`` and
    ``(batch_size, seq_length)``. A mask is on (nonzero) for the tokens of each sequence and off for the padding
    after it: the first time step must be on everywhere, and a sequence cannot resume after padding.

    Example::

        >>> crf = CRF(num_tags=5)
        >>> emissions = torch.randn(3, 2, 5)          # (seq_length, batch_size, num_tags)
        >>> tags = torch.tensor([[0, 1], [2, 4], [3, 1]])
        >>> crf(emissions, tags)                       # log likelihood, summed over the batch
        >>> crf.decode(emissions)                      # [[...], [...]]: best tag sequence of each sample

    .. [LMP01] Lafferty, J., McCallum, A., Pereira, F. (2001).
       "Conditional random fields: Probabilistic models for segmenting and
       labeling sequence data". *Proc. 18th International Conf. on Machine
       Learning*. Morgan Kaufmann. pp. 282–289.

    .. _Viterbi algorithm: https://en.wikipedia.org/wiki/Viterbi_algorithm
    """

    allowed_transitions: Optional[Tensor]
    allowed_start: Optional[Tensor]
    allowed_end: Optional[Tensor]

    def __init__(self, num_tags: int, batch_first: bool = False, constraints: Optional[Constraints] = None) -> None:
        """Create the layer with random parameters (:meth:`reset_parameters`); the class documents the arguments."""
        if num_tags <= 0:
            raise ValueError(f'invalid number of tags: {num_tags}')
        super().__init__()
        self.num_tags = num_tags
        self.batch_first = batch_first
        self.start_transitions = nn.Parameter(torch.empty(num_tags))
        self.end_transitions = nn.Parameter(torch.empty(num_tags))
        self.transitions = nn.Parameter(torch.empty(num_tags, num_tags))
        self.register_buffer('allowed_transitions', None, persistent=False)
        self.register_buffer('allowed_start', None, persistent=False)
        self.register_buffer('allowed_end', None, persistent=False)

        self.reset_parameters()
        if constraints is not None:
            self.set_constraints(constraints)

    def reset_parameters(self) -> None:
        """Initialize the transition parameters.

        The parameters are drawn from the uniform distribution on [-0.1, 0.1], in the order start, end, transitions
        (as pytorch-crf does: the same seed gives the same parameters).
        """
        nn.init.uniform_(self.start_transitions, -0.1, 0.1)
        nn.init.uniform_(self.end_transitions, -0.1, 0.1)
        nn.init.uniform_(self.transitions, -0.1, 0.1)

    def set_constraints(self, constraints: Optional[Constraints]) -> None:
        """Set (or, with None, remove) the allowed transitions; see the class' ``constraints`` argument."""
        if constraints is None:
            self.allowed_transitions = self.allowed_start = self.allowed_end = None
            return
        k = self.num_tags
        device = self.transitions.device
        if isinstance(constraints, Tensor):
            allowed = constraints
            start = torch.ones(k, dtype=torch.bool, device=device)
            end = torch.ones(k, dtype=torch.bool, device=device)
        elif isinstance(constraints, tuple) and len(constraints) == 3 and all(isinstance(c, Tensor) for c in constraints):
            allowed, start, end = constraints
        else:
            allowed = torch.zeros(k, k, dtype=torch.bool)
            start = torch.zeros(k, dtype=torch.bool)
            end = torch.zeros(k, dtype=torch.bool)
            for pair in constraints:
                i, j = (int(v) for v in pair)
                if i == k and j == k + 1:
                    continue  # start straight to end: no sequence is empty
                if i == k and 0 <= j < k:
                    start[j] = True
                elif j == k + 1 and 0 <= i < k:
                    end[i] = True
                elif 0 <= i < k and 0 <= j < k:
                    allowed[i, j] = True
                else:
                    raise ValueError(
                        f'invalid constraint ({i}, {j}): tags are 0..{k - 1}, {k} stands for the start and '
                        f'{k + 1} for the end')
        for name, tensor, shape in (('transitions', allowed, (k, k)), ('start', start, (k,)), ('end', end, (k,))):
            if tuple(tensor.shape) != shape:
                raise ValueError(f'allowed {name} must have size {shape}, got {tuple(tensor.shape)}')
        self.allowed_transitions = allowed.to(device=device, dtype=torch.bool)
        self.allowed_start = start.to(device=device, dtype=torch.bool)
        self.allowed_end = end.to(device=device, dtype=torch.bool)

    def __repr__(self) -> str:
        constrained = '' if self.allowed_transitions is None else ', constrained'
        return f'{self.__class__.__name__}(num_tags={self.num_tags}{constrained})'

    def forward(self, emissions: Tensor, tags: Tensor, mask: Optional[Tensor] = None,
                reduction: str = 'sum') -> Tensor:
        """Compute the conditional log likelihood of a sequence of tags given emission scores.

        Args:
            emissions (`~torch.Tensor`): Emission score tensor of size ``(seq_length, batch_size, num_tags)`` if
                ``batch_first`` is ``False``, ``(batch_size, seq_length, num_tags)`` otherwise.
            tags (`~torch.LongTensor`): Sequence of tags tensor of size ``(seq_length, batch_size)`` if
                ``batch_first`` is ``False``, ``(batch_size, seq_length)`` otherwise.
            mask (`~torch.ByteTensor`): Mask tensor of size ``(seq_length, batch_size)`` if ``batch_first`` is
                ``False``, ``(batch_size, seq_length)`` otherwise.
            reduction: Specifies the reduction to apply to the output: ``none|sum|mean|token_mean``. ``none``: no
                reduction will be applied. ``sum``: the output will be summed over batches. ``mean``: the output
                will be averaged over batches. ``token_mean``: the output will be averaged over tokens.

        Returns:
            `~torch.Tensor`: The log likelihood. This will have size ``(batch_size,)`` if reduction is ``none``,
            ``()`` otherwise. It is differentiable with respect to the emissions and the three parameters.
            A tag outside ``[0, num_tags)`` is an error on the CPU; on a GPU the kernels check tags themselves, so
            that the call never waits for the device, and such a sequence's log likelihood (and its gradients) is
            NaN instead.
        """
        lengths, mask_check = self._validate(emissions, tags=tags, mask=mask)
        with mask_check:  # (pytorch-crf's order: a bad mask is reported before a bad reduction)
            if reduction not in _REDUCTIONS:
                raise ValueError(f'invalid reduction: {reduction}')
            if tags.dtype != torch.int64:
                tags = tags.long()
            # The operator takes the caller's layout (no transposed views for autograd to track) and reduces the
            # log-likelihood itself (short chains: forming its gradients in the forward pass; long ones: through the
            # library's autograd, the backward kernels in the backward pass): one operator call is the whole forward.
            return torch.ops.trellis.crf_log_likelihood.default(emissions, tags, self.transitions,
                                                                self.start_transitions, self.end_transitions, None,
                                                                lengths, self.batch_first, reduction)

    @overload
    def decode(self, emissions: Tensor, mask: Optional[Tensor] = ..., *,
               as_tensor: Literal[False] = ...) -> List[List[int]]: ...

    @overload
    def decode(self, emissions: Tensor, mask: Optional[Tensor] = ..., *, as_tensor: Literal[True]) -> Tensor: ...

    def decode(self, emissions: Tensor, mask: Optional[Tensor] = None, *,
               as_tensor: bool = False) -> Union[List[List[int]], Tensor]:
        """Find the most likely tag sequence using Viterbi algorithm.

        Args:
            emissions (`~torch.Tensor`): Emission score tensor of size ``(seq_length, batch_size, num_tags)`` if
                ``batch_first`` is ``False``, ``(batch_size, seq_length, num_tags)`` otherwise.
            mask (`~torch.ByteTensor`): Mask tensor of size ``(seq_length, batch_size)`` if ``batch_first`` is
                ``False``, ``(batch_size, seq_length)`` otherwise.
            as_tensor: Return one int64 tensor laid out as the mask (``(seq_length, batch_size)`` or
                ``(batch_size, seq_length)``, on the emissions' device) with -1 at padding, instead of lists.

        Returns:
            List of list containing the best tag sequence for each batch (each as long as its sequence), or the
            tensor. With constraints, a sequence that no allowed tag sequence fits gets -1 at every position.
        """
        lengths, mask_check = self._validate(emissions, mask=mask)
        emissions = self._batch_major(emissions)
        with mask_check:
            paths, _ = torch.ops.trellis.crf_viterbi.default(emissions, *self._scores(), None, lengths, True,
                                                             *self._constraints_for(emissions))
        if as_tensor:
            return paths if self.batch_first else paths.transpose(0, 1)
        return _trim(paths, lengths)

    @overload
    def kbest(self, emissions: Tensor, k: int, mask: Optional[Tensor] = ..., *,
              as_tensor: Literal[False] = ...) -> List[List[Tuple[List[int], float]]]: ...

    @overload
    def kbest(self, emissions: Tensor, k: int, mask: Optional[Tensor] = ..., *,
              as_tensor: Literal[True]) -> Tuple[Tensor, Tensor]: ...

    def kbest(self, emissions: Tensor, k: int, mask: Optional[Tensor] = None, *,
              as_tensor: bool = False) -> Union[List[List[Tuple[List[int], float]]], Tuple[Tensor, Tensor]]:
        """Find the ``k`` most likely tag sequences of each sample, best first.

        Args:
            emissions (`~torch.Tensor`): Emission score tensor, laid out as for :meth:`decode`.
            k: How many sequences to find (at least 1).
            mask (`~torch.ByteTensor`): Mask tensor, laid out as for :meth:`decode`.
            as_tensor: Return tensors instead of lists.

        Returns:
            For each sample, a list of up to ``k`` pairs ``(tags, score)`` where ``score`` is the sequence's
            unnormalised score (its log probability plus the log-partition); fewer than ``k`` where fewer sequences
            exist or are allowed. With ``as_tensor=True``, ``(paths, scores)``: int64 paths of size
            ``(seq_length, batch_size, k)`` if ``batch_first`` is ``False``, ``(batch_size, k, seq_length)``
            otherwise (-1 at padding and for missing sequences), and scores of size ``(batch_size, k)`` (-inf for
            missing sequences).
        """
        if k < 1:
            raise ValueError(f'k must be at least 1, got {k}')
        lengths, mask_check = self._validate(emissions, mask=mask)
        emissions = self._batch_major(emissions)
        with mask_check:
            paths, scores = torch.ops.trellis.crf_kbest(emissions, *self._scores(), None, lengths, k, True,
                                                        *self._constraints_for(emissions))
        if as_tensor:
            return (paths if self.batch_first else paths.permute(2, 0, 1)), scores
        result = []
        for sample_paths, sample_scores, length in zip(paths.tolist(), scores.tolist(), _lengths_list(paths, lengths)):
            result.append([(path[:length], score) for path, score in zip(sample_paths, sample_scores)
                           if score != float('-inf')])
        return result

    @overload
    def marginals(self, emissions: Tensor, mask: Optional[Tensor] = ..., *, edges: Literal[False] = ...) -> Tensor: ...

    @overload
    def marginals(self, emissions: Tensor, mask: Optional[Tensor] = ..., *,
                  edges: Literal[True]) -> Tuple[Tensor, Tensor]: ...

    def marginals(self, emissions: Tensor, mask: Optional[Tensor] = None, *,
                  edges: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """Posterior probability of each tag at each position (forward-backward).

        Args:
            emissions (`~torch.Tensor`): Emission score tensor, laid out as for :meth:`decode`.
            mask (`~torch.ByteTensor`): Mask tensor, laid out as for :meth:`decode`.
            edges: Also return the posterior probability of each transition.

        Returns:
            `~torch.Tensor` laid out as the emissions: ``P(tag_t = j)``, 0 at padding. With ``edges=True``, also a
            tensor of size ``(batch_size, seq_length - 1, num_tags, num_tags)`` (``(seq_length - 1, batch_size,
            num_tags, num_tags)`` if ``batch_first`` is ``False``) whose ``[t, i, j]`` is ``P(tag_t = i,
            tag_{t+1} = j)``. Not differentiable: for gradients, differentiate :meth:`log_partition` (whose
            gradient with respect to the emissions these marginals are).
        """
        lengths, mask_check = self._validate(emissions, mask=mask)
        emissions = self._batch_major(emissions)
        with mask_check:
            unary, pairwise = torch.ops.trellis.crf_marginals(emissions, *self._scores(), None, lengths, True,
                                                              edges, *self._constraints_for(emissions))
        if not self.batch_first:
            unary = unary.transpose(0, 1)
            pairwise = pairwise.transpose(0, 1) if edges else pairwise
        return (unary, pairwise) if edges else unary

    def log_partition(self, emissions: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """Log of the sum of the exponentiated scores of all tag sequences (of the allowed ones, with constraints).

        Args:
            emissions (`~torch.Tensor`): Emission score tensor, laid out as for :meth:`decode`.
            mask (`~torch.ByteTensor`): Mask tensor, laid out as for :meth:`decode`.

        Returns:
            `~torch.Tensor` of size ``(batch_size,)``, differentiable (its gradient with respect to the emissions is
            the marginals).
        """
        lengths, mask_check = self._validate(emissions, mask=mask)
        emissions = self._batch_major(emissions)
        with mask_check:
            return torch.ops.trellis.crf_log_partition(emissions, *self._scores(), None, lengths, True,
                                                       *self._constraints_for(emissions))

    def _validate(self, emissions: Tensor, tags: Optional[Tensor] = None,
                  mask: Optional[Tensor] = None) -> Tuple[Optional[Tensor], '_MaskCheck']:
        """pytorch-crf's checks, in its order and with its messages; returns each sequence's length (None: all full)
        and the check of the mask's values, a context manager: the call it guards is queued before the check waits
        (see :class:`_MaskCheck`).
        """
        if emissions.dim() != 3:
            raise ValueError(f'emissions must have dimension of 3, got {emissions.dim()}')
        if emissions.size(2) != self.num_tags:
            raise ValueError(f'expected last dimension of emissions is {self.num_tags}, got {emissions.size(2)}')

        if tags is not None:
            if emissions.shape[:2] != tags.shape:
                raise ValueError('the first two dimensions of emissions and tags must match, '
                                 f'got {tuple(emissions.shape[:2])} and {tuple(tags.shape)}')

        if mask is None:
            return None, _NO_MASK
        if emissions.shape[:2] != mask.shape:
            raise ValueError('the first two dimensions of emissions and mask must match, '
                             f'got {tuple(emissions.shape[:2])} and {tuple(mask.shape)}')
        if mask.dtype != torch.bool and mask.dtype != torch.uint8:
            mask = mask != 0
        # Trellis' sequences are prefixes: a mask that turns on again after padding has no such reading
        # (pytorch-crf would silently score a mixture of the two), so it is refused. One operator call (one kernel on
        # a GPU) gives the lengths and both flags.
        lengths, flags = torch.ops.trellis._crf_mask_lengths.default(mask, self.batch_first)
        return lengths, _MaskCheck(flags)

    def _batch_major(self, emissions: Tensor) -> Tensor:
        """The emissions as (batch_size, seq_length, num_tags)."""
        return emissions if self.batch_first else emissions.transpose(0, 1)

    def _scores(self) -> Tuple[Tensor, Tensor, Tensor]:
        """transitions, start and end as the operators take them (any float type: they compute in float32, or in
        float64 when any input is float64)."""
        return self.transitions, self.start_transitions, self.end_transitions

    def _constraints_for(self, emissions: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        if self.allowed_transitions is None:
            return None, None, None
        device = emissions.device
        return self.allowed_transitions.to(device), self.allowed_start.to(device), self.allowed_end.to(device)


class _MaskCheck:
    """A mask's values checked as the block it guards ends: pytorch-crf's error for a first timestep not all on,
    Trellis' for a mask that is not a prefix, either one in place of an error the block raised. On a GPU the flags
    cross to the host by a non-blocking copy queued before the block, and the check waits for that copy alone: the
    block's own work (an operator call) is queued by then and keeps the GPU busy, where a transfer before the call
    would leave it idle while the host queues the call."""

    def __init__(self, flags: Optional[Tensor]):
        """flags: (some first timestep off, some timestep on after one that is off); None: no mask."""
        self._flags, self._copied = flags, None
        if flags is not None and flags.is_cuda:
            self._flags, self._copied = _pinned_flags(flags.device)
            self._flags.copy_(flags, non_blocking=True)
            self._copied.record(torch.cuda.current_stream(flags.device))  # the stream the copy was queued on

    def __enter__(self) -> '_MaskCheck':
        return self

    def __exit__(self, *raised) -> None:
        if self._flags is None:
            return
        if self._copied is not None:
            self._copied.synchronize()
        first_off, hole = self._flags.tolist()
        # `from None`: the block's own error (the call on a mask it cannot read) is not the one to show.
        if first_off:
            raise ValueError('mask of the first timestep must all be on') from None
        if hole:
            raise ValueError('mask must be on for a prefix of each sequence: got a timestep on after one that is '
                             'off') from None


_NO_MASK = _MaskCheck(None)
_pinned = threading.local()


def _pinned_flags(device: torch.device) -> Tuple[Tensor, 'torch.cuda.Event']:
    """This thread's pinned pair of flags and its event for a device, made once: a check waits for its copy before the
    thread can start the next one, so one pair per thread and device is never written while it is being read."""
    buffers = _pinned.__dict__.setdefault('buffers', {})
    pair = buffers.get(device)
    if pair is None:
        pair = buffers[device] = (torch.empty(2, dtype=torch.bool, pin_memory=True), torch.cuda.Event())
    return pair


def _lengths_list(paths: Tensor, lengths: Optional[Tensor]) -> List[int]:
    return [paths.shape[-1]] * paths.shape[0] if lengths is None else lengths.tolist()


def _trim(paths: Tensor, lengths: Optional[Tensor]) -> List[List[int]]:
    """(batch_size, seq_length) paths as lists, each cut to its sequence's length."""
    return [row[:n] for row, n in zip(paths.tolist(), _lengths_list(paths, lengths))]
