"""trellis.hmm on the GPU against itself on the CPU (no hmmlearn needed, so these run wherever there is a GPU):
float64 gives the CPU's numbers, float32 close ones; many sequences of mixed lengths in large batches; k-means
initialisation and EM on the device; the float32 emission statistics of a long sequence. Skipped without a GPU."""
import logging

import numpy as np
import pytest
import torch

from trellis import hmm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
GPU = "cuda"


@pytest.fixture(autouse=True)
def quiet(caplog):
    caplog.set_level(logging.ERROR)


def data(kind, rs, n_sequences=150, max_length=400, K=12):
    lengths = rs.randint(1, max_length, size=n_sequences)
    if kind == "categorical":
        X = rs.randint(0, 40, size=(lengths.sum(), 1))
        model = dict(n_features=40)
    else:
        X = rs.randn(lengths.sum(), 3) + rs.randint(0, 3, size=(lengths.sum(), 1)) * 2.0
        model = {}
    return X, lengths, K, model


def estimator(kind, K, device, **kwargs):
    cls = hmm.CategoricalHMM if kind == "categorical" else hmm.GaussianHMM
    return cls(n_components=K, device=device, **kwargs)


def assert_same_model(a, b, rtol, atol=1e-12):
    names = ["startprob_", "transmat_"] + (["emissionprob_"] if hasattr(a, "emissionprob_") else ["means_", "_covars_"])
    for name in names:
        np.testing.assert_allclose(getattr(b, name), getattr(a, name), rtol=rtol, atol=atol, err_msg=name)


def with_parameters_of(source, model):
    for name in ("startprob_", "transmat_", "emissionprob_", "means_", "_covars_", "n_features"):
        if hasattr(source, name):
            setattr(model, name, getattr(source, name))
    return model


def path_log_probs(model, X, lengths, states):
    """log P(x, s) of each sequence for the given states, from the model's parameters in numpy."""
    if hasattr(model, "emissionprob_"):
        emission = np.log(model.emissionprob_[states, X[:, 0]])
    else:
        var = model._covars_[states]
        emission = -0.5 * (np.log(2 * np.pi * var) + (X - model.means_[states]) ** 2 / var).sum(1)
    out, begin = [], 0
    for n in lengths:
        s = states[begin:begin + n]
        out.append(np.log(model.startprob_[s[0]]) + np.log(model.transmat_[s[:-1], s[1:]]).sum()
                   + emission[begin:begin + n].sum())
        begin += n
    return np.array(out)


def assert_equally_good(model, X, lengths, algorithm, states, ref_states):
    """The states equal the reference's, or where they differ the two are tied: Viterbi paths of the same
    probability, posterior-argmax states of the same posterior (GPU and CPU may break exact ties differently)."""
    if np.array_equal(states, ref_states):
        return
    if algorithm == "viterbi":
        np.testing.assert_allclose(path_log_probs(model, X, lengths, states),
                                   path_log_probs(model, X, lengths, ref_states), rtol=1e-12)
    else:
        posteriors = model.predict_proba(X, lengths)
        rows = np.arange(len(states))
        np.testing.assert_allclose(posteriors[rows, states], posteriors[rows, ref_states], rtol=1e-9, atol=1e-12)
    assert np.mean(states != ref_states) < 1e-3, "more than ties differ"


@pytest.mark.parametrize("kind", ["categorical", "gaussian"])
def test_float64_matches_cpu(kind, device=GPU):
    rs = np.random.RandomState(0)
    X, lengths, K, extra = data(kind, rs)
    start = estimator(kind, K, "cpu", random_state=1, n_iter=3, **extra).fit(X, lengths)
    cpu = with_parameters_of(start, estimator(kind, K, "cpu", init_params="", n_iter=4, tol=0, **extra))
    gpu = with_parameters_of(start, estimator(kind, K, device, init_params="", n_iter=4, tol=0, **extra))
    assert gpu.score(X, lengths) == pytest.approx(cpu.score(X, lengths), rel=1e-12)
    np.testing.assert_allclose(gpu.predict_proba(X, lengths), cpu.predict_proba(X, lengths), rtol=1e-9, atol=1e-12)
    for algorithm in ("viterbi", "map"):
        log_prob, states = gpu.decode(X, lengths, algorithm=algorithm)
        ref_log_prob, ref_states = cpu.decode(X, lengths, algorithm=algorithm)
        assert log_prob == pytest.approx(ref_log_prob, rel=1e-12)
        assert_equally_good(cpu, X, lengths, algorithm, states, ref_states)
    cpu.fit(X, lengths)
    gpu.fit(X, lengths)
    assert_same_model(cpu, gpu, rtol=1e-9)
    np.testing.assert_allclose(list(gpu.monitor_.history), list(cpu.monitor_.history), rtol=1e-12)


@pytest.mark.parametrize("kind", ["categorical", "gaussian"])
def test_float32_close_to_float64(kind, device=GPU):
    rs = np.random.RandomState(1)
    X, lengths, K, extra = data(kind, rs)
    start = estimator(kind, K, "cpu", random_state=2, n_iter=2, **extra).fit(X, lengths)
    cpu = with_parameters_of(start, estimator(kind, K, "cpu", init_params="", n_iter=2, tol=0, **extra))
    gpu = with_parameters_of(start, estimator(kind, K, device, init_params="", n_iter=2, tol=0,
                                              dtype=torch.float32, **extra))
    assert gpu.score(X, lengths) == pytest.approx(cpu.score(X, lengths), rel=1e-5)
    posteriors = gpu.predict_proba(X, lengths)
    np.testing.assert_allclose(posteriors, cpu.predict_proba(X, lengths), atol=1e-4)
    assert (gpu.predict(X, lengths) == cpu.predict(X, lengths)).mean() > 0.999
    cpu.fit(X, lengths)
    gpu.fit(X, lengths)
    assert_same_model(cpu, gpu, rtol=1e-3, atol=1e-5)


def test_kmeans_initialisation_on_the_device(device=GPU):
    rs = np.random.RandomState(3)
    centres = np.array([[-6.0, 0.0], [6.0, 0.0], [0.0, 6.0]])
    X = centres[rs.randint(0, 3, size=3000)] + rs.randn(3000, 2) * 0.3
    model = hmm.GaussianHMM(n_components=3, random_state=0, n_iter=5, device=device).fit(X, [1000] * 3)
    nearest = np.linalg.norm(model.means_[:, None] - centres[None], axis=-1).argmin(0)
    assert sorted(nearest) == [0, 1, 2]


def test_long_sequence_float32(device=GPU):
    # One sequence of 200k steps (hmmlearn's lengths=None): the statistics of the whole sequence in float32.
    rs = np.random.RandomState(4)
    model = hmm.CategoricalHMM(n_components=8, n_features=20, init_params="")
    model.startprob_ = rs.dirichlet(np.ones(8))
    model.transmat_ = rs.dirichlet(np.ones(8) * 0.3, size=8)
    model.emissionprob_ = rs.dirichlet(np.ones(20) * 0.3, size=8)
    X, _ = model.sample(200_000, random_state=0)
    cpu = hmm.CategoricalHMM(n_components=8, n_features=20, init_params="", n_iter=1)
    gpu = hmm.CategoricalHMM(n_components=8, n_features=20, init_params="", n_iter=1, device=device,
                             dtype=torch.float32)
    for m in (cpu, gpu):
        m.startprob_, m.transmat_, m.emissionprob_ = model.startprob_, model.transmat_, model.emissionprob_
        m.fit(X)
    assert gpu.monitor_.history[0] == pytest.approx(cpu.monitor_.history[0], rel=1e-5)
    assert_same_model(cpu, gpu, rtol=1e-3, atol=1e-5)
