#include "trellis/head/linear_cross_entropy_parallel.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cmath>
#include <vector>

#include "lib/src/head/head_maths.h"
#include "lib/src/head/head_slice.h"
#include "lib/src/io/message.h"
#include "trellis/error.h"

namespace trellis {
namespace {

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

// Every rank's `local` tensor, stacked in rank order: [P, ...local's shape]. One all-gather.
at::Tensor all_gather(const Group& group, const at::Tensor& local) {
  const at::Tensor mine = local.contiguous();
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < group->getSize(); ++r) out[0].push_back(at::empty_like(mine));
  std::vector<at::Tensor> in{mine};
  group->allgather(out, in)->wait();
  return at::stack(out[0]);
}

// This rank's rows of the whole vocabulary.
struct Slice {
  Group group;
  int64_t offset = 0, size = 0, vocabulary = 0;
};

Slice resolve(const VocabularySlice& s, const at::Tensor& weight) {
  if (!s.group) throw Error("vocabulary-parallel head: no process group");
  if (weight.dim() != 2)
    throw Error(message::text("vocabulary-parallel head: weight must be [V_r, D], got ", weight.sizes()));
  Slice out{s.group, s.offset, weight.size(0), s.vocabulary};
  if ((s.offset < 0 || s.vocabulary <= 0) && s.group->getSize() == 1) {
    out.offset = 0;  // the only rank holds the whole vocabulary: nothing to gather (nor a device-to-host copy)
    out.vocabulary = weight.size(0);
  } else if (s.offset < 0 || s.vocabulary <= 0) {
    const at::Tensor sizes =
        all_gather(s.group, at::full({1}, weight.size(0), weight.options().dtype(at::kLong))).flatten().cpu();
    out.offset = sizes.narrow(0, 0, s.group->getRank()).sum().item<int64_t>();
    out.vocabulary = sizes.sum().item<int64_t>();
  }
  if (out.offset < 0 || out.offset + out.size > out.vocabulary)
    throw Error(message::text("vocabulary-parallel head: rank ", s.group->getRank(), "'s rows [", out.offset, ", ",
                              out.offset + out.size, ") lie outside the vocabulary of ", out.vocabulary));
  return out;
}

// Targets as columns of this rank's slice: -1 where the target is another rank's or ignored. With check, the whole
// vocabulary's range is checked (every rank sees the same targets; the backward's were checked by the forward).
at::Tensor local_targets(const at::Tensor& targets, const Slice& s, int64_t ignore_index, bool check = true) {
  const at::Tensor t = targets.reshape({-1}).to(at::kLong);
  const at::Tensor valid = t != ignore_index;
  const at::Tensor bad = valid & ((t < 0) | (t >= s.vocabulary));
  if (check && bad.any().item<bool>()) {
    const int64_t i = bad.nonzero()[0][0].item<int64_t>();
    throw Error(message::text("vocabulary-parallel head: targets[", i, "] = ", t[i].item<int64_t>(),
                              " is outside the vocabulary [0, ", s.vocabulary, ") and is not ignore_index (",
                              ignore_index, ")"));
  }
  const at::Tensor here = valid & (t >= s.offset) & (t < s.offset + s.size);
  return at::where(here, t - s.offset, -1);
}

// The whole vocabulary's statistics from every rank's slice statistics: log-sum-exps merge as (max, sum) pairs, target
// logits and logit sums add (each target is in one slice), and the expected logit Σ p·z is the slices' own, each
// weighted by its share of the probability e^(lse_r − lse).
HeadRowStats merge(const Group& group, const HeadRowStats& local, bool with_targets, bool want_sum,
                   bool want_expected) {
  if (group->getSize() == 1) return local;  // one slice: its statistics are the whole vocabulary's
  std::vector<at::Tensor> columns{local.lse};
  if (with_targets) columns.push_back(local.target_logit);
  if (want_sum) columns.push_back(local.logit_sum);
  if (want_expected) columns.push_back(local.expected_logit);
  const at::Tensor all = all_gather(group, at::stack(columns, 1));  // [P, N, columns]
  HeadRowStats out;
  const at::Tensor lse_r = all.select(2, 0);
  out.lse = at::logsumexp(lse_r, 0);
  int64_t c = 1;
  if (with_targets) out.target_logit = all.select(2, c++).sum(0);
  if (want_sum) out.logit_sum = all.select(2, c++).sum(0);
  if (want_expected) {
    // A rank whose slice gives a row no probability (lse_r = -inf) adds nothing.
    const at::Tensor share = (lse_r - out.lse.unsqueeze(0)).exp();
    out.expected_logit = at::where(share > 0, share * all.select(2, c), 0).sum(0);
  }
  return out;
}

// dx summed over the ranks in place (one all-reduce): each slice's gradient holds that slice's share of every row's.
void sum_over_ranks(const Group& group, const at::Tensor& dx) {
  if (group->getSize() == 1) return;
  std::vector<at::Tensor> tensors{dx};
  group->allreduce(tensors)->wait();
}

std::vector<int64_t> row_shape(const at::Tensor& x) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.pop_back();
  return shape;
}

// Options kept in an autograd context until backward.
template <class T>
struct Held : torch::CustomClassHolder {
  explicit Held(T v) : value(std::move(v)) {}
  T value;
};
template <class T>
void hold(torch::autograd::AutogradContext* ctx, const char* name, T value) {
  ctx->saved_data[name] = c10::IValue::make_capsule(c10::make_intrusive<Held<T>>(std::move(value)));
}
template <class T>
const T& held(torch::autograd::AutogradContext* ctx, const char* name) {
  return c10::static_intrusive_pointer_cast<Held<T>>(ctx->saved_data.at(name).toCapsule())->value;
}

struct ParallelCrossEntropy : torch::autograd::Function<ParallelCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& targets, const std::optional<at::Tensor>& bias, const HeadOptions* head,
                            const LossOptions* loss, const VocabularySlice* slice, bool grad_enabled) {
    HeadOptions h = *head;
    h.bias = bias ? *bias : at::Tensor();
    // Grad mode is off inside forward: the caller's mode says whether anyone will ask for gradients.
    const std::array<bool, 3> want = {grad_enabled && x.requires_grad(), grad_enabled && weight.requires_grad(),
                                      grad_enabled && bias && bias->requires_grad()};
    const LinearCrossEntropyForward f = linear_cross_entropy_forward(x, weight, targets, h, *loss, *slice, want);
    // A reduced loss's gradients come with the forward; an unreduced one's backward forms them from the inputs.
    if (f.lse.defined()) ctx->save_for_backward({x, weight, targets, h.bias, f.lse});
    else ctx->save_for_backward({f.dx, f.dweight, f.dbias});
    ctx->saved_data["bias"] = bias.has_value();
    hold(ctx, "head", *head);
    hold(ctx, "loss", *loss);
    hold(ctx, "slice", *slice);
    return f.loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto s = ctx->get_saved_variables();
    HeadOptions head = held<HeadOptions>(ctx, "head");
    LinearCrossEntropyForward f;
    at::Tensor x, weight, targets;
    if (s.size() == 5) x = s[0], weight = s[1], targets = s[2], head.bias = s[3], f.lse = s[4];
    else f.dx = s[0], f.dweight = s[1], f.dbias = s[2];
    const std::array<bool, 3> want = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                      ctx->saved_data.at("bias").toBool() && ctx->needs_input_grad(3)};
    auto g = linear_cross_entropy_backward(grad_out[0], x, weight, targets, head, held<LossOptions>(ctx, "loss"), f,
                                           held<VocabularySlice>(ctx, "slice"), want);
    return {g[0], g[1], at::Tensor(), g[2], at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// linear_logsumexp and token_logprobs with autograd: outputs (lse, log-probabilities, entropies), [N] each; an output
// not asked for is an empty tensor without gradient.
struct ParallelHeadStatistics : torch::autograd::Function<ParallelHeadStatistics> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& weight, const std::optional<at::Tensor>& targets,
                                                const std::optional<at::Tensor>& bias, const HeadOptions* head,
                                                bool with_entropy, const VocabularySlice* slice) {
    HeadOptions h = *head;
    h.bias = bias ? *bias : at::Tensor();
    const at::Tensor t = targets.value_or(at::Tensor());
    ParallelHeadRows rows = head_statistics_forward(x, weight, t, h, with_entropy, *slice);
    ctx->save_for_backward({x, weight, t, h.bias, rows.lse, rows.slice_share, rows.slice_expected_logit_excess});
    ctx->saved_data["bias"] = bias.has_value();
    hold(ctx, "head", *head);
    hold(ctx, "slice", *slice);
    ctx->set_materialize_grads(false);  // an output nobody used has no gradient: nothing to add for it
    const at::Tensor none = at::empty({0}, rows.lse.options());
    const at::Tensor logprobs = rows.logprobs.defined() ? rows.logprobs : none;
    const at::Tensor entropy = rows.entropy.defined() ? rows.entropy : none.clone();
    if (!rows.logprobs.defined()) ctx->mark_non_differentiable({logprobs});
    if (!rows.entropy.defined()) ctx->mark_non_differentiable({entropy});
    return {rows.lse, logprobs, entropy};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto s = ctx->get_saved_variables();
    HeadOptions head = held<HeadOptions>(ctx, "head");
    head.bias = s[3];
    ParallelHeadRows rows;
    rows.lse = s[4];
    rows.slice_share = s[5];
    rows.slice_expected_logit_excess = s[6];
    const at::Tensor& targets = s[2];
    // needs_input_grad counts the tensor arguments given: bias is the fourth after targets, else the third.
    const std::array<bool, 3> want = {
        ctx->needs_input_grad(0), ctx->needs_input_grad(1),
        ctx->saved_data.at("bias").toBool() && ctx->needs_input_grad(targets.defined() ? 3 : 2)};
    auto g = head_statistics_backward(s[0], s[1], targets, head, rows, grad_out[0],
                                      targets.defined() ? grad_out[1] : at::Tensor(),
                                      rows.slice_expected_logit_excess.defined() ? grad_out[2] : at::Tensor(),
                                      held<VocabularySlice>(ctx, "slice"), want);
    return {g[0], g[1], at::Tensor(), g[2], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

torch::autograd::variable_list parallel_head_statistics(const at::Tensor& x, const at::Tensor& weight,
                                                        const at::Tensor& targets, const HeadOptions& head,
                                                        bool with_entropy, const VocabularySlice& slice) {
  const auto given = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
  return ParallelHeadStatistics::apply(x, weight, given(targets), given(head.bias), &head, with_entropy, &slice);
}

}  // namespace

at::Tensor linear_logsumexp(const at::Tensor& x, const at::Tensor& weight, const HeadOptions& head,
                            const VocabularySlice& slice) {
  return parallel_head_statistics(x, weight, {}, head, false, slice)[0].view(row_shape(x));
}

TokenLogprobs token_logprobs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                             const HeadOptions& head, bool with_entropy, const VocabularySlice& slice) {
  if (!targets.defined()) throw Error("token_logprobs: targets are required");
  const auto rows = parallel_head_statistics(x, weight, targets, head, with_entropy, slice);
  TokenLogprobs out;
  out.logprobs = rows[1].view(row_shape(x));
  if (with_entropy) out.entropy = rows[2].view(row_shape(x));
  return out;
}

ParallelHeadRows head_statistics_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                         const HeadOptions& head, bool with_entropy, const VocabularySlice& vs) {
  c10::NoGradGuard no_grad;
  const Slice slice = resolve(vs, weight);
  const at::Tensor local = targets.defined() ? local_targets(targets, slice, head.ignore_index) : at::Tensor();
  const HeadRowStats mine = head_slice::statistics(x, weight, local, head, false, with_entropy);
  const HeadRowStats whole = merge(slice.group, mine, targets.defined(), false, with_entropy);
  ParallelHeadRows rows;
  rows.lse = whole.lse;
  if (targets.defined())
    rows.logprobs = (whole.target_logit - whole.lse) * (targets.reshape({-1}) != head.ignore_index);
  if (with_entropy) rows.entropy = head_maths::entropy(whole.lse, whole.expected_logit);
  rows.slice_share = (mine.lse - whole.lse).exp();
  if (with_entropy) rows.slice_expected_logit_excess = mine.expected_logit - whole.expected_logit;
  return rows;
}

// With p = share·q on the slice (q its own softmax) and H − H_slice + lse_slice − lse = Σ q·z − Σ p·z (the excess),
// the whole vocabulary's per-logit gradients a·p + b·([v = t] − p) − c·p·(log p + H) are the single-device ones of the
// slice with a' = share·(a − b − c·excess) + b·[t in the slice], b' = b and c' = c·share: the slice's head computes
// them, and only dx, a sum over the slices, needs the other ranks.
std::array<at::Tensor, 3> head_statistics_backward(const at::Tensor& x, const at::Tensor& weight,
                                                   const at::Tensor& targets, const HeadOptions& head,
                                                   const ParallelHeadRows& forward, const at::Tensor& grad_lse,
                                                   const at::Tensor& grad_logprob, const at::Tensor& grad_entropy,
                                                   const VocabularySlice& vs, std::array<bool, 3> want) {
  c10::NoGradGuard no_grad;
  if (grad_logprob.defined() && !targets.defined())
    throw Error("vocabulary-parallel head_statistics_backward: the log-probabilities' gradient needs the targets");
  if (grad_entropy.defined() && !forward.slice_expected_logit_excess.defined())
    throw Error("vocabulary-parallel head_statistics_backward: an entropy gradient for a forward without entropies");
  const Slice slice = resolve(vs, weight);
  // One rank holds the whole vocabulary (share 1, excess 0): the single-device backward.
  if (slice.group->getSize() == 1)
    return trellis::head_statistics_backward(x, weight, targets, head, grad_lse, grad_logprob, grad_entropy, want);
  const at::Tensor share = forward.slice_share.reshape({-1});
  const auto rows = [&](const at::Tensor& g, const char* name) {
    if (g.numel() != share.numel())
      throw Error(message::text("vocabulary-parallel head_statistics_backward: ", name, " has ", g.numel(),
                                " entries for ", share.numel(), " rows"));
    return g.reshape({-1}).to(share.scalar_type());
  };
  at::Tensor local;
  if (targets.defined()) local = local_targets(targets, slice, head.ignore_index, /*check=*/false);
  if (grad_logprob.defined() && !grad_lse.defined() && !grad_entropy.defined()) {
    // log p(t) = −(the unreduced loss), whose slice backward takes the whole vocabulary's lse (fused kernels and
    // recompute_logits apply).
    LossOptions unreduced;
    unreduced.reduction = Reduction::none;
    const at::Tensor g = -rows(grad_logprob, "grad_logprob") * (targets.reshape({-1}) != head.ignore_index);
    auto grads =
        head_slice::gradients(x, weight, local, head, unreduced, forward.lse.reshape({-1}), g, slice.vocabulary, want);
    if (want[0]) sum_over_ranks(slice.group, grads[0]);
    return grads;
  }
  at::Tensor p_weight = grad_lse.defined() ? rows(grad_lse, "grad_lse") : at::zeros_like(share);
  at::Tensor logprob_grad, entropy_grad;
  if (grad_logprob.defined()) {
    logprob_grad = rows(grad_logprob, "grad_logprob") * (targets.reshape({-1}) != head.ignore_index);
    p_weight = p_weight - logprob_grad;
  }
  if (grad_entropy.defined()) {
    const at::Tensor c = rows(grad_entropy, "grad_entropy");
    p_weight = p_weight - c * forward.slice_expected_logit_excess.reshape({-1});
    entropy_grad = c * share;
  }
  at::Tensor lse_grad = share * p_weight;
  if (logprob_grad.defined()) lse_grad = lse_grad + logprob_grad * (local >= 0);
  HeadOptions local_head = head;
  local_head.ignore_index = -1;  // local targets: -1 where the target is another slice's or ignored
  auto grads =
      trellis::head_statistics_backward(x, weight, local, local_head, lse_grad, logprob_grad, entropy_grad, want);
  if (want[0]) sum_over_ranks(slice.group, grads[0]);
  return grads;
}

LinearCrossEntropyForward linear_cross_entropy_forward(const at::Tensor& x, const at::Tensor& weight,
                                                       const at::Tensor& targets, const HeadOptions& head,
                                                       const LossOptions& loss, const VocabularySlice& vs,
                                                       std::array<bool, 3> want) {
  if (!targets.defined()) throw Error("linear_cross_entropy: targets are required");
  if (!(loss.label_smoothing >= 0 && loss.label_smoothing <= 1))
    throw Error(message::text("linear_cross_entropy: label_smoothing must be in [0, 1], got ", loss.label_smoothing));
  if (!(loss.z_loss >= 0)) throw Error(message::text("linear_cross_entropy: z_loss must be >= 0, got ", loss.z_loss));
  c10::NoGradGuard no_grad;
  const bool smoothing = loss.label_smoothing != 0;
  const at::Tensor valid = targets.reshape({-1}) != head.ignore_index;
  want[2] = want[2] && head.bias.defined();
  const bool formed = loss.reduction != Reduction::none && !head.recompute_logits && (want[0] || want[1] || want[2]);
  const Slice slice = resolve(vs, weight);
  // One rank holds the whole vocabulary: the single-device head, asked for the gradients where this function forms
  // them. In training its CUDA kernel forms each slab's log-sum-exp with the slab's gradient from one read of the slab,
  // where a slice's log-sum-exp is read first, to be merged across the ranks before the gradient.
  if (slice.group->getSize() == 1)
    return trellis::linear_cross_entropy_forward(x, weight, targets, head, loss,
                                                 formed ? want : std::array<bool, 3>{false, false, false});
  LinearCrossEntropyForward f;
  HeadRowStats stats;
  if (formed) {
    // A reduced loss's row weights are known now (1, or 1/count), so its gradients form in the same pass as the
    // statistics, each slab's statistics merged across the ranks before its gradient: the logits are formed once.
    const at::Tensor w = valid.to(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
    const at::Tensor g = loss.reduction == Reduction::mean ? w / valid.sum().clamp_min(1) : w;
    const head_slice::Merge exchange = [&](const HeadRowStats& local) {
      return merge(slice.group, local, true, smoothing, false);
    };
    auto d = head_slice::gradients_in_one_pass(x, weight, local_targets(targets, slice, head.ignore_index), head, loss,
                                               g, slice.vocabulary, want, exchange, stats);
    if (want[0]) sum_over_ranks(slice.group, d[0]);
    f.dx = d[0], f.dweight = d[1], f.dbias = d[2];
  } else {
    const HeadRowStats mine =
        head_slice::statistics(x, weight, local_targets(targets, slice, head.ignore_index), head, smoothing, false);
    stats = merge(slice.group, mine, true, smoothing, false);
    f.lse = stats.lse;
  }
  // The single-device loss, from the whole vocabulary's statistics.
  const auto terms = head_maths::loss_terms<double>(loss.label_smoothing, loss.z_loss, slice.vocabulary);
  const at::Tensor rows = head_maths::row_loss(stats.lse, stats.target_logit, stats.logit_sum, terms) * valid;
  if (loss.reduction == Reduction::none) f.loss = rows.view(row_shape(x));
  else if (loss.reduction == Reduction::sum) f.loss = rows.sum();
  else f.loss = rows.sum() / valid.sum();  // NaN when every target is ignored, as on one device
  return f;
}

std::array<at::Tensor, 3> linear_cross_entropy_backward(const at::Tensor& grad, const at::Tensor& x,
                                                        const at::Tensor& weight, const at::Tensor& targets,
                                                        const HeadOptions& head, const LossOptions& loss,
                                                        const LinearCrossEntropyForward& forward,
                                                        const VocabularySlice& vs, std::array<bool, 3> want) {
  c10::NoGradGuard no_grad;
  if (!forward.lse.defined()) {
    // The forward formed the gradients (a reduced loss): scaled by the incoming gradient, as on one device.
    LinearCrossEntropyForward formed = forward;
    return trellis::linear_cross_entropy_backward(grad, {}, {}, {}, {}, loss, formed, want);
  }
  const Slice slice = resolve(vs, weight);
  const at::Tensor t = targets.reshape({-1}).to(at::kLong);
  const at::Tensor valid = (t != head.ignore_index).to(forward.lse.scalar_type());
  // Each counted row's weight in the loss, times the incoming gradient.
  const at::Tensor g = grad.reshape({-1}).to(forward.lse.scalar_type()) *
                       (loss.reduction == Reduction::mean ? valid / valid.sum().clamp_min(1) : valid);
  want[2] = want[2] && head.bias.defined();
  auto grads = head_slice::gradients(x, weight, local_targets(t, slice, head.ignore_index, /*check=*/false), head, loss,
                                     forward.lse, g, slice.vocabulary, want);
  if (want[0]) sum_over_ranks(slice.group, grads[0]);
  return grads;
}

at::Tensor linear_cross_entropy(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                const HeadOptions& head, const LossOptions& loss, const VocabularySlice& slice) {
  if (!targets.defined()) throw Error("linear_cross_entropy: targets are required");
  const std::optional<at::Tensor> bias = head.bias.defined() ? std::optional<at::Tensor>(head.bias) : std::nullopt;
  return ParallelCrossEntropy::apply(x, weight, targets, bias, &head, &loss, &slice, c10::GradMode::is_enabled());
}

}  // namespace trellis
