"""Shared fixtures of the Python package's tests. CTest runs them against the build tree: python/ on PYTHONPATH and
TRELLIS_OPS_LIBRARY naming the build's libtrellis_ops.so (tests/CMakeLists.txt)."""
import itertools

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def seed() -> None:
    torch.manual_seed(0)


def prefix_mask(lengths, seq_length: int, batch_first: bool, dtype=torch.uint8, device="cpu") -> torch.Tensor:
    """A pytorch-crf mask: on for the first lengths[b] steps of sample b."""
    mask = (torch.arange(seq_length)[None, :] < torch.as_tensor(lengths)[:, None]).to(dtype)
    return (mask if batch_first else mask.t()).contiguous().to(device)


def path_scores(emissions, transitions, start, end, length: int):
    """Every tag sequence of one sample (emissions (T, K)) of the given length and its score, by enumeration."""
    k = emissions.shape[-1]
    paths = list(itertools.product(range(k), repeat=length))
    scores = []
    for path in paths:
        s = start[path[0]] + end[path[-1]] + sum(emissions[t, y] for t, y in enumerate(path))
        s = s + sum(transitions[a, b] for a, b in zip(path, path[1:]))
        scores.append(s)
    return paths, torch.stack(scores)
