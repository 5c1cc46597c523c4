"""trellis.hmm's estimators against hmmlearn 0.3.3: from the same parameters, the same log-likelihoods, posteriors,
decodings, EM updates (with priors, parameter subsets and zero probabilities), convergence records, information
criteria and samples; hmmlearn's random initialisation from the same seed; and the same errors for bad input."""
import logging

import numpy as np
import pytest
import torch

from trellis import hmm as trellis_hmm

hmmlearn_hmm = pytest.importorskip("hmmlearn.hmm")

K, V, F = 4, 7, 3
LENGTHS = [5, 1, 9, 3, 12, 2, 8]  # a length-1 sequence has no transitions
N = sum(LENGTHS)


@pytest.fixture(autouse=True)
def quiet_hmmlearn(caplog):
    # Both libraries warn about degenerate fits of data this small; the tests look at numbers.
    caplog.set_level(logging.ERROR)


@pytest.fixture(scope="module")
def parameters():
    rs = np.random.RandomState(0)
    return {
        "startprob_": rs.dirichlet(np.ones(K)),
        "transmat_": rs.dirichlet(np.ones(K), size=K),
        "emissionprob_": rs.dirichlet(np.ones(V), size=K),
        "means_": rs.randn(K, F) * 2,
        "covars_": rs.uniform(0.5, 2.0, size=(K, F)),
        "symbols": rs.randint(0, V, size=(N, 1)),
        "features": rs.randn(N, F) * 2,
    }


def categorical(module, p, **kwargs):
    model = module.CategoricalHMM(n_components=K, n_features=V, init_params="", **kwargs)
    model.startprob_, model.transmat_, model.emissionprob_ = (p[k].copy() for k in
                                                              ("startprob_", "transmat_", "emissionprob_"))
    return model


def gaussian(module, p, **kwargs):
    model = module.GaussianHMM(n_components=len(p["startprob_"]), init_params="", **kwargs)
    model.startprob_, model.transmat_, model.means_ = (p[k].copy() for k in ("startprob_", "transmat_", "means_"))
    model.covars_ = p["covars_"].copy()
    return model


KINDS = {"categorical": (categorical, "symbols"), "gaussian": (gaussian, "features")}


def pair(kind, p, device="cpu", trellis_only=None, **kwargs):
    """The same model in hmmlearn and in trellis (with trellis' own arguments too), and the data to give both."""
    make, data = KINDS[kind]
    return (make(hmmlearn_hmm, p, **kwargs), make(trellis_hmm, p, device=device, **(trellis_only or {}), **kwargs),
            p[data])


def assert_same_parameters(reference, model, kind, rtol=1e-8, atol=1e-10):
    names = ["startprob_", "transmat_"] + (["emissionprob_"] if kind == "categorical" else ["means_", "covars_"])
    for name in names:
        np.testing.assert_allclose(getattr(model, name), getattr(reference, name), rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_score_posteriors_and_decoding(kind, parameters, device):
    reference, model, X = pair(kind, parameters, device)
    for lengths in (LENGTHS, None):
        assert model.score(X, lengths) == pytest.approx(reference.score(X, lengths), rel=1e-12)
        log_prob, posteriors = model.score_samples(X, lengths)
        ref_log_prob, ref_posteriors = reference.score_samples(X, lengths)
        assert log_prob == pytest.approx(ref_log_prob, rel=1e-12)
        assert posteriors.shape == (N, K)
        np.testing.assert_allclose(posteriors, ref_posteriors, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(model.predict_proba(X, lengths), ref_posteriors, rtol=1e-9, atol=1e-12)
        for algorithm in ("viterbi", "map"):
            log_prob, states = model.decode(X, lengths, algorithm=algorithm)
            ref_log_prob, ref_states = reference.decode(X, lengths, algorithm=algorithm)
            assert log_prob == pytest.approx(ref_log_prob, rel=1e-12)
            np.testing.assert_array_equal(states, ref_states)
        np.testing.assert_array_equal(model.predict(X, lengths), reference.predict(X, lengths))


@pytest.mark.parametrize("kind", KINDS)
def test_predict_follows_algorithm(kind, parameters):
    reference, model, X = pair(kind, parameters, algorithm="map")
    np.testing.assert_array_equal(model.predict(X, LENGTHS), reference.predict(X, LENGTHS))
    np.testing.assert_array_equal(model.predict(X, LENGTHS), model.decode(X, LENGTHS, algorithm="map")[1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_iter", [1, 6])
def test_em_from_the_same_start(kind, n_iter, parameters, device):
    reference, model, X = pair(kind, parameters, device, n_iter=n_iter, tol=0)
    reference.fit(X, LENGTHS)
    assert model.fit(X, LENGTHS) is model
    assert_same_parameters(reference, model, kind)
    np.testing.assert_allclose(list(model.monitor_.history), list(reference.monitor_.history), rtol=1e-12)
    assert model.monitor_.iter == reference.monitor_.iter == n_iter
    assert model.monitor_.converged


PRIORS = {
    "categorical": dict(startprob_prior=np.arange(1, K + 1) * 0.7, transmat_prior=2.0, emissionprob_prior=1.5),
    "gaussian": dict(startprob_prior=1.3, transmat_prior=np.full((K, K), 0.8), means_prior=0.5, means_weight=2.0,
                     covars_prior=0.3, covars_weight=3.0),
}


@pytest.mark.parametrize("kind", KINDS)
def test_em_with_priors(kind, parameters):
    reference, model, X = pair(kind, parameters, n_iter=4, tol=0, **PRIORS[kind])
    reference.fit(X, LENGTHS)
    model.fit(X, LENGTHS)
    assert_same_parameters(reference, model, kind)


@pytest.mark.parametrize("kind,params", [("categorical", "t"), ("categorical", "se"), ("gaussian", "sm"),
                                         ("gaussian", "tmc")])
def test_em_updates_only_params(kind, params, parameters):
    reference, model, X = pair(kind, parameters, n_iter=3, tol=0, params=params)
    reference.fit(X, LENGTHS)
    model.fit(X, LENGTHS)
    assert_same_parameters(reference, model, kind)
    if "s" not in params:
        np.testing.assert_array_equal(model.startprob_, parameters["startprob_"])


def test_covars_without_means(parameters):
    # params="c" (no "m"): covars_ around the fixed means, (covars_prior + Σγ(x−μ)²) / Σγ. hmmlearn 0.3.3 drops the
    # posterior weights from this update when means are not fitted; Trellis keeps them.
    model = gaussian(trellis_hmm, parameters, params="c", n_iter=1, covars_prior=0.05)
    X = parameters["features"]
    _, posteriors = model.score_samples(X, LENGTHS)
    model.fit(X, LENGTHS)
    squares = ((X[:, None, :] - parameters["means_"][None]) ** 2 * posteriors[:, :, None]).sum(0)
    np.testing.assert_allclose(model._covars_, (0.05 + squares) / posteriors.sum(0)[:, None], rtol=1e-10)
    np.testing.assert_array_equal(model.means_, parameters["means_"])


def test_zero_probabilities_stay_zero(parameters):
    # A left-right model: the forbidden transitions and start states stay impossible, as in hmmlearn. State 0 never
    # emits the first symbol of X (which batches repeat in their padding).
    reference, model, X = pair("categorical", parameters, n_iter=5, tol=0)
    transmat = np.triu(parameters["transmat_"])
    transmat /= transmat.sum(1, keepdims=True)
    startprob = np.array([0.5, 0.5, 0.0, 0.0])
    emissionprob = parameters["emissionprob_"].copy()
    emissionprob[0, X[0, 0]] = 0
    emissionprob /= emissionprob.sum(1, keepdims=True)
    for m in (reference, model):
        m.transmat_, m.startprob_, m.emissionprob_ = transmat.copy(), startprob.copy(), emissionprob.copy()
    assert model.score(X, LENGTHS) == pytest.approx(reference.score(X, LENGTHS), rel=1e-12)
    reference.fit(X, LENGTHS)
    model.fit(X, LENGTHS)
    assert_same_parameters(reference, model, "categorical")
    assert (model.transmat_[np.tril_indices(K, -1)] == 0).all() and (model.startprob_[2:] == 0).all()
    assert model.emissionprob_[0, X[0, 0]] == 0
    np.testing.assert_array_equal(model.predict(X, LENGTHS), reference.predict(X, LENGTHS))
    np.testing.assert_allclose(model.predict_proba(X, LENGTHS), reference.predict_proba(X, LENGTHS), atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_batches_give_the_same_results(kind, parameters):
    # Sequences in many small batches (sorted by length, padded) or one: the same numbers in X's order.
    _, whole, X = pair(kind, parameters, n_iter=3, tol=0)
    _, split, _ = pair(kind, parameters, n_iter=3, tol=0, trellis_only={"batch_tokens": 10})
    assert split.score(X, LENGTHS) == pytest.approx(whole.score(X, LENGTHS), rel=1e-12)
    np.testing.assert_allclose(split.predict_proba(X, LENGTHS), whole.predict_proba(X, LENGTHS), rtol=1e-12,
                               atol=1e-14)
    np.testing.assert_array_equal(split.predict(X, LENGTHS), whole.predict(X, LENGTHS))
    split.fit(X, LENGTHS)
    whole.fit(X, LENGTHS)
    assert_same_parameters(whole, split, kind, rtol=1e-12)


def test_random_initialisation_is_hmmlearns(parameters):
    # startprob_, transmat_ and emissionprob_ are drawn as hmmlearn draws them: fit from a seed gives its model.
    X = parameters["symbols"]
    reference = hmmlearn_hmm.CategoricalHMM(n_components=K, random_state=7, n_iter=4, tol=0).fit(X, LENGTHS)
    model = trellis_hmm.CategoricalHMM(n_components=K, random_state=7, n_iter=4, tol=0).fit(X, LENGTHS)
    assert model.n_features == reference.n_features == V
    assert_same_parameters(reference, model, "categorical")


def test_gaussian_random_initialisation(parameters):
    rs = np.random.RandomState(1)
    centres = np.array([[-6.0, 0.0, 0.0], [6.0, 0.0, 0.0], [0.0, 6.0, 0.0], [0.0, 0.0, 6.0]])
    labels = rs.randint(0, K, size=400)
    X = centres[labels] + rs.randn(400, F) * 0.5
    model = trellis_hmm.GaussianHMM(n_components=K, random_state=0, n_iter=10, tol=1e-9).fit(X, [100] * 4)
    # k-means puts one mean near each cluster; EM never lowers the log-likelihood.
    nearest = np.linalg.norm(model.means_[:, None, :] - centres[None], axis=-1).argmin(0)
    assert sorted(nearest) == list(range(K))
    history = np.array(model.monitor_.history)
    assert (np.diff(history) > -1e-8).all()
    np.testing.assert_allclose(model._covars_, np.full((K, F), 0.25), rtol=0.35)
    again = trellis_hmm.GaussianHMM(n_components=K, random_state=0, n_iter=10, tol=1e-9).fit(X, [100] * 4)
    np.testing.assert_array_equal(again.means_, model.means_)


@pytest.mark.parametrize("kind", KINDS)
def test_convergence_monitor(kind, parameters):
    reference, model, X = pair(kind, parameters, n_iter=100, tol=1e-3)
    reference.fit(X, LENGTHS)
    model.fit(X, LENGTHS)
    assert model.monitor_.iter == reference.monitor_.iter < 100
    assert model.monitor_.converged and reference.monitor_.converged
    assert model.monitor_.history[-1] - model.monitor_.history[-2] < 1e-3
    np.testing.assert_allclose(list(model.monitor_.history), list(reference.monitor_.history), rtol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_information_criteria(kind, parameters):
    reference, model, X = pair(kind, parameters)
    reference.score(X)  # hmmlearn's GaussianHMM counts parameters from n_features, set there
    assert model.aic(X, LENGTHS) == pytest.approx(reference.aic(X, LENGTHS), rel=1e-12)
    assert model.bic(X, LENGTHS) == pytest.approx(reference.bic(X, LENGTHS), rel=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_sample_is_hmmlearns(kind, parameters):
    reference, model, _ = pair(kind, parameters)
    X, Z = model.sample(50, random_state=3)
    ref_X, ref_Z = reference.sample(50, random_state=3)
    assert X.shape == ref_X.shape == ((50, 1) if kind == "categorical" else (50, F))
    assert X.dtype == ref_X.dtype and Z.dtype == ref_Z.dtype
    np.testing.assert_array_equal(Z, ref_Z)
    np.testing.assert_allclose(X, ref_X, rtol=1e-12)
    _, Z = model.sample(5, random_state=3, currstate=2)
    assert Z[0] == 2


def test_sample_statistics(parameters):
    model = categorical(trellis_hmm, parameters)
    X, Z = model.sample(20000, random_state=0)
    # Transition and emission frequencies estimate transmat_ and emissionprob_.
    counts = np.zeros((K, K))
    np.add.at(counts, (Z[:-1], Z[1:]), 1)
    np.testing.assert_allclose(counts / counts.sum(1, keepdims=True), model.transmat_, atol=0.03)
    emitted = np.zeros((K, V))
    np.add.at(emitted, (Z, X[:, 0]), 1)
    np.testing.assert_allclose(emitted / emitted.sum(1, keepdims=True), model.emissionprob_, atol=0.03)
    g = gaussian(trellis_hmm, parameters)
    X, Z = g.sample(20000, random_state=0)
    for k in range(K):
        np.testing.assert_allclose(X[Z == k].mean(0), g.means_[k], atol=0.15)
        np.testing.assert_allclose(X[Z == k].var(0), g._covars_[k], rtol=0.15)


def test_stationary_distribution(parameters):
    reference, model, _ = pair("categorical", parameters)
    np.testing.assert_allclose(model.get_stationary_distribution(), reference.get_stationary_distribution(),
                               rtol=1e-10)


def test_covars_shapes(parameters):
    reference, model, X = pair("gaussian", parameters)
    reference.score(X)  # hmmlearn's covars_ needs n_features, set there
    assert model.covars_.shape == reference.covars_.shape == (K, F, F)
    np.testing.assert_array_equal(model.covars_, reference.covars_)


def test_estimator_protocol():
    model = trellis_hmm.GaussianHMM(n_components=3, n_iter=7)
    params = model.get_params()
    assert params["n_components"] == 3 and params["n_iter"] == 7 and params["covariance_type"] == "diag"
    assert set(hmmlearn_hmm.GaussianHMM().get_params()) <= set(params)
    assert set(hmmlearn_hmm.CategoricalHMM().get_params()) <= set(trellis_hmm.CategoricalHMM().get_params())
    assert model.set_params(tol=0.5) is model and model.tol == 0.5
    with pytest.raises(ValueError, match="Invalid parameter"):
        model.set_params(n_states=2)
    assert repr(model) == "GaussianHMM(n_components=3, n_iter=7, tol=0.5)"


def errors(call_reference, call_model):
    """The ValueError messages of hmmlearn and trellis for the same call."""
    with pytest.raises(ValueError) as ref:
        call_reference()
    with pytest.raises(ValueError) as ours:
        call_model()
    return str(ref.value), str(ours.value)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_lengths(kind, parameters):
    reference, model, X = pair(kind, parameters)
    ref, ours = errors(lambda: reference.score(X, [3, 4]), lambda: model.score(X, [3, 4]))
    assert ref == ours == f"lengths array [3, 4] doesn't sum to {N} samples"
    with pytest.raises(ValueError, match="length 0"):
        model.score(X, [N, 0])


@pytest.mark.parametrize("bad,message", [
    (lambda X: X.astype(float), "Symbols should be integers"),
    (lambda X: X - 1, "Symbols should be nonnegative"),
])
def test_bad_symbols(bad, message, parameters):
    X = parameters["symbols"]
    ref, ours = errors(lambda: hmmlearn_hmm.CategoricalHMM(K).fit(bad(X)),
                       lambda: trellis_hmm.CategoricalHMM(K).fit(bad(X)))
    assert ref == ours == message
    with pytest.raises(ValueError, match=message):
        categorical(trellis_hmm, parameters).score(bad(X))


def test_symbol_outside_the_model(parameters):
    X = parameters["symbols"].copy()
    X[3] = V
    ref, ours = errors(lambda: hmmlearn_hmm.CategoricalHMM(K, n_features=V).fit(X),
                       lambda: trellis_hmm.CategoricalHMM(K, n_features=V).fit(X))
    assert ref == ours == f"Largest symbol is {V} but the model only emits symbols up to {V - 1}"
    with pytest.raises(ValueError, match="Largest symbol"):
        categorical(trellis_hmm, parameters).predict(X)


def test_bad_arrays(parameters):
    model = categorical(trellis_hmm, parameters)
    with pytest.raises(ValueError, match="Expected 2D array, got 1D array"):
        model.score(parameters["symbols"][:, 0])
    with pytest.raises(ValueError, match="0 sample"):
        model.score(np.zeros((0, 1), dtype=int))
    g = gaussian(trellis_hmm, parameters)
    X = parameters["features"].copy()
    X[2, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        g.score(X)
    reference = gaussian(hmmlearn_hmm, parameters)
    reference.score(parameters["features"])  # hmmlearn sets n_features there
    ref, ours = errors(lambda: reference.fit(parameters["features"][:, :2]),
                       lambda: g.fit(parameters["features"][:, :2]))
    assert ref == ours == f"Unexpected number of dimensions, got 2 but expected {F}"


@pytest.mark.parametrize("kind", KINDS)
def test_bad_parameters(kind, parameters):
    reference, model, X = pair(kind, parameters)
    for m in (reference, model):
        m.startprob_ = parameters["startprob_"] * 2
    ref, ours = errors(lambda: reference.score(X), lambda: model.score(X))
    assert ref == ours and "startprob_ must sum to 1" in ours
    reference, model, X = pair(kind, parameters)
    for m in (reference, model):
        m.transmat_ = parameters["transmat_"][:, :2]
    ref, ours = errors(lambda: reference.predict(X), lambda: model.predict(X))
    assert ref == ours == "transmat_ must have shape (n_components, n_components)"
    with pytest.raises(ValueError, match="Unknown decoder 'beam'"):
        pair(kind, parameters)[1].decode(X, algorithm="beam")


def test_bad_emission_parameters(parameters):
    reference, model, X = pair("categorical", parameters)
    for m in (reference, model):
        m.emissionprob_ = parameters["emissionprob_"][:, 1:]
    ref, ours = errors(lambda: reference.score(X), lambda: model.score(X))
    assert ref == ours
    with pytest.raises(ValueError, match="'diag' covars must be positive"):
        trellis_hmm.GaussianHMM(K).covars_ = -parameters["covars_"]
    with pytest.raises(ValueError, match="'diag' covars must have shape"):
        trellis_hmm.GaussianHMM(K).covars_ = parameters["covars_"][0]
    with pytest.raises(ValueError, match="covariance_type='diag' only"):
        trellis_hmm.GaussianHMM(K, covariance_type="full").fit(parameters["features"])


def test_not_fitted(parameters):
    with pytest.raises(trellis_hmm.NotFittedError, match="not fitted yet"):
        trellis_hmm.CategoricalHMM(K).score(parameters["symbols"])
    with pytest.raises(ValueError):  # as scikit-learn's, a ValueError and an AttributeError
        trellis_hmm.GaussianHMM(K).predict(parameters["features"])


def test_float32_data_far_from_zero(device):
    # Features near 1000 with variances near 0.3: float32 scores and float64 statistics keep hmmlearn's EM.
    rs = np.random.RandomState(5)
    p = {"startprob_": np.full(3, 1 / 3), "transmat_": rs.dirichlet(np.ones(3), size=3),
         "means_": 1000 + rs.randn(3, 2), "covars_": np.full((3, 2), 0.3)}
    X = 1000 + rs.randn(300, 2) * 0.5
    start = gaussian(trellis_hmm, p, device=device, dtype=torch.float32)
    assert start.score(X) == pytest.approx(gaussian(hmmlearn_hmm, p).score(X), rel=2e-5)
    np.testing.assert_allclose(start.predict_proba(X), gaussian(hmmlearn_hmm, p).predict_proba(X), atol=1e-3)
    reference = gaussian(hmmlearn_hmm, p, n_iter=3, tol=0).fit(X)
    model = gaussian(trellis_hmm, p, n_iter=3, tol=0, device=device, dtype=torch.float32).fit(X)
    np.testing.assert_allclose(model.means_, reference.means_, rtol=0, atol=1e-3)
    np.testing.assert_allclose(model._covars_, reference._covars_, rtol=1e-3)
    np.testing.assert_allclose(list(model.monitor_.history), list(reference.monitor_.history), rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_float32(kind, parameters):
    reference, model, X = pair(kind, parameters, "cuda", {"dtype": torch.float32}, n_iter=3, tol=0)
    assert model.score(X, LENGTHS) == pytest.approx(reference.score(X, LENGTHS), rel=1e-5)
    np.testing.assert_allclose(model.predict_proba(X, LENGTHS), reference.predict_proba(X, LENGTHS), atol=1e-4)
    np.testing.assert_array_equal(model.predict(X, LENGTHS), reference.predict(X, LENGTHS))
    reference.fit(X, LENGTHS)
    model.fit(X, LENGTHS)
    assert_same_parameters(reference, model, kind, rtol=1e-3, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cuda_large_batch_matches_cpu():
    # Many sequences of mixed lengths, batched on the GPU and on the CPU: the same scores and paths.
    rs = np.random.RandomState(2)
    lengths = rs.randint(1, 300, size=200)
    X = rs.randint(0, 50, size=(lengths.sum(), 1))
    cpu = trellis_hmm.CategoricalHMM(n_components=16, random_state=0, n_iter=2).fit(X, lengths)
    gpu = trellis_hmm.CategoricalHMM(n_components=16, random_state=0, n_iter=2, device="cuda").fit(X, lengths)
    assert_same_parameters(cpu, gpu, "categorical", rtol=1e-9)
    assert gpu.score(X, lengths) == pytest.approx(cpu.score(X, lengths), rel=1e-12)
    np.testing.assert_array_equal(gpu.predict(X, lengths), cpu.predict(X, lengths))
