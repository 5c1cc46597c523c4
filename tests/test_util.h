// Shared test helpers: random inputs, brute-force enumeration of label sequences, finite differences.
#pragma once
#include <ATen/ATen.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "trellis/error.h"
#include "trellis/crf/linear_chain_crf.h"

namespace trellis::testing {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

inline at::Tensor randn(std::vector<int64_t> shape, at::ScalarType dtype = at::kDouble, double scale = 1.0) {
  return at::randn(shape, at::TensorOptions().dtype(dtype)) * scale;
}

inline bool has_cuda() { return at::hasCUDA(); }

#define TRELLIS_REQUIRE_CUDA() \
  if (!::trellis::testing::has_cuda()) GTEST_SKIP() << "no CUDA device"

// A fresh, empty directory under GoogleTest's temporary directory, removed with the files in it when it goes out of
// scope. POSIX calls rather than std::filesystem: libtorch.so exports its own copies of some std::filesystem functions
// (remove_all among them) that crash when they interpose on a test's.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "trellis_") {
    std::string pattern = ::testing::TempDir() + prefix + "XXXXXX";
    if (!::mkdtemp(pattern.data())) throw std::runtime_error("mkdtemp " + pattern + " failed");
    path = pattern;
  }
  ~TempDir() {
    for (const std::string& name : list_dir(path)) std::remove((path + "/" + name).c_str());
    ::rmdir(path.c_str());
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string operator/(const std::string& name) const { return path + "/" + name; }

  // The names in `dir`, sorted, without "." and "..".
  static std::vector<std::string> list_dir(const std::string& dir) {
    std::vector<std::string> names;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (const dirent* e = ::readdir(d))
        if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") names.push_back(e->d_name);
      ::closedir(d);
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  std::string path;
};

// Random chain potentials in float64 with optional start/end and random lengths in [1, T].
inline ChainPotentials random_chain(int64_t B, int64_t T, int64_t K, bool with_ends = true, bool ragged = true) {
  ChainPotentials p;
  p.emissions = randn({B, T, K});
  p.transitions = randn({K, K});
  if (with_ends) {
    p.start = randn({K});
    p.end = randn({K});
  }
  if (ragged) {
    p.lengths = at::randint(1, T + 1, {B}, at::kLong);
    p.lengths[0] = T;
    if (B > 1) p.lengths[1] = 1;
  }
  return p;
}

// Every label sequence of one batch element, with its total score, by enumeration (float64).
struct Enumeration {
  std::vector<std::vector<int64_t>> paths;
  std::vector<double> scores;
  double log_partition() const {
    double m = -kInf;
    for (double s : scores) m = std::max(m, s);
    if (m == -kInf) return -kInf;
    double z = 0;
    for (double s : scores) z += std::exp(s - m);
    return m + std::log(z);
  }
  std::size_t best() const { return std::max_element(scores.begin(), scores.end()) - scores.begin(); }
};

inline Enumeration enumerate(const ChainPotentials& p, int64_t b) {
  const at::Tensor e = p.emissions.detach().to(at::kDouble).cpu(), w = p.transitions.detach().to(at::kDouble).cpu();
  const int64_t T = p.lengths.defined() ? p.lengths[b].item<int64_t>() : e.size(1), K = e.size(2);
  auto E = e.accessor<double, 3>();
  auto W = w.accessor<double, 2>();
  Enumeration out;
  std::vector<int64_t> y(T, 0);
  while (true) {
    double s = 0;
    for (int64_t t = 0; t < T; ++t) {
      s += E[b][t][y[t]];
      if (t > 0) s += W[y[t - 1]][y[t]];
    }
    if (p.start.defined()) s += p.start[y[0]].item<double>();
    if (p.end.defined()) s += p.end[y[T - 1]].item<double>();
    out.paths.push_back(y);
    out.scores.push_back(s);
    int64_t t = T - 1;
    while (t >= 0 && ++y[t] == K) y[t--] = 0;
    if (t < 0) break;
  }
  return out;
}

// Central finite differences of a scalar function of x (float64).
inline at::Tensor numeric_gradient(const std::function<double(const at::Tensor&)>& f, const at::Tensor& x,
                                   double h = 1e-6) {
  at::Tensor g = at::zeros_like(x);
  at::Tensor xf = x.detach().clone().contiguous();
  auto flat = xf.view({-1});
  auto gflat = g.view({-1});
  for (int64_t i = 0; i < flat.numel(); ++i) {
    const double v = flat[i].item<double>();
    flat[i] = v + h;
    const double up = f(xf);
    flat[i] = v - h;
    const double down = f(xf);
    flat[i] = v;
    gflat[i] = (up - down) / (2 * h);
  }
  return g;
}

inline void expect_close(const at::Tensor& actual, const at::Tensor& expected, double rtol = 1e-9, double atol = 1e-9) {
  ASSERT_EQ(actual.sizes(), expected.sizes());
  const at::Tensor a = actual.detach().to(at::kDouble).cpu(), b = expected.detach().to(at::kDouble).cpu();
  EXPECT_FALSE(a.isnan().any().item<bool>()) << "NaN in result";
  EXPECT_TRUE(at::allclose(a, b, rtol, atol, /*equal_nan=*/false))
      << "max abs diff " << (a - b).abs().nan_to_num(0, 0, 0).max().item<double>() << "\nactual:\n"
      << a << "\nexpected:\n"
      << b;
}

}  // namespace trellis::testing
