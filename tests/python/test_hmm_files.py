"""trellis.hmm.load / save and the `trellis hmm` command line: models written by either are read by the other, the CLI
computes from a Python model what Python does (scores, Viterbi states, posteriors, EM), saves are atomic, and bad
files are errors that name them. The CLI is build/apps/trellis beside the operator library CTest names
(TRELLIS_OPS_LIBRARY), or TRELLIS_CLI; without one, the tests that need it skip."""
import logging
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from trellis import hmm

h5py = pytest.importorskip("h5py")


def find_cli():
    if os.environ.get("TRELLIS_CLI"):
        return Path(os.environ["TRELLIS_CLI"])
    library = os.environ.get("TRELLIS_OPS_LIBRARY")
    if library:
        candidate = Path(library).resolve().parent.parent / "apps" / "trellis"
        if candidate.is_file():
            return candidate
    return None


CLI = find_cli()
needs_cli = pytest.mark.skipif(CLI is None, reason="no trellis command line (set TRELLIS_CLI)")


@pytest.fixture(autouse=True)
def quiet(caplog):
    caplog.set_level(logging.ERROR)


def cli(*args):
    result = subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, f"trellis {' '.join(map(str, args))}: {result.stderr}"
    return result


def read_dataset(path):
    with h5py.File(path, "r") as f:
        X = f["observations"][:]
        lengths = np.diff(f["offsets"][:])
    return (X[:, None] if X.ndim == 1 else X), lengths


def file_parameters(path):
    with h5py.File(path, "r") as f:
        return {name: f[name][:] for name in ("startprob", "transmat", "emissionprob", "means", "covars") if name in f}


def assert_model_is_file(model, path, rtol=1e-14):
    stored = file_parameters(path)
    np.testing.assert_allclose(model.startprob_, stored["startprob"], rtol=rtol)
    np.testing.assert_allclose(model.transmat_, stored["transmat"], rtol=rtol)
    if "emissionprob" in stored:
        np.testing.assert_allclose(model.emissionprob_, stored["emissionprob"], rtol=rtol)
    else:
        np.testing.assert_allclose(model.means_, stored["means"], rtol=rtol)
        np.testing.assert_allclose(model._covars_, stored["covars"], rtol=rtol)


@needs_cli
@pytest.mark.parametrize("kind", ["categorical", "gaussian"])
def test_cli_model_loads(kind, tmp_path):
    path = tmp_path / "model.h5"
    cli("hmm", "init", "--states", 3, *(["--symbols", 6] if kind == "categorical" else ["--features", 2]),
        "--seed", 1, "-o", path)
    model = hmm.load(path, n_iter=3)
    assert isinstance(model, hmm.CategoricalHMM if kind == "categorical" else hmm.GaussianHMM)
    assert model.n_components == 3 and model.n_features == (6 if kind == "categorical" else 2) and model.n_iter == 3
    assert_model_is_file(model, path)


def python_model(kind, seed=0):
    rs = np.random.RandomState(seed)
    K = 4
    if kind == "categorical":
        model = hmm.CategoricalHMM(n_components=K, n_features=9, init_params="")
        model.emissionprob_ = rs.dirichlet(np.ones(9), size=K)
    else:
        model = hmm.GaussianHMM(n_components=K, init_params="")
        model.means_ = rs.randn(K, 3) * 2
        model.covars_ = rs.uniform(0.5, 2.0, size=(K, 3))
    model.startprob_ = rs.dirichlet(np.ones(K))
    model.transmat_ = rs.dirichlet(np.ones(K), size=K)
    return model


@needs_cli
@pytest.mark.parametrize("kind", ["categorical", "gaussian"])
def test_python_model_in_the_cli(kind, tmp_path):
    # A model saved from Python: the CLI samples from it and infers what Python computes.
    model = python_model(kind)
    hmm.save(model, tmp_path / "model.h5")
    cli("hmm", "sample", "-m", tmp_path / "model.h5", "-o", tmp_path / "data.h5", "-n", 30, "-l", 25,
        "--min-length", 1, "--seed", 3)
    cli("hmm", "infer", "-m", tmp_path / "model.h5", "-d", tmp_path / "data.h5", "-o", tmp_path / "out.h5",
        "--posteriors")
    X, lengths = read_dataset(tmp_path / "data.h5")
    with h5py.File(tmp_path / "out.h5", "r") as out:
        log_likelihood, viterbi = out["log_likelihood"][:], out["viterbi_log_prob"][:]
        states, posteriors = out["states"][:], out["posteriors"][:]
    assert model.score(X, lengths) == pytest.approx(log_likelihood.sum(), rel=1e-12)
    # Per sequence: each sequence scored alone.
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for i in (0, len(lengths) // 2, len(lengths) - 1):
        sequence = X[starts[i]:starts[i] + lengths[i]]
        assert model.score(sequence) == pytest.approx(log_likelihood[i], rel=1e-12)
    log_prob, predicted = model.decode(X, lengths)
    assert log_prob == pytest.approx(viterbi.sum(), rel=1e-12)
    np.testing.assert_array_equal(predicted, states)
    np.testing.assert_allclose(model.predict_proba(X, lengths), posteriors, atol=1e-6)


@needs_cli
@pytest.mark.parametrize("kind", ["categorical", "gaussian"])
def test_em_in_python_and_cli(kind, tmp_path):
    # EM from the same start (saved from Python) in the CLI and in Python: the same model and log-likelihoods.
    start = python_model(kind, seed=1)
    hmm.save(start, tmp_path / "start.h5")
    cli("hmm", "sample", "-m", tmp_path / "start.h5", "-o", tmp_path / "data.h5", "-n", 40, "-l", 20, "--seed", 5)
    cli("hmm", "fit", "-d", tmp_path / "data.h5", "--init", tmp_path / "start.h5", "-o", tmp_path / "fitted.h5",
        "--max-iterations", 4, "--tolerance", 0)
    X, lengths = read_dataset(tmp_path / "data.h5")
    model = hmm.load(tmp_path / "start.h5", n_iter=4, tol=-np.inf, init_params="").fit(X, lengths)
    assert_model_is_file(model, tmp_path / "fitted.h5", rtol=1e-8)
    cli_fitted = hmm.load(tmp_path / "fitted.h5")
    np.testing.assert_allclose(list(cli_fitted.monitor_.history), list(model.monitor_.history), rtol=1e-10)


@needs_cli
def test_cli_reads_a_python_fit(tmp_path):
    rs = np.random.RandomState(4)
    X = rs.randint(0, 5, size=(200, 1))
    model = hmm.CategoricalHMM(n_components=3, random_state=0, n_iter=5).fit(X, [50, 50, 100])
    model.state_names_ = ["A", "B", "C"]
    hmm.save(model, tmp_path / "fitted.h5")
    with h5py.File(tmp_path / "data.h5", "w") as f:  # the same data as a dataset file (docs/hmm-format.md)
        f["observations"] = X[:, 0].astype(np.int32)
        f["offsets"] = np.array([0, 50, 100, 200], dtype=np.int64)
    cli("hmm", "infer", "-m", tmp_path / "fitted.h5", "-d", tmp_path / "data.h5", "-o", tmp_path / "out.h5")
    with h5py.File(tmp_path / "out.h5", "r") as out:
        np.testing.assert_array_equal(out["states"][:], model.predict(X, [50, 50, 100]))
        assert out["log_likelihood"][:].sum() == pytest.approx(model.score(X, [50, 50, 100]), rel=1e-12)
    assert_model_is_file(model, tmp_path / "fitted.h5")
    with h5py.File(tmp_path / "fitted.h5", "r") as f:
        assert f.attrs["format"] == "trellis-hmm" and f.attrs["emission"] == "categorical"
        assert [s.decode() if isinstance(s, bytes) else s for s in f["state_names"][:]] == ["A", "B", "C"]
        np.testing.assert_allclose(f["log_likelihood_history"][:], list(model.monitor_.history), rtol=1e-15)


@pytest.mark.parametrize("kind", ["categorical", "gaussian"])
def test_round_trip(kind, tmp_path):
    model = python_model(kind)
    model.state_names_ = [f"s{k}" for k in range(model.n_components)]
    if kind == "categorical":
        model.vocabulary_ = [f"w{v}" for v in range(model.n_features)]
    model.monitor_.history.extend([-10.0, -9.0])
    hmm.save(model, tmp_path / "m.h5")
    loaded = hmm.load(tmp_path / "m.h5")
    assert type(loaded) is type(model)
    for name in ("startprob_", "transmat_") + (("emissionprob_",) if kind == "categorical" else ("means_", "_covars_")):
        np.testing.assert_allclose(getattr(loaded, name), getattr(model, name), rtol=1e-15, err_msg=name)
    assert loaded.state_names_ == model.state_names_
    assert getattr(loaded, "vocabulary_", None) == getattr(model, "vocabulary_", None)
    assert list(loaded.monitor_.history) == [-10.0, -9.0]
    X = model.sample(30, random_state=0)[0]
    assert loaded.score(X) == pytest.approx(model.score(X), rel=1e-13)


def test_failed_save_leaves_the_old_file(tmp_path):
    path = tmp_path / "m.h5"
    hmm.save(python_model("categorical"), path)
    before = path.read_bytes()
    bad = python_model("categorical", seed=2)
    bad.state_names_ = ["only", "three", "names"]  # the model has 4 states: the library's writer refuses it
    with pytest.raises(RuntimeError, match=str(path)):
        hmm.save(bad, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.h5"]  # no temporary left behind
    with pytest.raises(hmm.NotFittedError):
        hmm.save(hmm.CategoricalHMM(2), tmp_path / "unfitted.h5")
    assert not (tmp_path / "unfitted.h5").exists()


def test_bad_files(tmp_path):
    with pytest.raises(RuntimeError, match="missing.h5"):
        hmm.load(tmp_path / "missing.h5")
    (tmp_path / "text.h5").write_text("not HDF5")
    with pytest.raises(RuntimeError, match="text.h5"):
        hmm.load(tmp_path / "text.h5")
    with h5py.File(tmp_path / "data.h5", "w") as f:  # a dataset, not a model
        f["observations"] = np.arange(3, dtype=np.int32)
        f["offsets"] = np.array([0, 3], dtype=np.int64)
    with pytest.raises(RuntimeError, match="not a Trellis HMM model"):
        hmm.load(tmp_path / "data.h5")
    hmm.save(python_model("categorical"), tmp_path / "m.h5")
    with h5py.File(tmp_path / "m.h5", "r+") as f:
        f["transmat"][0, 0] += 0.5
    with pytest.raises(RuntimeError, match="transmat"):
        hmm.load(tmp_path / "m.h5")
