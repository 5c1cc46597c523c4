// The LLM head against a float64 reference that materialises the logits: values, gradients, every option, awkward
// shapes, several slabs, bad input; on a GPU, the CUDA path against the reference and its memory bound, and small
// shapes that reach every head kernel quickly enough for compute-sanitizer (LinearCrossEntropySmallCuda).
#include <c10/core/GradMode.h>

#include <array>
#include <optional>
#include <string>

#include "test_util.h"
#include "trellis/head/linear_cross_entropy.h"
#if TRELLIS_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace trellis {
namespace {

using testing::expect_close;

struct Case {
  int64_t N, D, V;
  at::ScalarType dtype;
  bool bias;
  std::optional<double> softcap;
  double label_smoothing, z_loss;
  Reduction reduction;
  bool ignore_some;
  int64_t ignore_index = -100;
};

struct Inputs {
  at::Tensor x, w, b, t;
};

Inputs random_inputs(const Case& c, at::Device device = at::kCPU) {
  const auto opts = at::TensorOptions().dtype(c.dtype).device(device);
  Inputs in;
  // Logits of a few units, as in a trained head; rounded to the input type before anything else sees them.
  in.x = at::randn({c.N, c.D}, opts.dtype(at::kDouble).device(at::kCPU)).to(opts);
  in.w = (at::randn({c.V, c.D}, at::kDouble) * (2.0 / std::sqrt(double(c.D)))).to(opts);
  if (c.bias) in.b = at::randn({c.V}, at::kDouble).to(opts);
  in.t = at::randint(0, c.V, {c.N}, at::TensorOptions().dtype(at::kLong)).to(device);
  if (c.ignore_some)
    in.t.index_put_({at::arange(0, c.N, 3, at::TensorOptions().dtype(at::kLong).device(device))}, c.ignore_index);
  return in;
}

at::Tensor reference_logits(const Inputs& in, std::optional<double> softcap) {
  at::Tensor z = at::mm(in.x.to(at::kDouble), in.w.to(at::kDouble).t());
  if (in.b.defined()) z = z + in.b.to(at::kDouble);
  return softcap ? at::tanh(z / *softcap) * *softcap : z;
}

// The textbook loss on materialised float64 logits.
at::Tensor reference_loss(const Inputs& in, const Case& c) {
  const at::Tensor z = reference_logits(in, c.softcap);
  const at::Tensor valid = in.t != c.ignore_index, t = at::where(valid, in.t, 0);
  const at::Tensor logp = at::log_softmax(z, 1), lse = at::logsumexp(z, 1);
  at::Tensor rows = -(1 - c.label_smoothing) * logp.gather(1, t.unsqueeze(1)).squeeze(1) -
                    c.label_smoothing * logp.mean(1) + c.z_loss * lse * lse;
  rows = rows * valid;
  if (c.reduction == Reduction::none) return rows;
  if (c.reduction == Reduction::sum) return rows.sum();
  return rows.sum() / valid.sum();
}

HeadOptions head_of(const Inputs& in, const Case& c, int64_t chunk_bytes) {
  HeadOptions h;
  h.bias = in.b;
  h.softcap = c.softcap;
  h.chunk_bytes = chunk_bytes;
  h.ignore_index = c.ignore_index;
  return h;
}

double tolerance(at::ScalarType t) { return t == at::kDouble ? 1e-10 : t == at::kFloat ? 2e-5 : 1e-4; }
double grad_tolerance(at::ScalarType t) { return t == at::kDouble ? 1e-10 : t == at::kFloat ? 2e-5 : 2e-2; }

// Five rows of float32 logits per slab: several slabs for the tests' row counts.
int64_t five_rows(const Case& c) { return c.V * 4 * 5; }

std::string describe(const Case& c) {
  return c10::str("N=", c.N, " D=", c.D, " V=", c.V, " ", c.dtype, " bias=", c.bias, " softcap=", c.softcap.value_or(0),
                  " ls=", c.label_smoothing, " z=", c.z_loss, " reduction=", int(c.reduction),
                  " ignore=", c.ignore_some, " ignore_index=", c.ignore_index);
}

// Loss and gradients against the reference; chunk_bytes (default five_rows) small enough for several slabs of rows
// (or, recomputing the logits, a small slab of a few columns for what dW's unwritten rows cannot hold). want: which of
// x, W and the bias take gradients (the others are frozen and must get none).
void check_case(const Case& c, at::Device device = at::kCPU, bool recompute = false,
                std::optional<int64_t> chunk_bytes = std::nullopt, std::array<bool, 3> want = {true, true, true},
                int64_t memory_budget = -1) {
  SCOPED_TRACE(c10::str(describe(c), " ", device, " recompute=", recompute,
                        " chunk_bytes=", chunk_bytes.value_or(five_rows(c)), " want=", want[0], want[1], want[2],
                        " memory_budget=", memory_budget));
  Inputs in = random_inputs(c, device);
  const std::array<at::Tensor*, 3> inputs = {&in.x, &in.w, &in.b};
  for (int k = 0; k < 3; ++k)
    if (want[k] && inputs[k]->defined()) inputs[k]->requires_grad_();
  LossOptions lo{c.reduction, c.label_smoothing, c.z_loss};
  HeadOptions head = head_of(in, c, chunk_bytes.value_or(five_rows(c)));
  head.recompute_logits = recompute;
  head.memory_budget = memory_budget;
  const at::Tensor loss = linear_cross_entropy(in.x, in.w, in.t, head, lo);
  Inputs ref{in.x.detach().cpu().to(at::kDouble).requires_grad_(), in.w.detach().cpu().to(at::kDouble).requires_grad_(),
             c.bias ? in.b.detach().cpu().to(at::kDouble).requires_grad_() : at::Tensor(), in.t.cpu()};
  const at::Tensor expected = reference_loss(ref, c);
  expect_close(loss, expected, tolerance(c.dtype), tolerance(c.dtype));
  // A random upstream gradient, so that reduction none is checked row by row.
  const at::Tensor go = at::rand(expected.sizes(), at::kDouble) + 0.5;
  loss.backward(go.to(loss.dtype()).to(device));
  expected.backward(go);
  // Relative to the gradient's largest entry, so that small gradients are not waved through by the tolerance.
  auto expect_grad = [&](const at::Tensor& actual, const at::Tensor& expected) {
    const double gt = grad_tolerance(c.dtype), scale = expected.abs().max().item<double>();
    expect_close(actual, expected, gt, gt * scale);
  };
  const std::array<at::Tensor*, 3> expected_inputs = {&ref.x, &ref.w, &ref.b};
  for (int k = 0; k < 3; ++k) {
    if (!inputs[k]->defined()) continue;
    if (want[k]) expect_grad(inputs[k]->grad(), expected_inputs[k]->grad());
    else EXPECT_FALSE(inputs[k]->grad().defined()) << "a gradient for frozen input " << k;
  }
}

// Everything without gradients against the reference: token log-probabilities with and without the entropy, each
// row's log-sum-exp, and the loss (c.reduction) under NoGradGuard.
void check_rows(const Case& c, at::Device device, bool recompute, std::optional<int64_t> chunk_bytes = std::nullopt) {
  SCOPED_TRACE(c10::str(describe(c), " ", device, " recompute=", recompute,
                        " chunk_bytes=", chunk_bytes.value_or(five_rows(c))));
  const Inputs in = random_inputs(c, device);
  HeadOptions h = head_of(in, c, chunk_bytes.value_or(five_rows(c)));
  h.recompute_logits = recompute;
  const Inputs ref{in.x.cpu().to(at::kDouble), in.w.cpu().to(at::kDouble),
                   c.bias ? in.b.cpu().to(at::kDouble) : at::Tensor(), in.t.cpu()};
  const at::Tensor z = reference_logits(ref, c.softcap), logp = at::log_softmax(z, 1);
  const at::Tensor valid = ref.t != c.ignore_index;
  const at::Tensor target_logp = logp.gather(1, at::where(valid, ref.t, 0).unsqueeze(1)).squeeze(1) * valid;
  const double tol = tolerance(c.dtype);
  const TokenLogprobs with_entropy = token_logprobs(in.x, in.w, in.t, h, true);
  expect_close(with_entropy.logprobs, target_logp, tol, tol);
  expect_close(with_entropy.entropy, -(logp.exp() * logp).sum(1), tol, tol);
  expect_close(token_logprobs(in.x, in.w, in.t, h).logprobs, target_logp, tol, tol);
  expect_close(linear_logsumexp(in.x, in.w, h), at::logsumexp(z, 1), tol, tol);
  c10::NoGradGuard no_grad;
  const LossOptions lo{c.reduction, c.label_smoothing, c.z_loss};
  expect_close(linear_cross_entropy(in.x, in.w, in.t, h, lo), reference_loss(ref, c), tol, tol);
}

TEST(LinearCrossEntropy, MatchesMaterialisedReferenceForEveryOption) {
  at::manual_seed(1);
  for (const auto dtype : {at::kDouble, at::kFloat})
    for (const auto reduction : {Reduction::mean, Reduction::sum, Reduction::none})
      for (const bool bias : {false, true}) {
        check_case({37, 7, 131, dtype, bias, std::nullopt, 0, 0, reduction, true});
        check_case({37, 7, 131, dtype, bias, 1.5, 0.1, 1e-3, reduction, true});
      }
}

TEST(LinearCrossEntropy, HalfPrecisionInputsAccumulateInFloat32) {
  at::manual_seed(2);
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    check_case({29, 16, 97, dtype, true, std::nullopt, 0.1, 1e-4, Reduction::mean, true});
    check_case({29, 16, 97, dtype, false, 3.0, 0, 0, Reduction::none, false});
  }
}

TEST(LinearCrossEntropy, AwkwardShapes) {
  at::manual_seed(3);
  check_case({5, 3, 1, at::kDouble, true, std::nullopt, 0, 0, Reduction::mean, false});  // V = 1
  check_case({1, 1, 2, at::kDouble, false, std::nullopt, 0.2, 0, Reduction::sum, false});
  check_case({64, 33, 257, at::kDouble, true, 5.0, 0, 1e-2, Reduction::mean, true});  // V prime, D odd
}

// Training without a slab: the logits formed again a vocabulary chunk at a time in dW's unwritten rows. With 16-bit
// inputs and dx's float32 sum at most half of dW (V ≥ 4N), dx sums in dW's last rows and their chunks run twice.
TEST(LinearCrossEntropy, RecomputedLogitsMatchTheReference) {
  at::manual_seed(11);
  for (const auto reduction : {Reduction::mean, Reduction::none}) {
    for (const auto dtype : {at::kDouble, at::kFloat}) {
      check_case({37, 7, 131, dtype, true, 1.5, 0.1, 1e-3, reduction, true}, at::kCPU, true);
      check_case({37, 7, 131, dtype, false, std::nullopt, 0, 0, reduction, false}, at::kCPU, true);
    }
    for (const auto dtype : {at::kBFloat16, at::kHalf}) {
      // dx's float32 sum in a buffer of its own (N·D·4 bytes over half of dW), then in dW's last rows.
      check_case({29, 16, 97, dtype, true, std::nullopt, 0.1, 1e-4, reduction, true}, at::kCPU, true);
      check_case({13, 16, 211, dtype, true, 3.0, 0.1, 1e-4, reduction, true}, at::kCPU, true);
    }
    // dx's buffer wide enough to hold the slabs that dW's unwritten rows cannot.
    check_case({32, 256, 500, at::kBFloat16, false, std::nullopt, 0.1, 0, reduction, true}, at::kCPU, true);
  }
  check_case({5, 3, 1, at::kDouble, true, std::nullopt, 0, 0, Reduction::mean, false}, at::kCPU, true);  // V = 1
  check_case({64, 33, 257, at::kDouble, true, 5.0, 0, 1e-2, Reduction::sum, true}, at::kCPU, true);
}

// Only some gradients wanted (a frozen output layer, or frozen inputs): the recomputed ones match the slabs'.
TEST(LinearCrossEntropy, RecomputedLogitsWithSomeGradients) {
  at::manual_seed(12);
  const Case c{13, 16, 211, at::kBFloat16, true, std::nullopt, 0.1, 0, Reduction::mean, true};
  for (int which = 0; which < 3; ++which) {
    SCOPED_TRACE(which);
    std::array<at::Tensor, 2> grads[2];
    for (const bool recompute : {false, true}) {
      at::manual_seed(13);  // the same inputs for both runs
      Inputs in = random_inputs(c);
      if (which != 1) in.x.requires_grad_();
      if (which != 0) in.w.requires_grad_();
      HeadOptions h = head_of(in, c, c.V * 4 * 3);
      h.recompute_logits = recompute;
      linear_cross_entropy(in.x, in.w, in.t, h).backward();
      grads[recompute] = {in.x.grad(), in.w.grad()};
    }
    for (int k = 0; k < 2; ++k) {
      ASSERT_EQ(grads[0][k].defined(), grads[1][k].defined());
      if (grads[0][k].defined()) expect_close(grads[1][k].to(at::kDouble), grads[0][k].to(at::kDouble), 2e-2, 2e-3);
    }
  }
}

// memory_budget: budgets from the least the recompute route takes up to a whole slab, in small steps. Each plan stays
// within its budget, every route and place of dx's sum is met on the way (the recompute route with the sum in dW's
// last rows, then in a buffer of its own, then slabs of rows), and the first and last budget of each give the
// reference's loss and gradients. chunk_bytes and recompute_logits are set to values the budget must override.
void check_budgets(const Case& c, at::Device device = at::kCPU) {
  SCOPED_TRACE(describe(c));
  const Inputs in = random_inputs(c, device);
  HeadOptions h = head_of(in, c, int64_t(1) << 30);
  h.recompute_logits = true;
  h.memory_budget = 0;
  try {
    plan_head_memory(in.x, in.w, h);
    ADD_FAILURE() << "a budget of 0 bytes was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("memory_budget = 0 bytes is below the least"), std::string::npos) << e.what();
  }
  std::vector<std::pair<int64_t, HeadMemoryPlan>> accepted;
  for (int64_t budget = int64_t(1) << 20; budget < (int64_t(3) << 20); budget += 4096) {
    h.memory_budget = budget;
    try {
      accepted.emplace_back(budget, plan_head_memory(in.x, in.w, h));
    } catch (const Error&) {
      ASSERT_TRUE(accepted.empty()) << "budget " << budget << " refused after a smaller one was accepted";
    }
  }
  ASSERT_FALSE(accepted.empty());
  // (route, dx's own sum) in the order they must appear as the budget grows.
  const bool half = c.dtype == at::kBFloat16 || c.dtype == at::kHalf;
  std::vector<std::pair<bool, bool>> expected = {{true, false}, {true, true}, {false, false}};
  if (!half) expected = {{true, false}, {false, false}};
  std::vector<std::pair<bool, bool>> seen;
  std::vector<int64_t> budgets_to_run;
  for (std::size_t i = 0; i < accepted.size(); ++i) {
    const auto& [budget, plan] = accepted[i];
    EXPECT_LE(plan.extra_bytes, budget) << "the plan for budget " << budget << " takes more";
    if (plan.recompute_logits) EXPECT_GE(plan.slab_bytes, c.N * kBudgetMinColumns * 2);
    const std::pair<bool, bool> kind{plan.recompute_logits, plan.own_dx_sum};
    if (seen.empty() || seen.back() != kind) {
      seen.push_back(kind);
      budgets_to_run.push_back(budget);
      if (i > 0) budgets_to_run.push_back(accepted[i - 1].first);
    }
  }
  budgets_to_run.push_back(accepted.back().first);
  EXPECT_EQ(seen, expected);
  for (const int64_t budget : budgets_to_run)
    check_case(c, device, /*recompute=*/true, int64_t(1) << 30, {true, true, true}, budget);
}

TEST(LinearCrossEntropy, MemoryBudgetPicksRoutesThatMatchTheReference) {
  at::manual_seed(21);
  // V ≥ 4N: dx's float32 sum (N·D·4 bytes) fits in dW's last rows, so small budgets leave it there.
  check_budgets({40, 16, 1031, at::kBFloat16, true, 2.0, 0.1, 1e-4, Reduction::mean, true});
  check_budgets({40, 16, 1031, at::kBFloat16, false, std::nullopt, 0, 0, Reduction::none, true});
  check_budgets({40, 16, 1031, at::kFloat, true, std::nullopt, 0.1, 0, Reduction::mean, true});
  // More rows than kBudgetMinSlabRows: several slabs of 512 rows.
  Case many{1200, 16, 97, at::kDouble, true, 1.5, 0, 1e-3, Reduction::sum, false};
  const Inputs in = random_inputs(many);
  HeadOptions h = head_of(in, many, 0);
  h.memory_budget = (int64_t(1) << 20) + many.N * 64 + 2 * many.V * 8 + 600 * many.V * 16;
  const HeadMemoryPlan plan = plan_head_memory(in.x, in.w, h);
  EXPECT_FALSE(plan.recompute_logits);
  EXPECT_EQ(plan.slab_bytes, 512 * many.V * 8);
  EXPECT_LE(plan.extra_bytes, h.memory_budget);
  check_case(many, at::kCPU, false, 0, {true, true, true}, h.memory_budget);
  // 16-bit with V < 4N: dx's float32 sum cannot sit in dW, and the budget holds it only without chunks beside it; slabs
  // of fewer than kBudgetMinSlabRows rows are what fits.
  Case narrow{64, 16, 97, at::kBFloat16, false, std::nullopt, 0, 0, Reduction::mean, false};
  const Inputs narrow_in = random_inputs(narrow);
  HeadOptions nh;
  nh.memory_budget = (int64_t(1) << 20) + narrow.N * 64 + 6 * 1024;
  const HeadMemoryPlan narrow_plan = plan_head_memory(narrow_in.x, narrow_in.w, nh);
  EXPECT_FALSE(narrow_plan.recompute_logits);
  EXPECT_LE(narrow_plan.extra_bytes, nh.memory_budget);
  check_case(narrow, at::kCPU, false, 0, {true, true, true}, nh.memory_budget);
}

TEST(LinearCrossEntropy, IgnoreIndexInsideTheVocabulary) {
  at::manual_seed(7);
  Case c{40, 8, 53, at::kDouble, true, std::nullopt, 0.1, 1e-3, Reduction::mean, true};
  c.ignore_index = 0;  // e.g. a padding id that is also a token
  check_case(c);
  c.reduction = Reduction::none;
  check_case(c);
}

TEST(LinearCrossEntropy, Int32TargetsAndNonContiguousWeights) {
  at::manual_seed(8);
  const at::Tensor x = at::randn({9, 6}, at::kDouble), w_t = at::randn({6, 13}, at::kDouble);
  const at::Tensor t = at::randint(0, 13, {9}, at::kLong);
  const at::Tensor w = w_t.t();  // [V, D], not contiguous
  ASSERT_FALSE(w.is_contiguous());
  const at::Tensor expected = linear_cross_entropy(x, w.contiguous(), t);
  expect_close(linear_cross_entropy(x, w, t.to(at::kInt)), expected);
  expect_close(linear_cross_entropy(x.t().contiguous().t(), w, t), expected);
}

TEST(LinearCrossEntropy, EveryTargetIgnoredGivesZeroGradients) {
  const at::Tensor x = at::randn({5, 4}, at::kDouble).requires_grad_(),
                   w = at::randn({7, 4}, at::kDouble).requires_grad_();
  const at::Tensor loss = linear_cross_entropy(x, w, at::full({5}, -100, at::kLong));
  EXPECT_TRUE(loss.isnan().item<bool>());
  loss.backward();
  expect_close(x.grad(), at::zeros_like(x));
  expect_close(w.grad(), at::zeros_like(w));
}

TEST(LinearCrossEntropy, LeadingDimensionsAndEveryTargetIgnored) {
  at::manual_seed(4);
  const at::Tensor x = at::randn({3, 4, 6}, at::kDouble), w = at::randn({11, 6}, at::kDouble);
  const at::Tensor t = at::randint(0, 11, {3, 4}, at::kLong);
  LossOptions none{Reduction::none, 0, 0};
  const at::Tensor rows = linear_cross_entropy(x, w, t, {}, none);
  ASSERT_EQ(rows.sizes(), t.sizes());
  expect_close(rows.view({-1}),
               reference_loss({x.view({12, 6}), w, {}, t.view({-1})},
                              {12, 6, 11, at::kDouble, false, std::nullopt, 0, 0, Reduction::none, false}));
  const at::Tensor mean = linear_cross_entropy(x, w, at::full({3, 4}, -100, at::kLong));
  EXPECT_TRUE(mean.isnan().item<bool>()) << "the mean over no tokens is NaN, as in PyTorch";
}

TEST(LinearCrossEntropy, TokenLogprobsEntropyAndLogsumexp) {
  at::manual_seed(5);
  for (const auto dtype : {at::kDouble, at::kFloat, at::kBFloat16}) {
    const Case c{23, 9, 101, dtype, true, 2.5, 0, 0, Reduction::none, true};
    const Inputs in = random_inputs(c);
    const HeadOptions h = head_of(in, c, 101 * 4 * 4);
    const Inputs ref{in.x.to(at::kDouble), in.w.to(at::kDouble), in.b.to(at::kDouble), in.t};
    const at::Tensor z = reference_logits(ref, c.softcap), logp = at::log_softmax(z, 1);
    const at::Tensor valid = in.t != -100;
    const TokenLogprobs r = token_logprobs(in.x, in.w, in.t, h, true);
    const double tol = tolerance(dtype);
    expect_close(r.logprobs, logp.gather(1, at::where(valid, in.t, 0).unsqueeze(1)).squeeze(1) * valid, tol, tol);
    expect_close(r.entropy, -(logp.exp() * logp).sum(1), tol, tol);
    expect_close(linear_logsumexp(in.x, in.w, h), at::logsumexp(z, 1), tol, tol);
    EXPECT_FALSE(token_logprobs(in.x, in.w, in.t, h).entropy.defined());
  }
}

TEST(LinearCrossEntropy, BadInputIsAClearError) {
  const at::Tensor x = at::randn({4, 5}), w = at::randn({7, 5});
  auto expect_error = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one mentioning '" << part << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect_error([&] { linear_cross_entropy(x, w, at::tensor({0, 1, 7, 2}, at::kLong)); }, "targets[2] = 7");
  expect_error([&] { linear_cross_entropy(x, w, at::tensor({0, -1, 3, 2}, at::kLong)); }, "targets[1] = -1");
  expect_error([&] { linear_logsumexp(x, at::randn({7, 6})); }, "D=5");
  expect_error([&] { linear_logsumexp(x, w.to(at::kDouble)); }, "must share");
  expect_error([&] { linear_cross_entropy(x, w, at::zeros({3}, at::kLong)); }, "targets are [3]");
  HeadOptions h;
  h.softcap = -1;
  expect_error([&] { linear_logsumexp(x, w, h); }, "softcap");
  h = {};
  h.bias = at::randn({6});
  expect_error([&] { linear_logsumexp(x, w, h); }, "bias must be [V]");
  expect_error([&] { parse_reduction("avg"); }, "'avg'");
}

TEST(LinearCrossEntropyCuda, MatchesReferenceOnTheGpu) {
  TRELLIS_REQUIRE_CUDA();
  at::manual_seed(6);
  for (const auto dtype : {at::kDouble, at::kFloat, at::kBFloat16, at::kHalf})
    for (const auto reduction : {Reduction::mean, Reduction::sum, Reduction::none}) {
      check_case({300, 64, 1031, dtype, true, 4.0, 0.1, 1e-3, reduction, true}, at::kCUDA);
      check_case({77, 33, 257, dtype, false, std::nullopt, 0, 0, reduction, false}, at::kCUDA);
    }
  // More columns than the kernel's grid covers at once (64 blocks of 256), and an in-vocabulary ignore_index.
  Case wide{70, 16, 20011, at::kFloat, true, 10.0, 0.1, 1e-4, Reduction::mean, true};
  wide.ignore_index = 3;
  check_case(wide, at::kCUDA);
  check_case(wide, at::kCUDA, true);
  // Recomputed logits: for 16-bit inputs dx's float32 sum in a buffer of its own (first case) or in dW's last rows (the
  // others); D % 8 == 0 takes the fused kernel for 16-bit inputs.
  for (const auto dtype : {at::kDouble, at::kFloat, at::kBFloat16, at::kHalf})
    for (const auto reduction : {Reduction::mean, Reduction::none}) {
      check_case({300, 64, 1031, dtype, true, 4.0, 0.1, 1e-3, reduction, true}, at::kCUDA, true);
      check_case({40, 64, 1031, dtype, true, 4.0, 0.1, 1e-3, reduction, true}, at::kCUDA, true);
      check_case({21, 33, 257, dtype, false, std::nullopt, 0, 0, reduction, false}, at::kCUDA, true);
    }
}

#if TRELLIS_WITH_CUDA
// Device memory allocated beyond what was live before fn, at its peak.
int64_t peak_extra_bytes(const std::function<void()>& fn) {
  namespace alloc = c10::cuda::CUDACachingAllocator;
  const auto agg = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  alloc::resetPeakStats(0);
  const int64_t before = alloc::getDeviceStats(0).allocated_bytes[agg].current;
  fn();
  return alloc::getDeviceStats(0).allocated_bytes[agg].peak - before;
}
#endif

// The fused Hopper kernel (bfloat16/float16, D % 8 == 0 on compute capability 9.0) through every forward-only entry
// point: row blocks and vocabulary tiles cut by N and V, a K tail (D % 64 != 0), V = 1, several work units per block,
// bias, soft-cap, label smoothing and entropy; and forward memory O(N) with nothing of size N×V.
TEST(LinearCrossEntropyCuda, FusedKernelMatchesTheReference) {
  TRELLIS_REQUIRE_CUDA();
#if TRELLIS_WITH_CUDA
  if (at::cuda::getCurrentDeviceProperties()->major != 9) GTEST_SKIP() << "the fused kernel is for sm_90";
  at::manual_seed(8);
  const std::vector<Case> cases = {
      {300, 64, 1031, at::kBFloat16, true, std::nullopt, 0, 0, Reduction::none, true},
      {129, 72, 1, at::kHalf, false, std::nullopt, 0, 0, Reduction::none, false},
      {1000, 4096, 20011, at::kBFloat16, false, std::nullopt, 0.1, 0, Reduction::none, true},
      {257, 200, 5003, at::kHalf, true, 30.0, 0.2, 1e-3, Reduction::none, true},
      {64, 8, 256, at::kBFloat16, true, 5.0, 0, 0, Reduction::none, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c10::str("N=", c.N, " D=", c.D, " V=", c.V, " ", c.dtype));
    const Inputs in = random_inputs(c, at::kCUDA);
    HeadOptions h = head_of(in, c, int64_t(1) << 30);
    const Inputs ref{in.x.cpu().to(at::kDouble), in.w.cpu().to(at::kDouble),
                     c.bias ? in.b.cpu().to(at::kDouble) : at::Tensor(), in.t.cpu()};
    const at::Tensor z = reference_logits(ref, c.softcap), logp = at::log_softmax(z, 1);
    const at::Tensor valid = ref.t != c.ignore_index;
    const TokenLogprobs r = token_logprobs(in.x, in.w, in.t, h, true);
    expect_close(r.logprobs.cpu(), logp.gather(1, at::where(valid, ref.t, 0).unsqueeze(1)).squeeze(1) * valid, 1e-4,
                 1e-4);
    expect_close(r.entropy.cpu(), -(logp.exp() * logp).sum(1), 1e-4, 1e-4);
    expect_close(linear_logsumexp(in.x, in.w, h).cpu(), at::logsumexp(z, 1), 1e-4, 1e-4);
    c10::NoGradGuard no_grad;
    const LossOptions lo{Reduction::none, c.label_smoothing, c.z_loss};
    expect_close(linear_cross_entropy(in.x, in.w, in.t, h, lo).cpu(), reference_loss(ref, c), 1e-4, 1e-4);
  }
  const int64_t N = 4096, D = 256, V = 32000;
  const auto opts = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  const at::Tensor x = at::randn({N, D}, opts), w = at::randn({V, D}, opts) * 0.1;
  const at::Tensor t = at::randint(0, V, {N}, opts.dtype(at::kLong));
  token_logprobs(x, w, t, {}, true);
  const int64_t fwd = peak_extra_bytes([&] { token_logprobs(x, w, t, {}, true); });
  EXPECT_LT(fwd, 64 * N) << "forward peak " << fwd << " bytes";
#endif
}

TEST(LinearCrossEntropyCuda, MemoryStaysWithinTheSlabBound) {
  TRELLIS_REQUIRE_CUDA();
#if TRELLIS_WITH_CUDA
  const int64_t N = 4096, D = 256, V = 32000, chunk = int64_t(4) << 20;
  const auto opts = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  const at::Tensor x = at::randn({N, D}, opts).requires_grad_(), w = (at::randn({V, D}, opts) * 0.1).requires_grad_();
  const at::Tensor t = at::randint(0, V, {N}, opts.dtype(at::kLong));
  HeadOptions h;
  h.chunk_bytes = chunk;
  const int64_t logits_bytes = N * V * 4;  // what materialising would take: 500 MiB
  // Once before measuring: cuBLAS takes its workspace from the same allocator at the first GEMM.
  linear_cross_entropy(x, w, t, h).backward();
  x.mutable_grad() = at::Tensor();
  w.mutable_grad() = at::Tensor();
  const int64_t fwd = peak_extra_bytes([&] {
    c10::NoGradGuard no_grad;
    token_logprobs(x, w, t, h, true);
  });
  EXPECT_LT(fwd, 4 * chunk + 64 * N) << "forward peak " << fwd << " bytes (logits would be " << logits_bytes << ")";
  const int64_t grads = x.numel() * 2 + w.numel() * 2;
  const int64_t train = peak_extra_bytes([&] { linear_cross_entropy(x, w, t, h).backward(); });
  // One float32 slab at a time; on compute capability 9.0 and later dL/dz is written over the slab's own memory (no
  // second slab-sized buffer), elsewhere it takes a bf16 buffer of half a slab beside it.
  const bool in_place = at::cuda::getCurrentDeviceProperties()->major >= 9;
  EXPECT_LT(train, grads + (in_place ? chunk + chunk / 4 : 4 * chunk) + 64 * N)
      << "forward+backward peak " << train << " bytes";
  // Recomputing the logits: nothing beyond the gradients but O(N), and a slab of at most chunk_bytes (512 float32
  // columns at most) for what dW's unwritten rows cannot hold; dx sums in dW's last rows (N·D·4 = 4 MiB of 16).
  h.recompute_logits = true;
  const int64_t recomputed = peak_extra_bytes([&] { linear_cross_entropy(x, w, t, h).backward(); });
  EXPECT_LT(recomputed, grads + (in_place ? N * 2048 : 2 * chunk) + 64 * N)
      << "forward+backward peak with recomputed logits " << recomputed << " bytes";
  // float32: no fused forward, so the log-sum-exp too goes a chunk of columns at a time through the small slab.
  const at::Tensor x32 = x.detach().to(at::kFloat).requires_grad_(), w32 = w.detach().to(at::kFloat).requires_grad_();
  linear_cross_entropy(x32, w32, t, h).backward();
  x32.mutable_grad() = at::Tensor();
  w32.mutable_grad() = at::Tensor();
  const int64_t recomputed32 = peak_extra_bytes([&] { linear_cross_entropy(x32, w32, t, h).backward(); });
  EXPECT_LT(recomputed32, 2 * grads + 2 * N * 2048 + 64 * N)
      << "float32 forward+backward peak with recomputed logits " << recomputed32 << " bytes";
#endif
}

// memory_budget on the GPU: each budget's measured peak beyond the gradients stays within it (and within the plan's
// estimate), and the gradients are those of the default route.
TEST(LinearCrossEntropyCuda, MemoryBudgetIsRespected) {
  TRELLIS_REQUIRE_CUDA();
#if TRELLIS_WITH_CUDA
  at::manual_seed(22);
  const int64_t N = 4096, D = 256, V = 32000, MiB = int64_t(1) << 20;
  for (const auto dtype : {at::kBFloat16, at::kFloat}) {
    const auto opts = at::TensorOptions().dtype(dtype).device(at::kCUDA);
    const at::Tensor x = at::randn({N, D}, opts).requires_grad_(), w = (at::randn({V, D}, opts) * 0.1).requires_grad_();
    const at::Tensor t = at::randint(0, V, {N}, opts.dtype(at::kLong));
    const int64_t grads = (x.numel() + w.numel()) * x.element_size();
    linear_cross_entropy(x, w, t).backward();
    const at::Tensor dx = x.grad().clone(), dw = w.grad().clone();
    // A whole slab, slabs of 512 rows, the recompute route with dx's sum beside its chunks, then in dW's last rows.
    for (const int64_t budget : {1024 * MiB, 80 * MiB, 12 * MiB, 3 * MiB}) {
      SCOPED_TRACE(c10::str(dtype, " memory_budget=", budget));
      HeadOptions h;
      h.memory_budget = budget;
      const HeadMemoryPlan plan = plan_head_memory(x, w, h);
      // On Hopper a bfloat16 slab holds exponentials in x's type: 1 GiB takes every row, 80 MiB 1280 (float32: 512).
      const bool hopper = at::cuda::getCurrentDeviceProperties()->major == 9;
      if (!plan.recompute_logits && hopper && dtype == at::kBFloat16) {
        EXPECT_EQ(plan.slab_type, at::kBFloat16);
        EXPECT_EQ(plan.slab_bytes / (V * 2 + (V + 255) / 256 * 4), budget == 80 * MiB ? 1280 : N);
      }
      x.mutable_grad() = at::Tensor();
      w.mutable_grad() = at::Tensor();
      linear_cross_entropy(x, w, t, h).backward();  // cuBLAS' workspace for these shapes, before measuring
      x.mutable_grad() = at::Tensor();
      w.mutable_grad() = at::Tensor();
      const int64_t extra = peak_extra_bytes([&] { linear_cross_entropy(x, w, t, h).backward(); }) - grads;
      EXPECT_LE(extra, budget) << "route recompute=" << plan.recompute_logits << " slab " << plan.slab_bytes;
      EXPECT_LE(extra, plan.extra_bytes);
      const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
      expect_close(x.grad().to(at::kDouble).cpu(), dx.to(at::kDouble).cpu(), tol, tol * dx.abs().max().item<double>());
      expect_close(w.grad().to(at::kDouble).cpu(), dw.to(at::kDouble).cpu(), tol, tol * dw.abs().max().item<double>());
    }
  }
#endif
}

// Without a budget, training on Hopper takes the slabs in x's type for bfloat16 (chunk_bytes of exponentials: twice
// the rows of float32 logits; two slabs here, so that dW's product adds to the first) and float16 without a soft-cap,
// and the float32 slabs for float16 with one; the measured peak stays within the plan's estimate and the gradients are
// those of float32 inputs.
TEST(LinearCrossEntropyCuda, DefaultSlabsInXsTypeOnHopper) {
  TRELLIS_REQUIRE_CUDA();
#if TRELLIS_WITH_CUDA
  if (at::cuda::getCurrentDeviceProperties()->major != 9) GTEST_SKIP() << "the fused kernel is for sm_90";
  at::manual_seed(27);
  const int64_t N = 2048, D = 256, V = 32000, MiB = int64_t(1) << 20;
  for (const auto dtype : {at::kBFloat16, at::kHalf})
    for (const std::optional<double> cap : {std::optional<double>(), std::optional<double>(30.0)}) {
      SCOPED_TRACE(c10::str(dtype, cap ? " softcap 30" : ""));
      const auto opts = at::TensorOptions().dtype(dtype).device(at::kCUDA);
      const at::Tensor x = at::randn({N, D}, opts).requires_grad_(),
                       w = (at::randn({V, D}, opts) * 0.1).requires_grad_();
      const at::Tensor t = at::randint(0, V, {N}, opts.dtype(at::kLong));
      HeadOptions h;
      h.softcap = cap;
      h.chunk_bytes = 64 * MiB;
      const HeadMemoryPlan plan = plan_head_memory(x, w, h);
      const bool input_type = dtype == at::kBFloat16 || !cap;
      EXPECT_FALSE(plan.recompute_logits);
      EXPECT_EQ(plan.slab_type, input_type ? dtype : at::kFloat);
      EXPECT_EQ(plan.slab_bytes, h.chunk_bytes);
      const int64_t grads = (x.numel() + w.numel()) * x.element_size();
      linear_cross_entropy(x, w, t, h).backward();  // cuBLAS' workspaces for these shapes, before measuring
      x.mutable_grad() = at::Tensor();
      w.mutable_grad() = at::Tensor();
      const int64_t extra = peak_extra_bytes([&] { linear_cross_entropy(x, w, t, h).backward(); }) - grads;
      EXPECT_LE(extra, plan.extra_bytes);
      // The reference: float32 inputs (their float32 slabs) and float32 gradients.
      const at::Tensor x32 = x.detach().to(at::kFloat).requires_grad_(),
                       w32 = w.detach().to(at::kFloat).requires_grad_();
      linear_cross_entropy(x32, w32, t, h).backward();
      const at::Tensor dx = x32.grad().to(at::kDouble), dw = w32.grad().to(at::kDouble);
      expect_close(x.grad().to(at::kDouble), dx, 2e-2, 2e-2 * dx.abs().max().item<double>());
      expect_close(w.grad().to(at::kDouble), dw, 2e-2, 2e-2 * dw.abs().max().item<double>());
    }
#endif
}

// Small shapes for compute-sanitizer: scripts/gpu_check.sh runs LinearCrossEntropySmallCuda.* under memcheck, racecheck
// and synccheck, where the tests above take too long. Together they launch every head kernel from every place the
// library does, at a few rows and columns each (the comments name the kernels of cuda/linear_head.cu and
// cuda/linear_lse_sm90.cu and the paths of lib/src/head/linear_cross_entropy.cpp that each case reaches on an
// H100/H200).

// The fused Hopper kernel's statistics (bfloat16/float16 with D % 8 == 0), through token_logprobs with and without the
// entropy, linear_logsumexp (no targets) and the loss without gradients (extra sums for label smoothing): V = 1; whole
// 256-column tiles with neither bias nor soft-cap (no tile preparation); a vocabulary edge; a K tail (D % 64 != 0);
// more k-blocks than ring stages; N = 3 (the cluster's second CTA has no rows), N = 200 (both have some) and N = 300
// (two row blocks); an ignore_index inside the vocabulary.
TEST(LinearCrossEntropySmallCuda, FusedStatistics) {
  TRELLIS_REQUIRE_CUDA();
  at::manual_seed(21);
  check_rows({3, 8, 1, at::kBFloat16, false, std::nullopt, 0, 0, Reduction::none, false}, at::kCUDA, false);
  check_rows({5, 16, 512, at::kHalf, false, std::nullopt, 0, 0, Reduction::mean, false}, at::kCUDA, false);
  check_rows({200, 72, 1031, at::kBFloat16, true, 30.0, 0.2, 1e-3, Reduction::none, true}, at::kCUDA, false);
  check_rows({300, 320, 600, at::kHalf, true, std::nullopt, 0.1, 0, Reduction::mean, true, 0}, at::kCUDA, false);
}

// Statistics without the fused kernel (float32, float64, and 16-bit inputs with D % 8 != 0): slabs of five rows
// (slab_stats), and with recompute_logits a chunk of columns at a time (chunked_stats; the entropy still goes by
// slabs).
TEST(LinearCrossEntropySmallCuda, SlabAndChunkedStatistics) {
  TRELLIS_REQUIRE_CUDA();
  at::manual_seed(22);
  for (const bool recompute : {false, true}) {
    check_rows({13, 7, 97, at::kFloat, true, 2.5, 0.1, 1e-3, Reduction::none, true}, at::kCUDA, recompute);
    check_rows({13, 9, 61, at::kDouble, false, std::nullopt, 0, 0, Reduction::mean, true}, at::kCUDA, recompute);
    check_rows({13, 7, 97, at::kBFloat16, true, std::nullopt, 0.1, 0, Reduction::none, true}, at::kCUDA, recompute);
    check_rows({13, 12, 61, at::kHalf, false, 3.0, 0, 0, Reduction::mean, false, 5}, at::kCUDA, recompute);
  }
}

// Training by slabs of five rows (head_gradients), every input type. A reduced loss forms each slab's log-sum-exp and
// gradient in one read (logit_gradient_in_place_kernel with form_lse, clusters of 8 blocks; for 16-bit inputs dz in
// the first half of each float32 row), soft-capping the logits as it reads them unless label smoothing wants them
// capped first. Reduction none forwards without gradients (the fused kernel for 16-bit inputs with D % 8 == 0) and its
// backward gets the log-sum-exp: logit_gradient_kernel over the slab for float32/float64,
// logit_gradient_in_place_kernel without form_lse (one block per row) for 16-bit inputs, each soft-capping as it reads.
TEST(LinearCrossEntropySmallCuda, SlabGradients) {
  TRELLIS_REQUIRE_CUDA();
  at::manual_seed(23);
  for (const auto dtype : {at::kDouble, at::kFloat, at::kBFloat16, at::kHalf}) {
    check_case({13, 8, 97, dtype, true, 4.0, 0.1, 1e-3, Reduction::mean, true}, at::kCUDA);
    check_case({13, 8, 97, dtype, true, 4.0, 0, 1e-3, Reduction::sum, true}, at::kCUDA);
    check_case({13, 8, 97, dtype, true, 4.0, 0.1, 1e-3, Reduction::none, true, 3}, at::kCUDA);
    check_case({11, 7, 61, dtype, false, std::nullopt, 0, 0, Reduction::sum, false}, at::kCUDA);
  }
}

// Vocabularies wider than the kernels' single-pass shapes, with a few rows: logit_gradient_kernel's grid striding over
// more columns than 64 blocks of 256 threads; logit_gradient_in_place_kernel without form_lse in clusters of two
// blocks (a float32 row over one block's shared memory); the fused kernel with several work units per persistent
// block (more than 66 clusters' worth on 132 SMs). Where not even 8 blocks' shared memory holds a float32 row, the
// log-sum-exp comes from a separate reduction and the 16-bit dz from logit_gradient_kernel into its own buffer (the
// soft-cap, which that kernel would have applied, by tensor operations first).
TEST(LinearCrossEntropySmallCuda, WideVocabularies) {
  TRELLIS_REQUIRE_CUDA();
  at::manual_seed(24);
  check_case({3, 8, 60013, at::kBFloat16, true, 10.0, 0.1, 1e-4, Reduction::none, true}, at::kCUDA);
  // float64: float32 sums over 60013 columns round beyond the float32 tolerance.
  check_case({3, 8, 60013, at::kDouble, false, std::nullopt, 0, 0, Reduction::none, false}, at::kCUDA);
  check_case({2, 8, 480001, at::kBFloat16, false, std::nullopt, 0.1, 0, Reduction::mean, false}, at::kCUDA);
  check_case({2, 8, 480001, at::kHalf, true, std::nullopt, 0, 1e-4, Reduction::sum, false}, at::kCUDA);
  check_case({2, 8, 480001, at::kBFloat16, false, 10.0, 0, 0, Reduction::mean, false}, at::kCUDA);
  check_rows({2, 8, 60013, at::kBFloat16, true, 10.0, 0.1, 0, Reduction::none, false}, at::kCUDA, false);
}

// Training with recompute_logits (recomputed_gradients). With 16-bit inputs and D % 8 == 0 the fused kernel writes each
// chunk's dz on its tiles (odd chunk widths: unpaired stores; N = 300: two row blocks; a chunk of 1016 columns: several
// tiles); otherwise a GEMM writes the chunk's logits and logit_gradient_kernel (float32/float64) or
// logit_gradient_in_place_kernel (16-bit, at a column offset) turns them into dz. The chunks' slabs take every place:
// dW's unwritten rows, dx's buffer and the small slab; for 16-bit inputs dx's float32 sum in dW's last rows (whose
// chunks run twice) or in a buffer of its own; and only one input's gradient wanted.
TEST(LinearCrossEntropySmallCuda, RecomputedGradients) {
  TRELLIS_REQUIRE_CUDA();
  at::manual_seed(25);
  // Fused: dx's sum in dW's last rows, chunks in dW's rows and the small slab.
  check_case({16, 48, 211, at::kBFloat16, true, 4.0, 0.1, 1e-3, Reduction::mean, true}, at::kCUDA, true);
  // Fused: dx's sum in its own buffer, chunks in dW's rows and dx's buffer.
  check_case({16, 32, 61, at::kHalf, true, std::nullopt, 0.1, 0, Reduction::none, true}, at::kCUDA, true);
  // Fused: the small slab and dx's buffer.
  check_case({11, 8, 37, at::kBFloat16, false, 2.0, 0, 1e-3, Reduction::sum, false}, at::kCUDA, true);
  // Fused: two row blocks; a chunk of 1016 columns (four tiles, two work units) in the small slab.
  check_case({300, 16, 100, at::kHalf, true, std::nullopt, 0, 0, Reduction::mean, true}, at::kCUDA, true,
             int64_t(1) << 30);
  check_case({5, 16, 1031, at::kBFloat16, false, std::nullopt, 0, 0, Reduction::none, true}, at::kCUDA, true,
             int64_t(1) << 30);
  // GEMM chunks, 16-bit with D % 8 != 0: dx's sum in dW's last rows; then in its own buffer.
  check_case({13, 47, 61, at::kBFloat16, true, 4.0, 0.1, 1e-3, Reduction::mean, true}, at::kCUDA, true);
  check_case({8, 23, 37, at::kHalf, false, std::nullopt, 0, 0, Reduction::none, true}, at::kCUDA, true);
  // GEMM chunks, float32/float64: dW's rows and the small slab.
  check_case({5, 48, 37, at::kFloat, true, 1.5, 0.1, 1e-3, Reduction::mean, true}, at::kCUDA, true);
  check_case({5, 8, 37, at::kDouble, false, std::nullopt, 0.1, 0, Reduction::none, false}, at::kCUDA, true);
  // One gradient: dx alone (its buffer and the small slab; its buffer only), dW alone, the bias alone (the small slab).
  const Case fused_small{11, 8, 37, at::kBFloat16, true, std::nullopt, 0.1, 0, Reduction::mean, true};
  check_case(fused_small, at::kCUDA, true, std::nullopt, {true, false, false});
  check_case({5, 48, 37, at::kBFloat16, false, std::nullopt, 0, 0, Reduction::mean, true}, at::kCUDA, true,
             std::nullopt, {true, false, false});
  check_case({11, 64, 61, at::kBFloat16, false, 3.0, 0, 0, Reduction::mean, true}, at::kCUDA, true, std::nullopt,
             {false, true, false});
  check_case(fused_small, at::kCUDA, true, std::nullopt, {false, false, true});
  check_case({5, 8, 37, at::kFloat, true, std::nullopt, 0, 0, Reduction::mean, true}, at::kCUDA, true, std::nullopt,
             {true, false, true});
}

// Every target ignored: each row's weight g is 0 in every gradient kernel. The mean is NaN (as in PyTorch), the rows
// and the gradients are zero.
TEST(LinearCrossEntropySmallCuda, EveryTargetIgnored) {
  TRELLIS_REQUIRE_CUDA();
  at::manual_seed(26);
  for (const auto dtype : {at::kBFloat16, at::kFloat})
    for (const bool recompute : {false, true})
      for (const auto reduction : {Reduction::mean, Reduction::none}) {
        SCOPED_TRACE(c10::str(dtype, " recompute=", recompute, " reduction=", int(reduction)));
        const auto opts = at::TensorOptions().dtype(dtype).device(at::kCUDA);
        const at::Tensor x = at::randn({5, 8}, opts).requires_grad_(), w = at::randn({11, 8}, opts).requires_grad_();
        const at::Tensor t = at::full({5}, -100, opts.dtype(at::kLong));
        HeadOptions h;
        h.chunk_bytes = 11 * 4 * 2;
        h.recompute_logits = recompute;
        const at::Tensor loss = linear_cross_entropy(x, w, t, h, {reduction, 0.1, 1e-3});
        if (reduction == Reduction::mean) {
          EXPECT_TRUE(loss.isnan().item<bool>());
          loss.backward();
        } else {
          expect_close(loss, at::zeros({5}, at::kDouble));
          loss.backward(at::ones_like(loss));
        }
        expect_close(x.grad(), at::zeros({5, 8}, at::kDouble));
        expect_close(w.grad(), at::zeros({11, 8}, at::kDouble));
        expect_close(token_logprobs(x.detach(), w.detach(), t, h).logprobs, at::zeros({5}, at::kDouble));
      }
}

}  // namespace
}  // namespace trellis
