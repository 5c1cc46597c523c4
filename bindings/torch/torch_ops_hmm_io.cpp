// HMM model files (docs/hmm-format.md) as PyTorch operators, so that Python (trellis.hmm.load / save) reads and writes
// exactly the files `trellis hmm` does, through the same reader and writer: the reader's validation (format, version,
// shapes, rows that are distributions, positive variances) and the writer's atomic replacement come with them.
//
//   hmm_load(str path) -> (str emission, Tensor startprob, Tensor transmat, Tensor emissionprob, Tensor means,
//                          Tensor covars, str[] state_names, str[] vocabulary, Tensor state_labels,
//                          Tensor log_likelihood_history)
//       emission is "categorical" or "gaussian"; parameters in natural units (probabilities, variances), float64 on
//       the CPU; the parameters of the other emission kind, and optional datasets the file lacks, are empty tensors.
//       state_labels is int64 [K] or empty; log_likelihood_history float64 (the total log-likelihood before each EM
//       update, as fitting recorded it) or empty.
//   hmm_save(str path, str emission, Tensor startprob, Tensor transmat, Tensor? emissionprob, Tensor? means,
//            Tensor? covars, str[] state_names, str[] vocabulary, int[] state_labels,
//            float[] log_likelihood_history) -> ()
//       Writes NAME.tmp.PID and renames it to path when complete; the model is checked first (the same checks as the
//       reader), and errors name the path and the dataset at fault.
//
// These are plain functions of files, not of tensors on a device: registered without dispatch keys (CatchAll).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "trellis/error.h"
#include "trellis/hmm/hmm.h"
#include "trellis/hmm/hmm_io.h"

namespace {

using LoadedModel = std::tuple<std::string, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                               std::vector<std::string>, std::vector<std::string>, at::Tensor, at::Tensor>;

at::Tensor empty_doubles() { return at::empty({0}, at::kDouble); }

LoadedModel hmm_load(c10::string_view path) {
  const trellis::HMMModelFile file = trellis::load_hmm(std::string(path));
  const at::Tensor labels =
      file.state_labels.empty() ? at::empty({0}, at::kLong) : at::tensor(file.state_labels, at::kLong);
  const at::Tensor history =
      file.log_likelihood_history.empty() ? empty_doubles() : at::tensor(file.log_likelihood_history, at::kDouble);
  return std::visit(
      [&](const auto& hmm) -> LoadedModel {
        const at::Tensor start = hmm.log_start.exp(), transitions = hmm.log_transitions.exp();
        if constexpr (std::is_same_v<std::decay_t<decltype(hmm)>, trellis::CategoricalHMM>)
          return {"categorical",   start,           transitions,      hmm.log_emissions.exp(),
                  empty_doubles(), empty_doubles(), file.state_names, file.vocabulary,
                  labels,          history};
        else
          return {"gaussian",       start,           transitions, empty_doubles(), hmm.means, hmm.variances,
                  file.state_names, file.vocabulary, labels,      history};
      },
      file.model);
}

// A parameter as the library holds it: float64 on the CPU, contiguous. Shapes are the writer's check.
at::Tensor as_parameter(const at::Tensor& t, const std::string& path, const char* name) {
  if (!t.defined() || !t.is_floating_point())
    throw trellis::Error(path + ": not written: " + name + " must be a floating-point tensor");
  return t.detach().to(at::kCPU, at::kDouble).contiguous();
}

void hmm_save(c10::string_view path_view, c10::string_view emission_view, const at::Tensor& startprob,
              const at::Tensor& transmat, const std::optional<at::Tensor>& emissionprob,
              const std::optional<at::Tensor>& means, const std::optional<at::Tensor>& covars,
              std::vector<std::string> state_names, std::vector<std::string> vocabulary,
              std::vector<int64_t> state_labels, std::vector<double> log_likelihood_history) {
  const std::string path(path_view), emission(emission_view);
  const auto given = [](const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  const at::Tensor log_start = as_parameter(startprob, path, "startprob").log();
  const at::Tensor log_transitions = as_parameter(transmat, path, "transmat").log();
  trellis::HMMModelFile file;
  if (emission == "categorical") {
    if (!given(emissionprob) || given(means) || given(covars))
      throw trellis::Error(path + ": not written: a categorical model takes emissionprob (and no means or covars)");
    file.model =
        trellis::CategoricalHMM{log_start, log_transitions, as_parameter(*emissionprob, path, "emissionprob").log()};
  } else if (emission == "gaussian") {
    if (given(emissionprob) || !given(means) || !given(covars))
      throw trellis::Error(path + ": not written: a Gaussian model takes means and covars (and no emissionprob)");
    file.model = trellis::GaussianHMM{log_start, log_transitions, as_parameter(*means, path, "means"),
                                      as_parameter(*covars, path, "covars")};
  } else {
    throw trellis::Error(path + ": not written: unknown emission type '" + emission +
                         "' (expected categorical or gaussian)");
  }
  file.state_names = std::move(state_names);
  file.vocabulary = std::move(vocabulary);
  file.state_labels = std::move(state_labels);
  file.log_likelihood_history = std::move(log_likelihood_history);
  trellis::save_hmm(path, file);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trellis, m) {
  m.def(
      "hmm_load(str path) -> (str emission, Tensor startprob, Tensor transmat, Tensor emissionprob, Tensor means, "
      "Tensor covars, str[] state_names, str[] vocabulary, Tensor state_labels, Tensor log_likelihood_history)",
      &hmm_load);
  m.def(
      "hmm_save(str path, str emission, Tensor startprob, Tensor transmat, Tensor? emissionprob, Tensor? means, "
      "Tensor? covars, str[] state_names, str[] vocabulary, int[] state_labels, float[] log_likelihood_history) -> ()",
      &hmm_save);
}
