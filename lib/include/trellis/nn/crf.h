// trellis::nn::CRF: a linear-chain CRF layer in torch::nn's style (a module holder, CRF, around CRFImpl), the C++
// counterpart of pytorch-crf's CRF on Trellis' fused dynamic programs, on CPU and CUDA tensors alike.
//
//   trellis::nn::CRF crf(num_tags);                                  // or CRF(CRFOptions(num_tags).batch_first(false))
//   at::Tensor loss = -crf(emissions, tags, mask);                   // log-likelihood, summed over the batch
//   trellis::ViterbiResult best = crf->decode(emissions, mask);      // paths (-1 at padding) and scores
//   crf->set_constraints(labels, trellis::TagScheme::BIOES);         // constrained decoding from now on
//   torch::save(crf, "crf.pt"); torch::load(crf, "crf.pt");           // parameters and constraints
//
// Parameters (pytorch-crf's names and initialisation, uniform in [-0.1, 0.1]): transitions [K,K] (i followed by j),
// start_transitions [K], end_transitions [K]. Emissions [B,T,K] with tags and mask [B,T] (batch_first, the default),
// or [T,B,K] with [T,B]; masks are bool or uint8 and right-padded, a missing mask meaning every position is real;
// float16/bfloat16 emissions are accumulated in float32 and mixed float dtypes promote (trellis/crf/chain_inputs.h).
//
// Constraints (allowed transitions, starts and ends) are buffers, all allowed until set, so they follow the module to
// a device and through torch::save/load. They apply to decode, kbest, marginals and log_partition; forward (the
// training objective) scores the unconstrained model, as pytorch-crf and AllenNLP's CRF do.
#pragma once
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "trellis/crf/linear_chain_crf.h"

namespace trellis::nn {

// The module's options: the number of tags and the layout of its inputs.
struct CRFOptions {
  // K tags; the layout is batch-first.
  /* implicit */ CRFOptions(int64_t num_tags) : num_tags_(num_tags) {}
  // K, the number of tags.
  TORCH_ARG(int64_t, num_tags);
  // true: emissions [B,T,K], tags and mask [B,T]; false: [T,B,K] and [T,B], and per-position results time-first.
  TORCH_ARG(bool, batch_first) = true;
};

// A linear-chain CRF layer with pytorch-crf's parameters and methods (use it as trellis::nn::CRF, a module holder).
class CRFImpl : public torch::nn::Cloneable<CRFImpl> {
 public:
  // K tags, batch-first inputs.
  explicit CRFImpl(int64_t num_tags) : CRFImpl(CRFOptions(num_tags)) {}
  // Registers the parameters (initialised by reset_parameters) and unconstrained buffers.
  explicit CRFImpl(const CRFOptions& options);

  // Registers the parameters and buffers again from the options (torch::nn::Cloneable's hook).
  void reset() override;
  // uniform(-0.1, 0.1) for every parameter, as pytorch-crf; constraints are left as they are.
  void reset_parameters();
  // "trellis::nn::CRF(num_tags=K, batch_first=true|false)".
  void pretty_print(std::ostream& stream) const override;

  // Log-likelihood of tags under the unconstrained model, reduced by "sum" (the default), "none" ([B]), "mean" (over
  // sequences) or "token_mean" (over real positions). float32, or float64 when the emissions or parameters are.
  at::Tensor forward(const at::Tensor& emissions, const at::Tensor& tags, const at::Tensor& mask = {},
                     const std::string& reduction = "sum");
  // log Z [B] under the constraints.
  at::Tensor log_partition(const at::Tensor& emissions, const at::Tensor& mask = {});
  // The best allowed path: [B,T] (or [T,B]) int64, -1 at padding, and its score [B].
  ViterbiResult decode(const at::Tensor& emissions, const at::Tensor& mask = {});
  // The k best allowed paths, best first: [B,k,T] (or [T,B,k]), -1 at padding and beyond the paths that exist, and
  // their scores [B,k].
  KBestResult kbest(const at::Tensor& emissions, int64_t k, const at::Tensor& mask = {});
  // Node marginals [B,T,K] (or [T,B,K]) and, with edges, edge marginals [B,T-1,K,K] (or [T-1,B,K,K]); zero at padding.
  Marginals marginals(const at::Tensor& emissions, const at::Tensor& mask = {}, bool edges = false);

  // Allowed transitions [K,K], starts [K] and ends [K] (bool; an undefined part allows everything), or those of a
  // BIO/BIOES scheme over the labels in tag order.
  void set_constraints(const TransitionConstraints& allowed);
  void set_constraints(const std::vector<std::string>& labels, TagScheme scheme);  // the scheme's constraints
  // Allows every transition, start and end again.
  void clear_constraints();

  // The potentials the module's methods run on: the caller's emissions and mask with the module's parameters,
  // constrained or not.
  ChainPotentials potentials(const at::Tensor& emissions, const at::Tensor& mask, bool constrained) const;

  CRFOptions options;              // as constructed
  at::Tensor transitions;          // parameter [K,K]: score of tag i followed by tag j
  at::Tensor start_transitions;    // parameter [K]: score of starting with each tag
  at::Tensor end_transitions;      // parameter [K]: score of ending with each tag
  at::Tensor allowed_transitions;  // buffer [K,K] bool: nonzero where tag i may be followed by tag j
  at::Tensor allowed_start;        // buffer [K] bool: nonzero where a sequence may start with the tag
  at::Tensor allowed_end;          // buffer [K] bool: nonzero where a sequence may end with the tag
};

// The module holder of CRFImpl (a shared pointer, as every torch::nn module).
TORCH_MODULE(CRF);

}  // namespace trellis::nn
