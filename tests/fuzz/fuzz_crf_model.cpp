// CrfTagger::load on arbitrary model files. The file's checksum would stop almost every mutation at the first check,
// so the first input byte chooses: even, the rest of the input gets a correct checksum appended (reaching the parser
// behind it); odd, the rest is the file as it is. A model that loads must tag a sentence and survive save + load.
#include <ATen/ATen.h>

#include "fuzz_target.h"
#include "trellis/crf/crf_tagger.h"

namespace {

// The model format's checksum (FNV-1a, 64-bit) over everything before it.
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

void check_loaded_model(const trellis::CrfTagger& model) {
  const int64_t K = static_cast<int64_t>(model.labels().size());
  const int64_t F = static_cast<int64_t>(model.features().size());
  if (K < 1) trellis_fuzz::finding("a loaded model has no labels");
  if (model.weights.sizes() != at::IntArrayRef{F, K} || model.transitions.sizes() != at::IntArrayRef{K, K} ||
      model.start.sizes() != at::IntArrayRef{K} || model.end.sizes() != at::IntArrayRef{K})
    trellis_fuzz::finding("a loaded model's parameters do not match its labels and features");

  // Tagging a sentence of the model's own column count (the command line's next step after load).
  const std::size_t columns = model.input_columns();
  if (columns >= 1 && columns <= 8) {
    trellis::TokenRows sentence;
    for (int t = 0; t < 3; ++t) {
      std::vector<std::string> row;
      for (std::size_t c = 0; c < columns; ++c) row.push_back("w" + std::to_string(t) + "c" + std::to_string(c));
      sentence.push_back(row);
    }
    const std::vector<const trellis::TokenRows*> sentences = {&sentence};
    trellis_fuzz::succeeds_or_throws_error("CrfTagger::tag", [&] { model.tag(sentences, true); });
    trellis_fuzz::succeeds_or_throws_error("CrfTagger::tag_kbest", [&] { model.tag_kbest(sentences, 2); });
  }

  const std::string copy = trellis_fuzz::scratch_path("crf_model_resaved");
  if (!trellis_fuzz::succeeds_or_throws_error("CrfTagger::save", [&] { model.save(copy); })) return;
  if (!trellis_fuzz::succeeds_or_throws_error("CrfTagger::load of a saved model",
                                              [&] { trellis::CrfTagger::load(copy); }))
    trellis_fuzz::finding("a model that loaded, saved again, does not load");
}

}  // namespace

TRELLIS_FUZZ_TARGET(crf_model) {
  trellis_fuzz::FuzzInput in(data, size);
  const bool append_checksum = !(in.byte() & 1);
  std::string file = in.rest();
  if (append_checksum) {
    const uint64_t checksum = fnv1a(file);
    file.append(reinterpret_cast<const char*>(&checksum), sizeof checksum);
  }
  const std::string path = trellis_fuzz::scratch_path("crf_model");
  trellis_fuzz::write_file(path, file);
  trellis_fuzz::succeeds_or_throws_error("CrfTagger::load", [&] { check_loaded_model(trellis::CrfTagger::load(path)); });
}
