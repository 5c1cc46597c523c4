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
  "$trellis" hmm eval -d dev.h5 -p pred.h5 | grep -q "accuracy" && ok || fail "supervised POS round trip"
"$trellis" hmm fit -d train.h5 -o pos2.h5 --supervised --order 2 --smoothing 0.1 2>/dev/null &&
  "$trellis" hmm infer -m pos2.h5 -d train.h5 -o pred2.h5 >/dev/null 2>&1 &&
  "$trellis" hmm eval -d train.h5 -p pred2.h5 | grep -q "accuracy 100.00%" && ok || fail "second-order model round trip"
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
  "$trellis" hmm eval -d fd.h5 -p finep.h5 | grep -q "accuracy 50.00%" &&
  "$trellis" hmm eval -d fd.h5 -p finep.h5 --coarse | grep -q "accuracy 100.00%" && ok || fail "coarse scoring of fine labels"
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
data("two_features.h5", x[:, :2], [0, 3, 6])
data("bad_labels.h5", ids, [0, 3, 6], labels=np.array([0, 1, 2, 7, 0, 1], np.int32))
data("short_labels.h5", ids, [0, 3, 6], labels=np.array([0, 1], np.int32))
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
with h5py.File("no_covars.h5", "w") as f:
    f.attrs["format"] = "trellis-hmm"; f.attrs["version"] = 1; f.attrs["emission"] = "gaussian"
    f["startprob"] = [1.0]; f["transmat"] = [[1.0]]; f["means"] = [[0.0, 1.0]]
EOF
echo "not hdf5" >text.h5

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
expect_error "missing covars" "no_covars.h5: missing dataset 'covars'" out.h5 infer no_covars.h5 gauss_data.h5
expect_error "not HDF5" "text.h5: not an HDF5 file" out.h5 infer cat.h5 text.h5
expect_error "missing file" "cannot open 'nowhere.h5'" out.h5 infer cat.h5 nowhere.h5
expect_error "memory budget" "'12Q' is not a size" out.h5 "$trellis" hmm infer -m cat.h5 -d cat_data.h5 -o out.h5 --memory-budget 12Q
expect_error "init options" "exactly one of --symbols, --features" m.h5 "$trellis" hmm init --states 2 -o m.h5
expect_error "fit without K" "give --states or an initial model" m.h5 "$trellis" hmm fit -d cat_data.h5 -o m.h5
expect_error "unknown subcommand" "unknown command 'frobnicate'" none "$trellis" hmm frobnicate

echo "hmm cli: $passed passed, $failed failed"
[ "$failed" = 0 ]
