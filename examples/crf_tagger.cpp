// Train a small part-of-speech CRF with the library, save it, load it back as an application would, and tag a
// sentence with the marginal probability of each predicted label.
// Usage: crf_tagger TRAIN.txt MODEL.crf   (TRAIN: CoNLL columns "word label", e.g. data/ud-en-ewt-sample/train.txt)
#include <trellis/io/conll.h>
#include <trellis/train/crf_train.h>

#include <cstdio>
#include <exception>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s TRAIN.txt MODEL.crf\n", argv[0]);
    return 2;
  }
  try {
    trellis::CrfTrainOptions options;
    options.max_iterations = 15;
    const trellis::LabeledSentences train = trellis::split_labels(trellis::read_conll(argv[1]));
    trellis::train_crf(train, nullptr, trellis::builtin_features(), options).save(argv[2]);

    const trellis::CrfTagger tagger = trellis::CrfTagger::load(argv[2]);
    trellis::TokenRows sentence;
    for (const char* w : {"The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "."})
      sentence.push_back({w});
    const auto tagged = tagger.tag({&sentence}, /*with_marginals=*/true).front();
    for (std::size_t t = 0; t < sentence.size(); ++t)
      std::printf("%-6s %-6s %.3f\n", sentence[t][0].c_str(), tagged.labels[t].c_str(), tagged.marginals[t]);
    std::printf("P(labels | sentence) = %.4f\n", tagged.probability);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
