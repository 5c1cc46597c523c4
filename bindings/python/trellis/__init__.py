"""Trellis for PyTorch: structured prediction layers and fused operators, compiled C++ and CUDA.

- :class:`CRF`: a linear-chain conditional random field, a drop-in replacement for pytorch-crf's ``torchcrf.CRF``
  (``from trellis import CRF``), with marginals, k-best decoding and constraints beyond it.
- :func:`log_matmul`, :func:`max_matmul`: matrix products in the log and max-plus semirings.
- :func:`linear_cross_entropy`, :func:`token_logprobs`, :func:`linear_logsumexp`: an LLM output head's loss and
  statistics without materialising the logits; :func:`vocab_parallel_linear_cross_entropy`,
  :func:`vocab_parallel_token_logprobs`, :func:`vocab_parallel_linear_logsumexp`: the same with the vocabulary split
  over the ranks of a ``torch.distributed`` process group.
- :mod:`trellis.hmm`: ``CategoricalHMM`` and ``GaussianHMM`` estimators with hmmlearn's interface (CPU and CUDA), and
  the command line's HDF5 model files (``trellis.hmm.load``/``save``); imported on first use (it needs numpy).

Importing trellis imports torch and loads the compiled operators (``torch.ops.trellis``) into it; that torch must be
the release Trellis was built against (the error says which otherwise).
"""
# torch first (the modules below import it too): the operator library needs the LibTorch it loads into the process,
# so the library carries no path to it.
import torch  # noqa: F401

from . import _library
from .crf import CRF
from .ops import (linear_cross_entropy, linear_logsumexp, log_matmul, max_matmul, token_logprobs,
                  vocab_parallel_linear_cross_entropy, vocab_parallel_linear_logsumexp, vocab_parallel_token_logprobs)

__version__: str = _library.load() or "0+build.tree"

__all__ = ["CRF", "log_matmul", "max_matmul", "linear_cross_entropy", "token_logprobs", "linear_logsumexp",
           "vocab_parallel_linear_cross_entropy", "vocab_parallel_token_logprobs", "vocab_parallel_linear_logsumexp"]


def __getattr__(name: str):
    # trellis.hmm needs numpy, which torch does not require, so `import trellis` leaves it until first use.
    if name == "hmm":
        import importlib
        return importlib.import_module(".hmm", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
