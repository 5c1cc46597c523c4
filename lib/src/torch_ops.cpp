// The LLM head as PyTorch operators, for Python: torch.ops.load_library("libtrellis_ops.so"), then
// torch.ops.trellis.linear_cross_entropy(x, weight, targets, ...). Registered as CompositeImplicitAutograd, so autograd
// goes through the library's own backward (gradients formed without the N×V logits).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "trellis/linear_cross_entropy.h"

namespace {

trellis::HeadOptions head_options(const std::optional<at::Tensor>& bias, std::optional<double> softcap,
                                  int64_t ignore_index, int64_t chunk_bytes) {
  trellis::HeadOptions o;
  if (bias) o.bias = *bias;
  o.softcap = softcap;
  o.ignore_index = ignore_index;
  if (chunk_bytes > 0) o.chunk_bytes = chunk_bytes;
  return o;
}

at::Tensor linear_logsumexp(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            std::optional<double> softcap, int64_t chunk_bytes) {
  return trellis::linear_logsumexp(x, weight, head_options(bias, softcap, -100, chunk_bytes));
}

std::tuple<at::Tensor, at::Tensor> token_logprobs(const at::Tensor& x, const at::Tensor& weight,
                                                  const at::Tensor& targets, const std::optional<at::Tensor>& bias,
                                                  std::optional<double> softcap, int64_t ignore_index, bool entropy,
                                                  int64_t chunk_bytes) {
  auto r = trellis::token_logprobs(x, weight, targets, head_options(bias, softcap, ignore_index, chunk_bytes), entropy);
  // A schema cannot return an optional tensor: no entropy is an empty one.
  return {r.logprobs, entropy ? r.entropy : at::empty({0}, r.logprobs.options())};
}

at::Tensor linear_cross_entropy(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                const std::optional<at::Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                                double label_smoothing, std::optional<double> softcap, double z_loss,
                                int64_t chunk_bytes, bool recompute_logits) {
  trellis::LossOptions l;
  l.reduction = trellis::parse_reduction(std::string(reduction));
  l.label_smoothing = label_smoothing;
  l.z_loss = z_loss;
  trellis::HeadOptions h = head_options(bias, softcap, ignore_index, chunk_bytes);
  h.recompute_logits = recompute_logits;
  return trellis::linear_cross_entropy(x, weight, targets, h, l);
}

}  // namespace

TORCH_LIBRARY(trellis, m) {
  m.def("linear_logsumexp(Tensor x, Tensor weight, Tensor? bias=None, float? softcap=None, int chunk_bytes=0) -> Tensor");
  m.def("token_logprobs(Tensor x, Tensor weight, Tensor targets, Tensor? bias=None, float? softcap=None, "
        "int ignore_index=-100, bool entropy=False, int chunk_bytes=0) -> (Tensor, Tensor)");
  m.def("linear_cross_entropy(Tensor x, Tensor weight, Tensor targets, Tensor? bias=None, int ignore_index=-100, "
        "str reduction='mean', float label_smoothing=0.0, float? softcap=None, float z_loss=0.0, int chunk_bytes=0, "
        "bool recompute_logits=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(trellis, CompositeImplicitAutograd, m) {
  m.impl("linear_logsumexp", &linear_logsumexp);
  m.impl("token_logprobs", &token_logprobs);
  m.impl("linear_cross_entropy", &linear_cross_entropy);
}
