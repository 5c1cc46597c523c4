#include "trellis/nn/crf.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/serialize.h>

#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"
#include "trellis/error.h"

using namespace trellis;
using namespace trellis::testing;

namespace {

// Every label sequence of length L over K labels, [K^L, L], the first label varying slowest.
at::Tensor all_paths(int64_t K, int64_t L) {
  int64_t count = 1;
  for (int64_t t = 0; t < L; ++t) count *= K;
  at::Tensor paths = at::empty({count, L}, at::kLong);
  auto P = paths.accessor<int64_t, 2>();
  for (int64_t n = 0; n < count; ++n)
    for (int64_t t = L - 1, rest = n; t >= 0; --t, rest /= K) P[n][t] = rest % K;
  return paths;
}

// Scores [K^L] of every label sequence of sequence b (batch-first emissions), differentiable in every input; forbidden
// transitions, starts and ends (allowed false) score -inf.
at::Tensor path_scores(const at::Tensor& em, const at::Tensor& trans, const at::Tensor& start, const at::Tensor& end,
                       int64_t b, int64_t L, const TransitionConstraints& allowed = {}) {
  const at::Tensor paths = all_paths(em.size(2), L);
  const auto forbid = [](const at::Tensor& s, const at::Tensor& ok) {
    return ok.defined() ? s.masked_fill(~ok, -kInf) : s;
  };
  const at::Tensor w = forbid(trans, allowed.transitions), s0 = forbid(start, allowed.start),
                   sn = forbid(end, allowed.end);
  at::Tensor s = em[b].index({at::arange(L, at::kLong), paths}).sum(1) + s0.index_select(0, paths.select(1, 0)) +
                 sn.index_select(0, paths.select(1, L - 1));
  if (L > 1) s = s + w.index({paths.slice(1, 0, L - 1), paths.slice(1, 1, L)}).sum(1);
  return s;
}

int64_t path_index(const at::Tensor& tags, int64_t b, int64_t L, int64_t K) {
  int64_t index = 0;
  for (int64_t t = 0; t < L; ++t) index = index * K + tags[b][t].item<int64_t>();
  return index;
}

std::vector<int64_t> lengths_of(const at::Tensor& mask) {
  const at::Tensor l = mask.sum(1).cpu();
  return std::vector<int64_t>(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
}

at::Tensor mask_from(const std::vector<int64_t>& lengths, int64_t T) {
  return at::arange(T, at::kLong).unsqueeze(0) < at::tensor(lengths, at::kLong).unsqueeze(1);
}

// The module's log-likelihood [B] of tags by enumeration (batch-first), differentiable.
at::Tensor brute_log_likelihood(const nn::CRF& crf, const at::Tensor& em, const at::Tensor& tags,
                                const std::vector<int64_t>& lengths) {
  std::vector<at::Tensor> out;
  for (int64_t b = 0; b < em.size(0); ++b) {
    const at::Tensor s = path_scores(em, crf->transitions, crf->start_transitions, crf->end_transitions, b, lengths[b]);
    out.push_back(s[path_index(tags, b, lengths[b], em.size(2))] - s.logsumexp(0));
  }
  return at::stack(out);
}

nn::CRF float64_crf(int64_t K, bool batch_first = true) {
  nn::CRF crf(nn::CRFOptions(K).batch_first(batch_first));
  crf->to(at::kDouble);
  return crf;
}

const std::vector<int64_t> kLengths = {4, 2, 1, 3};
constexpr int64_t B = 4, T = 4, K = 3;

}  // namespace

TEST(NnCrf, ParametersAreRegisteredAndInitialisedAsPytorchCrf) {
  nn::CRF crf(5);
  const auto params = crf->named_parameters();
  ASSERT_EQ(params.size(), 3u);
  EXPECT_EQ(params["transitions"].sizes(), at::IntArrayRef({5, 5}));
  EXPECT_EQ(params["start_transitions"].sizes(), at::IntArrayRef({5}));
  EXPECT_EQ(params["end_transitions"].sizes(), at::IntArrayRef({5}));
  for (const auto& p : params) {
    EXPECT_TRUE(p.value().requires_grad()) << p.key();
    EXPECT_EQ(p.value().scalar_type(), at::kFloat) << p.key();
    EXPECT_LE(p.value().abs().max().item<double>(), 0.1) << p.key();
    EXPECT_GT(p.value().abs().max().item<double>(), 0.0) << p.key() << " left at zero";
  }
  EXPECT_EQ(crf->named_buffers().size(), 3u);  // the constraints, all allowed
  EXPECT_TRUE(crf->allowed_transitions.all().item<bool>());
  std::ostringstream printed;
  printed << *crf;
  EXPECT_EQ(printed.str(), "trellis::nn::CRF(num_tags=5, batch_first=true)");
  EXPECT_THROW(nn::CRF(0), Error);
}

TEST(NnCrf, LogLikelihoodAndReductionsMatchEnumeration) {
  for (bool batch_first : {true, false}) {
    nn::CRF crf = float64_crf(K, batch_first);
    const at::Tensor em = randn({B, T, K}), tags = at::randint(0, K, {B, T}, at::kLong);
    const at::Tensor mask = mask_from(kLengths, T);
    const auto layout = [&](const at::Tensor& x) { return batch_first ? x : x.transpose(0, 1); };
    const at::Tensor expected = brute_log_likelihood(crf, em, tags, kLengths).detach();
    expect_close(crf(layout(em), layout(tags), layout(mask), "none"), expected);
    expect_close(crf(layout(em), layout(tags), layout(mask)), expected.sum());
    expect_close(crf(layout(em), layout(tags), layout(mask), "mean"), expected.mean());
    expect_close(crf(layout(em), layout(tags), layout(mask.to(at::kByte)), "token_mean"), expected.sum() / 10.0);
    // Without a mask every position is real.
    const std::vector<int64_t> full(B, T);
    expect_close(crf(layout(em), layout(tags), at::Tensor(), "none"),
                 brute_log_likelihood(crf, em, tags, full).detach());
    expect_close(crf(layout(em), layout(tags), at::Tensor(), "token_mean"),
                 brute_log_likelihood(crf, em, tags, full).detach().sum() / double(B * T));
  }
}

TEST(NnCrf, GradientsMatchEnumeration) {
  nn::CRF crf = float64_crf(K);
  const at::Tensor em = randn({B, T, K}).requires_grad_(), tags = at::randint(0, K, {B, T}, at::kLong);
  const at::Tensor mask = mask_from(kLengths, T);
  const std::vector<at::Tensor> inputs = {em, crf->transitions, crf->start_transitions, crf->end_transitions};
  const auto got = torch::autograd::grad({crf(em, tags, mask, "mean")}, inputs);
  const auto expected = torch::autograd::grad({brute_log_likelihood(crf, em, tags, kLengths).mean()}, inputs);
  for (std::size_t i = 0; i < inputs.size(); ++i) expect_close(got[i], expected[i]);
  EXPECT_EQ(got[0][2].slice(0, 1).abs().sum().item<double>(), 0.0) << "gradient at padding";
}

TEST(NnCrf, DecodeKbestAndMarginalsMatchEnumeration) {
  for (bool batch_first : {true, false}) {
    nn::CRF crf = float64_crf(K, batch_first);
    const at::Tensor em = randn({B, T, K}), mask = mask_from(kLengths, T);
    const auto layout = [&](const at::Tensor& x) { return batch_first ? x : x.transpose(0, 1); };
    const ViterbiResult best = crf->decode(layout(em), layout(mask));
    const KBestResult top = crf->kbest(layout(em), 5, layout(mask));
    const Marginals m = crf->marginals(layout(em), layout(mask), /*edges=*/true);
    ASSERT_EQ(best.path.sizes(), layout(mask).sizes());
    const at::Tensor path = layout(best.path), nodes = layout(m.nodes), edges = layout(m.edges);
    const at::Tensor kpaths = batch_first ? top.paths : top.paths.permute({1, 2, 0});
    ASSERT_EQ(kpaths.sizes(), at::IntArrayRef({B, 5, T}));
    for (int64_t b = 0; b < B; ++b) {
      const int64_t L = kLengths[b];
      const at::Tensor s =
          path_scores(em, crf->transitions, crf->start_transitions, crf->end_transitions, b, L).detach();
      const at::Tensor paths = all_paths(K, L);
      const auto order = std::get<1>(s.sort(/*stable=*/true, 0, /*descending=*/true));
      EXPECT_TRUE(at::equal(path[b].slice(0, 0, L), paths[order[0]])) << "sequence " << b;
      EXPECT_TRUE((path[b].slice(0, L) == -1).all().item<bool>());
      EXPECT_NEAR(best.score[b].item<double>(), s.max().item<double>(), 1e-9);
      for (int64_t r = 0; r < 5; ++r) {
        if (r < s.size(0)) {
          EXPECT_TRUE(at::equal(kpaths[b][r].slice(0, 0, L), paths[order[r]])) << "sequence " << b << " rank " << r;
          EXPECT_NEAR(top.scores[b][r].item<double>(), s[order[r]].item<double>(), 1e-9);
        } else {
          EXPECT_TRUE((kpaths[b][r] == -1).all().item<bool>());
          EXPECT_EQ(top.scores[b][r].item<double>(), -kInf);
        }
      }
      const at::Tensor p = (s - s.logsumexp(0)).exp();
      at::Tensor expected_nodes = at::zeros({T, K}, at::kDouble),
                 expected_edges = at::zeros({T - 1, K, K}, at::kDouble);
      for (int64_t t = 0; t < L; ++t) expected_nodes[t].index_add_(0, paths.select(1, t), p);
      for (int64_t t = 0; t + 1 < L; ++t)
        expected_edges[t].view({-1}).index_add_(0, paths.select(1, t) * K + paths.select(1, t + 1), p);
      expect_close(nodes[b], expected_nodes);
      expect_close(edges[b], expected_edges);
    }
  }
}

TEST(NnCrf, ConstraintsApplyToDecodingAndLogPartitionNotTheObjective) {
  const std::vector<std::string> labels = {"O", "B-PER", "I-PER"};
  nn::CRF crf = float64_crf(K);
  // Emissions that favour I-PER everywhere: unconstrained, decoding starts with it and puts it after O.
  at::Tensor em = at::zeros({B, T, K}, at::kDouble);
  em.select(2, 2).fill_(3.0);
  em[0][1][0] = 10.0;
  const at::Tensor mask = mask_from(kLengths, T), tags = at::zeros({B, T}, at::kLong);
  const at::Tensor free_paths = crf->decode(em, mask).path;
  EXPECT_EQ(free_paths[0][0].item<int64_t>(), 2);
  const at::Tensor objective = crf(em, tags, mask, "none");
  crf->set_constraints(labels, TagScheme::BIO);
  const TransitionConstraints bio = tag_scheme_constraints(labels, TagScheme::BIO);
  const ViterbiResult best = crf->decode(em, mask);
  const KBestResult top = crf->kbest(em, 3, mask);
  for (int64_t b = 0; b < B; ++b) {
    const at::Tensor s =
        path_scores(em, crf->transitions, crf->start_transitions, crf->end_transitions, b, kLengths[b], bio).detach();
    EXPECT_NEAR(best.score[b].item<double>(), s.max().item<double>(), 1e-9);
    EXPECT_TRUE(
        at::equal(best.path[b].slice(0, 0, kLengths[b]), all_paths(K, kLengths[b])[s.argmax().item<int64_t>()]));
    EXPECT_NE(best.path[b][0].item<int64_t>(), 2) << "I-PER first";
    EXPECT_NEAR(top.scores[b][0].item<double>(), s.max().item<double>(), 1e-9);
    EXPECT_NEAR(crf->log_partition(em, mask)[b].item<double>(), s.logsumexp(0).item<double>(), 1e-9);
  }
  EXPECT_EQ(best.path[0][1].item<int64_t>(), 0);
  EXPECT_NE(best.path[0][2].item<int64_t>(), 2) << "I-PER after O";
  expect_close(crf(em, tags, mask, "none"), objective);
  // Nothing allowed after O, and O never ends: sequences longer than one label have no allowed path.
  TransitionConstraints none_after_o{at::ones({K, K}, at::kBool), {}, at::ones({K}, at::kBool)};
  none_after_o.transitions[0].fill_(false);
  none_after_o.end[0] = false;
  em.select(2, 0).fill_(10.0);
  crf->set_constraints(none_after_o);
  const ViterbiResult stuck = crf->decode(em, mask);
  EXPECT_TRUE(at::isfinite(stuck.score).all().item<bool>());
  EXPECT_NE(stuck.path[0][0].item<int64_t>(), 0);
  crf->set_constraints({at::zeros({K, K}, at::kBool), {}, {}});
  const ViterbiResult nothing = crf->decode(em, mask);
  EXPECT_EQ(nothing.score[0].item<double>(), -kInf);
  EXPECT_TRUE((nothing.path[0] == -1).all().item<bool>()) << nothing.path;
  EXPECT_EQ(nothing.path[2][0].item<int64_t>(), 0) << "a single label needs no transition";
  crf->clear_constraints();
  EXPECT_TRUE(crf->allowed_transitions.all().item<bool>());
  EXPECT_TRUE((crf->decode(em, mask).path.select(1, 0) == 0).all().item<bool>()) << "O everywhere, unconstrained";
  EXPECT_THROW(crf->set_constraints({"O", "B-PER"}, TagScheme::BIO), Error);
  EXPECT_THROW(crf->set_constraints({at::ones({K}, at::kBool), {}, {}}), Error);
}

TEST(NnCrf, SaveAndLoadRoundTripParametersAndConstraints) {
  nn::CRF crf(4);
  crf->set_constraints({"O", "B-X", "I-X", "B-Y"}, TagScheme::BIO);
  std::stringstream stream;
  torch::save(crf, stream);
  nn::CRF loaded(4);
  torch::load(loaded, stream);
  for (const auto& p : crf->named_parameters()) EXPECT_TRUE(at::equal(p.value(), loaded->named_parameters()[p.key()]));
  for (const auto& b : crf->named_buffers()) EXPECT_TRUE(at::equal(b.value(), loaded->named_buffers()[b.key()]));
  const at::Tensor em = at::randn({2, 5, 4});
  EXPECT_TRUE(at::equal(crf->decode(em).path, loaded->decode(em).path));
  EXPECT_FALSE(loaded->allowed_transitions.all().item<bool>());
  // clone() is a deep copy.
  auto copy = std::dynamic_pointer_cast<nn::CRFImpl>(crf->clone());
  ASSERT_TRUE(copy);
  {
    c10::NoGradGuard no_grad;
    copy->transitions.add_(1.0);
  }
  EXPECT_FALSE(at::equal(copy->transitions, crf->transitions));
}

TEST(NnCrf, DtypesPromoteAndHalfEmissionsAccumulateInFloat32) {
  nn::CRF crf(K);
  const at::Tensor em = at::randn({B, T, K}), tags = at::randint(0, K, {B, T}, at::kLong);
  const at::Tensor mask = mask_from(kLengths, T);
  const at::Tensor low = em.to(at::kBFloat16).requires_grad_();
  const at::Tensor ll = crf(low, tags, mask, "none");
  EXPECT_EQ(ll.scalar_type(), at::kFloat);
  expect_close(ll, crf(low.detach().to(at::kFloat), tags, mask, "none"), 1e-6, 1e-6);
  ll.sum().backward();
  EXPECT_EQ(low.grad().scalar_type(), at::kBFloat16);
  EXPECT_EQ(crf->transitions.grad().scalar_type(), at::kFloat);
  // float64 emissions with float32 parameters: computed and returned in float64.
  const at::Tensor ll64 = crf(em.to(at::kDouble), tags, mask, "none");
  EXPECT_EQ(ll64.scalar_type(), at::kDouble);
  expect_close(ll64, crf(em, tags, mask, "none"), 1e-5, 1e-5);
  EXPECT_EQ(crf->decode(em.to(at::kHalf), mask).score.scalar_type(), at::kFloat);
  // Module::to(dtype) converts the constraint buffers too: they still constrain.
  crf->set_constraints({"O", "B-X", "I-X"}, TagScheme::BIO);
  crf->to(at::kDouble);
  at::Tensor favour_i = at::zeros({1, 3, K}, at::kDouble);
  favour_i.select(2, 2).fill_(5.0);
  EXPECT_NE(crf->decode(favour_i).path[0][0].item<int64_t>(), 2);
}

TEST(NnCrf, BadInputsAreClearErrors) {
  nn::CRF crf(K);
  const at::Tensor em = at::randn({B, T, K}), tags = at::randint(0, K, {B, T}, at::kLong);
  const auto message = [&](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  at::Tensor hole = mask_from(kLengths, T);
  hole[0][2] = false;
  at::Tensor empty_first = mask_from(kLengths, T);
  empty_first[1][0] = false;
  EXPECT_NE(message([&] { crf(em, tags, empty_first); }).find("mask of the first timestep must all be on"),
            std::string::npos);
  EXPECT_NE(message([&] { crf->decode(em, hole); }).find("mask[0][3] is on after an off position"), std::string::npos);
  EXPECT_NE(message([&] { crf(em, tags, hole.to(at::kFloat)); }).find("mask must be a bool or uint8"),
            std::string::npos);
  EXPECT_NE(message([&] { crf(em, tags, hole.slice(1, 0, 3)); }).find("mask has shape"), std::string::npos);
  EXPECT_NE(message([&] { crf(em, tags, at::Tensor(), "average"); }).find("reduction must be"), std::string::npos);
  EXPECT_NE(message([&] { crf(em, tags.slice(1, 0, 3)); }).find("tags have shape"), std::string::npos);
  EXPECT_NE(message([&] { crf(em, tags.to(at::kFloat)); }).find("tags must be an integer tensor"), std::string::npos);
  EXPECT_NE(message([&] { crf(em, tags + K); }).find("is outside [0, 3)"), std::string::npos);
  EXPECT_NE(message([&] { crf(at::randn({B, T, K + 1}), tags); }).find("transitions has shape"), std::string::npos);
  EXPECT_NE(message([&] {
              crf(at::randn({B, T}), tags);
            }).find("emissions must be a [B,T,K] tensor"),
            std::string::npos);
  EXPECT_NE(message([&] { crf->kbest(em, 0); }).find("k must be at least 1"), std::string::npos);
}

TEST(NnCrf, CudaMatchesCpu) {
  TRELLIS_REQUIRE_CUDA();
  nn::CRF crf = float64_crf(K);
  const at::Tensor em = randn({B, T, K}), tags = at::randint(0, K, {B, T}, at::kLong), mask = mask_from(kLengths, T);
  const at::Tensor ll = crf(em, tags, mask, "none");
  const ViterbiResult best = crf->decode(em, mask);
  const Marginals m = crf->marginals(em, mask, true);
  const KBestResult top = crf->kbest(em, 4, mask);
  crf->set_constraints({"O", "B-X", "I-X"}, TagScheme::BIO);
  const ViterbiResult constrained = crf->decode(em, mask);
  crf->to(at::kCUDA);
  const at::Tensor g = em.cuda(), y = tags.cuda(), mk = mask.cuda();
  EXPECT_EQ(crf->allowed_transitions.device().type(), at::kCUDA);
  EXPECT_TRUE(at::equal(crf->decode(g, mk).path.cpu(), constrained.path));
  crf->clear_constraints();
  expect_close(crf(g, y, mk, "none"), ll);
  EXPECT_TRUE(at::equal(crf->decode(g, mk).path.cpu(), best.path));
  expect_close(crf->marginals(g, mk, true).edges, m.edges);
  const KBestResult gtop = crf->kbest(g, 4, mk);
  EXPECT_EQ(gtop.paths.device().type(), at::kCUDA);
  EXPECT_TRUE(at::equal(gtop.paths.cpu(), top.paths));
  crf(g, y, mk).backward();
  EXPECT_EQ(crf->transitions.grad().device().type(), at::kCUDA);
  EXPECT_THROW(crf(em, tags, mask), Error);  // CPU emissions, CUDA parameters
}

TEST(NnCrf, EmptyBatchGivesEmptyResults) {
  std::vector<at::Device> devices = {at::kCPU};
  if (has_cuda()) devices.push_back(at::kCUDA);  // the fused CUDA kernels launch no empty grid: answered before them
  for (const at::Device& device : devices) {
    nn::CRF crf(K);
    crf->to(device);
    const at::Tensor em = at::randn({0, T, K}, device),
                     tags = at::zeros({0, T}, at::TensorOptions(device).dtype(at::kLong));
    const at::Tensor mask = at::ones({0, T}, at::TensorOptions(device).dtype(at::kBool));
    EXPECT_EQ(crf(em, tags, mask, "none").sizes(), at::IntArrayRef({0})) << device;
    EXPECT_EQ(crf->decode(em, mask).path.sizes(), at::IntArrayRef({0, T})) << device;
    EXPECT_EQ(crf->marginals(em, mask, true).edges.sizes(), at::IntArrayRef({0, T - 1, K, K})) << device;
    EXPECT_EQ(crf->log_partition(em).sizes(), at::IntArrayRef({0})) << device;
  }
}
