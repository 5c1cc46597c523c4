// Hidden Markov model with categorical emissions. Inference reuses the linear-chain dynamic program: an HMM is a
// chain whose potentials are log-probabilities (start, transitions, and the emission of each observed symbol).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "trellis/linear_chain_crf.h"

namespace trellis {

struct CategoricalHMM {
  at::Tensor log_start;        // [K]   log P(s_0 = k)
  at::Tensor log_transitions;  // [K,K] log P(s_t = j | s_{t-1} = i)
  at::Tensor log_emissions;    // [K,V] log P(o_t = v | s_t = k)

  int64_t num_states() const { return log_transitions.size(0); }
  int64_t num_symbols() const { return log_emissions.size(1); }

  // A random model (rows drawn from a Dirichlet(1)), float64 on the CPU.
  static CategoricalHMM random(int64_t num_states, int64_t num_symbols, uint64_t seed);

  // Chain potentials for observations [B,T] (int64 ids in [0,V) up to each length; padding may hold anything).
  ChainPotentials potentials(const at::Tensor& observations, const at::Tensor& lengths = {}) const;
};

// log P(observations) per sequence, [B]; differentiable w.r.t. the model's tensors.
at::Tensor log_likelihood(const CategoricalHMM& hmm, const at::Tensor& observations, const at::Tensor& lengths = {});

struct ForwardBackward {
  at::Tensor log_alpha;       // [B,T,K] log P(o_0..o_t, s_t = k)
  at::Tensor log_beta;        // [B,T,K] log P(o_{t+1}.. | s_t = k)
  at::Tensor log_likelihood;  // [B]
};
ForwardBackward forward_backward(const CategoricalHMM& hmm, const at::Tensor& observations,
                                 const at::Tensor& lengths = {});

// P(s_t = k | observations), [B,T,K], zero at padding.
at::Tensor posteriors(const CategoricalHMM& hmm, const at::Tensor& observations, const at::Tensor& lengths = {});

// Most probable state sequence and its joint log-probability.
ViterbiResult viterbi(const CategoricalHMM& hmm, const at::Tensor& observations, const at::Tensor& lengths = {});

struct HMMSample {
  at::Tensor states;        // [B,T] int64
  at::Tensor observations;  // [B,T] int64
};
HMMSample sample(const CategoricalHMM& hmm, int64_t num_sequences, int64_t length, uint64_t seed);

// Maximum-likelihood estimate from labelled sequences with additive (Laplace) smoothing of every count.
CategoricalHMM fit_supervised(const at::Tensor& observations, const at::Tensor& states, const at::Tensor& lengths,
                              int64_t num_states, int64_t num_symbols, double smoothing = 1.0);

struct BaumWelchOptions {
  int max_iterations = 100;
  double tolerance = 1e-6;  // stop when the total log-likelihood gains less than this (relative to the token count)
  double smoothing = 0.0;   // added to every expected count before normalising
};
struct BaumWelchResult {
  CategoricalHMM model;
  std::vector<double> log_likelihood;  // total log-likelihood of the data before each update
  bool converged = false;
};
// EM from `initial`. The E-step's expected counts are the gradient of the total log-likelihood with respect to the
// log-parameters, so no T×K×K tensor is ever built.
BaumWelchResult baum_welch(const CategoricalHMM& initial, const at::Tensor& observations, const at::Tensor& lengths = {},
                           const BaumWelchOptions& options = {});

}  // namespace trellis
