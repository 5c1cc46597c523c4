#include "trellis/nn/crf.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "trellis/crf/chain_inputs.h"
#include "trellis/error.h"

namespace trellis::nn {
namespace {

constexpr const char* kWhat = "trellis::nn::CRF";

enum class Reduction { none, sum, mean, token_mean };

Reduction parse_reduction(const std::string& reduction) {
  if (reduction == "none") return Reduction::none;
  if (reduction == "sum") return Reduction::sum;
  if (reduction == "mean") return Reduction::mean;
  if (reduction == "token_mean") return Reduction::token_mean;
  throw Error(std::string(kWhat) + ": reduction must be 'none', 'sum', 'mean' or 'token_mean', got '" + reduction +
              "'");
}

}  // namespace

CRFImpl::CRFImpl(const CRFOptions& options_) : options(options_) { reset(); }

void CRFImpl::reset() {
  const int64_t K = options.num_tags();
  if (K < 1) throw Error(std::string(kWhat) + ": num_tags must be at least 1, got " + std::to_string(K));
  transitions = register_parameter("transitions", at::empty({K, K}));
  start_transitions = register_parameter("start_transitions", at::empty({K}));
  end_transitions = register_parameter("end_transitions", at::empty({K}));
  allowed_transitions = register_buffer("allowed_transitions", at::ones({K, K}, at::kBool));
  allowed_start = register_buffer("allowed_start", at::ones({K}, at::kBool));
  allowed_end = register_buffer("allowed_end", at::ones({K}, at::kBool));
  reset_parameters();
}

void CRFImpl::reset_parameters() {
  c10::NoGradGuard no_grad;
  for (at::Tensor* p : {&transitions, &start_transitions, &end_transitions}) p->uniform_(-0.1, 0.1);
}

void CRFImpl::pretty_print(std::ostream& stream) const {
  stream << "trellis::nn::CRF(num_tags=" << options.num_tags()
         << ", batch_first=" << (options.batch_first() ? "true" : "false") << ")";
}

ChainPotentials CRFImpl::potentials(const at::Tensor& emissions, const at::Tensor& mask, bool constrained) const {
  const ChainInputs in{emissions, transitions, start_transitions, end_transitions, mask, {}, options.batch_first()};
  ChainPotentials p = chain_potentials(in, kWhat);
  if (!constrained) return p;
  // Module::to(dtype) converts buffers too: whatever their dtype now, nonzero means allowed.
  return constrain(p, {allowed_transitions.ne(0), allowed_start.ne(0), allowed_end.ne(0)});
}

at::Tensor CRFImpl::forward(const at::Tensor& emissions, const at::Tensor& tags, const at::Tensor& mask,
                            const std::string& reduction) {
  const Reduction r = parse_reduction(reduction);
  const ChainPotentials p = potentials(emissions, mask, /*constrained=*/false);
  const ChainInputs in{emissions, {}, {}, {}, mask, {}, options.batch_first()};
  const at::Tensor llh = batch_log_likelihood(p, batch_first_tags(tags, in, kWhat));
  switch (r) {
    case Reduction::none: return llh;
    case Reduction::sum: return llh.sum();
    case Reduction::mean: return llh.mean();
    case Reduction::token_mean: break;
  }
  const at::Tensor tokens =
      p.lengths.defined()
          ? p.lengths.sum().to(llh.scalar_type())
          : at::scalar_tensor(static_cast<double>(p.emissions.size(0)) * static_cast<double>(p.emissions.size(1)),
                              llh.options());
  return llh.sum() / tokens;
}

at::Tensor CRFImpl::log_partition(const at::Tensor& emissions, const at::Tensor& mask) {
  return batch_log_partition(potentials(emissions, mask, /*constrained=*/true));
}

ViterbiResult CRFImpl::decode(const at::Tensor& emissions, const at::Tensor& mask) {
  const AutogradScope scope;
  return caller_layout(batch_viterbi(scope.usable(potentials(emissions, mask, /*constrained=*/true))),
                       options.batch_first());
}

KBestResult CRFImpl::kbest(const at::Tensor& emissions, int64_t k, const at::Tensor& mask) {
  return caller_layout(kbest_viterbi(potentials(emissions, mask, /*constrained=*/true), k), options.batch_first(),
                       emissions.device());
}

Marginals CRFImpl::marginals(const at::Tensor& emissions, const at::Tensor& mask, bool edges) {
  const AutogradScope scope;
  return caller_layout(batch_marginals(scope.usable(potentials(emissions, mask, /*constrained=*/true)), edges),
                       options.batch_first());
}

void CRFImpl::set_constraints(const TransitionConstraints& allowed) {
  const int64_t K = options.num_tags();
  const TransitionConstraints c =
      allowed_constraints(allowed.transitions, allowed.start, allowed.end, K, allowed_transitions.device(), kWhat);
  c10::NoGradGuard no_grad;
  allowed_transitions.copy_(c.transitions.defined() ? c.transitions : at::ones({K, K}, at::kBool));
  allowed_start.copy_(c.start.defined() ? c.start : at::ones({K}, at::kBool));
  allowed_end.copy_(c.end.defined() ? c.end : at::ones({K}, at::kBool));
}

void CRFImpl::set_constraints(const std::vector<std::string>& labels, TagScheme scheme) {
  if (static_cast<int64_t>(labels.size()) != options.num_tags())
    throw Error(std::string(kWhat) + ": " + std::to_string(labels.size()) + " labels for a CRF of " +
                std::to_string(options.num_tags()) + " tags");
  set_constraints(tag_scheme_constraints(labels, scheme));
}

void CRFImpl::clear_constraints() { set_constraints(TransitionConstraints{}); }

}  // namespace trellis::nn
