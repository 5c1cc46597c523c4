// trellis::load_hmm on structure-aware HDF5 files (hdf5_builder.h): the input decodes into a valid HDF5 file whose
// attributes (format, version, emission) and datasets (startprob, transmat, emissionprob or means/covars, state_names,
// vocabulary, state_labels, log_likelihood_history) have arbitrary types, shapes and values. A model that loads must
// pass its own check() and score a sequence without NaN.
#include <ATen/ATen.h>

#include <cmath>
#include <variant>

#include "fuzz_target.h"
#include "hdf5_builder.h"
#include "trellis/hmm/hmm.h"
#include "trellis/hmm/hmm_io.h"

namespace {

using trellis_fuzz::ElementType;
using trellis_fuzz::FuzzInput;
using trellis_fuzz::NaturalContents;

NaturalContents string_attribute(const std::string& value) {
  NaturalContents c;
  c.type = ElementType::variable_string;
  c.strings = {value};
  return c;
}

NaturalContents doubles(std::vector<hsize_t> dims,
                        double (*value)(std::size_t, const std::vector<hsize_t>&, FuzzInput&)) {
  NaturalContents c;
  c.type = ElementType::float64;
  c.dims = std::move(dims);
  c.value = value;
  return c;
}

void write_model(FuzzInput& in, const std::string& path) {
  trellis_fuzz::H5Builder file(path);
  if (!file.ok()) trellis_fuzz::finding("cannot create the scratch HDF5 file '" + path + "' (not a finding in the code under test)");
  const bool gaussian = in.flag();
  const hsize_t K = 1 + in.below(5), V = 1 + in.below(6);

  if (in.below(16) != 15) file.attribute(in, "format", string_attribute("trellis-hmm"));
  if (in.below(16) != 15) {
    NaturalContents version;
    version.type = ElementType::int64;
    version.value = [](std::size_t, const std::vector<hsize_t>&, FuzzInput&) { return 1.0; };
    file.attribute(in, "version", version);
  }
  if (in.below(16) != 15) file.attribute(in, "emission", string_attribute(gaussian ? "gaussian" : "categorical"));

  if (in.below(16) != 15) file.dataset(in, "startprob", doubles({K}, trellis_fuzz::probability_row_value));
  if (in.below(16) != 15) file.dataset(in, "transmat", doubles({K, K}, trellis_fuzz::probability_row_value));
  // The other emission kind's datasets too, now and then.
  const bool both = in.below(8) == 7;
  if ((!gaussian || both) && in.below(16) != 15)
    file.dataset(in, "emissionprob", doubles({K, V}, trellis_fuzz::probability_row_value));
  if ((gaussian || both) && in.below(16) != 15) file.dataset(in, "means", doubles({K, V}, trellis_fuzz::feature_value));
  if ((gaussian || both) && in.below(16) != 15) file.dataset(in, "covars", doubles({K, V}, trellis_fuzz::positive_value));

  const auto names = [](const char* prefix, hsize_t n) {
    NaturalContents c;
    c.type = ElementType::variable_string;
    c.dims = {n};
    for (hsize_t i = 0; i < n; ++i) c.strings.push_back(prefix + std::to_string(i));
    return c;
  };
  if (in.flag()) file.dataset(in, "state_names", names("S", K));
  if (in.flag()) file.dataset(in, "vocabulary", names("w", V));
  if (in.flag()) {
    NaturalContents labels = doubles({K}, trellis_fuzz::small_id_value);
    labels.type = ElementType::int64;
    file.dataset(in, "state_labels", labels);
  }
  if (in.flag()) file.dataset(in, "log_likelihood_history", doubles({1 + in.below(4)}, trellis_fuzz::feature_value));
}

// What a loaded model must be able to do: pass check() and score a short valid sequence (finite or -inf).
template <class HMM>
void use_model(const HMM& hmm) {
  if (!trellis_fuzz::succeeds_or_throws_error("check", [&] { hmm.check(); }))
    trellis_fuzz::finding("load_hmm returned a model that its check() rejects");
  at::Tensor observations;
  if constexpr (std::is_same_v<HMM, trellis::CategoricalHMM>) {
    observations = at::arange(3, at::kLong).remainder(hmm.num_symbols()).unsqueeze(0);
  } else {
    observations = at::linspace(-1, 1, 3 * hmm.num_features(), at::kDouble).view({1, 3, hmm.num_features()});
  }
  at::Tensor log_likelihood;
  if (!trellis_fuzz::succeeds_or_throws_error("log_likelihood",
                                              [&] { log_likelihood = trellis::log_likelihood(hmm, observations); }))
    trellis_fuzz::finding("a loaded model cannot score a valid sequence");
  if (at::isnan(log_likelihood).any().item<bool>())
    trellis_fuzz::finding("a loaded model scores a valid sequence as NaN");
}

}  // namespace

TRELLIS_FUZZ_TARGET(hmm_model) {
  FuzzInput in(data, size);
  const std::string path = trellis_fuzz::scratch_path("hmm_model.h5");
  write_model(in, path);
  trellis::HMMModelFile model;
  if (!trellis_fuzz::succeeds_or_throws_error("load_hmm", [&] { model = trellis::load_hmm(path); })) return;
  const int64_t K = std::visit([](const auto& hmm) { return hmm.num_states(); }, model.model);
  if (!model.state_names.empty() && static_cast<int64_t>(model.state_names.size()) != K)
    trellis_fuzz::finding("load_hmm accepted state_names of the wrong length");
  if (!model.state_labels.empty() && static_cast<int64_t>(model.state_labels.size()) != K)
    trellis_fuzz::finding("load_hmm accepted state_labels of the wrong length");
  std::visit([](const auto& hmm) { use_model(hmm); }, model.model);
}
