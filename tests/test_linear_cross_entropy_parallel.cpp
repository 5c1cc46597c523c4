// The vocabulary-parallel head's C++ API (trellis/head/linear_cross_entropy_parallel.h) with autograd, against the same
// results on materialised logits: world sizes 1, 2, 3 and 5 with uneven slices of W and of the bias, float64. Each rank
// is a process, as under torchrun: this test binary run again for one rank (TRELLIS_TEST_RANK, TRELLIS_TEST_WORLD),
// the ranks meeting through a c10d::FileStore (TRELLIS_TEST_STORE) in one Gloo group.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "trellis/distributed/distributed.h"
#include "trellis/error.h"
#include "trellis/head/linear_cross_entropy_parallel.h"
#include "test_util.h"

extern char** environ;

namespace {

constexpr int64_t N = 13, D = 5, V = 41, kIgnore = -100;
constexpr double kCap = 4.0;

double relative(const at::Tensor& got, const at::Tensor& expected) {
  if (!got.defined()) return INFINITY;
  return ((got - expected).abs().max() / expected.abs().max().clamp_min(1)).item<double>();
}

// The first row of each rank's slice of the V rows: the first slice two rows larger, the last smaller.
std::vector<int64_t> slice_begins(int world) {
  std::vector<int64_t> begin{0};
  for (int r = 0; r < world; ++r) begin.push_back(begin.back() + V / world + (r < V % world) + (r == 0 ? 2 : 0));
  begin.back() = V;
  return begin;
}

// One rank's share of the test in a group of `world` ranks: the head's outputs and this rank's gradients, against
// every output and the loss from materialised, soft-capped logits differentiated by autograd. Every rank draws the
// same inputs from the same seed.
void run_rank(int rank, int world, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  at::manual_seed(11);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor x = at::randn({N, D}, f64), w = at::randn({V, D}, f64), b = at::randn({V}, f64);
  at::Tensor targets = at::randint(0, V, {N}, at::kLong);
  targets.index_put_({at::indexing::Slice(0, N, 4)}, kIgnore);
  const at::Tensor g_logprob = at::randn({N}, f64), g_entropy = at::randn({N}, f64), g_lse = at::randn({N}, f64);

  const at::Tensor xr = x.clone().requires_grad_(), wr = w.clone().requires_grad_(), br = b.clone().requires_grad_();
  const at::Tensor z = (at::addmm(br, xr, wr.t()) / kCap).tanh() * kCap;
  const at::Tensor log_p = z.log_softmax(1), valid = targets != kIgnore;
  const at::Tensor logprob = log_p.gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1) * valid;
  const at::Tensor entropy = -(log_p.exp() * log_p).sum(1), lse = z.logsumexp(1);
  const at::Tensor loss = -(logprob.sum() / valid.sum());
  ((logprob * g_logprob).sum() + (entropy * g_entropy).sum() + (lse * g_lse).sum() + loss).backward();

  const std::vector<int64_t> begin = slice_begins(world);
  const int64_t rows = begin[rank + 1] - begin[rank];
  const at::Tensor xp = x.clone().requires_grad_();
  const at::Tensor wp = w.narrow(0, begin[rank], rows).clone().requires_grad_();
  const at::Tensor bp = b.narrow(0, begin[rank], rows).clone().requires_grad_();
  trellis::HeadOptions head;
  head.bias = bp;
  head.softcap = kCap;
  head.ignore_index = kIgnore;
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
}

// This test binary's path (/proc/self/exe's target; POSIX rather than std::filesystem, see TempDir).
std::string self_executable() {
  std::string path(4096, '\0');
  const ssize_t n = ::readlink("/proc/self/exe", path.data(), path.size());
  if (n <= 0 || n == static_cast<ssize_t>(path.size())) throw std::runtime_error("cannot read /proc/self/exe");
  path.resize(n);
  return path;
}

struct Rank {
  pid_t pid = -1;
  int status = 0;
  std::string log;
};

// Runs this test in `world` processes, one per rank, each writing its output to a log in `dir`; waits for all of them
// (the group's timeout bounds a rank whose peers died). Returns each rank's exit status and log.
std::vector<Rank> spawn_ranks(int world, const trellis::testing::TempDir& dir) {
  const std::string self = self_executable();
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string filter = std::string("--gtest_filter=") + info->test_suite_name() + "." + info->name();
  const std::string store = dir / ("store-" + std::to_string(world));
  std::vector<Rank> ranks(world);
  for (int r = 0; r < world; ++r) {
    ranks[r].log = dir / ("world-" + std::to_string(world) + "-rank-" + std::to_string(r) + ".log");
    std::vector<std::string> env_strings{"TRELLIS_TEST_RANK=" + std::to_string(r),
                                         "TRELLIS_TEST_WORLD=" + std::to_string(world), "TRELLIS_TEST_STORE=" + store};
    for (char** e = environ; *e; ++e)
      if (std::string(*e).rfind("TRELLIS_TEST_", 0) != 0) env_strings.emplace_back(*e);
    std::vector<char*> env;
    for (std::string& s : env_strings) env.push_back(s.data());
    env.push_back(nullptr);
    std::vector<std::string> arg_strings{self, filter};
    std::vector<char*> argv;
    for (std::string& s : arg_strings) argv.push_back(s.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, ranks[r].log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    const int failed = posix_spawn(&ranks[r].pid, self.c_str(), &actions, nullptr, argv.data(), env.data());
    posix_spawn_file_actions_destroy(&actions);
    if (failed) throw std::runtime_error("posix_spawn " + self + ": " + std::strerror(failed));
  }
  for (Rank& rank : ranks) waitpid(rank.pid, &rank.status, 0);
  return ranks;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(VocabularyParallelHead, AutogradEqualsMaterialisedLogitsOnEveryRank) {
  if (const char* rank = std::getenv("TRELLIS_TEST_RANK")) {  // one rank of a group this test spawned
    const int world = std::atoi(std::getenv("TRELLIS_TEST_WORLD"));
    const auto store = c10::make_intrusive<c10d::FileStore>(std::getenv("TRELLIS_TEST_STORE"), world);
    run_rank(std::atoi(rank), world,
             trellis::make_gloo_process_group(store, std::atoi(rank), world, std::chrono::seconds(60)));
    return;
  }
  try {
    trellis::make_gloo_process_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, std::chrono::seconds(60));
  } catch (const trellis::Error& e) {
    GTEST_SKIP() << e.what();  // a build without Gloo's headers has no CPU process group
  }
  // A group of one has no peers: that rank runs here.
  run_rank(0, 1,
           trellis::make_gloo_process_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, std::chrono::seconds(60)));
  const trellis::testing::TempDir dir("trellis_vocab_parallel_");
  for (int world : {2, 3, 5}) {
    for (const Rank& rank : spawn_ranks(world, dir)) {
      const bool passed = WIFEXITED(rank.status) && WEXITSTATUS(rank.status) == 0;
      EXPECT_TRUE(passed) << rank.log << " (status " << rank.status << "):\n" << read_all(rank.log);
    }
  }
}

}  // namespace
