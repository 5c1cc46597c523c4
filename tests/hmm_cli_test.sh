#!/usr/bin/env bash
# trellis hmm on good and bad input: every bad file or option exits non-zero with a message naming the file, dataset
# and index, and nothing appears under the output's name (not even when the error comes after batches were written).
# Usage: hmm_cli_test.sh TRELLIS_BINARY WORK_DIR PYTHON (with h5py and numpy, to write the bad files)
set -uo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/cli_harness.sh" || exit 1
trellis=$1
work=$2
py=$3
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
"$py" -c 'import h5py, numpy' 2>/dev/null || { echo "SKIP: $py cannot import h5py and numpy"; exit 77; }

# Good path: random model, sample, infer, EM, supervised fit.
"$trellis" hmm init --states 3 --symbols 6 --seed 1 -o cat.h5 2>/dev/null && ok || fail "init categorical"
"$trellis" hmm init --states 2 --features 3 --seed 1 -o gauss.h5 2>/dev/null && ok || fail "init gaussian"
"$trellis" hmm sample -m cat.h5 -o cat_data.h5 -n 200 -l 30 --min-length 1 --seed 2 2>/dev/null && ok || fail "sample"
"$trellis" hmm sample -m gauss.h5 -o gauss_data.h5 -n 50 -l 20 --seed 2 2>/dev/null && ok || fail "sample gaussian"
"$trellis" hmm infer -m cat.h5 -d cat_data.h5 -o big.h5 --posteriors >infer.txt 2>/dev/null && grep -q "tokens/s" infer.txt &&
  ok || fail "infer"
# Streaming: a budget of a few sequences per batch gives the same results as one batch.
"$trellis" hmm infer -m cat.h5 -d cat_data.h5 -o small.h5 --posteriors --memory-budget 20k >/dev/null 2>small.log &&
  "$py" - <<'EOF' && ok || fail "small batches differ from one batch"
import h5py, numpy as np
a, b = h5py.File("big.h5"), h5py.File("small.h5")
for k in ("offsets", "log_likelihood", "viterbi_log_prob", "states", "posteriors"):
    assert np.allclose(a[k][:], b[k][:], rtol=1e-12, atol=1e-7), k
EOF
grep -q "batches of up to [0-9]* positions" small.log && ok || fail "infer does not report its batch size"
# Posteriors uncompressed (--compression 0) and at gzip 9: the same values, the filter as asked.
"$trellis" hmm infer -m cat.h5 -d cat_data.h5 -o raw.h5 --posteriors --compression 0 >/dev/null 2>&1 &&
  "$trellis" hmm infer -m cat.h5 -d cat_data.h5 -o gz9.h5 --posteriors --compression 9 >/dev/null 2>&1 &&
  "$py" - <<'EOF' && ok || fail "posteriors compression"
import h5py, numpy as np
a, raw, gz9 = h5py.File("big.h5"), h5py.File("raw.h5"), h5py.File("gz9.h5")
assert raw["posteriors"].compression is None, raw["posteriors"].compression
assert a["posteriors"].compression == "gzip" and a["posteriors"].compression_opts == 1, a["posteriors"].compression_opts
assert gz9["posteriors"].compression == "gzip" and gz9["posteriors"].compression_opts == 9
for f in (raw, gz9):
    assert np.array_equal(a["posteriors"][:], f["posteriors"][:])
EOF
"$trellis" hmm infer -m cat.h5 -d cat_data.h5 -o bad.h5 --posteriors --compression 10 >/dev/null 2>err.txt
[ $? -ne 0 ] && grep -q -- "--compression must be a gzip level from 0 (none) to 9, not 10" err.txt && [ ! -e bad.h5 ] &&
  ok || fail "a bad --compression is an error"
"$trellis" hmm fit -d cat_data.h5 -o em.h5 --states 3 --restarts 2 --max-iterations 5 2>fit.log && grep -q "restart 1" fit.log &&
  ok || fail "EM with restarts"
"$trellis" hmm fit -d cat_data.h5 -o sup.h5 --supervised --smoothing 0.1 2>/dev/null && ok || fail "supervised fit"
"$trellis" hmm fit -d gauss_data.h5 -o gfit.h5 --states 2 --max-iterations 5 2>/dev/null && ok || fail "EM gaussian"

# CoNLL conversion with a training vocabulary, then tagging and scoring.
printf 'the DT\ncat NN\nsat VBD\n\nthe DT\ndog NN\nran VBD\n\nthe DT\ncat NN\n\n' >train.txt
printf 'the DT\nbird NN\nsang VBD\n\n' >dev.txt
"$trellis" hmm convert -i train.txt -o train.h5 --min-count 2 2>/dev/null && ok || fail "convert train"
"$trellis" hmm convert -i dev.txt -o dev.h5 --vocabulary-from train.h5 2>/dev/null && ok || fail "convert dev"
"$trellis" hmm fit -d train.h5 -o pos.h5 --supervised --smoothing 0.1 2>/dev/null &&
  "$trellis" hmm infer -m pos.h5 -d dev.h5 -o pred.h5 >/dev/null 2>&1 &&
  prints "accuracy" "$trellis" hmm eval -d dev.h5 -p pred.h5 && ok || fail "supervised POS round trip"
"$trellis" hmm fit -d train.h5 -o pos2.h5 --supervised --order 2 --smoothing 0.1 2>/dev/null &&
  "$trellis" hmm infer -m pos2.h5 -d train.h5 -o pred2.h5 >/dev/null 2>&1 &&
  prints "accuracy 100.00%" "$trellis" hmm eval -d train.h5 -p pred2.h5 && ok || fail "second-order model round trip"
# No smoothing: a label never followed by another (sentence-final punctuation) keeps uniform transitions, a state no
# label reaches uniform rows; the model is written and valid.
printf 'hello X\nworld X\n. P\n\nbye X\n. P\n\n' >punct.txt
"$trellis" hmm convert -i punct.txt -o punct.h5 --min-count 1 2>/dev/null &&
  "$trellis" hmm fit -d punct.h5 -o punct_model.h5 --supervised 2>/dev/null &&
  "$trellis" hmm fit -d punct.h5 -o punct4.h5 --supervised --states 4 2>/dev/null &&
  "$trellis" hmm fit -d punct.h5 -o punct_o2.h5 --supervised --order 2 --states 5 2>/dev/null &&
  "$py" - <<'EOF' && ok || fail "supervised fit without smoothing: rows without counts"
import h5py, numpy as np
with h5py.File("punct_model.h5") as f:
    names = [n.decode() if isinstance(n, bytes) else n for n in f["state_names"][:]]
    t = f["transmat"][:]
    assert np.allclose(t[names.index("P")], 0.5), t  # P ends every sentence: no counts, uniform
    x, p = names.index("X"), names.index("P")
    assert np.allclose([t[x, x], t[x, p]], [1 / 3, 2 / 3]), t  # X -> X once, X -> P twice
with h5py.File("punct4.h5") as f:
    assert np.allclose(f["transmat"][:][3], 0.25) and np.allclose(f["emissionprob"][:][3], 1 / f["emissionprob"].shape[1])
EOF
# Fine labels from two columns, scored on their first part; dev labels training never saw kept with --add-labels.
printf 'the DT x\ncat NN y\nsat VBD z\n\nthe DT x\ndog NN y\nran VBD w\n\n' >fine.txt
printf 'the DT x\ncat NN q\n\n' >finedev.txt
"$trellis" hmm convert -i fine.txt -o fine.h5 --label-column 1,2 2>fine.log && grep -q ", 4 labels" fine.log && ok ||
  fail "two label columns give fine labels"
expect_error "unseen fine label" "finedev.txt:2: label 'NN|q'" fd.h5 \
  "$trellis" hmm convert -i finedev.txt -o fd.h5 --vocabulary-from fine.h5 --label-column 1,2
"$trellis" hmm convert -i finedev.txt -o fd.h5 --vocabulary-from fine.h5 --label-column 1,2 --add-labels 2>/dev/null &&
  "$trellis" hmm fit -d fine.h5 -o finem.h5 --supervised --smoothing 0.1 2>/dev/null &&
  "$trellis" hmm infer -m finem.h5 -d fd.h5 -o finep.h5 >/dev/null 2>&1 &&
  prints "accuracy 50.00%" "$trellis" hmm eval -d fd.h5 -p finep.h5 &&
  prints "accuracy 100.00%" "$trellis" hmm eval -d fd.h5 -p finep.h5 --coarse && ok || fail "coarse scoring of fine labels"
expect_error "bad label column list" "--label-column '1,x' is not a comma-separated list" f2.h5 \
  "$trellis" hmm convert -i fine.txt -o f2.h5 --label-column 1,x
expect_error "second order without labels" "--order must be 1, or 2 with --supervised" m.h5 \
  "$trellis" hmm fit -d train.h5 -o m.h5 --states 3 --order 2
printf 'the DT\ncat XX\n\n' >badlabel.txt
expect_error "unknown label" "badlabel.txt:2: label 'XX'" bl.h5 \
  "$trellis" hmm convert -i badlabel.txt -o bl.h5 --vocabulary-from train.h5
"$trellis" hmm convert -i train.txt -o strict.h5 --unknown error 2>/dev/null
expect_error "unknown word, no unknown classes" "dev.txt:2: word 'bird' is not in the vocabulary" d2.h5 \
  "$trellis" hmm convert -i dev.txt -o d2.h5 --vocabulary-from strict.h5

# Bad data files, written with h5py.
"$py" - <<'EOF' || fail "writing the bad files"
import h5py, numpy as np
def data(name, obs, offsets, **extra):
    with h5py.File(name, "w") as f:
        if obs is not None: f["observations"] = obs
        if offsets is not None: f["offsets"] = np.asarray(offsets, dtype=np.int64)
        for k, v in extra.items(): f[k] = v
ids = np.array([0, 1, 2, 3, 1, 0], dtype=np.int32)
data("no_obs.h5", None, [0, 6])
data("no_offsets.h5", ids, None)
data("strings.h5", np.array([b"a", b"b"]), [0, 2])
data("rank.h5", ids.reshape(3, 2), [0, 3])
data("float_rank.h5", np.ones(6, np.float32), [0, 6])
data("not_monotone.h5", ids, [0, 4, 3, 6])
data("empty_seq.h5", ids, [0, 2, 2, 6])
data("bad_end.h5", ids, [0, 2, 5])
data("bad_start.h5", ids, [1, 6])
data("big_id.h5", np.array([0, 1, 2, 3, 99, 0], np.int32), [0, 3, 6])
data("neg_id.h5", np.array([0, -1, 2, 3, 1, 0], np.int32), [0, 3, 6])
x = np.random.default_rng(0).normal(size=(6, 3)).astype(np.float32)
y = x.copy(); y[4, 1] = np.nan
data("nan.h5", y, [0, 3, 6])
y = x.copy(); y[2, 0] = np.inf
data("inf.h5", y, [0, 3, 6])
y = x.copy(); y[5, 2] = 3e20  # finite in float32, its square is not
data("huge_feature.h5", y, [0, 3, 6])
data("two_features.h5", x[:, :2], [0, 3, 6])
data("bad_labels.h5", ids, [0, 3, 6], labels=np.array([0, 1, 2, 7, 0, 1], np.int32))
data("short_labels.h5", ids, [0, 3, 6], labels=np.array([0, 1], np.int32))
data("huge_label.h5", ids, [0, 3, 6], labels=np.array([0, 1, 2, 1000000000, 0, 1], np.int32))
# 4000 good sequences, then a bad id: the error comes after many batches were written.
late = np.zeros(8000, np.int32); late[7999] = 9
data("late_error.h5", late, np.arange(0, 8001, 2))
with h5py.File("rows.h5", "w") as f:
    f.attrs["format"] = "trellis-hmm"; f.attrs["version"] = 1; f.attrs["emission"] = "categorical"
    f["startprob"] = [0.5, 0.5]; f["transmat"] = [[0.5, 0.5], [0.9, 0.3]]; f["emissionprob"] = [[0.5, 0.5], [0.5, 0.5]]
with h5py.File("foreign.h5", "w") as f:
    f["startprob"] = [1.0]
with h5py.File("version.h5", "w") as f:
    f.attrs["format"] = "trellis-hmm"; f.attrs["version"] = 7; f.attrs["emission"] = "categorical"
with h5py.File("no_version.h5", "w") as f:
    f.attrs["format"] = "trellis-hmm"; f.attrs["emission"] = "categorical"
with h5py.File("no_covars.h5", "w") as f:
    f.attrs["format"] = "trellis-hmm"; f.attrs["version"] = 1; f.attrs["emission"] = "gaussian"
    f["startprob"] = [1.0]; f["transmat"] = [[1.0]]; f["means"] = [[0.0, 1.0]]
# 16 GB of means in a file of kilobytes: chunks never written read as the fill value.
with h5py.File("unwritten.h5", "w") as f:
    f.attrs["format"] = "trellis-hmm"; f.attrs["version"] = 1; f.attrs["emission"] = "gaussian"
    f["startprob"] = [1.0]; f["transmat"] = [[1.0]]
    f.create_dataset("means", shape=(1, 2**31), dtype="f8", chunks=(1, 2**16))
EOF
echo "not hdf5" >text.h5
head -c 1000 cat_data.h5 >cut.h5  # an interrupted copy

infer() { "$trellis" hmm infer -m "$1" -d "$2" -o out.h5; }
expect_error "missing observations" "no_obs.h5: missing dataset '/observations'" out.h5 infer cat.h5 no_obs.h5
expect_error "missing offsets" "no_offsets.h5: missing dataset '/offsets'" out.h5 infer cat.h5 no_offsets.h5
expect_error "wrong dtype" "strings.h5: '/observations' must hold integers" out.h5 infer cat.h5 strings.h5
expect_error "categorical rank" "rank.h5: categorical '/observations' must be 1-d" out.h5 infer cat.h5 rank.h5
expect_error "continuous rank" "float_rank.h5: continuous '/observations' must be 2-d" out.h5 infer gauss.h5 float_rank.h5
expect_error "offsets not monotone" "not_monotone.h5: /offsets[2] = 3 is not greater than offsets[1] = 4" out.h5 \
  infer cat.h5 not_monotone.h5
expect_error "empty sequence" "empty_seq.h5: /offsets[2] = 2 is not greater than offsets[1] = 2 (sequence 1 is empty)" \
  out.h5 infer cat.h5 empty_seq.h5
expect_error "offsets end" "bad_end.h5: '/offsets' ends at 5 but '/observations' has 6 rows" out.h5 infer cat.h5 bad_end.h5
expect_error "offsets start" "bad_start.h5: /offsets[0] = 1, expected 0" out.h5 infer cat.h5 bad_start.h5
expect_error "id outside vocabulary" "big_id.h5: /observations[4] = 99 is outside the vocabulary [0, 6)" out.h5 \
  infer cat.h5 big_id.h5
expect_error "negative id" "neg_id.h5: /observations[1] = -1 is outside the vocabulary" out.h5 infer cat.h5 neg_id.h5
expect_error "NaN feature" "nan.h5: /observations[4][1] is NaN" out.h5 infer gauss.h5 nan.h5
expect_error "inf feature" "inf.h5: /observations[2][0] is infinite" out.h5 infer gauss.h5 inf.h5
expect_error "huge feature" "huge_feature.h5: /observations[5][2] is 3e+20, too large: its square overflows float32" \
  out.h5 infer gauss.h5 huge_feature.h5
expect_error "feature count" "two_features.h5: observations have F = 2 features, the model has 3" out.h5 \
  infer gauss.h5 two_features.h5
expect_error "emission kind" "nan.h5: holds feature vectors (F = 3), but the model has categorical emissions" out.h5 \
  infer cat.h5 nan.h5
expect_error "categorical data, Gaussian model" "cat_data.h5: holds categorical ids, but the model has Gaussian" out.h5 \
  infer gauss.h5 cat_data.h5
expect_error "error after batches were written" "late_error.h5: /observations[7999] = 9 is outside the vocabulary" out.h5 \
  "$trellis" hmm infer -m cat.h5 -d late_error.h5 -o out.h5 --memory-budget 20k
expect_error "label outside the states" "bad_labels.h5: /labels[3] = 7 is outside the states [0, 3)" fit.h5 \
  "$trellis" hmm fit -d bad_labels.h5 -o fit.h5 --supervised --states 3
expect_error "labels length" "short_labels.h5: '/labels' must be a 1-d integer dataset with one entry per observation" \
  fit.h5 "$trellis" hmm fit -d short_labels.h5 -o fit.h5 --supervised
expect_error "transition row" "rows.h5: transmat row 1 is not a probability distribution" out.h5 infer rows.h5 cat_data.h5
expect_error "foreign model" "foreign.h5: not a Trellis HMM model" out.h5 infer foreign.h5 cat_data.h5
expect_error "model version" "version.h5: model format version 7 is not supported" out.h5 infer version.h5 cat_data.h5
expect_error "model without a version" "no_version.h5: no attribute 'version'" out.h5 infer no_version.h5 cat_data.h5
expect_error "unwritten 16 GB dataset" "unwritten.h5: dataset 'means' claims 17.2 GB of numbers but the file stores only 0 bytes of them" \
  out.h5 infer unwritten.h5 gauss_data.h5
expect_error "missing covars" "no_covars.h5: missing dataset '/covars'" out.h5 infer no_covars.h5 gauss_data.h5
expect_error "not HDF5" "text.h5: not an HDF5 file" out.h5 infer cat.h5 text.h5
expect_error "truncated" "cut.h5: the HDF5 file is truncated: it holds 1000 bytes" out.h5 infer cat.h5 cut.h5
expect_error "missing file" "cannot open 'nowhere.h5'" out.h5 infer cat.h5 nowhere.h5
expect_error "memory budget" "'12Q' is not a size" out.h5 "$trellis" hmm infer -m cat.h5 -d cat_data.h5 -o out.h5 --memory-budget 12Q
for budget in nan inf -1G; do
  expect_error "memory budget $budget" "'$budget' is not a size" out.h5 \
    "$trellis" hmm infer -m cat.h5 -d cat_data.h5 -o out.h5 --memory-budget $budget
done
expect_error "memory budget 1e30" "'1e30' is larger than any memory" out.h5 \
  "$trellis" hmm infer -m cat.h5 -d cat_data.h5 -o out.h5 --memory-budget 1e30
expect_error "init options" "exactly one of --symbols, --features" m.h5 "$trellis" hmm init --states 2 -o m.h5
expect_error "fit without K" "give --states or an initial model" m.h5 "$trellis" hmm fit -d cat_data.h5 -o m.h5
expect_error "unknown subcommand" "unknown command 'frobnicate'" none "$trellis" hmm frobnicate

# Numeric flags out of range: a message naming the flag (or the model's size), before any work.
fit() { "$trellis" hmm fit -d cat_data.h5 -o m.h5 "$@"; }
expect_error "no EM iterations" "--max-iterations must be >= 1, not 0" m.h5 fit --states 3 --max-iterations 0
expect_error "negative EM iterations" "--max-iterations must be >= 1, not -2" m.h5 fit --states 3 --max-iterations -2
expect_error "negative smoothing" "--smoothing must be a finite number >= 0, not -1" m.h5 fit --supervised --smoothing -1
expect_error "NaN smoothing" "--smoothing must be a finite number >= 0, not nan" m.h5 fit --supervised --smoothing nan
expect_error "zero covars prior" "--covars-prior must be a finite number > 0, not 0" m.h5 \
  "$trellis" hmm fit -d gauss_data.h5 -o m.h5 --states 2 --covars-prior 0
expect_error "NaN tolerance" "--tolerance must be a finite number >= 0, not nan" m.h5 fit --states 3 --tolerance nan
expect_error "negative tolerance" "--tolerance must be a finite number >= 0, not -1" m.h5 fit --states 3 --tolerance -1
expect_error "no restarts" "--restarts must be >= 1, not 0" m.h5 fit --states 3 --restarts 0
expect_error "order 3" "--order must be 1, or 2 with --supervised" m.h5 fit --supervised --order 3
expect_error "absurd label id" "(huge_label.h5's largest label id is 1000000000" m.h5 \
  "$trellis" hmm fit --supervised -d huge_label.h5 -o m.h5
expect_error "negative states" "--states must be >= 1, not -1" m.h5 fit --states -1
expect_error "states in exponent notation" "the argument ('1e10') for option '--states' is invalid" m.h5 fit --states 1e10
expect_error "states beyond memory" "a model of 10000000000 states and 6 symbols (8 copies of its parameters) needs about" m.h5 \
  fit --states 10000000000
expect_error "negative symbols" "--symbols must be >= 1, not -4" m.h5 fit --states 3 --symbols -4
expect_error "negative threads" "--threads '-2': takes 0 (all) to" m.h5 fit --states 3 --threads -2
expect_error "init: negative states" "a model needs at least 1 state, not -1" m.h5 "$trellis" hmm init --states -1 --symbols 3 -o m.h5
expect_error "init: no symbols" "a model needs at least 1 symbol, not 0" m.h5 "$trellis" hmm init --states 2 --symbols 0 -o m.h5
expect_error "init: negative features" "a model needs at least 1 feature, not -3" m.h5 \
  "$trellis" hmm init --states 2 --features -3 -o m.h5
expect_error "init: both kinds" "exactly one of --symbols, --features" m.h5 "$trellis" hmm init --states 2 --symbols 3 --features 2 -o m.h5
expect_error "init beyond memory" "a model of 3000000 states and 5 symbols (2 copies of its parameters) needs about" m.h5 \
  "$trellis" hmm init --states 3000000 --symbols 5 -o m.h5
expect_error "sample: no sequences" "need --sequences >= 1" d.h5 "$trellis" hmm sample -m cat.h5 -o d.h5 -n 0 -l 5
expect_error "sample: negative length" "need --sequences >= 1 and 1 <= --min-length <= --length" d.h5 \
  "$trellis" hmm sample -m cat.h5 -o d.h5 -n 3 -l -5
expect_error "sample: min above max" "1 <= --min-length <= --length" d.h5 "$trellis" hmm sample -m cat.h5 -o d.h5 -n 3 -l 5 --min-length 9
expect_error "sample beyond memory" "sampling 1 sequences of up to 1000000000000 positions needs about" d.h5 \
  "$trellis" hmm sample -m cat.h5 -o d.h5 -n 1 -l 1000000000000
expect_error "sample beyond a dataset" "are more than a dataset can hold" d.h5 \
  "$trellis" hmm sample -m cat.h5 -o d.h5 -n 9000000000000000000 -l 1000
expect_error "infer: negative threads" "--threads '-1': takes 0 (all) to" out.h5 \
  "$trellis" hmm infer -m cat.h5 -d cat_data.h5 -o out.h5 --threads -1

# Model files whose values are out of range: the file, dataset and index.
"$py" - <<'EOF' || fail "writing the bad models"
import h5py, numpy as np
def model(name, emission="categorical", **datasets):
    base = dict(startprob=[0.5, 0.5], transmat=[[0.5, 0.5], [0.2, 0.8]])
    if emission == "categorical":
        base["emissionprob"] = [[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]
    else:
        base.update(means=[[0.0], [1.0]], covars=[[1.0], [2.0]])
    base.update(datasets)
    with h5py.File(name, "w") as f:
        f.attrs["format"] = "trellis-hmm"; f.attrs["version"] = 1; f.attrs["emission"] = emission
        for k, v in base.items():
            f[k] = np.asarray(v, dtype=np.float64)
model("nan_trans.h5", transmat=[[0.5, 0.5], [np.nan, 0.8]])
model("neg_emit.h5", emissionprob=[[0.5, 0.25, 0.25], [1.2, -0.2, 0.0]])
model("inf_mean.h5", "gaussian", means=[[0.0], [np.inf]])
model("neg_var.h5", "gaussian", covars=[[1.0], [-2.0]])
model("denormal_var.h5", "gaussian", covars=[[1.0], [1e-310]])
model("tiny_var.h5", "gaussian", covars=[[1.0], [1e-50]])
model("bad_state_labels.h5")
with h5py.File("bad_state_labels.h5", "a") as f: f["state_labels"] = np.array([0, 7], np.int64)
model("vocab_size.h5")
with h5py.File("vocab_size.h5", "a") as f: f["vocabulary"] = np.array([b"a", b"b"], dtype=h5py.string_dtype())
model("group.h5")
with h5py.File("group.h5", "a") as f: del f["transmat"]; f.create_group("transmat")
# Observations stored as uint64 with ids of 2^63 and more (HDF5 would clamp them to 2^63 - 1).
with h5py.File("huge_id.h5", "w") as f:
    f["observations"] = np.array([0, 1, 2**63 + 5, 1], np.uint64); f["offsets"] = np.array([0, 2, 4], np.int64)
with h5py.File("huge_id_fit.h5", "w") as f:
    f["observations"] = np.array([0, 1, 2**64 - 1, 1], np.uint64); f["offsets"] = np.array([0, 2, 4], np.int64)
with h5py.File("group_obs.h5", "w") as f:
    f.create_group("observations"); f["offsets"] = np.array([0, 1], np.int64)
with h5py.File("no_sequences.h5", "w") as f:
    f["observations"] = np.zeros(0, np.int32); f["offsets"] = np.array([0], np.int64)
x = np.random.default_rng(0).normal(size=(6, 1)).astype(np.float32)
with h5py.File("one_feature.h5", "w") as f:
    f["observations"] = x; f["offsets"] = np.array([0, 3, 6], np.int64)
EOF
expect_error "NaN transition" "nan_trans.h5: transmat[1][0] is nan; probabilities must be finite" out.h5 infer nan_trans.h5 cat_data.h5
expect_error "negative emission" "neg_emit.h5: emissionprob[1][1] = -0.200000 is negative" out.h5 infer neg_emit.h5 cat_data.h5
expect_error "infinite mean" "inf_mean.h5: means[1][0] is inf; means must be finite" out.h5 infer inf_mean.h5 one_feature.h5
expect_error "negative variance" "neg_var.h5: covars[1][0] = -2; variances must be finite and > 0" out.h5 infer neg_var.h5 one_feature.h5
expect_error "denormal variance" "denormal_var.h5: covars[1][0] = 1e-310 is too small" out.h5 infer denormal_var.h5 one_feature.h5
expect_error "variance too small for float32" "the model's covars[1][0] = 1e-50 (mean 1) is too small for float32 computation" out.h5 \
  "$trellis" hmm infer -m tiny_var.h5 -d one_feature.h5 -o out.h5 --precision float32
"$trellis" hmm infer -m tiny_var.h5 -d one_feature.h5 -o tiny.h5 >/dev/null 2>&1 && "$py" - <<'EOF' && ok || fail "tiny variance in float64"
import h5py, numpy as np
f = h5py.File("tiny.h5")
assert np.isfinite(f["log_likelihood"][:]).all() and np.isfinite(f["viterbi_log_prob"][:]).all()
EOF
expect_error "state label outside the states" "bad_state_labels.h5: state_labels[1] = 7 is not a label id in [0, 2)" out.h5 \
  infer bad_state_labels.h5 cat_data.h5
expect_error "vocabulary size" "vocab_size.h5: 'vocabulary' has 2 entries for 3 symbols" out.h5 infer vocab_size.h5 cat_data.h5
expect_error "group instead of a dataset" "group.h5: '/transmat' is not a dataset" out.h5 infer group.h5 cat_data.h5
expect_error "uint64 id of 2^63 and more" "huge_id.h5: /observations[2] = 9223372036854775813 is outside the vocabulary [0, 6)" \
  out.h5 infer cat.h5 huge_id.h5
expect_error "uint64 id, no vocabulary" "huge_id_fit.h5: /observations[2] = 18446744073709551615 is not an id" m.h5 \
  "$trellis" hmm fit -d huge_id_fit.h5 -o m.h5 --states 2
expect_error "observations a group" "group_obs.h5: '/observations' is not a dataset" out.h5 infer cat.h5 group_obs.h5
expect_error "fit on no sequences" "no_sequences.h5: has no sequences to fit a model to" m.h5 \
  "$trellis" hmm fit -d no_sequences.h5 -o m.h5 --states 2
mkdir -p adir
expect_error "directory as data" "cannot open 'adir': it is a directory" out.h5 infer cat.h5 adir
expect_error "directory as model" "cannot open 'adir': it is a directory" out.h5 infer adir cat_data.h5
# The output's directory is checked before any work.
expect_error "infer into a missing directory" "cannot write 'nodir/out.h5': directory 'nodir': No such file or directory" \
  nodir/out.h5 "$trellis" hmm infer -m cat.h5 -d cat_data.h5 -o nodir/out.h5
expect_error "fit into a missing directory" "cannot write 'nodir/m.h5': directory 'nodir': No such file or directory" \
  nodir/m.h5 "$trellis" hmm fit -d cat_data.h5 -o nodir/m.h5 --states 3
grep -q "^iter" stderr.txt && fail "fit into a missing directory: trained first" || ok
expect_error "convert into a missing directory" "cannot write 'nodir/c.h5': directory 'nodir'" nodir/c.h5 \
  "$trellis" hmm convert -i train.txt -o nodir/c.h5
expect_error "output onto a directory" "cannot write 'adir': it is a directory" none \
  "$trellis" hmm infer -m cat.h5 -d cat_data.h5 -o adir
printf 'a DT\ndog NN\nsat VBD\n\nthe DT\ncat NN\nran VBD\n\nthe DT\ncat NN\n\n' >other.txt
"$trellis" hmm convert -i other.txt -o other.h5 --min-count 1 2>/dev/null && ok || fail "convert with its own vocabulary"
expect_error "data of another vocabulary" "other.h5: its '/vocabulary' is not the model's" pred_other.h5 \
  "$trellis" hmm infer -m pos.h5 -d other.h5 -o pred_other.h5
printf 'the\ncat\n\n' >one_column.txt
expect_error "a one-column file with labels" "one_column.txt: column 0 would be both the word and a label" oc.h5 \
  "$trellis" hmm convert -i one_column.txt -o oc.h5
expect_error "a label column twice" "label column 1 is named twice" lc.h5 \
  "$trellis" hmm convert -i train.txt -o lc.h5 --label-column 1,1
expect_error "--min-count 0" "--min-count must be >= 1, not 0" mc.h5 "$trellis" hmm convert -i train.txt -o mc.h5 --min-count 0
expect_error "--init with --supervised" "--init and --supervised cannot be combined" is.h5 \
  "$trellis" hmm fit -d cat_data.h5 --init cat.h5 --supervised -o is.h5
expect_error "--init with another --symbols" "--symbols 10 differs from the initial model's 6 symbols" iv.h5 \
  "$trellis" hmm fit -d cat_data.h5 --init cat.h5 --symbols 10 -o iv.h5
expect_error "a stray argument" "too many positional options" out.h5 "$trellis" hmm infer -m cat.h5 -d cat_data.h5 -o out.h5 junk
expect_error "output onto its model" "--output 'cat.h5' is the --model file" none \
  "$trellis" hmm infer -m cat.h5 -d cat_data.h5 -o cat.h5
expect_error "a dataset as predictions" "cat_data.h5: no '/states': not an output of trellis hmm infer" none \
  "$trellis" hmm eval -d cat_data.h5 -p cat_data.h5

# Sequences of probability 0: exit 0, states -1, and a warning that counts them.
"$py" - <<'EOF' || fail "writing the impossible model"
import h5py, numpy as np
with h5py.File("zero.h5", "w") as f:
    f.attrs["format"] = "trellis-hmm"; f.attrs["version"] = 1; f.attrs["emission"] = "categorical"
    f["startprob"] = [1.0, 0.0]; f["transmat"] = [[0.5, 0.5], [0.5, 0.5]]; f["emissionprob"] = [[0.5, 0.5, 0], [0.5, 0.5, 0]]
with h5py.File("zero_data.h5", "w") as f:
    f["observations"] = np.array([0, 1, 1, 2, 1, 0], np.int32); f["offsets"] = np.array([0, 3, 6], np.int64)
EOF
"$trellis" hmm infer -m zero.h5 -d zero_data.h5 -o zero_out.h5 >/dev/null 2>zero.err &&
  grep -q "warning: 1 of 2 sequences have probability 0" zero.err &&
  "$py" -c 'import h5py; f = h5py.File("zero_out.h5"); assert list(f["states"][3:]) == [-1] * 3 and min(f["states"][:3]) >= 0' &&
  ok || fail "a sequence of probability 0: $(cat zero.err)"
expect_error "EM from a model that gives the data probability 0" \
  "zero_data.h5: some sequences have probability 0 under the --init model" zero_fit.h5 \
  "$trellis" hmm fit --init zero.h5 -d zero_data.h5 -o zero_fit.h5 --max-iterations 3

echo "hmm cli: $passed passed, $failed failed"
[ "$failed" = 0 ]
