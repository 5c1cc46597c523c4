// trellis bench: Trellis against plain LibTorch implementations of the same algorithms and the cuBLAS GEMM of the
// same shape, measured side by side in one process. Prints a table and, with --json, writes the same rows.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <boost/program_options.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>

#include "commands.h"
#include "trellis/io/atomic_file.h"
#include "trellis/error.h"
#include "trellis/device.h"
#include "trellis/crf/linear_chain_crf.h"
#include "trellis/head/linear_cross_entropy.h"
#include "trellis/semiring/semiring_ops.h"
#if TRELLIS_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace po = boost::program_options;

namespace trellis::cli {
namespace {

struct Row {
  std::string workload, shape, implementation;
  double ms = 0, ratio = 0;
  int64_t peak_bytes = -1;          // extra device memory at peak; -1 where not measured (CPU)
  std::optional<double> max_error;  // vs the float64 result of the same computation
  std::string device;
};

struct Bench {
  at::Device device;
  int repeats;
  std::string device_name;
  std::vector<Row> rows;

  void sync() const {
#if TRELLIS_WITH_CUDA
    if (device.is_cuda()) c10::cuda::device_synchronize();
#endif
  }

  // Median time of `repeats` runs after warm-up, and the peak of memory allocated beyond what was live before.
  std::pair<double, int64_t> measure(const std::function<void()>& fn) const {
    for (int i = 0; i < 2; ++i) fn();
    sync();
    int64_t peak = -1;
#if TRELLIS_WITH_CUDA
    if (device.is_cuda()) {
      namespace alloc = c10::cuda::CUDACachingAllocator;
      const auto agg = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
      alloc::resetPeakStats(device.index());
      const int64_t before = alloc::getDeviceStats(device.index()).allocated_bytes[agg].current;
      fn();
      sync();
      peak = alloc::getDeviceStats(device.index()).allocated_bytes[agg].peak - before;
    }
#endif
    std::vector<double> ms;
    for (int i = 0; i < repeats; ++i) {
#if TRELLIS_WITH_CUDA
      if (device.is_cuda()) {
        at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
        start.record();
        fn();
        stop.record();
        stop.synchronize();
        ms.push_back(start.elapsed_time(stop));
        continue;
      }
#endif
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
    return {ms[ms.size() / 2], peak};
  }

  // Adds a row; the first row of a workload is Trellis, and every row's ratio is its time over Trellis'.
  void run(const std::string& workload, const std::string& shape, const std::string& impl,
           const std::function<void()>& fn, std::optional<double> error = std::nullopt) {
    const auto [ms, peak] = measure(fn);
    double ratio = 1;
    for (const Row& r : rows)
      if (r.workload == workload && r.shape == shape) {
        ratio = ms / r.ms;
        break;
      }
    rows.push_back({workload, shape, impl, ms, ratio, peak, error, device_name});
    const Row& r = rows.back();
    std::printf("%-26s %-22s %-34s %10.3f %8.2fx %12s %10s\n", r.workload.c_str(), r.shape.c_str(),
                r.implementation.c_str(), r.ms, r.ratio, r.peak_bytes < 0 ? "-" : std::to_string(r.peak_bytes).c_str(),
                r.max_error ? c10::str(*r.max_error).c_str() : "-");
    std::fflush(stdout);
  }

  at::TensorOptions opts(at::ScalarType t = at::kFloat) const { return at::TensorOptions().dtype(t).device(device); }
};

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// ---- plain LibTorch baselines: the textbook algorithms with broadcasting, looped over positions ----

at::Tensor plain_log_partition(const ChainPotentials& p) {
  at::Tensor alpha = p.emissions.select(1, 0) + p.start;
  for (int64_t t = 1; t < p.emissions.size(1); ++t)
    alpha = at::logsumexp(alpha.unsqueeze(2) + p.transitions.unsqueeze(0), 1) + p.emissions.select(1, t);
  return at::logsumexp(alpha + p.end, 1);
}

// The usual large-K recipe: probabilities with the running maximum factored out, one matmul per step.
at::Tensor scaled_matmul_log_partition(const ChainPotentials& p) {
  const at::Tensor wmax = p.transitions.max();
  const at::Tensor w = (p.transitions - wmax).exp();
  at::Tensor alpha = p.emissions.select(1, 0) + p.start;
  for (int64_t t = 1; t < p.emissions.size(1); ++t) {
    const at::Tensor m = alpha.amax(1, true);
    alpha = at::mm((alpha - m).exp(), w).log() + m + wmax + p.emissions.select(1, t);
  }
  return at::logsumexp(alpha + p.end, 1);
}

std::pair<at::Tensor, at::Tensor> plain_viterbi(const ChainPotentials& p) {
  const int64_t T = p.emissions.size(1);
  at::Tensor score = p.emissions.select(1, 0) + p.start;
  std::vector<at::Tensor> back;
  for (int64_t t = 1; t < T; ++t) {
    auto [best, idx] = (score.unsqueeze(2) + p.transitions.unsqueeze(0)).max(1);
    score = best + p.emissions.select(1, t);
    back.push_back(idx);
  }
  auto [total, last] = (score + p.end).max(1);
  std::vector<at::Tensor> path(T);
  path[T - 1] = last;
  for (int64_t t = T - 1; t >= 1; --t) path[t - 1] = back[t - 1].gather(1, path[t].unsqueeze(1)).squeeze(1);
  return {at::stack(path, 1), total};
}

ChainPotentials random_chain(const Bench& b, int64_t B, int64_t T, int64_t K, at::ScalarType dtype, bool hmm) {
  ChainPotentials p;
  p.emissions = at::randn({B, T, K}, b.opts(dtype));
  p.transitions = at::randn({K, K}, b.opts(dtype)) * 0.5;
  p.start = at::randn({K}, b.opts(dtype));
  p.end = at::randn({K}, b.opts(dtype));
  if (hmm) {  // log-probabilities: rows of the transitions normalised, emission scores of observed symbols
    p.transitions = at::log_softmax(p.transitions * 4, 1);
    p.start = at::log_softmax(p.start, 0);
    p.end = at::zeros({K}, b.opts(dtype));
    p.emissions = at::log_softmax(p.emissions * 2, 2);
  }
  return p;
}

ChainPotentials cast(const ChainPotentials& p, at::ScalarType t) {
  return {p.emissions.to(t), p.transitions.to(t), p.start.to(t), p.end.to(t), p.lengths};
}

std::string shape3(int64_t B, int64_t T, int64_t K) { return c10::str("B=", B, " T=", T, " K=", K); }

// The GEMM floor of one pass: T products [B,K]·[K,K] in float32 (cuBLAS on CUDA).
void gemm_floor(Bench& b, const std::string& workload, const std::string& shape, int64_t B, int64_t T, int64_t K,
                int passes) {
  const at::Tensor x = at::rand({B, K}, b.opts()), w = at::rand({K, K}, b.opts());
  b.run(workload, shape, c10::str("GEMM fp32 ", T * passes, "x[B,K]x[K,K]"), [&] {
    for (int64_t t = 0; t < T * passes; ++t) at::mm(x, w);
  });
}

void crf_fwd_bwd(Bench& b, int64_t B, int64_t T, int64_t K) {
  const std::string w = "crf log-lik fwd+bwd", shape = shape3(B, T, K);
  const ChainPotentials p = random_chain(b, B, T, K, at::kFloat, false);
  const at::Tensor tags = at::randint(0, K, {B, T}, b.opts(at::kLong));
  const at::Tensor ref = log_likelihood(cast(p, at::kDouble), tags);
  auto step = [&](const std::function<at::Tensor(const ChainPotentials&)>& ll_of) {
    ChainPotentials q = p;
    for (at::Tensor* t : {&q.emissions, &q.transitions, &q.start, &q.end}) *t = t->detach().requires_grad_();
    const at::Tensor ll = ll_of(q);
    (-ll.sum()).backward();
    return ll.detach();
  };
  const auto trellis_ll = [&](const ChainPotentials& q) { return log_likelihood(q, tags); };
  const auto plain_ll = [&](const ChainPotentials& q) { return gold_score(q, tags) - plain_log_partition(q); };
  const auto scaled_ll = [&](const ChainPotentials& q) { return gold_score(q, tags) - scaled_matmul_log_partition(q); };
  // A training loop that built lengths and tags itself vouches for them and skips the range check's host sync.
  const auto vouched_ll = [&](ChainPotentials q) {
    q.values_checked = true;
    return log_likelihood(q, tags);
  };
  // What a training step that wants the gradients right away calls (trellis.CRF's reduced log-likelihood): no graph.
  const auto direct = [&] { return log_likelihood_with_gradients(p, tags).log_likelihood; };
  b.run(
      w, shape, "trellis", [&] { step(trellis_ll); }, max_abs_diff(step(trellis_ll), ref));
  b.run(
      w, shape, "trellis, values vouched for", [&] { step(vouched_ll); }, max_abs_diff(step(vouched_ll), ref));
  b.run(w, shape, "trellis, log_likelihood_with_gradients", direct, max_abs_diff(direct(), ref));
  b.run(
      w, shape, "libtorch logsumexp loop", [&] { step(plain_ll); }, max_abs_diff(step(plain_ll), ref));
  b.run(
      w, shape, "libtorch scaled-matmul loop", [&] { step(scaled_ll); }, max_abs_diff(step(scaled_ll), ref));
  gemm_floor(b, w, shape, B, T, K, 3);
}

void crf_viterbi(Bench& b, int64_t B, int64_t T, int64_t K) {
  const std::string w = "crf viterbi", shape = shape3(B, T, K);
  const ChainPotentials p = random_chain(b, B, T, K, at::kFloat, false);
  const at::Tensor ref = viterbi(cast(p, at::kDouble)).score;
  b.run(
      w, shape, "trellis", [&] { viterbi(p); }, max_abs_diff(viterbi(p).score, ref));
  b.run(
      w, shape, "libtorch max loop + backtrace", [&] { plain_viterbi(p); }, max_abs_diff(plain_viterbi(p).second, ref));
}

void hmm_loglik(Bench& b, int64_t B, int64_t T, int64_t K) {
  c10::NoGradGuard no_grad;
  const std::string w = "hmm log-lik", shape = shape3(B, T, K);
  const ChainPotentials p = random_chain(b, B, T, K, at::kFloat, true);
  const at::Tensor ref = log_partition(cast(p, at::kDouble));
  b.run(
      w, shape, "trellis", [&] { log_partition(p); }, max_abs_diff(log_partition(p), ref));
  b.run(
      w, shape, "libtorch scaled-matmul loop", [&] { scaled_matmul_log_partition(p); },
      max_abs_diff(scaled_matmul_log_partition(p), ref));
  if (B * K * K <= (int64_t(1) << 28))
    b.run(
        w, shape, "libtorch logsumexp loop", [&] { plain_log_partition(p); },
        max_abs_diff(plain_log_partition(p), ref));
  gemm_floor(b, w, shape, B, T, K, 1);
  const at::Tensor trans = p.transitions.contiguous();
  b.run(w, shape, c10::str("read transitions x", T, " (sum)"), [&] {
    for (int64_t t = 0; t < T; ++t) trans.sum();
  });
}

void semiring_matmul_bench(Bench& b, int64_t batch, int64_t n) {
  c10::NoGradGuard no_grad;
  const std::string w = "log-semiring matmul fwd", shape = c10::str("b=", batch, " M=K=N=", n);
  const at::Tensor x = at::randn({batch, n, n}, b.opts()) * 3, y = at::randn({batch, n, n}, b.opts()) * 3;
  const at::Tensor ref = log_matmul(x.to(at::kDouble), y.to(at::kDouble));
  b.run(
      w, shape, "trellis (exact)", [&] { log_matmul(x, y); }, max_abs_diff(log_matmul(x, y), ref));
  auto plain = [&] { return at::logsumexp(x.unsqueeze(-1) + y.unsqueeze(1), 2); };
  b.run(
      w, shape, "libtorch logsumexp broadcast", [&] { plain(); }, max_abs_diff(plain(), ref));
  b.run(w, shape, "bmm fp32 (cuBLAS on CUDA)", [&] { at::bmm(x, y); });
}

// The LLM head beside the GEMM of the same shape (cuBLAS on CUDA) and plain LibTorch with materialised logits.
// Error: the largest per-token NLL difference from log_softmax of float32 logits of the same (rounded) inputs.
void head_bench(Bench& b, int64_t N, int64_t D, int64_t V, at::ScalarType dtype) {
  const std::string shape = c10::str("N=", N, " D=", D, " V=", V, " ", dtype);
  at::Tensor x = at::randn({N, D}, b.opts()).to(dtype),
             w = (at::randn({V, D}, b.opts()) * (1 / std::sqrt(D))).to(dtype);
  const at::Tensor t = at::randint(0, V, {N}, b.opts(at::kLong));
  at::Tensor ref_nll;
  {
    c10::NoGradGuard no_grad;
    ref_nll = -at::log_softmax(at::mm(x.to(at::kFloat), w.to(at::kFloat).t()), 1).gather(1, t.unsqueeze(1)).squeeze(1);
  }
  auto nll_error = [&](const at::Tensor& nll) { return max_abs_diff(nll, ref_nll); };
  auto plain_logits = [&] { return at::mm(x, w.t()).to(at::kFloat); };
  {
    c10::NoGradGuard no_grad;
    const std::string wl = "head fwd (lse+logprobs)";
    b.run(
        wl, shape, "trellis", [&] { token_logprobs(x, w, t); }, nll_error(-token_logprobs(x, w, t).logprobs));
    b.run(wl, shape, c10::str("GEMM x*W^T ", dtype, " (cuBLAS on CUDA)"), [&] { at::mm(x, w.t()); });
    auto plain = [&] { return -at::log_softmax(plain_logits(), 1).gather(1, t.unsqueeze(1)).squeeze(1); };
    b.run(
        wl, shape, "libtorch logits+log_softmax", [&] { plain(); }, nll_error(plain()));
  }
  ref_nll = ref_nll.mean();
  const std::string wl = "head fwd+bwd (loss,dx,dW)";
  x.requires_grad_();
  w.requires_grad_();
  auto step = [&](const std::function<at::Tensor()>& loss_of) {
    x.mutable_grad() = at::Tensor();
    w.mutable_grad() = at::Tensor();
    const at::Tensor loss = loss_of();
    loss.backward();
    return loss.detach();
  };
  const auto trellis_loss = [&] { return linear_cross_entropy(x, w, t); };
  const auto plain_loss = [&] { return at::cross_entropy_loss(plain_logits(), t); };
  b.run(
      wl, shape, "trellis", [&] { step(trellis_loss); }, nll_error(step(trellis_loss)));
  // Training's memory/time knob: each memory_budget (bytes beyond the gradients) picks a route and a slab; 64 MiB is
  // the O(N) route's at these shapes.
  for (const int64_t mib : {1024, 256, 128, 64}) {
    HeadOptions budget;
    budget.memory_budget = mib << 20;
    const auto budget_loss = [&x, &w, &t, budget] { return linear_cross_entropy(x, w, t, budget); };
    b.run(
        wl, shape, c10::str("trellis, memory_budget ", mib, " MiB"), [&] { step(budget_loss); },
        nll_error(step(budget_loss)));
  }
  // No slab: the logits formed twice (for the log-sum-exp, then a vocabulary chunk at a time for the gradients).
  HeadOptions recompute;
  recompute.recompute_logits = true;
  const auto recompute_loss = [&] { return linear_cross_entropy(x, w, t, recompute); };
  b.run(
      wl, shape, "trellis, logits recomputed", [&] { step(recompute_loss); }, nll_error(step(recompute_loss)));
  {
    c10::NoGradGuard no_grad;
    const at::Tensor xd = x.detach(), wd = w.detach();
    b.run(wl, shape, c10::str("GEMM x*W^T ", dtype, " (cuBLAS on CUDA)"), [&] { at::mm(xd, wd.t()); });
    // The tensor work alone, by cuBLAS: every design forms the logits and takes the products dz·W (dx) and dzᵀ·x
    // (dW); one that never holds N×V values forms the logits a second time, since each row's log-sum-exp must be
    // known before any of its logits can become gradient. dz is the true gradient of the mean loss (its size and
    // sign pattern, which set the GEMMs' power draw, are those of training), made once outside the timing.
    const at::Tensor dz = [&] {
      at::Tensor p = at::softmax(at::mm(xd, wd.t()).to(at::kFloat), 1);
      p.scatter_add_(1, t.unsqueeze(1), at::full({N, 1}, -1.0, p.options()));
      return p.div_(static_cast<double>(N)).to(dtype);
    }();
    auto products = [&](int logit_products) {
      for (int i = 0; i < logit_products; ++i) at::mm(xd, wd.t());
      at::mm(dz, wd);
      at::mm(dz.t(), xd);
    };
    b.run(wl, shape, "floor: 3 GEMMs (logits once)", [&] { products(1); });
    b.run(wl, shape, "floor: 4 GEMMs (logits twice)", [&] { products(2); });
  }
  b.run(
      wl, shape, "libtorch logits+cross_entropy", [&] { step(plain_loss); }, nll_error(step(plain_loss)));
}

void write_json(const std::string& path, const std::vector<Row>& rows) {
  write_file_atomically(path, [&](std::ostream& out) {
    out << "[\n";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      out << "  {\"workload\": \"" << r.workload << "\", \"shape\": \"" << r.shape << "\", \"implementation\": \""
          << r.implementation << "\", \"ms\": " << r.ms << ", \"ratio\": " << r.ratio
          << ", \"peak_bytes\": " << (r.peak_bytes < 0 ? "null" : std::to_string(r.peak_bytes))
          << ", \"max_error\": " << (r.max_error ? c10::str(*r.max_error) : "null") << ", \"device\": \"" << r.device
          << "\"}" << (i + 1 < rows.size() ? "," : "") << "\n";
    }
    out << "]\n";
  });
}

}  // namespace

int bench_main(const std::vector<std::string>& args) {
  std::string what = "all", device = "cpu", json;
  int repeats = 10;
  po::options_description desc("options");
  desc.add_options()("help,h", "this message")("what", po::value(&what)->default_value("all"),
                                               "semiring, crf, hmm, head or all")(
      "device", po::value(&device)->default_value("cpu"), "cpu, cuda or cuda:N")(
      "json", po::value(&json), "also write the rows as JSON to this file")(
      "repeats", po::value(&repeats)->default_value(10), "timed runs per row (the median is reported)");
  po::positional_options_description pos;
  pos.add("what", 1);
  po::variables_map vm;
  const std::string usage = "usage: trellis bench [semiring|crf|hmm|head|all] [--device cpu|cuda] [--json FILE]";
  try {
    po::store(po::command_line_parser(args).options(desc).positional(pos).run(), vm);
    if (vm.count("help")) {
      std::cout << usage
                << "\n\nTimes Trellis beside plain LibTorch implementations of the same algorithms and the "
                   "fp32 GEMM of the same shape, in one run; ratio = time / Trellis' time.\n\n"
                << desc;
      return 0;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    std::cerr << "trellis bench: " << e.what() << "\n" << usage << "\n";
    return 2;
  }
  if (what != "all" && what != "semiring" && what != "crf" && what != "hmm" && what != "head") {
    std::cerr << "trellis bench: unknown workload '" << what << "'\n" << usage << "\n";
    return 2;
  }
  Bench b{parse_device(device), std::max(1, repeats), "cpu", {}};
  if (b.device.is_cuda()) {
#if TRELLIS_WITH_CUDA
    b.device_name = at::cuda::getDeviceProperties(b.device.index() < 0 ? 0 : b.device.index())->name;
    if (b.device.index() < 0) b.device = at::Device(at::kCUDA, 0);
#else
    throw Error("this Trellis build has no CUDA support");
#endif
  }
  const bool cuda = b.device.is_cuda();
  at::manual_seed(0);
  std::printf("device: %s\n%-26s %-22s %-34s %10s %9s %12s %10s\n", b.device_name.c_str(), "workload", "shape",
              "implementation", "ms", "ratio", "peak bytes", "max error");
  if (what == "all" || what == "crf") {
    crf_fwd_bwd(b, 512, 64, 23);
    crf_viterbi(b, 512, 64, 23);
    crf_fwd_bwd(b, 64, 512, 50);
    if (cuda) crf_fwd_bwd(b, 256, 128, 256);
  }
  if (what == "all" || what == "hmm") {
    hmm_loglik(b, 16, 128, cuda ? 4096 : 512);
    // The forward kernel at the state counts scripts/gpu/hmm_bench.sh runs the commands at (its rows divide by these).
    if (cuda) hmm_loglik(b, 16, 128, 1024);
    if (cuda) hmm_loglik(b, 16, 128, 64);
    if (cuda) hmm_loglik(b, 4, 64, 16384);
    if (cuda) hmm_loglik(b, 256, 128, 256);  // many sequences: the fused chain kernel
  }
  if (what == "all" || what == "semiring") semiring_matmul_bench(b, 16, cuda ? 512 : 128);
  if (what == "all" || what == "head") {
    if (cuda) {
      head_bench(b, 16384, 4096, 128256, at::kBFloat16);
      head_bench(b, 8192, 4096, 128256, at::kBFloat16);
      head_bench(b, 4096, 2048, 32000, at::kBFloat16);
      head_bench(b, 4096, 2048, 32000, at::kFloat);
    } else {
      head_bench(b, 512, 256, 8000, at::kFloat);
    }
  }
  if (!json.empty()) write_json(json, b.rows);
  return 0;
}

}  // namespace trellis::cli
