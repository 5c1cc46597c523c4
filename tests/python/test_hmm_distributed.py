"""trellis.hmm's estimators fitted data-parallel (``fit(..., group=...)``): processes joined by a Gloo group on the CPU
at world sizes 2 and 3, each holding an uneven share of the sequences, give the single-process fit of all of them
(random initialisation included: the categorical model's number of symbols seen on one rank only, the Gaussian
model's k-means and variances over every rank's samples): the same parameters within 1e-10 relative and the same
monitor history, on every rank; each rank then scores and decodes its own share."""
import datetime
import logging

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trellis import hmm as trellis_hmm

K, V, F = 3, 6, 2
LENGTHS = [7, 3, 12, 1, 9, 5, 14, 2, 8, 6, 11, 4, 10, 3, 7, 13, 2, 9, 5, 8]
# Consecutive shares of the sequences, rank by rank: uneven in sequences and in samples.
CUTS = {2: [0, 6, 20], 3: [0, 3, 11, 20]}
PARAMETERS = {"categorical": ("startprob_", "transmat_", "emissionprob_"),
              "gaussian": ("startprob_", "transmat_", "means_", "covars_")}


def data(kind):
    rs = np.random.RandomState(3)
    n = sum(LENGTHS)
    if kind == "categorical":
        X = rs.randint(0, V - 1, size=(n, 1))
        X[-1, 0] = V - 1  # the largest symbol on the last rank only: n_features must come from every rank
        return X
    return rs.randn(n, F) * 2 + np.arange(n)[:, None] % 3


def estimator(kind):
    make = trellis_hmm.CategoricalHMM if kind == "categorical" else trellis_hmm.GaussianHMM
    return make(n_components=K, n_iter=6, tol=1e-300, random_state=0)


def share(kind, rank, world):
    first, end = CUTS[world][rank], CUTS[world][rank + 1]
    offsets = np.concatenate([[0], np.cumsum(LENGTHS)])
    return data(kind)[offsets[first]:offsets[end]], LENGTHS[first:end]


def fitted(model, kind):
    return {"history": list(model.monitor_.history), "n_features": model.n_features,
            **{name: np.asarray(getattr(model, name)) for name in PARAMETERS[kind]}}


def worker(rank, world, port, results):
    logging.getLogger("trellis.hmm").setLevel(logging.ERROR)  # warnings about data this small
    torch.set_num_threads(1)
    # A rank that fails leaves the others in a collective: the timeout ends their wait.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for kind in PARAMETERS:
            X, lengths = share(kind, rank, world)
            model = estimator(kind).fit(X, lengths, group=dist.group.WORLD)
            results.put((kind, rank, fitted(model, kind), model.score(X, lengths), model.predict(X, lengths)))
    finally:
        dist.destroy_process_group()


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relative(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


@pytest.mark.parametrize("world", [2, 3])
def test_fit_with_a_process_group_equals_one_process(world, caplog):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with Gloo is not available")
    caplog.set_level(logging.ERROR)
    expected = {}
    for kind in PARAMETERS:
        model = estimator(kind).fit(data(kind), LENGTHS)
        expected[kind] = (model, fitted(model, kind))
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(worker, args=(world, free_port(), results), nprocs=world, join=True, start_method="spawn")
    received = 0
    while not results.empty():
        kind, rank, got, score, states = results.get()
        received += 1
        model, reference = expected[kind]
        where = f"{kind}, rank {rank} of {world}"
        assert got["n_features"] == reference["n_features"], where
        assert len(got["history"]) == len(reference["history"]) == 6, where
        assert relative(got["history"], reference["history"]) < 1e-10, where
        for name in PARAMETERS[kind]:
            assert relative(got[name], reference[name]) < 1e-10, f"{where}: {name}"
        X, lengths = share(kind, rank, world)
        assert abs(score - model.score(X, lengths)) <= 1e-10 * abs(score), where
        np.testing.assert_array_equal(states, model.predict(X, lengths), err_msg=where)
    assert received == world * len(PARAMETERS)
