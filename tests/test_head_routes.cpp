// Every route of the LLM head (lib/src/head/head_routes.h), forced, against a float64 reference that materialises the
// logits, on each device and dtype: the statistics routes through token_logprobs (with the entropy), linear_logsumexp
// and the loss without gradients; the gradient routes through the loss and its gradients, reduced (the forward forms
// them) and unreduced (the backward does). A forced route that does not apply is an Error naming it.
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <array>
#include <cctype>
#include <string>

#include "lib/src/head/head_routes.h"
#include "test_util.h"
#include "trellis/error.h"
#include "trellis/head/linear_cross_entropy.h"

namespace trellis::testing {
namespace {

using head_detail::HeadQuantity;
using head_detail::HeadRoute;

struct RouteCase {
  HeadRoute route;
  bool cuda;
  at::ScalarType dtype;
};

std::string case_name(const ::testing::TestParamInfo<RouteCase>& info) {
  std::string name = std::string(head_detail::route_name(info.param.route)) + (info.param.cuda ? "_cuda_" : "_cpu_") +
                     c10::toString(info.param.dtype);
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return name;
}

class HeadRoutes : public ::testing::TestWithParam<RouteCase> {};

// N rows, D = 16 (the fused kernel takes D % 8 == 0), V columns; a bias, a soft-cap and some ignored targets.
struct Problem {
  at::Tensor x, w, b, t;  // on the case's device and dtype
  at::Tensor z;           // the float64 reference logits
  HeadOptions head;
};

Problem make_problem(const RouteCase& c) {
  const int64_t N = 37, D = 16, V = 131;
  const auto o = at::TensorOptions().dtype(c.dtype).device(c.cuda ? at::kCUDA : at::kCPU);
  Problem p;
  p.x = at::randn({N, D}, at::kDouble).to(o);
  p.w = (at::randn({V, D}, at::kDouble) * 0.5).to(o);
  p.b = at::randn({V}, at::kDouble).to(o);
  p.t = at::randint(0, V, {N}, at::kLong);
  p.t.index_put_({at::arange(0, N, 3, at::kLong)}, -100);
  p.t = p.t.to(o.device());
  p.z =
      at::tanh((at::mm(p.x.cpu().to(at::kDouble), p.w.cpu().to(at::kDouble).t()) + p.b.cpu().to(at::kDouble)) / 4) * 4;
  p.head.bias = p.b;
  p.head.softcap = 4.0;
  p.head.chunk_bytes = V * 4 * 5;  // several slabs of rows, and several chunks of columns
  return p;
}

double tolerance(at::ScalarType t) { return t == at::kDouble ? 1e-10 : t == at::kFloat ? 2e-5 : 1e-4; }
double grad_tolerance(at::ScalarType t) { return t == at::kDouble ? 1e-10 : t == at::kFloat ? 2e-5 : 2e-2; }

// The loss on the reference logits, each row's or their mean over the counted rows.
at::Tensor reference_loss(const at::Tensor& z, const at::Tensor& t, const LossOptions& lo) {
  const at::Tensor valid = t != -100, logp = at::log_softmax(z, 1), lse = at::logsumexp(z, 1);
  const at::Tensor target_logp = logp.gather(1, at::where(valid, t, 0).unsqueeze(1)).squeeze(1);
  const at::Tensor rows =
      (-(1 - lo.label_smoothing) * target_logp - lo.label_smoothing * logp.mean(1) + lo.z_loss * lse * lse) * valid;
  return lo.reduction == Reduction::none ? rows : rows.sum() / valid.sum();
}

void check_statistics(const Problem& p, const RouteCase& c, bool entropy_applies) {
  const double tol = tolerance(c.dtype);
  const at::Tensor t = p.t.cpu(), valid = t != -100, logp = at::log_softmax(p.z, 1);
  const at::Tensor target_logp = logp.gather(1, at::where(valid, t, 0).unsqueeze(1)).squeeze(1) * valid;
  if (entropy_applies) {
    const TokenLogprobs r = token_logprobs(p.x, p.w, p.t, p.head, true);
    expect_close(r.logprobs, target_logp, tol, tol);
    expect_close(r.entropy, -(logp.exp() * logp).sum(1), tol, tol);
  } else {
    EXPECT_THROW(token_logprobs(p.x, p.w, p.t, p.head, true), Error);
  }
  expect_close(token_logprobs(p.x, p.w, p.t, p.head).logprobs, target_logp, tol, tol);
  expect_close(linear_logsumexp(p.x, p.w, p.head), at::logsumexp(p.z, 1), tol, tol);
  c10::NoGradGuard no_grad;
  const LossOptions lo{Reduction::mean, 0.1, 1e-3};
  expect_close(linear_cross_entropy(p.x, p.w, p.t, p.head, lo), reference_loss(p.z, t, lo), tol, tol);
}

// The two halves that the autograd function calls, called here on this thread (autograd runs a CUDA backward on a
// thread of its own, where the forced route would not hold).
std::array<at::Tensor, 3> loss_gradients(const Problem& p, const LossOptions& lo, const at::Tensor& upstream,
                                         at::Tensor& loss) {
  const LinearCrossEntropyForward f = linear_cross_entropy_forward(p.x, p.w, p.t, p.head, lo, {true, true, true});
  loss = f.loss;
  return linear_cross_entropy_backward(upstream.to(f.loss.dtype()).to(f.loss.device()), p.x, p.w, p.t, p.head, lo, f,
                                       {true, true, true});
}

// Label smoothing or none: the training slabs leave the soft-cap to the gradient (on CUDA the kernels, as they read
// each logit) only without it, whose Σ z needs capped logits first.
void check_gradients(const Problem& p, const RouteCase& c) {
  for (const Reduction reduction : {Reduction::mean, Reduction::none})
    for (const double label_smoothing : {0.1, 0.0}) {
      SCOPED_TRACE(c10::str(reduction == Reduction::mean ? "mean" : "none", " label_smoothing=", label_smoothing));
      const LossOptions lo{reduction, label_smoothing, 1e-3};
      std::array<at::Tensor, 3> ref;  // copies (a float64 CPU input's .to would return the input itself)
      const std::array<const at::Tensor*, 3> inputs = {&p.x, &p.w, &p.b};
      for (int k = 0; k < 3; ++k) ref[k] = inputs[k]->cpu().to(at::kDouble).clone().requires_grad_();
      const at::Tensor z = at::tanh((at::mm(ref[0], ref[1].t()) + ref[2]) / 4) * 4;
      const at::Tensor expected = reference_loss(z, p.t.cpu(), lo);
      const at::Tensor upstream = at::rand(expected.sizes(), at::kDouble) + 0.5;
      at::Tensor loss;
      const std::array<at::Tensor, 3> grads = loss_gradients(p, lo, upstream, loss);
      expect_close(loss, expected, tolerance(c.dtype), tolerance(c.dtype));
      expected.backward(upstream);
      for (int k = 0; k < 3; ++k) {
        const double gt = grad_tolerance(c.dtype), scale = ref[k].grad().abs().max().item<double>();
        expect_close(grads[k], ref[k].grad(), gt, gt * scale);
      }
    }
}

TEST_P(HeadRoutes, MatchesTheMaterialisedReference) {
  const RouteCase c = GetParam();
  if (c.cuda) TRELLIS_REQUIRE_CUDA();
  at::manual_seed(11);
  const Problem p = make_problem(c);
  const head_detail::ForcedHeadRoute forced(c.route);
  const head_detail::Head h = head_detail::prepare(p.x, p.w, p.t, p.head);
  const bool statistics = head_detail::quantity_of(c.route) == HeadQuantity::kStatistics;
  if (!head_detail::route_applies(c.route, h)) {
    // Forced anyway: an Error, not a silent fallback to another route.
    at::Tensor loss;
    const LossOptions lo{Reduction::none, 0, 0};
    if (statistics) EXPECT_THROW(linear_logsumexp(p.x, p.w, p.head), Error);
    else EXPECT_THROW(loss_gradients(p, lo, at::ones({p.x.size(0)}, at::kDouble), loss), Error);
    GTEST_SKIP() << head_detail::route_name(c.route) << " does not apply here";
  }
  if (statistics) check_statistics(p, c, head_detail::route_applies(c.route, h, /*want_expected=*/true));
  else check_gradients(p, c);
}

// The training slabs in x's type over several 256-column tiles (each with its own reference; the last one short) and
// several slabs of rows, with logits spread wide enough that the tiles' references differ by several units: the loss
// as the float64 reference's (its statistics are float32), and the gradients within bfloat16's tolerance of it and of
// the float32 slabs' (the exponential and dL/dz are each rounded once to bfloat16). On the GPU this is the fused
// kernel's exponentials mode and its pass; on the CPU their reference steps. bfloat16, and float16 without a soft-cap.
TEST(InputTypeSlabs, SeveralTilesMatchTheReferenceAndTheFloat32Slabs) {
  at::manual_seed(12);
  const int64_t N = 70, D = 32, V = 776;  // rows of whole 16-byte vectors; four tiles, the last of 8 columns
  for (const bool cuda : {false, true})
    for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
      if (cuda && !at::hasCUDA()) break;  // the CPU's steps alone
      const auto o = at::TensorOptions().dtype(dtype).device(cuda ? at::kCUDA : at::kCPU);
      const at::Tensor x = (at::randn({N, D}, at::kDouble) * 2).to(o), w = (at::randn({V, D}, at::kDouble) * 0.5).to(o);
      at::Tensor t = at::randint(0, V, {N}, at::kLong);
      t.index_put_({at::arange(0, N, 5, at::kLong)}, -100);
      t = t.to(o.device());
      for (const std::optional<double> cap : {std::optional<double>(), std::optional<double>(30.0)}) {
        if (cap && dtype == at::kHalf) continue;  // not a route of float16 (input_type_slabs_apply)
        SCOPED_TRACE(c10::str(cuda ? "cuda " : "cpu ", dtype, cap ? " softcap 30" : ""));
        HeadOptions head;
        head.softcap = cap;
        head.chunk_bytes = 16 * (V * 2 + 4 * 4);  // 16 rows of the slab in x's type: five slabs
        const LossOptions lo{Reduction::mean, cap ? 0.1 : 0.0, 1e-3};
        std::array<at::Tensor, 3> ref;
        ref[0] = x.cpu().to(at::kDouble).requires_grad_();
        ref[1] = w.cpu().to(at::kDouble).requires_grad_();
        at::Tensor z = at::mm(ref[0], ref[1].t());
        if (cap) z = at::tanh(z / *cap) * *cap;
        const at::Tensor expected = reference_loss(z, t.cpu(), lo);
        expected.backward();
        const auto run = [&](HeadRoute route) {
          const head_detail::ForcedHeadRoute forced(route);
          const LinearCrossEntropyForward f = linear_cross_entropy_forward(x, w, t, head, lo, {true, true, false});
          return std::array<at::Tensor, 3>{f.loss, f.dx, f.dweight};
        };
        const std::array<at::Tensor, 3> half = run(HeadRoute::kInputTypeSlabs), full = run(HeadRoute::kTrainingSlabs);
        expect_close(half[0], expected, 1e-4, 1e-4);
        for (int k = 1; k < 3; ++k) {
          const double scale = ref[k - 1].grad().abs().max().item<double>();
          expect_close(half[k], ref[k - 1].grad(), 2e-2, 2e-2 * scale);
          expect_close(half[k].to(at::kDouble), full[k].to(at::kDouble), 2e-2, 1e-2 * scale);
        }
      }
    }
}

std::vector<RouteCase> all_cases() {
  std::vector<RouteCase> cases;
  for (const HeadRoute route :
       {HeadRoute::kFusedStatistics, HeadRoute::kColumnChunks, HeadRoute::kRowSlabs, HeadRoute::kTrainingSlabs,
        HeadRoute::kInputTypeSlabs, HeadRoute::kRecomputed, HeadRoute::kRecomputedFused})
    for (const bool cuda : {false, true})
      for (const at::ScalarType dtype : {at::kDouble, at::kFloat, at::kBFloat16}) cases.push_back({route, cuda, dtype});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(EveryRoute, HeadRoutes, ::testing::ValuesIn(all_cases()), case_name);

}  // namespace
}  // namespace trellis::testing
