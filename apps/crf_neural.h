// The `trellis crf` commands of neural taggers: `train --encoder bilstm|cnn`, and tag, eval and dump of a neural
// model file (told apart from a feature CRF's by its magic).
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace trellis::cli {

// Runs args (`train ...`, `tag ...`, `eval ...`, `dump ...`) when they concern a neural tagger and returns the exit
// code; nullopt when they are the feature CRF's (train without --encoder or with --encoder none, or a feature model
// file), which `trellis crf` then runs as before.
std::optional<int> neural_crf_main(const std::vector<std::string>& args);

}  // namespace trellis::cli
