// The LLM head's public entry points: each checks its inputs (head_problem.cpp), asks head_routes.cpp which route
// computes the rows' statistics or the loss's gradients, and runs it: the fused Hopper kernel (head_fused.cpp), row
// slabs (head_row_slabs.cpp) or vocabulary chunks (head_column_chunks.cpp). The per-row and per-logit formulas are
// head_maths.h's, shared with the CUDA kernels.
#include "trellis/head/linear_cross_entropy.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <optional>

#include "lib/src/head/head_maths.h"
#include "lib/src/head/head_routes.h"
#include "lib/src/head/head_slice.h"
#include "lib/src/io/message.h"
#include "trellis/error.h"

namespace trellis {

Reduction parse_reduction(const std::string& name) {
  if (name == "none") return Reduction::none;
  if (name == "sum") return Reduction::sum;
  if (name == "mean") return Reduction::mean;
  throw Error("linear head: reduction '" + name + "' is not one of none, sum, mean");
}

namespace {

using namespace head_detail;

// Per-row results without gradients: lse, and optionally the per-row loss, target log-prob and entropy.
struct RowResults {
  at::Tensor lse, loss, logprob, entropy;
};

// Every row's statistics (lse, target logit, and Σ z and Σ p·z when wanted) by the route chosen for them.
SlabStats all_row_stats(const Head& h, bool want_sum, bool want_expected) {
  switch (choose_route(HeadQuantity::kStatistics, h, want_expected)) {
    case HeadRoute::kFusedStatistics: return fused_row_stats(h, want_sum || want_expected);
    case HeadRoute::kColumnChunks: return chunked_stats(h, want_sum);
    default: return slab_row_stats(h, want_sum, want_expected);
  }
}

// Gradients of Σ_i g_i·loss_i by the route chosen for them (lse: every row's, or undefined for the training slabs to
// form; loss: receives the per-row loss where the training slabs form it).
Gradients loss_gradients(const Head& h, HeadRoute route, const at::Tensor& g, const at::Tensor& lse,
                         const LossOptions& o, std::array<bool, 3> want, at::Tensor* loss = nullptr) {
  if (route == HeadRoute::kTrainingSlabs) return slab_gradients(h, g, lse, o, want, loss);
  if (route == HeadRoute::kInputTypeSlabs) return input_type_slab_gradients(h, g, lse, o, want, loss);
  return recomputed_gradients(h, g, lse, o, want, route == HeadRoute::kRecomputedFused);
}

RowResults head_rows(const Head& h, const LossOptions* loss, bool want_logprob, bool want_entropy) {
  c10::NoGradGuard no_grad;
  const SlabStats s = all_row_stats(h, loss && loss->label_smoothing != 0, want_entropy);
  RowResults r;
  r.lse = s.lse;
  if (loss || want_logprob) {
    const at::Tensor valid = valid_targets(h.targets, h.ignore_index);
    if (loss) r.loss = row_loss(h, s, valid, *loss);
    if (want_logprob) r.logprob = (s.target_logit - s.lse) * valid;
  }
  if (want_entropy) r.entropy = head_maths::entropy(s.lse, s.expected_logit);
  return r;
}

at::Tensor reduce(const at::Tensor& rows, const at::Tensor& valid, Reduction r) {
  if (r == Reduction::none) return rows;
  if (r == Reduction::sum) return rows.sum();
  return rows.sum() / valid.sum();  // NaN when every target is ignored, as in PyTorch
}

// The row weights g_i of a reduced loss: 1 (sum) or 1/count (mean) for counted rows, 0 for ignored ones.
at::Tensor row_weights(const at::Tensor& valid, Reduction r, at::ScalarType acc) {
  // With every target ignored the mean loss is NaN, but the gradients are zero (as in PyTorch), not NaN.
  const at::Tensor w = valid.to(acc);
  return r == Reduction::mean ? w / valid.sum().clamp_min(1) : w;
}

// The C++ API's autograd: the two halves below, with the options in the context.
struct LinearCrossEntropyFunction : torch::autograd::Function<LinearCrossEntropyFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& targets, const std::optional<at::Tensor>& bias, const HeadOptions* head,
                            const LossOptions* loss, bool grad_enabled) {
    HeadOptions ho = *head;
    ho.bias = bias ? *bias : at::Tensor();
    // Grad mode is off inside forward: the caller's mode says whether anyone will ask for gradients.
    const std::array<bool, 3> want = {grad_enabled && x.requires_grad(), grad_enabled && weight.requires_grad(),
                                      grad_enabled && bias && bias->requires_grad()};
    LinearCrossEntropyForward f = linear_cross_entropy_forward(x, weight, targets, ho, *loss, want);
    // The unreduced loss's backward forms the gradients from the inputs; a reduced one's come with the forward.
    if (loss->reduction == Reduction::none) ctx->save_for_backward({x, weight, targets, ho.bias, f.lse});
    else ctx->save_for_backward({f.dx, f.dweight, f.dbias});
    ctx->saved_data["bias"] = bias.has_value();
    ctx->saved_data["reduction"] = static_cast<int64_t>(loss->reduction);
    ctx->saved_data["label_smoothing"] = loss->label_smoothing;
    ctx->saved_data["z_loss"] = loss->z_loss;
    ctx->saved_data["softcap"] = head->softcap ? *head->softcap : 0.0;
    ctx->saved_data["ignore_index"] = head->ignore_index;
    ctx->saved_data["chunk_bytes"] = head->chunk_bytes;
    ctx->saved_data["recompute_logits"] = head->recompute_logits;
    ctx->saved_data["memory_budget"] = head->memory_budget;
    return f.loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    HeadOptions ho;
    const double cap = ctx->saved_data["softcap"].toDouble();
    if (cap > 0) ho.softcap = cap;
    ho.ignore_index = ctx->saved_data["ignore_index"].toInt();
    ho.chunk_bytes = ctx->saved_data["chunk_bytes"].toInt();
    ho.recompute_logits = ctx->saved_data["recompute_logits"].toBool();
    ho.memory_budget = ctx->saved_data["memory_budget"].toInt();
    LossOptions lo;
    lo.reduction = static_cast<Reduction>(ctx->saved_data["reduction"].toInt());
    lo.label_smoothing = ctx->saved_data["label_smoothing"].toDouble();
    lo.z_loss = ctx->saved_data["z_loss"].toDouble();
    const bool unreduced = lo.reduction == Reduction::none;
    LinearCrossEntropyForward f;
    at::Tensor x, weight, targets;
    if (unreduced) x = saved[0], weight = saved[1], targets = saved[2], ho.bias = saved[3], f.lse = saved[4];
    else f.dx = saved[0], f.dweight = saved[1], f.dbias = saved[2];
    const std::array<bool, 3> want = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                      ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(3)};
    auto d = linear_cross_entropy_backward(grad_out[0], x, weight, targets, ho, lo, f, want);
    return {d[0], d[1], at::Tensor(), d[2], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor linear_logsumexp(const at::Tensor& x, const at::Tensor& weight, const HeadOptions& head) {
  const Head h = prepare(x, weight, {}, head);
  return head_rows(h, nullptr, false, false).lse.view(h.row_shape);
}

TokenLogprobs token_logprobs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                             const HeadOptions& head, bool with_entropy) {
  if (!targets.defined()) throw Error("token_logprobs: targets are required");
  const Head h = prepare(x, weight, targets, head);
  RowResults r = head_rows(h, nullptr, true, with_entropy);
  return {r.logprob.view(h.row_shape), with_entropy ? r.entropy.view(h.row_shape) : at::Tensor()};
}

LinearCrossEntropyForward linear_cross_entropy_forward(const at::Tensor& x, const at::Tensor& weight,
                                                       const at::Tensor& targets, const HeadOptions& head,
                                                       const LossOptions& loss, std::array<bool, 3> want) {
  if (!targets.defined()) throw Error("linear_cross_entropy: targets are required");
  if (!(loss.label_smoothing >= 0 && loss.label_smoothing <= 1))
    throw Error(message::text("linear_cross_entropy: label_smoothing must be in [0, 1], got ", loss.label_smoothing));
  if (!(loss.z_loss >= 0)) throw Error(message::text("linear_cross_entropy: z_loss must be >= 0, got ", loss.z_loss));
  c10::NoGradGuard no_grad;
  const Head h = prepare(x, weight, targets, head);
  want[2] = want[2] && h.bias.defined();
  const at::Tensor valid = valid_targets(h.targets, h.ignore_index);
  LinearCrossEntropyForward out;
  if (loss.reduction != Reduction::none && (want[0] || want[1] || want[2])) {
    // Reduced loss: form the gradients now, from the same logits; backward scales them by the incoming gradient.
    const at::Tensor weights = row_weights(valid, loss.reduction, h.acc);
    const HeadRoute route = choose_route(HeadQuantity::kGradients, h);
    at::Tensor rows;
    Gradients g;
    if (route == HeadRoute::kTrainingSlabs || route == HeadRoute::kInputTypeSlabs) {
      // The slabs form each row's statistics and loss with its gradients.
      rows = at::empty({h.rows()}, h.x.options().dtype(h.acc));
      g = loss_gradients(h, route, weights, {}, loss, want, &rows);
    } else {
      RowResults r = head_rows(h, &loss, false, false);
      rows = r.loss;
      g = loss_gradients(h, route, weights, r.lse, loss, want);
    }
    out.loss = reduce(rows, valid, loss.reduction);
    out.dx = g.x.defined() ? g.x.view(x.sizes()) : g.x;
    out.dweight = g.weight;
    out.dbias = g.bias;
    return out;
  }
  RowResults r = head_rows(h, &loss, false, false);
  out.lse = r.lse;
  out.loss = reduce(r.loss, valid, loss.reduction)
                 .view(loss.reduction == Reduction::none ? h.row_shape : std::vector<int64_t>{});
  return out;
}

std::array<at::Tensor, 3> linear_cross_entropy_backward(const at::Tensor& grad, const at::Tensor& x,
                                                        const at::Tensor& weight, const at::Tensor& targets,
                                                        const HeadOptions& head, const LossOptions& loss,
                                                        const LinearCrossEntropyForward& forward,
                                                        std::array<bool, 3> want) {
  c10::NoGradGuard no_grad;
  if (loss.reduction != Reduction::none) {
    // loss.backward() passes 1: hand the gradients over as they are, without a scaled copy. A tensor that
    // torch.compile traces (fake or functional: the Python or Functionalize key) has no value to look at; it scales.
    const bool traced =
        grad.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
    const bool one = !traced && grad.item<double>() == 1;
    auto scale = [&](const at::Tensor& t, bool wanted) {
      return !wanted || !t.defined() ? at::Tensor() : one ? t : t * grad.to(t.scalar_type());
    };
    return {scale(forward.dx, want[0]), scale(forward.dweight, want[1]), scale(forward.dbias, want[2])};
  }
  const Head h = prepare(x, weight, targets, head, /*check_targets=*/false);
  want[2] = want[2] && h.bias.defined();
  const at::Tensor g = grad.reshape({-1}).to(h.acc) * valid_targets(h.targets, h.ignore_index);
  Gradients d = loss_gradients(h, choose_route(HeadQuantity::kGradients, h), g, forward.lse, loss, want);
  return {d.x.defined() ? d.x.view(x.sizes()) : d.x, d.weight, d.bias};
}

std::array<at::Tensor, 3> head_statistics_backward(const at::Tensor& x, const at::Tensor& weight,
                                                   const at::Tensor& targets, const HeadOptions& head,
                                                   const at::Tensor& grad_lse, const at::Tensor& grad_logprob,
                                                   const at::Tensor& grad_entropy, std::array<bool, 3> want) {
  c10::NoGradGuard no_grad;
  if ((grad_logprob.defined() || grad_entropy.defined()) && !targets.defined())
    throw Error("head_statistics_backward: the log-probabilities' gradients need the targets");
  const Head h = prepare(x, weight, targets, head, /*check_targets=*/false);
  want[2] = want[2] && h.bias.defined();
  const auto rows = [&](const at::Tensor& g, const char* name) {
    if (!g.defined()) return g;
    if (g.numel() != h.rows())
      throw Error(
          message::text("head_statistics_backward: ", name, " has ", g.numel(), " entries for ", h.rows(), " rows"));
    return g.reshape({-1}).to(h.acc);
  };
  if (!grad_lse.defined() && !grad_entropy.defined() && grad_logprob.defined()) {
    // log p(t) = -(the unreduced loss): its backward, whose fused kernels and recompute_logits apply.
    LinearCrossEntropyForward f;
    LossOptions none;
    none.reduction = Reduction::none;
    return linear_cross_entropy_backward(-grad_logprob, x, weight, targets, head, none, f, want);
  }
  Gradients d = statistics_gradients(h, rows(grad_lse, "grad_lse"), rows(grad_logprob, "grad_logprob"),
                                     rows(grad_entropy, "grad_entropy"), want);
  return {d.x.defined() ? d.x.view(x.sizes()) : d.x, d.weight, d.bias};
}

namespace head_slice {

namespace {
HeadOptions slice_options(const HeadOptions& head) {
  HeadOptions o = head;
  o.ignore_index = -1;  // local targets: -1 where the target is not in the slice
  return o;
}
}  // namespace

HeadRowStats statistics(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& local_targets,
                        const HeadOptions& head, bool want_sum, bool want_expected) {
  c10::NoGradGuard no_grad;
  return all_row_stats(prepare(x, weight, local_targets, slice_options(head), /*check_targets=*/false), want_sum,
                       want_expected);
}

std::array<at::Tensor, 3> gradients(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& local_targets,
                                    const HeadOptions& head, const LossOptions& loss, const at::Tensor& lse,
                                    const at::Tensor& g, int64_t total_vocabulary, std::array<bool, 3> want) {
  c10::NoGradGuard no_grad;
  Head h = prepare(x, weight, local_targets, slice_options(head), /*check_targets=*/false);
  h.total_vocabulary = total_vocabulary;
  want[2] = want[2] && h.bias.defined();
  Gradients d = loss_gradients(h, choose_route(HeadQuantity::kGradients, h), g, lse, loss, want);
  return {d.x.defined() ? d.x.view(x.sizes()) : d.x, d.weight, d.bias};
}

std::array<at::Tensor, 3> gradients_in_one_pass(const at::Tensor& x, const at::Tensor& weight,
                                                const at::Tensor& local_targets, const HeadOptions& head,
                                                const LossOptions& loss, const at::Tensor& g, int64_t total_vocabulary,
                                                std::array<bool, 3> want, const Merge& merge, HeadRowStats& merged) {
  c10::NoGradGuard no_grad;
  Head h = prepare(x, weight, local_targets, slice_options(head), /*check_targets=*/false);
  h.total_vocabulary = total_vocabulary;
  want[2] = want[2] && h.bias.defined();
  Gradients d = slab_gradients(h, g, {}, loss, want, nullptr, &merge, &merged);
  if (h.rows() == 0) merged = all_row_stats(h, loss.label_smoothing != 0, false);
  return {d.x.defined() ? d.x.view(x.sizes()) : d.x, d.weight, d.bias};
}

}  // namespace head_slice

at::Tensor linear_cross_entropy(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                const HeadOptions& head, const LossOptions& loss) {
  const std::optional<at::Tensor> bias = head.bias.defined() ? std::optional<at::Tensor>(head.bias) : std::nullopt;
  return LinearCrossEntropyFunction::apply(x, weight, targets, bias, &head, &loss, c10::GradMode::is_enabled());
}

}  // namespace trellis
