// The textbook ice-cream HMM (Eisner): hidden weather HOT/COLD, observed ice creams eaten per day (1..3).
// Decodes the most likely weather, prints the posterior of HOT per day, and the sequence log-likelihood.
#include <ATen/ATen.h>
#include <trellis/hmm/hmm.h>

#include <cstdio>

int main() {
  const auto log = [](std::initializer_list<double> v, std::vector<int64_t> shape) {
    return at::tensor(std::vector<double>(v), at::kDouble).view(shape).log();
  };
  trellis::CategoricalHMM hmm{log({0.8, 0.2}, {2}),                          // start: HOT, COLD
                              log({0.6, 0.4, 0.5, 0.5}, {2, 2}),             // transitions
                              log({0.2, 0.4, 0.4, 0.5, 0.4, 0.1}, {2, 3})};  // P(1,2,3 ice creams | state)
  const std::vector<int64_t> eaten{3, 1, 3, 3, 2, 1, 1};                     // observed, 1-based
  at::Tensor obs = at::tensor(eaten, at::kLong).view({1, -1}) - 1;

  const trellis::ViterbiResult best = trellis::viterbi(hmm, obs);
  const at::Tensor post = trellis::posteriors(hmm, obs);
  std::printf("day  ice-creams  viterbi  P(HOT)\n");
  for (std::size_t t = 0; t < eaten.size(); ++t)
    std::printf("%3zu  %10lld  %7s  %.4f\n", t + 1, static_cast<long long>(eaten[t]),
                best.path[0][t].item<int64_t>() == 0 ? "HOT" : "COLD", post[0][t][0].item<double>());
  std::printf("log P(observations) = %.6f\n", trellis::log_likelihood(hmm, obs)[0].item<double>());
  return 0;
}
