// An application's view of HMM files: write a model (as `trellis hmm fit` would), load it back, then score and
// decode sequences held in memory, without going through a dataset file.
#include <ATen/ATen.h>
#include <trellis/hmm/hmm_io.h>

#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : "example_model.h5";
  trellis::save_hmm(path, {trellis::GaussianHMM::random(3, 2, /*seed=*/7), {"low", "mid", "high"}});

  const trellis::HMMModelFile file = trellis::load_hmm(path);
  const auto& hmm = std::get<trellis::GaussianHMM>(file.model);
  const trellis::HMMSample data = trellis::sample(hmm, /*sequences=*/2, /*min_length=*/5, /*max_length=*/8, /*seed=*/1);
  const at::Tensor ll = trellis::log_likelihood(hmm, data.observations, data.lengths);
  const trellis::ViterbiResult best = trellis::viterbi(hmm, data.observations, data.lengths);
  for (int64_t b = 0; b < 2; ++b) {
    std::printf("sequence %lld: log P = %.4f, states:", static_cast<long long>(b), ll[b].item<double>());
    for (int64_t t = 0; t < data.lengths[b].item<int64_t>(); ++t)
      std::printf(" %s", file.state_names[best.path[b][t].item<int64_t>()].c_str());
    std::printf("\n");
  }
  return 0;
}
