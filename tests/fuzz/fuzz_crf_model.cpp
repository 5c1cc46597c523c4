// CrfTagger::load on arbitrary model files (the checksum handled as trellis_fuzz::model_file says). A model that loads
// must tag a sentence and survive save + load.
#include <ATen/ATen.h>

#include "fuzz_target.h"
#include "trellis/crf/crf_tagger.h"

namespace {

void check_loaded_model(const trellis::CrfTagger& model) {
  const int64_t K = static_cast<int64_t>(model.labels().size());
  const int64_t F = static_cast<int64_t>(model.features().size());
  if (K < 1) trellis_fuzz::finding("a loaded model has no labels");
  if (model.weights.sizes() != at::IntArrayRef{F, K} || model.transitions.sizes() != at::IntArrayRef{K, K} ||
      model.start.sizes() != at::IntArrayRef{K} || model.end.sizes() != at::IntArrayRef{K})
    trellis_fuzz::finding("a loaded model's parameters do not match its labels and features");

  trellis_fuzz::check_tagging_and_reload(model, "CrfTagger");
}

}  // namespace

TRELLIS_FUZZ_TARGET(crf_model) {
  trellis_fuzz::FuzzInput in(data, size);
  const std::string file = trellis_fuzz::model_file(in);
  const std::string path = trellis_fuzz::scratch_path("crf_model");
  trellis_fuzz::write_file(path, file);
  trellis_fuzz::succeeds_or_throws_error("CrfTagger::load", [&] { check_loaded_model(trellis::CrfTagger::load(path)); });
}
