"""Hidden Markov models with hmmlearn's estimator interface, on Trellis' batched CPU and CUDA operators.

:class:`CategoricalHMM` and :class:`GaussianHMM` (diagonal covariances) take the constructor arguments, methods and
fitted attributes of ``hmmlearn.hmm.CategoricalHMM`` and ``hmmlearn.hmm.GaussianHMM`` (hmmlearn 0.3), so code written
for hmmlearn runs with ``from trellis.hmm import CategoricalHMM, GaussianHMM`` in place of its import::

    from trellis.hmm import CategoricalHMM
    model = CategoricalHMM(n_components=64, n_iter=20, random_state=0)          # device="cuda" for the GPU
    model.fit(X, lengths)                    # X: (n_samples, 1) symbol ids; lengths: the sequences' lengths
    log_prob = model.score(X, lengths)
    states = model.predict(X, lengths)

The sequences are computed together, as padded batches of emission scores log P(x_t | state), by the chain
operators: ``torch.ops.trellis.crf_log_partition`` (the log-likelihood), ``crf_marginals`` (posteriors) and
``crf_viterbi``; the E-step takes the expected counts as the gradient of the log-likelihood with respect to the log
start and transition probabilities and the emission scores. The M-step, the priors, the random initialisation of
``startprob_``, ``transmat_`` and ``emissionprob_`` and :meth:`~CategoricalHMM.sample` are hmmlearn's, with its random number streams: from the same parameters (or the same
``random_state``) fitting gives hmmlearn's model. Differences: ``means_`` are initialised by a k-means of Trellis' own
(not scikit-learn's); ``covariance_type`` is ``"diag"`` only; ``params`` without ``"m"`` still updates ``covars_``
around the current means (hmmlearn 0.3.3 leaves the posterior weights out of that update).

:func:`load` and :func:`save` read and write the HDF5 model files of the ``trellis hmm`` command line
(docs/hmm-format.md) through the library's own reader and writer.
"""
import inspect
import logging
import math
import sys
from collections import deque
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

__all__ = ["CategoricalHMM", "GaussianHMM", "ConvergenceMonitor", "NotFittedError", "load", "save"]

_log = logging.getLogger(__name__)

#: The decoders of :meth:`CategoricalHMM.decode`, as hmmlearn's.
DECODER_ALGORITHMS = frozenset(("viterbi", "map"))
#: hmmlearn's covariance types; Trellis implements "diag".
COVARIANCE_TYPES = frozenset(("spherical", "diag", "full", "tied"))

try:  # scikit-learn's exception where it is installed, so that `except NotFittedError` written for hmmlearn works
    from sklearn.exceptions import NotFittedError
except ImportError:  # pragma: no cover - scikit-learn comes with hmmlearn, not with Trellis
    class NotFittedError(ValueError, AttributeError):  # type: ignore[no-redef]
        """Raised when an estimator is used before it has parameters (scikit-learn's class of the same name)."""

ArrayLike = Union[np.ndarray, Sequence, Tensor]
RandomStateLike = Union[None, int, np.random.RandomState]
# Bytes of one [B,T,K] tensor of a batch: the batches' sizes follow from it (a longer sequence is a batch alone).
_BATCH_BYTES = {"cpu": 256 << 20, "cuda": 1 << 30}


def check_random_state(seed: RandomStateLike) -> np.random.RandomState:
    """A ``numpy.random.RandomState`` from None (numpy's global one), an int seed or an instance (scikit-learn's)."""
    if seed is None or seed is np.random:
        return np.random.mtrand._rand
    if isinstance(seed, (int, np.integer)):
        return np.random.RandomState(seed)
    if isinstance(seed, np.random.RandomState):
        return seed
    raise ValueError(f"{seed!r} cannot be used to seed a numpy.random.RandomState instance")


def _normalize(a: np.ndarray, axis: Optional[int] = None) -> None:
    """hmmlearn.utils.normalize: divide by the sum in place; all-zero rows (axis given) stay zero."""
    a_sum = a.sum(axis)
    if axis and a.ndim > 1:
        a_sum[a_sum == 0] = 1
        shape = list(a.shape)
        shape[axis] = 1
        a_sum.shape = shape
    a /= a_sum


class ConvergenceMonitor:
    """Reports and checks the convergence of EM, as ``hmmlearn.base.ConvergenceMonitor``.

    Attributes:
        history: The total log-likelihood of the data before each EM update (all iterations).
        iter: The number of iterations performed.
    """

    _template = "{iter:>10d} {log_prob:>16.8f} {delta:>+16.8f}"

    def __init__(self, tol: float, n_iter: int, verbose: bool) -> None:
        self.tol = tol
        self.n_iter = n_iter
        self.verbose = verbose
        self.history: deque = deque()
        self.iter = 0

    def __repr__(self) -> str:
        params = sorted(dict(vars(self), history=list(self.history)).items())
        return f"{type(self).__name__}(\n" + "".join(f"    {k}={v},\n" for k, v in params) + ")"

    def _reset(self) -> None:
        self.iter = 0
        self.history.clear()

    def report(self, log_prob: float) -> None:
        """Record one iteration's log-likelihood (printed to stderr when verbose; a decrease is logged)."""
        if self.verbose:
            delta = log_prob - self.history[-1] if self.history else np.nan
            print(self._template.format(iter=self.iter + 1, log_prob=log_prob, delta=delta), file=sys.stderr)
        precision = np.finfo(float).eps ** 0.5
        if self.history and (log_prob - self.history[-1]) < -precision:
            _log.warning(f"Model is not converging.  Current: {log_prob} is not greater than {self.history[-1]}. "
                         f"Delta is {log_prob - self.history[-1]}")
        self.history.append(log_prob)
        self.iter += 1

    @property
    def converged(self) -> bool:
        """Whether EM has converged: ``n_iter`` iterations done, or the last gain below ``tol``."""
        return (self.iter == self.n_iter or
                (len(self.history) >= 2 and self.history[-1] - self.history[-2] < self.tol))


class _Batches:
    """Sequences concatenated in X as padded batches on the device, and the way back to X's rows.

    Sequences are sorted by length (longest first) and cut into batches of at most ``batch_tokens`` padded positions,
    so that sequences of similar length share a batch. With ``min_fill`` > 0 a batch of at least ``min_sequences``
    also ends before a sequence shorter than ``min_fill`` times its longest: the CPU computes padding it need not,
    while a GPU runs one large batch in about the time of a small one.
    """

    def __init__(self, observations: Tensor, lengths: np.ndarray, batch_tokens: int, min_fill: float = 0.0,
                 min_sequences: int = 1) -> None:
        device = observations.device
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        order = np.argsort(-lengths, kind="stable")
        sorted_lengths = lengths[order]
        self.batches: List[Tuple[Tensor, Tensor, Tensor, Tensor]] = []  # observations, lengths, mask, rows
        first = 0
        while first < len(order):
            longest = int(sorted_lengths[first])
            end = min(len(order), first + max(1, batch_tokens // longest))
            if min_fill > 0:
                # The first sequence (from min_sequences on) shorter than min_fill * longest starts the next batch.
                short = first + min_sequences + int(np.searchsorted(-sorted_lengths[first + min_sequences:end],
                                                                     -min_fill * longest, side="right"))
                end = min(end, max(short, first + 1))
            chosen = order[first:end]
            first = end
            batch_lengths = torch.as_tensor(lengths[chosen], device=device)
            steps = torch.arange(longest, device=device)
            mask = steps[None, :] < batch_lengths[:, None]
            rows = torch.as_tensor(offsets[chosen], device=device)[:, None] + steps[None, :]
            rows = torch.where(mask, rows, torch.zeros((), dtype=rows.dtype, device=device))
            self.batches.append((observations[rows], batch_lengths, mask, rows[mask]))

    def __iter__(self) -> Iterator[Tuple[Tensor, Tensor, Tensor, Tensor]]:
        return iter(self.batches)


class _BaseHMM:
    """What the categorical and Gaussian estimators share: hmmlearn's ``BaseHMM`` on Trellis' operators."""

    def __init__(self, n_components: int, startprob_prior: Union[float, np.ndarray],
                 transmat_prior: Union[float, np.ndarray], algorithm: str, random_state: RandomStateLike,
                 n_iter: int, tol: float, verbose: bool, params: str, init_params: str, implementation: str,
                 device: Union[str, torch.device], dtype: Optional[torch.dtype], batch_tokens: Optional[int]) -> None:
        self.n_components = n_components
        self.startprob_prior = startprob_prior
        self.transmat_prior = transmat_prior
        self.algorithm = algorithm
        self.random_state = random_state
        self.n_iter = n_iter
        self.tol = tol
        self.verbose = verbose
        self.params = params
        self.init_params = init_params
        self.implementation = implementation
        self.device = device
        self.dtype = dtype
        self.batch_tokens = batch_tokens
        self.monitor_ = ConvergenceMonitor(self.tol, self.n_iter, self.verbose)

    # ---- scikit-learn's estimator protocol (get_params/set_params, repr) ----

    @classmethod
    def _param_names(cls) -> List[str]:
        return [p.name for p in inspect.signature(cls.__init__).parameters.values()
                if p.name != "self" and p.kind != p.VAR_KEYWORD]

    def get_params(self, deep: bool = True) -> Dict[str, Any]:
        """The constructor's arguments as set on this estimator (scikit-learn's protocol)."""
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params: Any) -> "_BaseHMM":
        """Set constructor arguments by name (scikit-learn's protocol); returns self."""
        valid = self._param_names()
        for name, value in params.items():
            if name not in valid:
                raise ValueError(f"Invalid parameter {name!r} for estimator {type(self).__name__}. "
                                 f"Valid parameters are: {sorted(valid)!r}.")
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        defaults = {p.name: p.default for p in inspect.signature(type(self).__init__).parameters.values()}
        changed = [f"{k}={v!r}" for k, v in self.get_params().items()
                   if not (isinstance(v, (str, int, float, type(None))) and v == defaults.get(k))]
        return f"{type(self).__name__}({', '.join(changed)})"

    # ---- the device, the computation's type, the batches ----

    def _torch_device(self) -> torch.device:
        return torch.device(self.device)

    def _compute_dtype(self) -> torch.dtype:
        dtype = self.dtype if self.dtype is not None else torch.float64
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {self.dtype!r}")
        return dtype

    def _batch_tokens(self) -> int:
        if self.batch_tokens is not None:
            if int(self.batch_tokens) < 1:
                raise ValueError(f"batch_tokens must be positive, got {self.batch_tokens}")
            return int(self.batch_tokens)
        itemsize = torch.empty((), dtype=self._compute_dtype()).element_size()
        budget = _BATCH_BYTES.get(self._torch_device().type, _BATCH_BYTES["cpu"])
        return max(1, budget // (max(1, self.n_components) * itemsize))

    def _batches(self, X: np.ndarray, lengths: Optional[ArrayLike]) -> _Batches:
        lengths = self._check_lengths(X, lengths)
        on_cpu = self._torch_device().type == "cpu"
        return _Batches(self._observations_tensor(X), lengths, self._batch_tokens(), min_fill=0.75 if on_cpu else 0.0,
                        min_sequences=4 * torch.get_num_threads())

    @staticmethod
    def _check_lengths(X: np.ndarray, lengths: Optional[ArrayLike]) -> np.ndarray:
        n_samples = len(X)
        if lengths is None:
            return np.asarray([n_samples], dtype=np.int64)
        given = lengths
        lengths = np.asarray(lengths)
        if lengths.ndim != 1 or (lengths.size and not np.issubdtype(lengths.dtype, np.integer)):
            raise ValueError(f"lengths must be a 1-d array of integers, got {given!r}")
        lengths = lengths.astype(np.int64)
        if lengths.size == 0 or lengths.sum() != n_samples:
            raise ValueError(f"lengths array {given} doesn't sum to {n_samples} samples")
        if (lengths < 1).any():
            raise ValueError(f"lengths array {given} holds a sequence of length {lengths.min()} (each must be >= 1)")
        return lengths

    def _log_parameters(self) -> Dict[str, Tensor]:
        """The model as the operators take it: log_start, log_transitions and the emission parameters."""
        device, dtype = self._torch_device(), self._compute_dtype()
        as_tensor = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float64), device=device).to(dtype)  # noqa: E731
        return {"log_start": as_tensor(self.startprob_).log(), "log_transitions": as_tensor(self.transmat_).log(),
                **self._emission_parameters(as_tensor)}

    # ---- inference ----

    def _check_is_fitted(self) -> None:
        if not hasattr(self, "startprob_"):
            raise NotFittedError(f"This {type(self).__name__} instance is not fitted yet. Call 'fit' with "
                                 f"appropriate arguments before using this estimator.")

    def _prepare(self, X: ArrayLike, lengths: Optional[ArrayLike]) -> Tuple[np.ndarray, _Batches, Dict[str, Tensor]]:
        self._check_is_fitted()
        self._check()
        X = self._check_X(X)
        self._check_X_fits_model(X)
        return X, self._batches(X, lengths), self._log_parameters()

    @torch.no_grad()
    def _score(self, X: ArrayLike, lengths: Optional[ArrayLike], compute_posteriors: bool) \
            -> Tuple[float, np.ndarray]:
        X, batches, model = self._prepare(X, lengths)
        log_prob = torch.zeros((), dtype=torch.float64, device=self._torch_device())
        posteriors = None
        if compute_posteriors:
            posteriors = torch.empty((len(X), self.n_components), dtype=self._compute_dtype(),
                                     device=self._torch_device())
        for observations, batch_lengths, mask, rows in batches:
            scores = self._emission_scores(observations, model)
            log_prob += torch.ops.trellis.crf_log_partition(scores, model["log_transitions"], model["log_start"], None,
                                                            None, batch_lengths).sum()
            if compute_posteriors:
                nodes, _ = torch.ops.trellis.crf_marginals(scores, model["log_transitions"], model["log_start"], None,
                                                           None, batch_lengths)
                posteriors[rows] = nodes[mask]
        posteriors_np = posteriors.double().cpu().numpy() if compute_posteriors \
            else np.empty((0, self.n_components))
        return float(log_prob), posteriors_np

    def score_samples(self, X: ArrayLike, lengths: Optional[ArrayLike] = None) -> Tuple[float, np.ndarray]:
        """The log-likelihood of ``X`` and the state posteriors of each sample.

        Args:
            X: The samples of all sequences, concatenated: ``(n_samples, n_features)`` (``(n_samples, 1)`` symbol ids
                for :class:`CategoricalHMM`).
            lengths: The length of each sequence (summing to ``n_samples``); None: ``X`` is one sequence.

        Returns:
            ``(log_prob, posteriors)``: the total log-likelihood (a float) and ``P(state | sequence)`` of each sample,
            ``(n_samples, n_components)``.
        """
        return self._score(X, lengths, compute_posteriors=True)

    def score(self, X: ArrayLike, lengths: Optional[ArrayLike] = None) -> float:
        """The total log-likelihood of the sequences of ``X`` (arguments as in :meth:`score_samples`)."""
        return self._score(X, lengths, compute_posteriors=False)[0]

    @torch.no_grad()
    def decode(self, X: ArrayLike, lengths: Optional[ArrayLike] = None, algorithm: Optional[str] = None) \
            -> Tuple[float, np.ndarray]:
        """The most likely states of each sequence of ``X``.

        Args:
            X, lengths: As in :meth:`score_samples`.
            algorithm: ``"viterbi"``: the most probable state sequence; ``"map"``: the most probable state of each
                sample (posterior decoding). None: the estimator's ``algorithm``.

        Returns:
            ``(log_prob, state_sequence)``: for "viterbi" the total log-probability of the best paths with the
            observations; for "map" hmmlearn's figure, the sum of each sample's largest posterior; and the states,
            ``(n_samples,)`` int64.
        """
        self._check_is_fitted()
        self._check()
        algorithm = algorithm or self.algorithm
        if algorithm not in DECODER_ALGORITHMS:
            raise ValueError(f"Unknown decoder {algorithm!r}")
        if algorithm == "map":
            _, posteriors = self.score_samples(X, lengths)
            return float(np.max(posteriors, axis=1).sum()), np.argmax(posteriors, axis=1)
        X, batches, model = self._prepare(X, lengths)
        device = self._torch_device()
        log_prob = torch.zeros((), dtype=torch.float64, device=device)
        states = torch.empty(len(X), dtype=torch.int64, device=device)
        for observations, batch_lengths, mask, rows in batches:
            scores = self._emission_scores(observations, model)
            paths, path_scores = torch.ops.trellis.crf_viterbi(scores, model["log_transitions"], model["log_start"],
                                                               None, None, batch_lengths)
            log_prob += path_scores.sum()
            states[rows] = paths[mask]
        return float(log_prob), states.cpu().numpy()

    def predict(self, X: ArrayLike, lengths: Optional[ArrayLike] = None) -> np.ndarray:
        """The states of :meth:`decode` with the estimator's ``algorithm``: ``(n_samples,)`` int64."""
        return self.decode(X, lengths)[1]

    def predict_proba(self, X: ArrayLike, lengths: Optional[ArrayLike] = None) -> np.ndarray:
        """The state posteriors of each sample, ``(n_samples, n_components)`` (see :meth:`score_samples`)."""
        return self.score_samples(X, lengths)[1]

    def get_stationary_distribution(self) -> np.ndarray:
        """The stationary distribution of the states: the left eigenvector of ``transmat_`` of eigenvalue 1."""
        if not hasattr(self, "transmat_"):
            raise NotFittedError(f"This {type(self).__name__} instance is not fitted yet. Call 'fit' with "
                                 f"appropriate arguments before using this estimator.")
        eigvals, eigvecs = np.linalg.eig(np.asarray(self.transmat_).T)
        eigvec = np.real_if_close(eigvecs[:, np.argmax(eigvals)])
        return eigvec / eigvec.sum()

    # ---- information criteria ----

    def aic(self, X: ArrayLike, lengths: Optional[ArrayLike] = None) -> float:
        """Akaike's information criterion, ``-2 log L + 2 p`` with hmmlearn's count ``p`` of free parameters."""
        log_likelihood = self.score(X, lengths=lengths)  # checks the model (and sets n_features) first
        return -2 * log_likelihood + 2 * sum(self._get_n_fit_scalars_per_param().values())

    def bic(self, X: ArrayLike, lengths: Optional[ArrayLike] = None) -> float:
        """The Bayesian information criterion, ``-2 log L + p log(n_samples)``."""
        log_likelihood = self.score(X, lengths=lengths)
        return -2 * log_likelihood + sum(self._get_n_fit_scalars_per_param().values()) * np.log(len(X))

    # ---- sampling (hmmlearn's algorithm and random stream) ----

    def sample(self, n_samples: int = 1, random_state: RandomStateLike = None,
               currstate: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
        """Draw one sequence of ``n_samples`` samples from the model.

        The draws are hmmlearn's, from the same random stream: the same ``random_state`` gives the same samples.

        Args:
            n_samples: The sequence's length.
            random_state: A seed or ``numpy.random.RandomState``; None: the estimator's ``random_state``.
            currstate: The first sample's state; None: drawn from ``startprob_``.

        Returns:
            ``(X, state_sequence)``: the samples, ``(n_samples, n_features)`` (``(n_samples, 1)`` symbol ids for
            :class:`CategoricalHMM`), and their states, ``(n_samples,)``.
        """
        self._check_is_fitted()
        self._check()
        if random_state is None:
            random_state = self.random_state
        random_state = check_random_state(random_state)
        transmat_cdf = np.cumsum(self.transmat_, axis=1)
        if currstate is None:
            startprob_cdf = np.cumsum(self.startprob_)
            currstate = (startprob_cdf > random_state.rand()).argmax()
        state_sequence = [currstate]
        X = [self._generate_sample_from_state(currstate, random_state)]
        for _ in range(n_samples - 1):
            currstate = (transmat_cdf[currstate] > random_state.rand()).argmax()
            state_sequence.append(currstate)
            X.append(self._generate_sample_from_state(currstate, random_state))
        return np.atleast_2d(X), np.array(state_sequence, dtype=int)

    # ---- fitting ----

    def fit(self, X: ArrayLike, lengths: Optional[ArrayLike] = None, *,
            group: Optional["torch.distributed.ProcessGroup"] = None) -> "_BaseHMM":
        """Estimate the parameters by EM (Baum-Welch) from the sequences of ``X``.

        The parameters named in ``init_params`` (and any not set yet) are initialised first; then at most ``n_iter``
        iterations update those named in ``params``, stopping when the log-likelihood gains less than ``tol``.
        ``monitor_`` records the log-likelihood before each update.

        Data parallelism: with ``group`` (a ``torch.distributed`` process group, e.g. ``torch.distributed.group.WORLD``)
        every rank of the group calls ``fit`` with its own share of the sequences (at least one) and the same
        estimator settings.
        Each iteration sums the ranks' expected statistics and log-likelihoods in one ``all_reduce`` over the group
        (on the estimator's ``device``: a Gloo group for ``"cpu"``, NCCL for ``"cuda"``), so every rank runs the same
        M-step on the same sums, holds the same model after every iteration, and stops at the same one; ``monitor_``
        records the whole data's log-likelihood. The initial parameters are the same on every rank too: the random ones
        come from ``random_state`` and the number of symbols seen by all ranks; :class:`GaussianHMM`'s initial means
        and variances, when drawn, are computed from every rank's samples, gathered once on each rank (give
        ``means_`` and ``covars_`` with ``init_params=""`` to avoid that copy). Shares held in rank order give the
        single-process model on their concatenation, up to the sums' order (float64: about 1e-12 relative).
        :meth:`score`, :meth:`predict` and the other methods need no group: each rank works on its own sequences.

        The group is an argument of ``fit``, not of the constructor, as torch.distributed's own functions take
        ``group=``: it says how the data of this call is split, not what the model is, and it stays out of
        ``get_params``, ``clone`` and pickling, which cannot copy a process group. None (the default) fits this
        process's sequences alone, whether or not a default process group exists.

        Args:
            X, lengths: As in :meth:`score_samples`: this rank's sequences under a ``group``.
            group: The process group whose ranks share the data; None: this process alone.

        Returns:
            self.
        """
        X = self._check_X(X)
        if lengths is None:
            lengths = np.asarray([X.shape[0]])
        self._init(X if group is None else self._initialisation_data(X, group), lengths)
        self._check()
        self._check_X_fits_model(X)
        batches = self._batches(X, lengths)
        self.monitor_._reset()
        for _ in range(self.n_iter):
            stats, log_prob = self._do_estep(batches, group)
            self._do_mstep(stats)
            self.monitor_.report(log_prob)
            if self.monitor_.converged:
                break
            if (self.transmat_.sum(axis=1) == 0).any():
                _log.warning("Some rows of transmat_ have zero sum because no transition from the state was ever "
                             "observed.")
        return self

    def _initialisation_data(self, X: np.ndarray, group: "torch.distributed.ProcessGroup") -> np.ndarray:
        """The samples ``_init`` needs under a process group for every rank to draw the same initial model: this
        rank's, with ``n_features`` (when not set) from the largest symbol of all ranks (CategoricalHMM)."""
        return X

    def _do_estep(self, batches: _Batches, group: Optional["torch.distributed.ProcessGroup"] = None) \
            -> Tuple[Dict[str, np.ndarray], float]:
        """Expected statistics over all sequences, as the gradients of their total log-likelihood; with a group,
        summed over its ranks."""
        model = self._log_parameters()
        device = self._torch_device()
        K = self.n_components
        total = {"start": torch.zeros(K, dtype=torch.float64, device=device),
                 "trans": torch.zeros(K, K, dtype=torch.float64, device=device),
                 **self._initial_emission_statistics(device)}
        log_prob = torch.zeros((), dtype=torch.float64, device=device)
        log_start = model["log_start"].requires_grad_()
        log_transitions = model["log_transitions"].requires_grad_()
        for observations, batch_lengths, mask, rows in batches:
            with torch.enable_grad():
                scores = self._emission_scores(observations, model).requires_grad_()
                log_z = torch.ops.trellis.crf_log_partition(scores, log_transitions, log_start, None, None,
                                                            batch_lengths)
                start, trans, posteriors = torch.autograd.grad(log_z.sum(), [log_start, log_transitions, scores])
            log_prob += log_z.detach().sum()
            total["start"] += start
            total["trans"] += trans
            self._accumulate_emission_statistics(total, observations[mask], posteriors[mask])
        if group is not None:
            # One all-reduce per iteration: every statistic and the log-likelihood packed in one float64 tensor.
            packed = torch.cat([t.reshape(-1) for t in total.values()] + [log_prob.reshape(1)])
            torch.distributed.all_reduce(packed, group=group)
            parts = packed.split([t.numel() for t in total.values()] + [1])
            total = {name: part.view_as(t) for (name, t), part in zip(total.items(), parts)}
            log_prob = parts[-1][0]
        stats = {name: value.cpu().numpy() for name, value in total.items()}
        return stats, float(log_prob)

    def _do_mstep(self, stats: Dict[str, np.ndarray]) -> None:
        # hmmlearn's M-step: a prior below 1 can make counts negative (set to 0); zero probabilities stay zero.
        if "s" in self.params:
            startprob_ = np.maximum(self.startprob_prior - 1 + stats["start"], 0)
            self.startprob_ = np.where(self.startprob_ == 0, 0, startprob_)
            _normalize(self.startprob_)
        if "t" in self.params:
            transmat_ = np.maximum(self.transmat_prior - 1 + stats["trans"], 0)
            self.transmat_ = np.where(self.transmat_ == 0, 0, transmat_)
            _normalize(self.transmat_, axis=1)

    def _needs_init(self, code: str, name: str) -> bool:
        if code in self.init_params:
            if hasattr(self, name):
                _log.warning("Even though the %r attribute is set, it will be overwritten during initialization "
                             "because 'init_params' contains %r", name, code)
            return True
        return not hasattr(self, name)

    def _init(self, X: np.ndarray, lengths: ArrayLike) -> None:
        """hmmlearn's initialisation of startprob_ and transmat_: Dirichlet(1/K) draws from random_state."""
        self._check_and_set_n_features(X)
        init = 1. / self.n_components
        random_state = check_random_state(self.random_state)
        if self._needs_init("s", "startprob_"):
            self.startprob_ = random_state.dirichlet(np.full(self.n_components, init))
        if self._needs_init("t", "transmat_"):
            self.transmat_ = random_state.dirichlet(np.full(self.n_components, init), size=self.n_components)
        n_fit_scalars_per_param = self._get_n_fit_scalars_per_param()
        n_fit_scalars = sum(n_fit_scalars_per_param.get(p, 0) for p in self.params)
        if X.size < n_fit_scalars:
            _log.warning("Fitting a model with %d free scalar parameters with only %d data points will result in a "
                         "degenerate solution.", n_fit_scalars, X.size)

    def _check_sum_1(self, name: str) -> None:
        s = getattr(self, name).sum(axis=-1)
        if not np.allclose(s, 1):
            raise ValueError(f"{name} must sum to 1 (got {s:.4f})" if s.ndim == 0
                             else f"{name} rows must sum to 1 (got row sums of {s})" if s.ndim == 1
                             else "Expected 1D or 2D array")

    def _check(self) -> None:
        """Validate the parameters (hmmlearn's checks and messages)."""
        if self.implementation not in ("log", "scaling"):
            raise ValueError(f"implementation must be 'log' or 'scaling', got {self.implementation!r}")
        self.startprob_ = np.asarray(self.startprob_)
        if len(self.startprob_) != self.n_components:
            raise ValueError("startprob_ must have length n_components")
        self._check_sum_1("startprob_")
        self.transmat_ = np.asarray(self.transmat_)
        if self.transmat_.shape != (self.n_components, self.n_components):
            raise ValueError("transmat_ must have shape (n_components, n_components)")
        self._check_sum_1("transmat_")

    @staticmethod
    def _check_array(X: ArrayLike) -> np.ndarray:
        """scikit-learn's check_array as hmmlearn uses it: a 2-d array with at least one row and finite values."""
        if isinstance(X, Tensor):
            X = X.detach().cpu().numpy()
        X = np.asarray(X)
        if X.ndim != 2:
            raise ValueError(f"Expected 2D array, got {'scalar' if X.ndim == 0 else f'{X.ndim}D'} array instead: "
                             f"array={X!r}.\nReshape your data either using array.reshape(-1, 1) if your data has a "
                             f"single feature or array.reshape(1, -1) if it contains a single sample.")
        if X.shape[0] < 1:
            raise ValueError(f"Found array with 0 sample(s) (shape={X.shape}) while a minimum of 1 is required.")
        if X.dtype.kind not in "biuf":
            raise ValueError(f"X must hold numbers, got dtype {X.dtype}")
        if X.dtype.kind == "f" and not np.isfinite(X).all():
            raise ValueError("Input X contains NaN." if np.isnan(X).any() else "Input X contains infinity.")
        return X

    # The emission model's part (subclasses).
    def _check_X(self, X: ArrayLike) -> np.ndarray:
        raise NotImplementedError

    def _check_X_fits_model(self, X: np.ndarray) -> None:
        raise NotImplementedError

    def _check_and_set_n_features(self, X: np.ndarray) -> None:
        raise NotImplementedError

    def _observations_tensor(self, X: np.ndarray) -> Tensor:
        raise NotImplementedError

    def _emission_parameters(self, as_tensor: Callable[[Any], Tensor]) -> Dict[str, Tensor]:
        raise NotImplementedError

    def _emission_scores(self, observations: Tensor, model: Dict[str, Tensor]) -> Tensor:
        """log P(x_t | state) of a padded batch, [B,T,K]. The chain operators never read padding, which repeats X's
        first row (possibly a symbol some state cannot emit: -inf)."""
        raise NotImplementedError

    def _initial_emission_statistics(self, device: torch.device) -> Dict[str, Tensor]:
        raise NotImplementedError

    def _accumulate_emission_statistics(self, total: Dict[str, Tensor], observations: Tensor,
                                        posteriors: Tensor) -> None:
        raise NotImplementedError

    def _get_n_fit_scalars_per_param(self) -> Dict[str, int]:
        raise NotImplementedError

    def _generate_sample_from_state(self, state: int, random_state: np.random.RandomState) -> Any:
        raise NotImplementedError


class CategoricalHMM(_BaseHMM):
    """An HMM with categorical (discrete) emissions: ``hmmlearn.hmm.CategoricalHMM`` on Trellis' operators.

    Args:
        n_components: The number of states.
        startprob_prior: Dirichlet prior of ``startprob_`` (a scalar or ``(n_components,)``).
        transmat_prior: Dirichlet prior of each row of ``transmat_`` (a scalar or ``(n_components, n_components)``).
        emissionprob_prior: Dirichlet prior of each row of ``emissionprob_``.
        n_features: The number of symbols; None: one more than the largest symbol of the data fitted.
        algorithm: The decoder of :meth:`predict`: ``"viterbi"`` or ``"map"``.
        random_state: Seed or ``numpy.random.RandomState`` of the random initialisation (and of :meth:`sample`).
        n_iter: The most EM iterations :meth:`fit` performs.
        tol: EM stops when the log-likelihood gains less than this.
        verbose: Print each iteration's log-likelihood to stderr.
        params: The parameters EM updates: ``"s"`` startprob_, ``"t"`` transmat_, ``"e"`` emissionprob_.
        init_params: The parameters :meth:`fit` initialises at random first.
        implementation: Accepted for hmmlearn's sake (``"log"`` or ``"scaling"``); Trellis computes in log space.
        device: Where the sequences are computed: ``"cpu"``, ``"cuda"``, or a ``torch.device``.
        dtype: ``torch.float64`` (the default) or ``torch.float32`` (faster on a GPU).
        batch_tokens: The most padded positions of one batch of sequences; None: about 256 MiB (1 GiB on a GPU) of
            ``[batch, time, n_components]`` scores.

    Attributes:
        startprob_: ``(n_components,)`` initial state probabilities.
        transmat_: ``(n_components, n_components)``; ``transmat_[i, j]`` = P(next state j | state i).
        emissionprob_: ``(n_components, n_features)``; P(symbol | state).
        monitor_: The :class:`ConvergenceMonitor` of the last :meth:`fit`.

    Observations ``X`` are ``(n_samples, 1)`` integer symbol ids in ``[0, n_features)``.
    """

    def __init__(self, n_components: int = 1, startprob_prior: Union[float, np.ndarray] = 1.0,
                 transmat_prior: Union[float, np.ndarray] = 1.0, *,
                 emissionprob_prior: Union[float, np.ndarray] = 1.0, n_features: Optional[int] = None,
                 algorithm: str = "viterbi", random_state: RandomStateLike = None, n_iter: int = 10,
                 tol: float = 1e-2, verbose: bool = False, params: str = "ste", init_params: str = "ste",
                 implementation: str = "log", device: Union[str, torch.device] = "cpu",
                 dtype: Optional[torch.dtype] = None, batch_tokens: Optional[int] = None) -> None:
        super().__init__(n_components, startprob_prior, transmat_prior, algorithm, random_state, n_iter, tol,
                         verbose, params, init_params, implementation, device, dtype, batch_tokens)
        self.emissionprob_prior = emissionprob_prior
        self.n_features = n_features

    def _check_X(self, X: ArrayLike) -> np.ndarray:
        X = self._check_array(X)
        if not np.issubdtype(X.dtype, np.integer):
            raise ValueError("Symbols should be integers")
        if X.shape[1] != 1:
            raise ValueError(f"CategoricalHMM takes X of shape (n_samples, 1), got {X.shape}")
        if X.min() < 0:
            raise ValueError("Symbols should be nonnegative")
        return X

    def _check_X_fits_model(self, X: np.ndarray) -> None:
        if X.max() > self.n_features - 1:
            raise ValueError(f"Largest symbol is {X.max()} but the model only emits symbols up to "
                             f"{self.n_features - 1}")

    def _check_and_set_n_features(self, X: np.ndarray) -> None:
        if self.n_features is not None:
            self._check_X_fits_model(X)
        else:
            self.n_features = int(X.max()) + 1

    def _get_n_fit_scalars_per_param(self) -> Dict[str, int]:
        nc, nf = self.n_components, self.n_features
        return {"s": nc - 1, "t": nc * (nc - 1), "e": nc * (nf - 1)}

    def _init(self, X: np.ndarray, lengths: ArrayLike) -> None:
        super()._init(X, lengths)
        # hmmlearn keeps the RandomState it draws emissionprob_ from (so a second fit starts elsewhere).
        self.random_state = check_random_state(self.random_state)
        if self._needs_init("e", "emissionprob_"):
            self.emissionprob_ = self.random_state.rand(self.n_components, self.n_features)
            _normalize(self.emissionprob_, axis=1)

    def _check(self) -> None:
        super()._check()
        self.emissionprob_ = np.atleast_2d(self.emissionprob_)
        if self.n_features is None:
            self.n_features = self.emissionprob_.shape[1]
        if self.emissionprob_.shape != (self.n_components, self.n_features):
            raise ValueError(f"emissionprob_ must have shape({self.n_components}, {self.n_features})")
        self._check_sum_1("emissionprob_")

    def _observations_tensor(self, X: np.ndarray) -> Tensor:
        return torch.as_tensor(X[:, 0].astype(np.int64, copy=False), device=self._torch_device())

    def _emission_parameters(self, as_tensor: Callable[[Any], Tensor]) -> Dict[str, Tensor]:
        return {"log_emissions": as_tensor(self.emissionprob_).log()}

    def _emission_scores(self, observations: Tensor, model: Dict[str, Tensor]) -> Tensor:
        return model["log_emissions"].t()[observations]

    def _initial_emission_statistics(self, device: torch.device) -> Dict[str, Tensor]:
        return {"obs": torch.zeros(self.n_features, self.n_components, dtype=torch.float64, device=device)}

    def _accumulate_emission_statistics(self, total: Dict[str, Tensor], observations: Tensor,
                                        posteriors: Tensor) -> None:
        total["obs"].index_add_(0, observations, posteriors.to(torch.float64))

    def _initialisation_data(self, X: np.ndarray, group: "torch.distributed.ProcessGroup") -> np.ndarray:
        if self.n_features is None:
            largest = torch.tensor([int(X.max())], dtype=torch.int64, device=self._torch_device())
            torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX, group=group)
            self.n_features = int(largest) + 1
        return X

    def _do_estep(self, batches: _Batches, group: Optional["torch.distributed.ProcessGroup"] = None) \
            -> Tuple[Dict[str, np.ndarray], float]:
        stats, log_prob = super()._do_estep(batches, group)
        stats["obs"] = np.ascontiguousarray(stats["obs"].T)  # accumulated symbol-major: [V,K] -> [K,V]
        return stats, log_prob

    def _do_mstep(self, stats: Dict[str, np.ndarray]) -> None:
        super()._do_mstep(stats)
        if "e" in self.params:
            self.emissionprob_ = np.maximum(self.emissionprob_prior - 1 + stats["obs"], 0)
            _normalize(self.emissionprob_, axis=1)

    def _generate_sample_from_state(self, state: int, random_state: np.random.RandomState) -> List[int]:
        cdf = np.cumsum(self.emissionprob_[state, :])
        return [(cdf > random_state.rand()).argmax()]


class GaussianHMM(_BaseHMM):
    """An HMM with Gaussian emissions of diagonal covariance: ``hmmlearn.hmm.GaussianHMM(covariance_type="diag")``.

    Args:
        n_components: The number of states.
        covariance_type: ``"diag"`` (the only type Trellis implements).
        min_covar: Added to the data's variances when ``covars_`` is initialised.
        startprob_prior, transmat_prior: Dirichlet priors, as in :class:`CategoricalHMM`.
        means_prior, means_weight: Mean and precision of the normal prior of ``means_``.
        covars_prior, covars_weight: The inverse-gamma prior of ``covars_``.
        algorithm, random_state, n_iter, tol, verbose: As in :class:`CategoricalHMM`.
        params, init_params: Letters ``"s"``, ``"t"``, ``"m"`` (means_), ``"c"`` (covars_).
        implementation, device, dtype, batch_tokens: As in :class:`CategoricalHMM`.

    Attributes:
        startprob_, transmat_, monitor_: As in :class:`CategoricalHMM`.
        means_: ``(n_components, n_features)``.
        covars_: Read: ``(n_components, n_features, n_features)`` diagonal matrices (hmmlearn's shape); set:
            ``(n_components, n_features)`` variances, as hmmlearn takes them.
        n_features: The dimension of the observations.

    Observations ``X`` are ``(n_samples, n_features)``.
    """

    def __init__(self, n_components: int = 1, covariance_type: str = "diag", min_covar: float = 1e-3,
                 startprob_prior: Union[float, np.ndarray] = 1.0, transmat_prior: Union[float, np.ndarray] = 1.0,
                 means_prior: Union[float, np.ndarray] = 0, means_weight: Union[float, np.ndarray] = 0,
                 covars_prior: Union[float, np.ndarray] = 1e-2, covars_weight: Union[float, np.ndarray] = 1,
                 algorithm: str = "viterbi", random_state: RandomStateLike = None, n_iter: int = 10,
                 tol: float = 1e-2, verbose: bool = False, params: str = "stmc", init_params: str = "stmc",
                 implementation: str = "log", device: Union[str, torch.device] = "cpu",
                 dtype: Optional[torch.dtype] = None, batch_tokens: Optional[int] = None) -> None:
        super().__init__(n_components, startprob_prior, transmat_prior, algorithm, random_state, n_iter, tol,
                         verbose, params, init_params, implementation, device, dtype, batch_tokens)
        self.covariance_type = covariance_type
        self.min_covar = min_covar
        self.means_prior = means_prior
        self.means_weight = means_weight
        self.covars_prior = covars_prior
        self.covars_weight = covars_weight

    def _check_covariance_type(self) -> None:
        if self.covariance_type not in COVARIANCE_TYPES:
            raise ValueError(f"covariance_type must be one of {COVARIANCE_TYPES}")
        if self.covariance_type != "diag":
            raise ValueError(f"trellis.hmm.GaussianHMM implements covariance_type='diag' only, got "
                             f"{self.covariance_type!r}")

    @property
    def covars_(self) -> np.ndarray:
        """The covariance matrices, ``(n_components, n_features, n_features)`` (diagonal)."""
        return np.array(list(map(np.diag, self._covars_)))

    @covars_.setter
    def covars_(self, covars: ArrayLike) -> None:
        self._check_covariance_type()
        covars = np.array(covars, copy=True)
        if len(covars.shape) != 2:
            raise ValueError("'diag' covars must have shape (n_components, n_dim)")
        if np.any(covars <= 0):
            raise ValueError("'diag' covars must be positive")
        self._covars_ = covars

    def _check_X(self, X: ArrayLike) -> np.ndarray:
        return self._check_array(X)

    def _check_X_fits_model(self, X: np.ndarray) -> None:
        if X.shape[1] != self.n_features:
            raise ValueError(f"Unexpected number of dimensions, got {X.shape[1]} but expected {self.n_features}")

    def _check_and_set_n_features(self, X: np.ndarray) -> None:
        if getattr(self, "n_features", None) is not None:
            self._check_X_fits_model(X)
        else:
            self.n_features = X.shape[1]

    def _get_n_fit_scalars_per_param(self) -> Dict[str, int]:
        nc, nf = self.n_components, self.n_features
        return {"s": nc - 1, "t": nc * (nc - 1), "m": nc * nf, "c": nc * nf}

    def _initialisation_data(self, X: np.ndarray, group: "torch.distributed.ProcessGroup") -> np.ndarray:
        """Every rank's samples, in rank order, where the k-means of the means or the variances are to be drawn."""
        draws = any(code in self.init_params or not hasattr(self, name)
                    for code, name in (("m", "means_"), ("c", "covars_")))
        if not draws:
            return X
        local = torch.as_tensor(X, dtype=torch.float64, device=self._torch_device())
        world = torch.distributed.get_world_size(group)
        counts = [torch.zeros(1, dtype=torch.int64, device=local.device) for _ in range(world)]
        torch.distributed.all_gather(counts, torch.tensor([len(local)], device=local.device), group=group)
        counts = [int(c) for c in counts]
        # all_gather takes equal shapes: every share padded to the largest.
        padded = torch.zeros((max(counts),) + local.shape[1:], dtype=local.dtype, device=local.device)
        padded[:len(local)] = local
        shares = [torch.empty_like(padded) for _ in range(world)]
        torch.distributed.all_gather(shares, padded, group=group)
        return torch.cat([share[:n] for share, n in zip(shares, counts)]).cpu().numpy()

    def _init(self, X: np.ndarray, lengths: ArrayLike) -> None:
        self._check_covariance_type()
        super()._init(X, lengths)
        if self._needs_init("m", "means_"):
            self.means_ = _kmeans(torch.as_tensor(X, dtype=self._compute_dtype(), device=self._torch_device()),
                                  self.n_components, check_random_state(self.random_state))
        if self._needs_init("c", "covars_"):
            cv = np.cov(X.T) + self.min_covar * np.eye(X.shape[1])
            if not cv.shape:
                cv.shape = (1, 1)
            self.covars_ = np.tile(np.diag(cv), (self.n_components, 1))

    def _check(self) -> None:
        super()._check()
        self._check_covariance_type()
        self.means_ = np.asarray(self.means_)
        if self.means_.ndim != 2 or self.means_.shape[0] != self.n_components:
            raise ValueError(f"means_ must have shape (n_components, n_features), got {self.means_.shape}")
        self.n_features = self.means_.shape[1]
        if self._covars_.shape != self.means_.shape:
            raise ValueError(f"'diag' covars must have shape (n_components, n_dim) = {self.means_.shape}, got "
                             f"{self._covars_.shape}")

    def _observations_tensor(self, X: np.ndarray) -> Tensor:
        return torch.as_tensor(X, device=self._torch_device()).to(self._compute_dtype())

    def _emission_parameters(self, as_tensor: Callable[[Any], Tensor]) -> Dict[str, Tensor]:
        return {"means": as_tensor(self.means_), "variances": as_tensor(self._covars_)}

    def _emission_scores(self, observations: Tensor, model: Dict[str, Tensor]) -> Tensor:
        # log N(x; μ, diag σ²) per state, as hmmlearn's (variances floored at the smallest positive double). Σ(x−μ)²/σ²
        # is summed a feature at a time: no [B,T,K,F] tensor, and no x² − 2xμ + μ² expansion, whose cancellation
        # loses the digits of data far from 0 in float32.
        means, variances = model["means"], model["variances"].clamp_min(np.finfo(float).tiny)
        precisions = variances.reciprocal()
        scores = torch.zeros(observations.shape[:-1] + (means.shape[0],), dtype=observations.dtype,
                             device=observations.device)
        for f in range(means.shape[1]):
            scores.add_((observations[..., f, None] - means[:, f]).square_().mul_(precisions[:, f]))
        return scores.add_(means.shape[1] * math.log(2 * math.pi) + variances.log().sum(-1)).mul_(-0.5)

    def _initial_emission_statistics(self, device: torch.device) -> Dict[str, Tensor]:
        K, F = self.n_components, self.n_features
        return {"post": torch.zeros(K, dtype=torch.float64, device=device),
                "obs": torch.zeros(K, F, dtype=torch.float64, device=device),
                "obs**2": torch.zeros(K, F, dtype=torch.float64, device=device)}

    def _accumulate_emission_statistics(self, total: Dict[str, Tensor], observations: Tensor,
                                        posteriors: Tensor) -> None:
        # In float64 whatever the computation's type: the M-step subtracts 2μΣγx from Σγx², which cancel to the
        # variance's size for data far from 0.
        posteriors, observations = posteriors.to(torch.float64), observations.to(torch.float64)
        total["post"] += posteriors.sum(0)
        total["obs"] += posteriors.t() @ observations
        total["obs**2"] += posteriors.t() @ (observations * observations)

    def _do_mstep(self, stats: Dict[str, np.ndarray]) -> None:
        super()._do_mstep(stats)
        means_prior, means_weight = self.means_prior, self.means_weight
        denom = stats["post"][:, None]
        if "m" in self.params:
            self.means_ = (means_weight * means_prior + stats["obs"]) / (means_weight + denom)
        if "c" in self.params:
            meandiff = self.means_ - means_prior
            c_n = means_weight * meandiff ** 2 + stats["obs**2"] - 2 * self.means_ * stats["obs"] \
                + self.means_ ** 2 * denom
            c_d = max(self.covars_weight - 1, 0) + denom
            self._covars_ = (self.covars_prior + c_n) / np.maximum(c_d, 1e-5)

    def _generate_sample_from_state(self, state: int, random_state: np.random.RandomState) -> np.ndarray:
        return random_state.multivariate_normal(self.means_[state], self.covars_[state])


def _kmeans(X: Tensor, k: int, random_state: np.random.RandomState, max_iter: int = 300,
            tol: float = 1e-4) -> np.ndarray:
    """The centres of k clusters of the rows of X: k-means++ seeding from random_state, then Lloyd's iterations until
    the centres move less than tol times the data's mean variance (scikit-learn's criterion)."""
    n = X.shape[0]
    if n < k:
        raise ValueError(f"n_samples={n} should be >= n_clusters={k}.")
    centres = X[[random_state.randint(n)]]
    distances = ((X - centres[0]) ** 2).sum(1)
    for _ in range(1, k):
        cumulative = distances.cumsum(0)
        total = float(cumulative[-1])
        # All points on the centres already: any row will do.
        pick = random_state.randint(n) if total <= 0 else \
            min(int(torch.searchsorted(cumulative, torch.tensor([random_state.rand() * total], dtype=X.dtype,
                                                                 device=X.device))), n - 1)
        centres = torch.cat([centres, X[[pick]]])
        distances = torch.minimum(distances, ((X - X[pick]) ** 2).sum(1))
    threshold = tol * float(X.var(0, correction=0).mean())
    squared_norms = (X * X).sum(1, keepdim=True)
    for _ in range(max_iter):
        nearest = (squared_norms - 2 * X @ centres.t() + (centres * centres).sum(1)).argmin(1)
        counts = torch.bincount(nearest, minlength=k).to(X.dtype)
        sums = torch.zeros_like(centres).index_add_(0, nearest, X)
        # A cluster that lost all its points keeps its centre.
        moved = torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], centres)
        shift = float(((moved - centres) ** 2).sum())
        centres = moved
        if shift <= threshold:
            break
    return centres.double().cpu().numpy()


def load(path: str, **kwargs: Any) -> Union[CategoricalHMM, GaussianHMM]:
    """Read an HMM model file of the ``trellis hmm`` command line (docs/hmm-format.md).

    The file is read and validated by the library's reader (format, version, shapes, rows that are distributions,
    positive variances); errors name the file and dataset at fault.

    Args:
        path: The HDF5 file.
        **kwargs: Constructor arguments of the estimator (e.g. ``device="cuda"``, ``n_iter``).

    Returns:
        A :class:`CategoricalHMM` or :class:`GaussianHMM` with ``startprob_``, ``transmat_`` and ``emissionprob_`` or
        ``means_``/``covars_`` set (so ``init_params=""`` fits onwards from it). A file's optional ``state_names``,
        ``vocabulary`` and ``state_labels`` become attributes of those names with a trailing underscore; its
        log-likelihood history becomes ``monitor_.history``.
    """
    (emission, startprob, transmat, emissionprob, means, covars, state_names, vocabulary, state_labels,
     history) = torch.ops.trellis.hmm_load(str(path))
    K = startprob.shape[0]
    model: Union[CategoricalHMM, GaussianHMM]
    if emission == "categorical":
        model = CategoricalHMM(n_components=K, n_features=emissionprob.shape[1], **kwargs)
        model.emissionprob_ = emissionprob.numpy()
    else:
        model = GaussianHMM(n_components=K, **kwargs)
        model.means_ = means.numpy()
        model.covars_ = covars.numpy()
        model.n_features = means.shape[1]
    model.startprob_ = startprob.numpy()
    model.transmat_ = transmat.numpy()
    if state_names:
        model.state_names_ = list(state_names)
    if vocabulary:
        model.vocabulary_ = list(vocabulary)
    if state_labels.numel():
        model.state_labels_ = state_labels.numpy()
    model.monitor_.history.extend(history.tolist())
    model.monitor_.iter = len(model.monitor_.history)
    return model


def save(model: Union[CategoricalHMM, GaussianHMM], path: str) -> None:
    """Write a model as the ``trellis hmm`` command line does (docs/hmm-format.md), atomically.

    The library's writer checks the model first (shapes, rows that are distributions, positive variances) and writes
    ``NAME.tmp.PID`` beside ``path``, renamed to ``path`` only when complete. ``monitor_.history`` is stored as the
    log-likelihood history, and ``state_names_``, ``vocabulary_`` and ``state_labels_`` where the model has them.

    Args:
        model: A fitted :class:`CategoricalHMM` or :class:`GaussianHMM`.
        path: The HDF5 file to write.
    """
    model._check_is_fitted()
    model._check()
    as_tensor = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float64))  # noqa: E731
    if isinstance(model, CategoricalHMM):
        emission, emissionprob, means, covars = "categorical", as_tensor(model.emissionprob_), None, None
    elif isinstance(model, GaussianHMM):
        emission, emissionprob, means, covars = "gaussian", None, as_tensor(model.means_), as_tensor(model._covars_)
    else:
        raise TypeError(f"trellis.hmm.save takes a CategoricalHMM or GaussianHMM, got {type(model).__name__}")
    torch.ops.trellis.hmm_save(str(path), emission, as_tensor(model.startprob_), as_tensor(model.transmat_),
                               emissionprob, means, covars, list(getattr(model, "state_names_", [])),
                               list(getattr(model, "vocabulary_", [])),
                               [int(v) for v in getattr(model, "state_labels_", [])],
                               [float(v) for v in model.monitor_.history])
