// The LLM head as PyTorch operators, for Python: torch.ops.load_library("libtrellis_ops.so"), then
// torch.ops.trellis.linear_cross_entropy(x, weight, targets, ...). torch.compile can trace them: every operator has a
// Meta kernel (shapes and types only, for fake tensors), and every operator's autograd calls operators of its own
// (_linear_cross_entropy_forward and _linear_cross_entropy_backward for the loss, _head_statistics_backward for
// linear_logsumexp and token_logprobs, and their _vocab_parallel_ forms), so that a compiled graph holds those instead
// of the library's internals (gradients formed without the N×V logits either way).
#include <cmath>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "lib/src/io/message.h"
#include "trellis/error.h"
#include "trellis/head/linear_cross_entropy.h"
#include "trellis/head/linear_cross_entropy_parallel.h"

namespace {

using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Tensors5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Mask = std::array<bool, 3>;  // gradients wanted for x, weight, bias

trellis::HeadOptions head_options(const std::optional<at::Tensor>& bias, std::optional<double> softcap,
                                  int64_t ignore_index, int64_t chunk_bytes, bool recompute_logits = false,
                                  int64_t memory_budget = -1) {
  trellis::HeadOptions o;
  if (bias) o.bias = *bias;
  o.softcap = softcap;
  o.ignore_index = ignore_index;
  if (chunk_bytes > 0) o.chunk_bytes = chunk_bytes;
  o.recompute_logits = recompute_logits;
  o.memory_budget = memory_budget;
  return o;
}

trellis::LossOptions loss_options(c10::string_view reduction, double label_smoothing, double z_loss) {
  trellis::LossOptions l;
  l.reduction = trellis::parse_reduction(std::string(reduction));
  l.label_smoothing = label_smoothing;
  l.z_loss = z_loss;
  return l;
}

void check_temperature(const char* op, double temperature) {
  if (!(std::isfinite(temperature) && temperature > 0))
    throw trellis::Error(
        trellis::message::text("trellis.", op, ": temperature must be a positive finite number, got ", temperature));
}

// The inputs at a sampling temperature τ, whose logits are softcap(x·Wᵀ + b) / τ. Dividing x, the bias and the soft-cap
// by τ gives exactly those logits ((c/τ)·tanh((z/τ)/(c/τ)) = c·tanh(z/c)/τ), so the library's kernels run unchanged and
// autograd carries the gradients through the divisions; τ = 1 passes the inputs through as they are. x/τ holds x's
// type, so bfloat16 and float16 inputs are rounded once more (a relative 2⁻⁹ and 2⁻¹² at most; none for τ a power of
// two).
struct Tempered {
  at::Tensor x;
  std::optional<at::Tensor> bias;
  std::optional<double> softcap;
};
Tempered temper(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                std::optional<double> softcap, double temperature) {
  check_temperature(op, temperature);
  if (temperature == 1) return {x, bias, softcap};
  Tempered t{x.div(temperature), bias, softcap};
  if (bias && bias->defined()) t.bias = bias->div(temperature);
  if (softcap) t.softcap = *softcap / temperature;
  return t;
}

// A schema cannot return an undefined tensor: "none" is an empty one.
at::Tensor none(const at::Tensor& like) { return at::empty({0}, like.options()); }
at::Tensor or_none(const at::Tensor& t, const at::Tensor& like) { return t.defined() ? t : none(like); }

// ---- the kernels: the library's functions (CPU and CUDA) ----

at::Tensor linear_logsumexp(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            std::optional<double> softcap, int64_t chunk_bytes, double temperature) {
  const Tempered t = temper("linear_logsumexp", x, bias, softcap, temperature);
  return trellis::linear_logsumexp(t.x, weight, head_options(t.bias, t.softcap, -100, chunk_bytes));
}

std::tuple<at::Tensor, at::Tensor> token_logprobs(const at::Tensor& x, const at::Tensor& weight,
                                                  const at::Tensor& targets, const std::optional<at::Tensor>& bias,
                                                  std::optional<double> softcap, int64_t ignore_index, bool entropy,
                                                  int64_t chunk_bytes, double temperature) {
  const Tempered t = temper("token_logprobs", x, bias, softcap, temperature);
  auto r = trellis::token_logprobs(t.x, weight, targets, head_options(t.bias, t.softcap, ignore_index, chunk_bytes),
                                   entropy);
  return {r.logprobs, entropy ? r.entropy : none(r.logprobs)};
}

Tensors5 linear_cross_entropy_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                      const std::optional<at::Tensor>& bias, int64_t ignore_index,
                                      c10::string_view reduction, double label_smoothing, std::optional<double> softcap,
                                      double z_loss, int64_t chunk_bytes, bool recompute_logits, int64_t memory_budget,
                                      Mask want) {
  auto f = trellis::linear_cross_entropy_forward(
      x, weight, targets, head_options(bias, softcap, ignore_index, chunk_bytes, recompute_logits, memory_budget),
      loss_options(reduction, label_smoothing, z_loss), want);
  return {f.loss, or_none(f.lse, x), or_none(f.dx, x), or_none(f.dweight, x), or_none(f.dbias, x)};
}

// Backward of the unreduced loss (the reduced one's gradients come from the forward, scaled).
Tensors3 linear_cross_entropy_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                       const at::Tensor& targets, const std::optional<at::Tensor>& bias,
                                       const at::Tensor& lse, int64_t ignore_index, double label_smoothing,
                                       std::optional<double> softcap, double z_loss, int64_t chunk_bytes,
                                       bool recompute_logits, int64_t memory_budget, Mask want) {
  trellis::LinearCrossEntropyForward f;
  f.lse = lse;
  auto d = trellis::linear_cross_entropy_backward(
      grad, x, weight, targets, head_options(bias, softcap, ignore_index, chunk_bytes, recompute_logits, memory_budget),
      loss_options("none", label_smoothing, z_loss), f, want);
  return {or_none(d[0], x), or_none(d[1], x), or_none(d[2], x)};
}

// Backward of linear_logsumexp and token_logprobs (each grad optional: zero).
Tensors3 head_statistics_backward(const at::Tensor& x, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& targets, const std::optional<at::Tensor>& bias,
                                  std::optional<double> softcap, int64_t ignore_index, int64_t chunk_bytes,
                                  const std::optional<at::Tensor>& grad_lse,
                                  const std::optional<at::Tensor>& grad_logprob,
                                  const std::optional<at::Tensor>& grad_entropy, Mask want) {
  auto d = trellis::head_statistics_backward(
      x, weight, targets.value_or(at::Tensor()), head_options(bias, softcap, ignore_index, chunk_bytes),
      grad_lse.value_or(at::Tensor()), grad_logprob.value_or(at::Tensor()), grad_entropy.value_or(at::Tensor()), want);
  return {or_none(d[0], x), or_none(d[1], x), or_none(d[2], x)};
}

// ---- vocabulary parallelism: weight (and bias) is this rank's slice of the vocabulary; the process group is named as
// in PyTorch's functional collectives (torch.distributed's group_name), which keeps the operators traceable ----

trellis::VocabularySlice vocabulary_slice(c10::string_view group_name) {
  trellis::VocabularySlice s;
  s.group = c10d::resolve_process_group(std::string(group_name));
  return s;
}

// linear_logsumexp's and token_logprobs' forward: (lse, logprobs, entropy, slice_share, slice_expected_logit_excess),
// each of x's row shape (trellis::ParallelHeadRows); empty tensors stand for none.
Tensors5 vp_head_statistics_forward(const at::Tensor& x, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& targets, c10::string_view group_name,
                                    const std::optional<at::Tensor>& bias, std::optional<double> softcap,
                                    int64_t ignore_index, bool entropy, int64_t chunk_bytes) {
  const trellis::ParallelHeadRows r = trellis::head_statistics_forward(
      x, weight, targets.value_or(at::Tensor()), head_options(bias, softcap, ignore_index, chunk_bytes), entropy,
      vocabulary_slice(group_name));
  const at::IntArrayRef rows = x.sizes().slice(0, x.dim() - 1);
  const auto shaped = [&](const at::Tensor& t) { return t.defined() ? t.view(rows) : none(r.lse); };
  return {shaped(r.lse), shaped(r.logprobs), shaped(r.entropy), shaped(r.slice_share),
          shaped(r.slice_expected_logit_excess)};
}

// Their backward: gradients for (x, weight, bias) of Σ grad_lse·lse + grad_logprob·logprob + grad_entropy·entropy
// (each grad optional: zero), dx all-reduced over the group.
Tensors3 vp_head_statistics_backward(const at::Tensor& x, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& targets, c10::string_view group_name,
                                     const std::optional<at::Tensor>& bias, std::optional<double> softcap,
                                     int64_t ignore_index, int64_t chunk_bytes, const at::Tensor& lse,
                                     const at::Tensor& slice_share, const at::Tensor& slice_expected_logit_excess,
                                     const std::optional<at::Tensor>& grad_lse,
                                     const std::optional<at::Tensor>& grad_logprob,
                                     const std::optional<at::Tensor>& grad_entropy, Mask want) {
  trellis::ParallelHeadRows f;
  f.lse = lse;
  f.slice_share = slice_share;
  if (grad_entropy) f.slice_expected_logit_excess = slice_expected_logit_excess;
  auto d = trellis::head_statistics_backward(x, weight, targets.value_or(at::Tensor()),
                                             head_options(bias, softcap, ignore_index, chunk_bytes), f,
                                             grad_lse.value_or(at::Tensor()), grad_logprob.value_or(at::Tensor()),
                                             grad_entropy.value_or(at::Tensor()), vocabulary_slice(group_name), want);
  return {or_none(d[0], x), or_none(d[1], x), or_none(d[2], x)};
}

at::Tensor vp_linear_logsumexp(const at::Tensor& x, const at::Tensor& weight, c10::string_view group_name,
                               const std::optional<at::Tensor>& bias, std::optional<double> softcap,
                               int64_t chunk_bytes, double temperature) {
  const Tempered t = temper("vocab_parallel_linear_logsumexp", x, bias, softcap, temperature);
  return std::get<0>(
      vp_head_statistics_forward(t.x, weight, std::nullopt, group_name, t.bias, t.softcap, -100, false, chunk_bytes));
}

std::tuple<at::Tensor, at::Tensor> vp_token_logprobs(const at::Tensor& x, const at::Tensor& weight,
                                                     const at::Tensor& targets, c10::string_view group_name,
                                                     const std::optional<at::Tensor>& bias,
                                                     std::optional<double> softcap, int64_t ignore_index, bool entropy,
                                                     int64_t chunk_bytes, double temperature) {
  const Tempered t = temper("vocab_parallel_token_logprobs", x, bias, softcap, temperature);
  auto r = vp_head_statistics_forward(t.x, weight, targets, group_name, t.bias, t.softcap, ignore_index, entropy,
                                      chunk_bytes);
  return {std::get<1>(r), std::get<2>(r)};
}

Tensors5 vp_linear_cross_entropy_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                         c10::string_view group_name, const std::optional<at::Tensor>& bias,
                                         int64_t ignore_index, c10::string_view reduction, double label_smoothing,
                                         std::optional<double> softcap, double z_loss, int64_t chunk_bytes,
                                         bool recompute_logits, Mask want) {
  auto f = trellis::linear_cross_entropy_forward(
      x, weight, targets, head_options(bias, softcap, ignore_index, chunk_bytes, recompute_logits),
      loss_options(reduction, label_smoothing, z_loss), vocabulary_slice(group_name), want);
  return {f.loss, or_none(f.lse, x), or_none(f.dx, x), or_none(f.dweight, x), or_none(f.dbias, x)};
}

// Backward of the unreduced loss, or of one whose forward kept the lse (recompute_logits).
Tensors3 vp_linear_cross_entropy_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                          const at::Tensor& targets, c10::string_view group_name,
                                          const std::optional<at::Tensor>& bias, const at::Tensor& lse,
                                          int64_t ignore_index, c10::string_view reduction, double label_smoothing,
                                          std::optional<double> softcap, double z_loss, int64_t chunk_bytes,
                                          bool recompute_logits, Mask want) {
  trellis::LinearCrossEntropyForward f;
  f.lse = lse;
  auto d = trellis::linear_cross_entropy_backward(
      grad, x, weight, targets, head_options(bias, softcap, ignore_index, chunk_bytes, recompute_logits),
      loss_options(reduction, label_smoothing, z_loss), f, vocabulary_slice(group_name), want);
  return {or_none(d[0], x), or_none(d[1], x), or_none(d[2], x)};
}

at::Tensor vp_linear_cross_entropy_loss(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                        c10::string_view group_name, const std::optional<at::Tensor>& bias,
                                        int64_t ignore_index, c10::string_view reduction, double label_smoothing,
                                        std::optional<double> softcap, double z_loss, int64_t chunk_bytes,
                                        bool recompute_logits, double temperature) {
  const Tempered t = temper("vocab_parallel_linear_cross_entropy", x, bias, softcap, temperature);
  return std::get<0>(vp_linear_cross_entropy_forward(t.x, weight, targets, group_name, t.bias, ignore_index, reduction,
                                                     label_smoothing, t.softcap, z_loss, chunk_bytes, recompute_logits,
                                                     {false, false, false}));
}

// Without autograd (inference mode, or below it): the loss alone.
at::Tensor linear_cross_entropy_loss(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                     const std::optional<at::Tensor>& bias, int64_t ignore_index,
                                     c10::string_view reduction, double label_smoothing, std::optional<double> softcap,
                                     double z_loss, int64_t chunk_bytes, bool recompute_logits, double temperature,
                                     int64_t memory_budget) {
  const Tempered t = temper("linear_cross_entropy", x, bias, softcap, temperature);
  return std::get<0>(linear_cross_entropy_forward(t.x, weight, targets, t.bias, ignore_index, reduction,
                                                  label_smoothing, t.softcap, z_loss, chunk_bytes, recompute_logits,
                                                  memory_budget, {false, false, false}));
}

// ---- Meta kernels: the same results' shapes and types, with symbolic sizes ----

at::TensorOptions acc_options(const at::Tensor& x) {
  return x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
}
c10::SymIntArrayRef row_shape(const at::Tensor& x) { return x.sym_sizes().slice(0, x.dim() - 1); }
at::Tensor rows_meta(const at::Tensor& x) { return at::empty_symint(row_shape(x), acc_options(x)); }
at::Tensor shaped_meta(bool wanted, c10::SymIntArrayRef shape, const at::Tensor& x) {
  return wanted ? at::empty_symint(shape, x.options()) : none(x);
}

at::Tensor linear_logsumexp_meta(const at::Tensor& x, const at::Tensor&, const std::optional<at::Tensor>&,
                                 std::optional<double>, int64_t, double temperature) {
  check_temperature("linear_logsumexp", temperature);
  return rows_meta(x);
}

std::tuple<at::Tensor, at::Tensor> token_logprobs_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                                       const std::optional<at::Tensor>&, std::optional<double>, int64_t,
                                                       bool entropy, int64_t, double temperature) {
  check_temperature("token_logprobs", temperature);
  return {rows_meta(x), entropy ? rows_meta(x) : at::empty({0}, acc_options(x))};
}

Tensors5 linear_cross_entropy_forward_meta(const at::Tensor& x, const at::Tensor& weight, const at::Tensor&,
                                           const std::optional<at::Tensor>& bias, int64_t, c10::string_view reduction,
                                           double, std::optional<double>, double, int64_t, bool, int64_t, Mask want) {
  const bool unreduced = trellis::parse_reduction(std::string(reduction)) == trellis::Reduction::none;
  want[2] = want[2] && bias;
  const bool formed = !unreduced && (want[0] || want[1] || want[2]);  // the gradients come with the loss
  c10::SymInt n = 1;
  for (const c10::SymInt& s : row_shape(x)) n *= s;
  return {unreduced ? rows_meta(x) : at::empty({}, acc_options(x)),
          formed ? none(x) : at::empty_symint({n}, acc_options(x)), shaped_meta(formed && want[0], x.sym_sizes(), x),
          shaped_meta(formed && want[1], weight.sym_sizes(), x),
          shaped_meta(formed && want[2], weight.sym_sizes().slice(0, 1), x)};
}

Tensors3 linear_cross_entropy_backward_meta(const at::Tensor&, const at::Tensor& x, const at::Tensor& weight,
                                            const at::Tensor&, const std::optional<at::Tensor>& bias, const at::Tensor&,
                                            int64_t, double, std::optional<double>, double, int64_t, bool, int64_t,
                                            Mask want) {
  return {shaped_meta(want[0], x.sym_sizes(), x), shaped_meta(want[1], weight.sym_sizes(), x),
          shaped_meta(want[2] && bias, weight.sym_sizes().slice(0, 1), x)};
}

Tensors3 head_statistics_backward_meta(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>&,
                                       const std::optional<at::Tensor>& bias, std::optional<double>, int64_t, int64_t,
                                       const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                       const std::optional<at::Tensor>&, Mask want) {
  return {shaped_meta(want[0], x.sym_sizes(), x), shaped_meta(want[1], weight.sym_sizes(), x),
          shaped_meta(want[2] && bias, weight.sym_sizes().slice(0, 1), x)};
}

at::Tensor vp_linear_logsumexp_meta(const at::Tensor& x, const at::Tensor&, c10::string_view,
                                    const std::optional<at::Tensor>&, std::optional<double>, int64_t,
                                    double temperature) {
  check_temperature("vocab_parallel_linear_logsumexp", temperature);
  return rows_meta(x);
}

std::tuple<at::Tensor, at::Tensor> vp_token_logprobs_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                                          c10::string_view, const std::optional<at::Tensor>&,
                                                          std::optional<double>, int64_t, bool entropy, int64_t,
                                                          double temperature) {
  check_temperature("vocab_parallel_token_logprobs", temperature);
  return {rows_meta(x), entropy ? rows_meta(x) : at::empty({0}, acc_options(x))};
}

Tensors5 vp_head_statistics_forward_meta(const at::Tensor& x, const at::Tensor&,
                                         const std::optional<at::Tensor>& targets, c10::string_view,
                                         const std::optional<at::Tensor>&, std::optional<double>, int64_t, bool entropy,
                                         int64_t) {
  const at::Tensor empty = at::empty({0}, acc_options(x));
  return {rows_meta(x), targets ? rows_meta(x) : empty, entropy ? rows_meta(x) : empty, rows_meta(x),
          entropy ? rows_meta(x) : empty};
}

Tensors3 vp_head_statistics_backward_meta(const at::Tensor& x, const at::Tensor& weight,
                                          const std::optional<at::Tensor>&, c10::string_view,
                                          const std::optional<at::Tensor>& bias, std::optional<double>, int64_t,
                                          int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                          const std::optional<at::Tensor>&, Mask want) {
  return {shaped_meta(want[0], x.sym_sizes(), x), shaped_meta(want[1], weight.sym_sizes(), x),
          shaped_meta(want[2] && bias, weight.sym_sizes().slice(0, 1), x)};
}

Tensors5 vp_linear_cross_entropy_forward_meta(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                              c10::string_view, const std::optional<at::Tensor>& bias,
                                              int64_t ignore_index, c10::string_view reduction, double label_smoothing,
                                              std::optional<double> softcap, double z_loss, int64_t chunk_bytes,
                                              bool recompute_logits, Mask want) {
  // As on one device, except that recompute_logits keeps the lse for the backward instead of forming the gradients.
  auto m = linear_cross_entropy_forward_meta(x, weight, targets, bias, ignore_index, reduction, label_smoothing,
                                             softcap, z_loss, chunk_bytes, false, -1,
                                             recompute_logits ? Mask{false, false, false} : want);
  return m;
}

Tensors3 vp_linear_cross_entropy_backward_meta(const at::Tensor&, const at::Tensor& x, const at::Tensor& weight,
                                               const at::Tensor&, c10::string_view,
                                               const std::optional<at::Tensor>& bias, const at::Tensor&, int64_t,
                                               c10::string_view, double, std::optional<double>, double, int64_t, bool,
                                               Mask want) {
  return {shaped_meta(want[0], x.sym_sizes(), x), shaped_meta(want[1], weight.sym_sizes(), x),
          shaped_meta(want[2] && bias, weight.sym_sizes().slice(0, 1), x)};
}

at::Tensor vp_linear_cross_entropy_loss_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                             c10::string_view, const std::optional<at::Tensor>&, int64_t,
                                             c10::string_view reduction, double, std::optional<double>, double, int64_t,
                                             bool, double temperature) {
  check_temperature("vocab_parallel_linear_cross_entropy", temperature);
  const bool unreduced = trellis::parse_reduction(std::string(reduction)) == trellis::Reduction::none;
  return unreduced ? rows_meta(x) : at::empty({}, acc_options(x));
}

at::Tensor linear_cross_entropy_loss_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                          const std::optional<at::Tensor>&, int64_t, c10::string_view reduction, double,
                                          std::optional<double>, double, int64_t, bool, double temperature, int64_t) {
  check_temperature("linear_cross_entropy", temperature);
  const bool unreduced = trellis::parse_reduction(std::string(reduction)) == trellis::Reduction::none;
  return unreduced ? rows_meta(x) : at::empty({}, acc_options(x));
}

// ---- autograd: the forward and backward operators above, through the dispatcher ----

template <class Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

std::optional<double> saved_softcap(const torch::autograd::AutogradContext* ctx) {
  const c10::IValue& v = ctx->saved_data.at("softcap");
  return v.isNone() ? std::nullopt : std::optional<double>(v.toDouble());
}

// The loss's options, kept in an autograd node's saved_data for its backward.
struct SavedLossOptions {
  int64_t ignore_index = -100;
  std::string reduction;
  double label_smoothing = 0;
  std::optional<double> softcap;
  double z_loss = 0;
  int64_t chunk_bytes = 0;
  bool recompute_logits = false;

  void save(torch::autograd::AutogradContext* ctx) const {
    auto& d = ctx->saved_data;
    d["ignore_index"] = ignore_index;
    d["reduction"] = reduction;
    d["label_smoothing"] = label_smoothing;
    d["softcap"] = softcap;
    d["z_loss"] = z_loss;
    d["chunk_bytes"] = chunk_bytes;
    d["recompute_logits"] = recompute_logits;
  }
  static SavedLossOptions load(const torch::autograd::AutogradContext* ctx) {
    const auto& d = ctx->saved_data;
    return {d.at("ignore_index").toInt(),       d.at("reduction").toStringRef(),
            d.at("label_smoothing").toDouble(), saved_softcap(ctx),
            d.at("z_loss").toDouble(),          d.at("chunk_bytes").toInt(),
            d.at("recompute_logits").toBool()};
  }
};

// A reduced loss's gradients, formed by the forward and saved as (dx, dweight, dbias), scaled by grad: the library
// scales them (in operators that torch.compile traces).
std::array<at::Tensor, 3> scaled_forward_gradients(const at::Tensor& grad, const std::vector<at::Tensor>& saved,
                                                   const std::string& reduction, Mask want) {
  trellis::LinearCrossEntropyForward f;
  f.dx = saved[0], f.dweight = saved[1], f.dbias = saved[2];
  return trellis::linear_cross_entropy_backward(grad, {}, {}, {}, {}, loss_options(reduction, 0, 0), f, want);
}

std::optional<at::Tensor> optional(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

struct LinearCrossEntropy : torch::autograd::Function<LinearCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& targets, const std::optional<at::Tensor>& bias, int64_t ignore_index,
                            c10::string_view reduction, double label_smoothing, std::optional<double> softcap,
                            double z_loss, int64_t chunk_bytes, bool recompute_logits, int64_t memory_budget,
                            Mask want) {
    static const auto op = find<decltype(linear_cross_entropy_forward)>("trellis::_linear_cross_entropy_forward");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [loss, lse, dx, dweight, dbias] = op.call(x, weight, targets, bias, ignore_index, reduction, label_smoothing,
                                                   softcap, z_loss, chunk_bytes, recompute_logits, memory_budget, want);
    // The unreduced loss's backward forms the gradients from the inputs; a reduced one's come with the forward.
    if (reduction == "none") ctx->save_for_backward({x, weight, targets, bias.value_or(at::Tensor()), lse});
    else ctx->save_for_backward({dx, dweight, dbias});
    ctx->saved_data["bias"] = bias.has_value();
    SavedLossOptions{ignore_index, std::string(reduction), label_smoothing, softcap, z_loss,
                     chunk_bytes,  recompute_logits}
        .save(ctx);
    ctx->saved_data["memory_budget"] = memory_budget;
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    static const auto op = find<decltype(linear_cross_entropy_backward)>("trellis::_linear_cross_entropy_backward");
    const auto s = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    const Mask want = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                       d.at("bias").toBool() && ctx->needs_input_grad(3)};
    const SavedLossOptions o = SavedLossOptions::load(ctx);
    std::array<at::Tensor, 3> g;
    if (o.reduction != "none") {
      g = scaled_forward_gradients(grad[0], s, o.reduction, want);
    } else {
      auto [dx, dweight, dbias] =
          op.call(grad[0], s[0], s[1], s[2], optional(s[3]), s[4], o.ignore_index, o.label_smoothing, o.softcap,
                  o.z_loss, o.chunk_bytes, o.recompute_logits, d.at("memory_budget").toInt(), want);
      g = {want[0] ? dx : at::Tensor(), want[1] ? dweight : at::Tensor(), want[2] ? dbias : at::Tensor()};
    }
    return {g[0], g[1], at::Tensor(), g[2], {}, {}, {}, {}, {}, {}, {}, {}, {}};
  }
};

// The gradients of linear_logsumexp and token_logprobs: the logits formed again (_head_statistics_backward).
Tensors3 statistics_backward(torch::autograd::AutogradContext* ctx, const at::Tensor& grad_lse,
                             const at::Tensor& grad_logprob, const at::Tensor& grad_entropy, int64_t bias_input) {
  static const auto op = find<decltype(head_statistics_backward)>("trellis::_head_statistics_backward");
  const auto s = ctx->get_saved_variables();  // x, weight, targets, bias
  const Mask want = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                     s[3].defined() && ctx->needs_input_grad(bias_input)};
  auto [dx, dweight, dbias] =
      op.call(s[0], s[1], optional(s[2]), optional(s[3]), saved_softcap(ctx),
              ctx->saved_data.at("ignore_index").toInt(), ctx->saved_data.at("chunk_bytes").toInt(), optional(grad_lse),
              optional(grad_logprob), optional(grad_entropy), want);
  return {want[0] ? dx : at::Tensor(), want[1] ? dweight : at::Tensor(), want[2] ? dbias : at::Tensor()};
}

void save_head(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
               const at::Tensor& targets, const std::optional<at::Tensor>& bias, std::optional<double> softcap,
               int64_t ignore_index, int64_t chunk_bytes) {
  ctx->save_for_backward({x, weight, targets, bias.value_or(at::Tensor())});
  ctx->saved_data["softcap"] = softcap;
  ctx->saved_data["ignore_index"] = ignore_index;
  ctx->saved_data["chunk_bytes"] = chunk_bytes;
}

struct LinearLogsumexp : torch::autograd::Function<LinearLogsumexp> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, std::optional<double> softcap, int64_t chunk_bytes) {
    static const auto op = find<decltype(linear_logsumexp)>("trellis::linear_logsumexp");
    at::AutoDispatchBelowADInplaceOrView below;
    save_head(ctx, x, weight, at::Tensor(), bias, softcap, -100, chunk_bytes);
    return op.call(x, weight, bias, softcap, chunk_bytes, 1.0);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    auto [dx, dweight, dbias] = statistics_backward(ctx, grad[0], {}, {}, 2);
    return {dx, dweight, dbias, {}, {}};
  }
};

struct TokenLogprobs : torch::autograd::Function<TokenLogprobs> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& weight, const at::Tensor& targets,
                                                const std::optional<at::Tensor>& bias, std::optional<double> softcap,
                                                int64_t ignore_index, bool entropy, int64_t chunk_bytes) {
    static const auto op = find<decltype(token_logprobs)>("trellis::token_logprobs");
    at::AutoDispatchBelowADInplaceOrView below;
    save_head(ctx, x, weight, targets, bias, softcap, ignore_index, chunk_bytes);
    ctx->saved_data["entropy"] = entropy;
    auto [logprobs, row_entropy] = op.call(x, weight, targets, bias, softcap, ignore_index, entropy, chunk_bytes, 1.0);
    if (!entropy) ctx->mark_non_differentiable({row_entropy});  // the empty stand-in for none
    return {logprobs, row_entropy};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    const at::Tensor grad_entropy = ctx->saved_data.at("entropy").toBool() ? grad[1] : at::Tensor();
    auto [dx, dweight, dbias] = statistics_backward(ctx, {}, grad[0], grad_entropy, 3);
    return {dx, dweight, {}, dbias, {}, {}, {}, {}};
  }
};

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& targets, c10::string_view group_name,
                            const std::optional<at::Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                            double label_smoothing, std::optional<double> softcap, double z_loss, int64_t chunk_bytes,
                            bool recompute_logits, Mask want) {
    static const auto op =
        find<decltype(vp_linear_cross_entropy_forward)>("trellis::_vocab_parallel_linear_cross_entropy_forward");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [loss, lse, dx, dweight, dbias] =
        op.call(x, weight, targets, group_name, bias, ignore_index, reduction, label_smoothing, softcap, z_loss,
                chunk_bytes, recompute_logits, want);
    // The gradients come with the forward (a reduced loss), or its backward forms them from the inputs and lse.
    const bool formed = reduction != "none" && !recompute_logits && (want[0] || want[1] || want[2]);
    if (formed) ctx->save_for_backward({dx, dweight, dbias});
    else ctx->save_for_backward({x, weight, targets, bias.value_or(at::Tensor()), lse});
    ctx->saved_data["formed"] = formed;
    ctx->saved_data["bias"] = bias.has_value();
    ctx->saved_data["group_name"] = std::string(group_name);
    SavedLossOptions{ignore_index, std::string(reduction), label_smoothing, softcap, z_loss,
                     chunk_bytes,  recompute_logits}
        .save(ctx);
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    static const auto op =
        find<decltype(vp_linear_cross_entropy_backward)>("trellis::_vocab_parallel_linear_cross_entropy_backward");
    const auto s = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    // needs_input_grad counts tensor arguments only: bias is the fourth.
    const Mask want = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                       d.at("bias").toBool() && ctx->needs_input_grad(3)};
    const SavedLossOptions o = SavedLossOptions::load(ctx);
    std::array<at::Tensor, 3> g;
    if (d.at("formed").toBool()) {
      g = scaled_forward_gradients(grad[0], s, o.reduction, want);
    } else {
      auto [dx, dweight, dbias] =
          op.call(grad[0], s[0], s[1], s[2], d.at("group_name").toStringRef(), optional(s[3]), s[4], o.ignore_index,
                  o.reduction, o.label_smoothing, o.softcap, o.z_loss, o.chunk_bytes, o.recompute_logits, want);
      g = {want[0] ? dx : at::Tensor(), want[1] ? dweight : at::Tensor(), want[2] ? dbias : at::Tensor()};
    }
    return {g[0], g[1], {}, {}, g[2], {}, {}, {}, {}, {}, {}, {}, {}};
  }
};

at::Tensor vp_linear_cross_entropy_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                            c10::string_view group_name, const std::optional<at::Tensor>& bias,
                                            int64_t ignore_index, c10::string_view reduction, double label_smoothing,
                                            std::optional<double> softcap, double z_loss, int64_t chunk_bytes,
                                            bool recompute_logits, double temperature) {
  const Tempered t = temper("vocab_parallel_linear_cross_entropy", x, bias, softcap, temperature);
  // Grad mode is off inside forward: the caller's mode says whether anyone will ask for gradients.
  const bool grad = c10::GradMode::is_enabled();
  const Mask want = {grad && t.x.requires_grad(), grad && weight.requires_grad(),
                     grad && t.bias && t.bias->defined() && t.bias->requires_grad()};
  return VocabParallelCrossEntropy::apply(t.x, weight, targets, group_name, t.bias, ignore_index, reduction,
                                          label_smoothing, t.softcap, z_loss, chunk_bytes, recompute_logits, want);
}

// vocab_parallel_linear_logsumexp and vocab_parallel_token_logprobs (targets undefined for the former): outputs
// (lse, logprobs, entropy); an output not asked for is an empty tensor without gradient. The backward forms the
// slice's gradients again from the inputs and the slice's statistics (_vocab_parallel_head_statistics_backward).
struct VocabParallelHeadStatistics : torch::autograd::Function<VocabParallelHeadStatistics> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& weight, const std::optional<at::Tensor>& targets,
                                                c10::string_view group_name, const std::optional<at::Tensor>& bias,
                                                std::optional<double> softcap, int64_t ignore_index, bool entropy,
                                                int64_t chunk_bytes) {
    static const auto op =
        find<decltype(vp_head_statistics_forward)>("trellis::_vocab_parallel_head_statistics_forward");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [lse, logprobs, row_entropy, share, excess] =
        op.call(x, weight, targets, group_name, bias, softcap, ignore_index, entropy, chunk_bytes);
    ctx->save_for_backward(
        {x, weight, targets.value_or(at::Tensor()), bias.value_or(at::Tensor()), lse, share, excess});
    ctx->saved_data["group_name"] = std::string(group_name);
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["entropy"] = entropy;
    ctx->saved_data["chunk_bytes"] = chunk_bytes;
    ctx->set_materialize_grads(false);  // an output nobody used has no gradient: nothing to add for it
    if (!targets) ctx->mark_non_differentiable({logprobs});  // the empty stand-ins for none
    if (!entropy) ctx->mark_non_differentiable({row_entropy});
    return {lse, logprobs, row_entropy};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    static const auto op =
        find<decltype(vp_head_statistics_backward)>("trellis::_vocab_parallel_head_statistics_backward");
    // x, weight, targets, bias, lse, slice_share, slice_expected_logit_excess
    const auto s = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    // needs_input_grad counts the tensor arguments given: bias is the fourth after targets, else the third.
    const Mask want = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                       s[3].defined() && ctx->needs_input_grad(s[2].defined() ? 3 : 2)};
    const at::Tensor grad_logprob = s[2].defined() ? grad[1] : at::Tensor();
    const at::Tensor grad_entropy = d.at("entropy").toBool() ? grad[2] : at::Tensor();
    auto [dx, dweight, dbias] =
        op.call(s[0], s[1], optional(s[2]), d.at("group_name").toStringRef(), optional(s[3]), saved_softcap(ctx),
                d.at("ignore_index").toInt(), d.at("chunk_bytes").toInt(), s[4], s[5], s[6], optional(grad[0]),
                optional(grad_logprob), optional(grad_entropy), want);
    return {want[0] ? dx : at::Tensor(),
            want[1] ? dweight : at::Tensor(),
            {},
            {},
            want[2] ? dbias : at::Tensor(),
            {},
            {},
            {},
            {}};
  }
};

at::Tensor vp_linear_logsumexp_autograd(const at::Tensor& x, const at::Tensor& weight, c10::string_view group_name,
                                        const std::optional<at::Tensor>& bias, std::optional<double> softcap,
                                        int64_t chunk_bytes, double temperature) {
  const Tempered t = temper("vocab_parallel_linear_logsumexp", x, bias, softcap, temperature);
  return VocabParallelHeadStatistics::apply(t.x, weight, std::nullopt, group_name, t.bias, t.softcap, -100, false,
                                            chunk_bytes)[0];
}

std::tuple<at::Tensor, at::Tensor> vp_token_logprobs_autograd(const at::Tensor& x, const at::Tensor& weight,
                                                              const at::Tensor& targets, c10::string_view group_name,
                                                              const std::optional<at::Tensor>& bias,
                                                              std::optional<double> softcap, int64_t ignore_index,
                                                              bool entropy, int64_t chunk_bytes, double temperature) {
  const Tempered t = temper("vocab_parallel_token_logprobs", x, bias, softcap, temperature);
  auto out = VocabParallelHeadStatistics::apply(t.x, weight, targets, group_name, t.bias, t.softcap, ignore_index,
                                                entropy, chunk_bytes);
  return {out[1], out[2]};
}

at::Tensor linear_logsumexp_autograd(const at::Tensor& x, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias, std::optional<double> softcap,
                                     int64_t chunk_bytes, double temperature) {
  const Tempered t = temper("linear_logsumexp", x, bias, softcap, temperature);
  return LinearLogsumexp::apply(t.x, weight, t.bias, t.softcap, chunk_bytes);
}

std::tuple<at::Tensor, at::Tensor> token_logprobs_autograd(const at::Tensor& x, const at::Tensor& weight,
                                                           const at::Tensor& targets,
                                                           const std::optional<at::Tensor>& bias,
                                                           std::optional<double> softcap, int64_t ignore_index,
                                                           bool entropy, int64_t chunk_bytes, double temperature) {
  const Tempered t = temper("token_logprobs", x, bias, softcap, temperature);
  auto out = TokenLogprobs::apply(t.x, weight, targets, t.bias, t.softcap, ignore_index, entropy, chunk_bytes);
  return {out[0], out[1]};
}

at::Tensor linear_cross_entropy_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                         const std::optional<at::Tensor>& bias, int64_t ignore_index,
                                         c10::string_view reduction, double label_smoothing,
                                         std::optional<double> softcap, double z_loss, int64_t chunk_bytes,
                                         bool recompute_logits, double temperature, int64_t memory_budget) {
  const Tempered t = temper("linear_cross_entropy", x, bias, softcap, temperature);
  // Grad mode is off inside forward: the caller's mode says whether anyone will ask for gradients.
  const bool grad = c10::GradMode::is_enabled();
  const Mask want = {grad && t.x.requires_grad(), grad && weight.requires_grad(),
                     grad && t.bias && t.bias->defined() && t.bias->requires_grad()};
  return LinearCrossEntropy::apply(t.x, weight, targets, t.bias, ignore_index, reduction, label_smoothing, t.softcap,
                                   z_loss, chunk_bytes, recompute_logits, memory_budget, want);
}

}  // namespace

TORCH_LIBRARY(trellis, m) {
  // temperature τ > 0: every result is that of the logits softcap(x·Wᵀ + b) / τ (the sampling temperature).
  m.def(
      "linear_logsumexp(Tensor x, Tensor weight, Tensor? bias=None, float? softcap=None, int chunk_bytes=0, "
      "float temperature=1.0) -> Tensor");
  m.def(
      "token_logprobs(Tensor x, Tensor weight, Tensor targets, Tensor? bias=None, float? softcap=None, "
      "int ignore_index=-100, bool entropy=False, int chunk_bytes=0, float temperature=1.0) -> (Tensor, Tensor)");
  m.def(
      "linear_cross_entropy(Tensor x, Tensor weight, Tensor targets, Tensor? bias=None, int ignore_index=-100, "
      "str reduction='mean', float label_smoothing=0.0, float? softcap=None, float z_loss=0.0, int chunk_bytes=0, "
      "bool recompute_logits=False, float temperature=1.0, int memory_budget=-1) -> Tensor");
  // linear_cross_entropy's halves. The forward returns (loss, lse, dx, dweight, dbias): the gradients when it forms
  // them (a mean or sum reduction with gradients wanted), else lse for the backward; empty tensors stand for none.
  m.def(
      "_linear_cross_entropy_forward(Tensor x, Tensor weight, Tensor targets, Tensor? bias, int ignore_index, "
      "str reduction, float label_smoothing, float? softcap, float z_loss, int chunk_bytes, bool recompute_logits, "
      "int memory_budget, bool[3] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "_linear_cross_entropy_backward(Tensor grad, Tensor x, Tensor weight, Tensor targets, Tensor? bias, "
      "Tensor lse, int ignore_index, float label_smoothing, float? softcap, float z_loss, int chunk_bytes, "
      "bool recompute_logits, int memory_budget, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // The backward of linear_logsumexp and token_logprobs: gradients for (x, weight, bias) of
  // Σ grad_lse·lse + grad_logprob·logprob + grad_entropy·entropy.
  // Vocabulary parallelism: weight and bias are this rank's contiguous slice of the vocabulary (ranks in order),
  // targets are ids of the whole vocabulary, group_name names the process group (torch.distributed's group_name).
  m.def(
      "vocab_parallel_linear_logsumexp(Tensor x, Tensor weight, str group_name, Tensor? bias=None, "
      "float? softcap=None, int chunk_bytes=0, float temperature=1.0) -> Tensor");
  m.def(
      "vocab_parallel_token_logprobs(Tensor x, Tensor weight, Tensor targets, str group_name, Tensor? bias=None, "
      "float? softcap=None, int ignore_index=-100, bool entropy=False, int chunk_bytes=0, float temperature=1.0) "
      "-> (Tensor, Tensor)");
  m.def(
      "vocab_parallel_linear_cross_entropy(Tensor x, Tensor weight, Tensor targets, str group_name, "
      "Tensor? bias=None, int ignore_index=-100, str reduction='mean', float label_smoothing=0.0, "
      "float? softcap=None, float z_loss=0.0, int chunk_bytes=0, bool recompute_logits=False, "
      "float temperature=1.0) -> Tensor");
  // Returns (loss, lse, dx, dweight, dbias) as _linear_cross_entropy_forward does (the gradients formed with a reduced
  // loss, unless recompute_logits, which keeps lse for the backward).
  m.def(
      "_vocab_parallel_linear_cross_entropy_forward(Tensor x, Tensor weight, Tensor targets, str group_name, "
      "Tensor? bias, int ignore_index, str reduction, float label_smoothing, float? softcap, float z_loss, "
      "int chunk_bytes, bool recompute_logits, bool[3] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "_vocab_parallel_linear_cross_entropy_backward(Tensor grad, Tensor x, Tensor weight, Tensor targets, "
      "str group_name, Tensor? bias, Tensor lse, int ignore_index, str reduction, float label_smoothing, "
      "float? softcap, float z_loss, int chunk_bytes, bool recompute_logits, bool[3] output_mask) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "_head_statistics_backward(Tensor x, Tensor weight, Tensor? targets, Tensor? bias, float? softcap, "
      "int ignore_index, int chunk_bytes, Tensor? grad_lse, Tensor? grad_logprob, Tensor? grad_entropy, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // vocab_parallel_linear_logsumexp's and vocab_parallel_token_logprobs' halves. The forward returns (lse, logprobs,
  // entropy, slice_share, slice_expected_logit_excess): the results, and this rank's slice's statistics that the
  // backward takes (empty tensors stand for none). The backward's gradients are those of
  // Σ grad_lse·lse + grad_logprob·logprob + grad_entropy·entropy, dx all-reduced over the group.
  m.def(
      "_vocab_parallel_head_statistics_forward(Tensor x, Tensor weight, Tensor? targets, str group_name, "
      "Tensor? bias, float? softcap, int ignore_index, bool entropy, int chunk_bytes) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "_vocab_parallel_head_statistics_backward(Tensor x, Tensor weight, Tensor? targets, str group_name, "
      "Tensor? bias, float? softcap, int ignore_index, int chunk_bytes, Tensor lse, Tensor slice_share, "
      "Tensor slice_expected_logit_excess, Tensor? grad_lse, Tensor? grad_logprob, Tensor? grad_entropy, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(trellis, CompositeExplicitAutograd, m) {
  m.impl("linear_logsumexp", &linear_logsumexp);
  m.impl("token_logprobs", &token_logprobs);
  m.impl("linear_cross_entropy", &linear_cross_entropy_loss);
  m.impl("_linear_cross_entropy_forward", &linear_cross_entropy_forward);
  m.impl("_linear_cross_entropy_backward", &linear_cross_entropy_backward);
  m.impl("_head_statistics_backward", &head_statistics_backward);
  m.impl("vocab_parallel_linear_logsumexp", &vp_linear_logsumexp);
  m.impl("vocab_parallel_token_logprobs", &vp_token_logprobs);
  m.impl("vocab_parallel_linear_cross_entropy", &vp_linear_cross_entropy_loss);
  m.impl("_vocab_parallel_linear_cross_entropy_forward", &vp_linear_cross_entropy_forward);
  m.impl("_vocab_parallel_linear_cross_entropy_backward", &vp_linear_cross_entropy_backward);
  m.impl("_vocab_parallel_head_statistics_forward", &vp_head_statistics_forward);
  m.impl("_vocab_parallel_head_statistics_backward", &vp_head_statistics_backward);
}

TORCH_LIBRARY_IMPL(trellis, Meta, m) {
  m.impl("linear_logsumexp", &linear_logsumexp_meta);
  m.impl("token_logprobs", &token_logprobs_meta);
  m.impl("linear_cross_entropy", &linear_cross_entropy_loss_meta);
  m.impl("_linear_cross_entropy_forward", &linear_cross_entropy_forward_meta);
  m.impl("_linear_cross_entropy_backward", &linear_cross_entropy_backward_meta);
  m.impl("_head_statistics_backward", &head_statistics_backward_meta);
  m.impl("vocab_parallel_linear_logsumexp", &vp_linear_logsumexp_meta);
  m.impl("vocab_parallel_token_logprobs", &vp_token_logprobs_meta);
  m.impl("vocab_parallel_linear_cross_entropy", &vp_linear_cross_entropy_loss_meta);
  m.impl("_vocab_parallel_linear_cross_entropy_forward", &vp_linear_cross_entropy_forward_meta);
  m.impl("_vocab_parallel_linear_cross_entropy_backward", &vp_linear_cross_entropy_backward_meta);
  m.impl("_vocab_parallel_head_statistics_forward", &vp_head_statistics_forward_meta);
  m.impl("_vocab_parallel_head_statistics_backward", &vp_head_statistics_backward_meta);
}

TORCH_LIBRARY_IMPL(trellis, Autograd, m) {
  m.impl("linear_logsumexp", &linear_logsumexp_autograd);
  m.impl("token_logprobs", &token_logprobs_autograd);
  m.impl("linear_cross_entropy", &linear_cross_entropy_autograd);
  m.impl("vocab_parallel_linear_logsumexp", &vp_linear_logsumexp_autograd);
  m.impl("vocab_parallel_token_logprobs", &vp_token_logprobs_autograd);
  m.impl("vocab_parallel_linear_cross_entropy", &vp_linear_cross_entropy_autograd);
}
