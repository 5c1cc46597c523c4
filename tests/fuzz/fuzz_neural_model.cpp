// NeuralTagger::load on arbitrary neural CRF model files (the checksum handled as trellis_fuzz::model_file says). A
// model that loads must tag a sentence and survive save + load.
#include "fuzz_target.h"
#include "trellis/train/neural_tagger.h"

namespace {

void check_loaded_model(const trellis::NeuralTagger& model) {
  if (model.labels().empty()) trellis_fuzz::finding("a loaded neural model has no labels");
  // Tagging a sentence of the model's own column count (the command line's next step after load).
  const std::size_t columns = model.input_columns();
  if (columns >= 1 && columns <= 8) {
    const trellis::TokenRows sentence = trellis_fuzz::sentence_of(columns);
    const std::vector<const trellis::TokenRows*> sentences = {&sentence};
    trellis_fuzz::succeeds_or_throws_error("NeuralTagger::tag", [&] { model.tag(sentences, true); });
    trellis_fuzz::succeeds_or_throws_error("NeuralTagger::tag_kbest", [&] { model.tag_kbest(sentences, 2); });
  }

  const std::string copy = trellis_fuzz::scratch_path("neural_model_resaved");
  if (!trellis_fuzz::succeeds_or_throws_error("NeuralTagger::save", [&] { model.save(copy); })) return;
  if (!trellis_fuzz::succeeds_or_throws_error("NeuralTagger::load of a saved model",
                                              [&] { trellis::NeuralTagger::load(copy); }))
    trellis_fuzz::finding("a neural model that loaded, saved again, does not load");
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
