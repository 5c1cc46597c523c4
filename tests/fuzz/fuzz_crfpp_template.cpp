// The CRF++ template parser on arbitrary text; a template it accepts must survive the model file's round trip
// (spec() -> FeatureExtractor::from_spec) and, once validated for the data's columns, featurise every token.
#include "fuzz_target.h"
#include "trellis/crf/crf_features.h"

TRELLIS_FUZZ_TARGET(crfpp_template) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::unique_ptr<trellis::FeatureExtractor> parsed;
  if (!trellis_fuzz::succeeds_or_throws_error("crfpp_template_features",
                                              [&] { parsed = trellis::crfpp_template_features(text, "fuzz"); }))
    return;
  const std::string spec = parsed->spec();
  std::unique_ptr<trellis::FeatureExtractor> reloaded;
  if (!trellis_fuzz::succeeds_or_throws_error("FeatureExtractor::from_spec",
                                              [&] { reloaded = trellis::FeatureExtractor::from_spec(spec); }))
    trellis_fuzz::finding("a parsed template's spec() does not load back through from_spec");
  if (reloaded->spec() != spec) trellis_fuzz::finding("from_spec(spec()).spec() differs from spec()");

  constexpr std::size_t kColumns = 3;
  if (!trellis_fuzz::succeeds_or_throws_error("validate", [&] { parsed->validate(kColumns, "fuzz data"); })) return;
  const trellis::TokenRows rows = {{"The", "DT", "B-NP"}, {"fuzzy", "JJ", "I-NP"}, {"cat", "NN", "I-NP"}, {".", ".", "O"}};
  trellis::FeatureList features, features_reloaded;
  for (std::size_t t = 0; t < rows.size(); ++t) {
    features.clear();
    features_reloaded.clear();
    if (!trellis_fuzz::succeeds_or_throws_error("extract", [&] { parsed->extract(rows, t, features); }) ||
        !trellis_fuzz::succeeds_or_throws_error("extract", [&] { reloaded->extract(rows, t, features_reloaded); }))
      trellis_fuzz::finding("a template that validate() accepted fails to featurise a token");
    if (features.strings() != features_reloaded.strings())
      trellis_fuzz::finding("the reloaded template extracts different features");
  }
}
