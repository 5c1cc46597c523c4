// The vocabulary-parallel head's C++ API (trellis/head/linear_cross_entropy_parallel.h) with autograd, against the same
// results on materialised logits: ranks as threads of this process in one Gloo group (an in-memory store), world sizes
// 1, 2, 3, 5 and 8 with uneven slices of W and of the bias, float64.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "trellis/distributed/distributed.h"
#include "trellis/error.h"
#include "trellis/head/linear_cross_entropy_parallel.h"

namespace {

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

// Runs work(rank, group) on `world` threads, each a rank of one Gloo group; returns each rank's exception message
// ("" where it finished).
std::vector<std::string> on_ranks(int world, const std::function<void(int, const Group&)>& work) {
  const auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        work(r, trellis::make_gloo_process_group(store, r, world, std::chrono::seconds(60)));
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  return errors;
}

double relative(const at::Tensor& got, const at::Tensor& expected) {
  if (!got.defined()) return INFINITY;
  return ((got - expected).abs().max() / expected.abs().max().clamp_min(1)).item<double>();
}

TEST(VocabularyParallelHead, AutogradEqualsMaterialisedLogitsOnEveryRank) {
  try {
    trellis::make_gloo_process_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, std::chrono::seconds(60));
  } catch (const trellis::Error& e) {
    GTEST_SKIP() << e.what();  // a build without Gloo's headers has no CPU process group
  }
  const int64_t N = 13, D = 5, V = 41, ignore = -100;
  const double cap = 4.0;
  at::manual_seed(11);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor x = at::randn({N, D}, f64), w = at::randn({V, D}, f64), b = at::randn({V}, f64);
  at::Tensor targets = at::randint(0, V, {N}, at::kLong);
  targets.index_put_({at::indexing::Slice(0, N, 4)}, ignore);
  const at::Tensor g_logprob = at::randn({N}, f64), g_entropy = at::randn({N}, f64), g_lse = at::randn({N}, f64);

  // The reference: every output and the loss from materialised, soft-capped logits, differentiated by autograd.
  const at::Tensor xr = x.clone().requires_grad_(), wr = w.clone().requires_grad_(), br = b.clone().requires_grad_();
  const at::Tensor z = (at::addmm(br, xr, wr.t()) / cap).tanh() * cap;
  const at::Tensor log_p = z.log_softmax(1), valid = targets != ignore;
  const at::Tensor logprob = log_p.gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1) * valid;
  const at::Tensor entropy = -(log_p.exp() * log_p).sum(1), lse = z.logsumexp(1);
  const at::Tensor loss = -(logprob.sum() / valid.sum());
  ((logprob * g_logprob).sum() + (entropy * g_entropy).sum() + (lse * g_lse).sum() + loss).backward();

  for (int world : {1, 2, 3, 5, 8}) {
    std::vector<int64_t> begin{0};
    for (int r = 0; r < world; ++r) begin.push_back(begin.back() + V / world + (r < V % world) + (r == 0 ? 2 : 0));
    begin.back() = V;  // the first slice two rows larger, the last smaller
    const auto errors = on_ranks(world, [&](int rank, const Group& group) {
      const int64_t rows = begin[rank + 1] - begin[rank];
      const at::Tensor xp = x.clone().requires_grad_();
      const at::Tensor wp = w.narrow(0, begin[rank], rows).clone().requires_grad_();
      const at::Tensor bp = b.narrow(0, begin[rank], rows).clone().requires_grad_();
      trellis::HeadOptions head;
      head.bias = bp;
      head.softcap = cap;
      head.ignore_index = ignore;
      trellis::VocabularySlice slice;
      slice.group = group;
      const trellis::TokenLogprobs t = trellis::token_logprobs(xp, wp, targets, head, true, slice);
      const at::Tensor l = trellis::linear_logsumexp(xp, wp, head, slice);
      const at::Tensor ce = trellis::linear_cross_entropy(xp, wp, targets, head, {}, slice);
      ((t.logprobs * g_logprob).sum() + (t.entropy * g_entropy).sum() + (l * g_lse).sum() + ce).backward();
      const std::string where = "world size " + std::to_string(world) + ", rank " + std::to_string(rank);
      EXPECT_LT(relative(t.logprobs, logprob), 1e-12) << where;
      EXPECT_LT(relative(t.entropy, entropy), 1e-12) << where;
      EXPECT_LT(relative(l, lse), 1e-12) << where;
      EXPECT_LT(relative(ce, loss), 1e-12) << where;
      EXPECT_LT(relative(xp.grad(), xr.grad()), 1e-12) << where;
      EXPECT_LT(relative(wp.grad(), wr.grad().narrow(0, begin[rank], rows)), 1e-12) << where;
      EXPECT_LT(relative(bp.grad(), br.grad().narrow(0, begin[rank], rows)), 1e-12) << where;
    });
    for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "world size " << world << ", rank " << r;
  }
}

}  // namespace
