#include "trellis/hmm.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include "trellis/error.h"

namespace trellis {
namespace {

void check_model(const CategoricalHMM& m) {
  if (!m.log_start.defined() || !m.log_transitions.defined() || !m.log_emissions.defined())
    throw Error("HMM: log_start, log_transitions and log_emissions are all required");
  const int64_t K = m.log_transitions.size(0);
  if (m.log_transitions.dim() != 2 || m.log_transitions.size(1) != K || m.log_start.dim() != 1 ||
      m.log_start.size(0) != K || m.log_emissions.dim() != 2 || m.log_emissions.size(0) != K)
    throw Error("HMM: expected log_start [K], log_transitions [K,K], log_emissions [K,V]; got " +
                c10::str(m.log_start.sizes(), ", ", m.log_transitions.sizes(), ", ", m.log_emissions.sizes()));
}

at::Tensor valid_mask(const at::Tensor& observations, const at::Tensor& lengths) {
  const int64_t T = observations.size(1);
  const auto l = lengths.defined() ? lengths.to(observations.device(), at::kLong)
                                   : at::full({observations.size(0)}, T, observations.options().dtype(at::kLong));
  return at::arange(T, l.options()).unsqueeze(0) < l.unsqueeze(1);
}

// Rows of counts normalised to log-probabilities; a row with no mass keeps `fallback` (or becomes uniform).
at::Tensor normalise_rows(const at::Tensor& counts, const at::Tensor& fallback) {
  const at::Tensor total = counts.sum(-1, true);
  const at::Tensor uniform = at::full_like(counts, -std::log(static_cast<double>(counts.size(-1))));
  return at::where(total > 0, (counts / total).log(), fallback.defined() ? fallback : uniform);
}

at::Tensor dirichlet_rows(int64_t rows, int64_t cols, at::Generator& gen) {
  const at::Tensor g = -at::empty({rows, cols}, at::kDouble).uniform_(1e-12, 1.0, gen).log();  // Gamma(1) = Exp(1)
  return (g / g.sum(-1, true)).log();
}

}  // namespace

CategoricalHMM CategoricalHMM::random(int64_t num_states, int64_t num_symbols, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return {dirichlet_rows(1, num_states, gen).squeeze(0), dirichlet_rows(num_states, num_states, gen),
          dirichlet_rows(num_states, num_symbols, gen)};
}

ChainPotentials CategoricalHMM::potentials(const at::Tensor& observations, const at::Tensor& lengths) const {
  check_model(*this);
  if (!observations.defined() || observations.dim() != 2) throw Error("HMM: observations must be a [B,T] tensor");
  const int64_t V = num_symbols();
  const at::Tensor obs = observations.to(log_emissions.device(), at::kLong);
  const at::Tensor mask = valid_mask(obs, lengths);
  const at::Tensor bad = mask & ((obs < 0) | (obs >= V));
  if (bad.any().item<bool>()) {
    const at::Tensor at_ = bad.nonzero()[0].cpu();
    const int64_t b = at_[0].item<int64_t>(), t = at_[1].item<int64_t>();
    throw Error("HMM: observation [" + std::to_string(b) + "][" + std::to_string(t) + "] = " +
                std::to_string(obs[b][t].item<int64_t>()) + " is outside the vocabulary [0, " + std::to_string(V) + ")");
  }
  const at::Tensor ids = obs.masked_fill(~mask, 0);
  ChainPotentials p;
  p.emissions = log_emissions.t().index_select(0, ids.flatten()).view({obs.size(0), obs.size(1), num_states()});
  p.transitions = log_transitions;
  p.start = log_start;
  if (lengths.defined()) p.lengths = lengths;
  return p;
}

at::Tensor log_likelihood(const CategoricalHMM& hmm, const at::Tensor& observations, const at::Tensor& lengths) {
  return log_partition(hmm.potentials(observations, lengths));
}

ForwardBackward forward_backward(const CategoricalHMM& hmm, const at::Tensor& observations, const at::Tensor& lengths) {
  const ChainPotentials p = hmm.potentials(observations, lengths);
  return {forward_log_alphas(p), backward_log_betas(p), log_partition(p)};
}

at::Tensor posteriors(const CategoricalHMM& hmm, const at::Tensor& observations, const at::Tensor& lengths) {
  return marginals(hmm.potentials(observations, lengths)).nodes;
}

ViterbiResult viterbi(const CategoricalHMM& hmm, const at::Tensor& observations, const at::Tensor& lengths) {
  return viterbi(hmm.potentials(observations, lengths));
}

HMMSample sample(const CategoricalHMM& hmm, int64_t num_sequences, int64_t length, uint64_t seed) {
  check_model(hmm);
  if (num_sequences < 1 || length < 1) throw Error("HMM sample: need at least one sequence of length >= 1");
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor start = hmm.log_start.detach().cpu().to(at::kDouble).exp();
  const at::Tensor trans = hmm.log_transitions.detach().cpu().to(at::kDouble).exp();
  const at::Tensor emit = hmm.log_emissions.detach().cpu().to(at::kDouble).exp();
  std::vector<at::Tensor> states, obs;
  at::Tensor s = at::multinomial(start.expand({num_sequences, -1}), 1, true, gen).squeeze(1);
  for (int64_t t = 0; t < length; ++t) {
    if (t > 0) s = at::multinomial(trans.index_select(0, s), 1, true, gen).squeeze(1);
    states.push_back(s);
    obs.push_back(at::multinomial(emit.index_select(0, s), 1, true, gen).squeeze(1));
  }
  return {at::stack(states, 1), at::stack(obs, 1)};
}

CategoricalHMM fit_supervised(const at::Tensor& observations, const at::Tensor& states, const at::Tensor& lengths,
                              int64_t K, int64_t V, double smoothing) {
  if (!observations.defined() || !states.defined() || observations.sizes() != states.sizes() || observations.dim() != 2)
    throw Error("HMM fit: observations and states must be [B,T] tensors of the same shape");
  if (smoothing < 0) throw Error("HMM fit: smoothing must be >= 0");
  const at::Tensor obs = observations.cpu().to(at::kLong), st = states.cpu().to(at::kLong);
  const at::Tensor mask = valid_mask(obs, lengths.defined() ? lengths.cpu() : lengths);
  const at::Tensor bad_s = mask & ((st < 0) | (st >= K)), bad_o = mask & ((obs < 0) | (obs >= V));
  for (const auto& [bad, what, n] : {std::tuple{bad_s, "state", K}, std::tuple{bad_o, "observation", V}})
    if (bad.any().item<bool>()) {
      const at::Tensor at_ = bad.nonzero()[0];
      throw Error(std::string("HMM fit: ") + what + " [" + std::to_string(at_[0].item<int64_t>()) + "][" +
                  std::to_string(at_[1].item<int64_t>()) + "] is outside [0, " + std::to_string(n) + ")");
    }
  const auto count = [](const at::Tensor& ids, int64_t n) { return at::bincount(ids, {}, n).to(at::kDouble); };
  const at::Tensor start = count(st.select(1, 0), K) + smoothing;
  const at::Tensor pairs = mask.slice(1, 1);
  const at::Tensor trans =
      count((st.slice(1, 0, -1) * K + st.slice(1, 1)).masked_select(pairs), K * K).view({K, K}) + smoothing;
  const at::Tensor emit = count((st * V + obs).masked_select(mask), K * V).view({K, V}) + smoothing;
  return {normalise_rows(start, {}), normalise_rows(trans, {}), normalise_rows(emit, {})};
}

BaumWelchResult baum_welch(const CategoricalHMM& initial, const at::Tensor& observations, const at::Tensor& lengths,
                           const BaumWelchOptions& options) {
  check_model(initial);
  if (options.smoothing < 0) throw Error("Baum-Welch: smoothing must be >= 0");
  const double tokens = valid_mask(observations, lengths).sum().item<double>();
  c10::AutoGradMode grad_on(true);
  BaumWelchResult result{initial, {}, false};
  for (int it = 0; it < options.max_iterations; ++it) {
    CategoricalHMM m{result.model.log_start.detach().requires_grad_(),
                     result.model.log_transitions.detach().requires_grad_(),
                     result.model.log_emissions.detach().requires_grad_()};
    const at::Tensor total = log_likelihood(m, observations, lengths).sum();
    // d total / d log θ = expected number of times θ is used: the E-step.
    const auto counts = torch::autograd::grad({total}, {m.log_start, m.log_transitions, m.log_emissions});
    const double ll = total.item<double>();
    if (!result.log_likelihood.empty() && ll - result.log_likelihood.back() < options.tolerance * tokens) {
      result.log_likelihood.push_back(ll);
      result.converged = true;
      break;
    }
    result.log_likelihood.push_back(ll);
    result.model = {normalise_rows(counts[0] + options.smoothing, m.log_start.detach()),
                    normalise_rows(counts[1] + options.smoothing, m.log_transitions.detach()),
                    normalise_rows(counts[2] + options.smoothing, m.log_emissions.detach())};
  }
  return result;
}

}  // namespace trellis
