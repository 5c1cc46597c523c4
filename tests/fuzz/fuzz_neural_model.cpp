// NeuralTagger::load on arbitrary neural CRF model files (the checksum handled as trellis_fuzz::model_file says). A
// model that loads must tag a sentence and survive save + load.
#include "fuzz_target.h"
#include "trellis/train/neural_tagger.h"

namespace {

void check_loaded_model(const trellis::NeuralTagger& model) {
  if (model.labels().empty()) trellis_fuzz::finding("a loaded neural model has no labels");
  trellis_fuzz::check_tagging_and_reload(model, "NeuralTagger");
}

}  // namespace

TRELLIS_FUZZ_TARGET(neural_model) {
  trellis_fuzz::FuzzInput in(data, size);
  const std::string file = trellis_fuzz::model_file(in);
  const std::string path = trellis_fuzz::scratch_path("neural_model");
  trellis_fuzz::write_file(path, file);
  trellis_fuzz::succeeds_or_throws_error("NeuralTagger::load",
                                         [&] { check_loaded_model(trellis::NeuralTagger::load(path)); });
}
