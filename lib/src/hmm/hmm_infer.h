// `hmm infer`'s log-likelihoods and Viterbi paths of one batch in one pass, where the CUDA kernels that read the
// transitions once per step for both take the batch (lib/src/hmm/hmm.cpp).
#pragma once
#include <optional>

#include "trellis/hmm/hmm.h"

namespace trellis::detail {

struct LikelihoodAndPath {
  at::Tensor log_likelihood;  // [B], as chain_log_likelihood gives it
  ViterbiResult viterbi;      // as viterbi(p) gives it: the same paths
};

// Both quantities of potentials as HMM::potentials builds them, from cuda::many_label_infer where it takes them: the
// streamed route's potentials (CUDA, many states, no gradients) in float32, with few sequences (at most two groups of
// the step kernels: each step is then bound by reading the transitions, which the two recursions share) and
// transitions all ≤ 0. Otherwise nullopt: the caller computes each on its own route.
std::optional<LikelihoodAndPath> likelihood_and_path(const ChainPotentials& p);

}  // namespace trellis::detail
