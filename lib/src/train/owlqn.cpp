#include "lib/src/train/owlqn.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "lib/src/semiring/fixed_order_sum.h"

namespace trellis {
namespace {

using Tensors = std::vector<at::Tensor>;

double dot(const Tensors& a, const Tensors& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d += fixed_order_dot(a[i], b[i]);
  return d;
}

Tensors clone(const Tensors& a) {
  Tensors c;
  for (const auto& t : a) c.push_back(t.detach().clone());
  return c;
}

}  // namespace

OwlQn::OwlQn(std::vector<at::Tensor> params, double c1, std::function<double()> smooth, int history,
             int max_line_search)
    : params_(std::move(params)), c1_(c1), smooth_(std::move(smooth)), history_(history),
      max_line_search_(max_line_search) {}

double OwlQn::evaluate() {
  double f = 0;
  {
    c10::AutoGradMode grad_on(true);  // step() runs without autograd; the objective needs it for its gradient
    f = smooth_();
  }
  c10::NoGradGuard no_grad;
  grad_.clear();
  for (auto& p : params_) {
    f += c1_ * fixed_order_abs_sum(p);
    grad_.push_back(p.grad().detach().clone());
  }
  return f;
}

Tensors OwlQn::pseudo_gradient() const {
  c10::NoGradGuard no_grad;
  Tensors pg;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& x = params_[i];
    const at::Tensor& g = grad_[i];
    // Away from zero the L1 term's slope is c1·sign(θ); at zero, the one-sided slope that descends, if any.
    const at::Tensor at_zero = at::where(g + c1_ < 0, g + c1_, at::where(g - c1_ > 0, g - c1_, at::zeros_like(g)));
    pg.push_back(at::where(x > 0, g + c1_, at::where(x < 0, g - c1_, at_zero)));
  }
  return pg;
}

double OwlQn::pseudo_gradient_norm() const {
  if (!started_) return 0.0;
  const Tensors pg = pseudo_gradient();
  return std::sqrt(dot(pg, pg));
}

double OwlQn::step() {
  c10::NoGradGuard no_grad;
  if (!started_) {
    value_ = evaluate();
    started_ = true;
  }
  const Tensors pg = pseudo_gradient();
  // Two-loop recursion: d = -H·pg with the curvature pairs of the smooth part.
  Tensors d;
  for (const auto& t : pg) d.push_back(-t);
  std::vector<double> alpha(sy_.size()), rho(sy_.size());
  for (std::size_t j = sy_.size(); j-- > 0;) {
    const auto& [s, y] = sy_[j];
    rho[j] = 1.0 / dot(y, s);
    alpha[j] = rho[j] * dot(s, d);
    for (std::size_t i = 0; i < d.size(); ++i) d[i].sub_(y[i], alpha[j]);
  }
  if (!sy_.empty()) {
    const auto& [s, y] = sy_.back();
    const double gamma = dot(s, y) / dot(y, y);
    for (auto& t : d) t.mul_(gamma);
  }
  for (std::size_t j = 0; j < sy_.size(); ++j) {
    const auto& [s, y] = sy_[j];
    const double beta = rho[j] * dot(y, d);
    for (std::size_t i = 0; i < d.size(); ++i) d[i].add_(s[i], alpha[j] - beta);
  }
  // Keep only the components that descend along the pseudo-gradient; the orthant is the current signs, or the
  // descent direction's at zeros.
  Tensors orthant;
  for (std::size_t i = 0; i < d.size(); ++i) {
    d[i] = at::where(d[i] * pg[i] < 0, d[i], at::zeros_like(d[i]));
    const at::Tensor& x = params_[i];
    orthant.push_back(at::where(x != 0, x.sign(), (-pg[i]).sign()));
  }
  const double slope = dot(pg, d);
  if (!(slope < 0)) return value_;  // nothing descends: at a minimum
  const Tensors x0 = clone(params_), g0 = grad_;
  const double f0 = value_;
  // The first step is scaled so that it moves by 1 in norm, as liblbfgs does; later ones try the quasi-Newton step.
  double step = sy_.empty() ? 1.0 / std::sqrt(dot(d, d)) : 1.0;
  for (int k = 0; k < max_line_search_; ++k, step *= 0.5) {
    double decrease = 0;  // pg·(x - x0), the first-order decrease the Armijo test asks a share of
    for (std::size_t i = 0; i < params_.size(); ++i) {
      at::Tensor x = x0[i] + step * d[i];
      x = at::where(x.sign() == orthant[i], x, at::zeros_like(x));  // projected back onto the orthant
      params_[i].copy_(x);
      decrease += fixed_order_dot(pg[i], x - x0[i]);
    }
    const double f = evaluate();
    if (f <= f0 + 1e-4 * decrease) {
      Tensors s, y;
      for (std::size_t i = 0; i < params_.size(); ++i) {
        s.push_back(params_[i].detach() - x0[i]);
        y.push_back(grad_[i] - g0[i]);
      }
      if (dot(s, y) > 0) {  // curvature pairs must be positive for H to stay positive definite
        sy_.emplace_back(std::move(s), std::move(y));
        if (static_cast<int>(sy_.size()) > history_) sy_.pop_front();
      }
      value_ = f;
      return f;
    }
  }
  for (std::size_t i = 0; i < params_.size(); ++i) params_[i].copy_(x0[i]);  // no lower point found
  grad_ = g0;
  for (std::size_t i = 0; i < params_.size(); ++i) params_[i].mutable_grad().copy_(g0[i]);
  return value_;
}

}  // namespace trellis

namespace trellis {
namespace {

// The minimiser of the cubic through (x1, f1) and (x2, f2) with slopes g1 and g2, clamped to [lo, hi].
double cubic_interpolate(double x1, double f1, double g1, double x2, double f2, double g2, double lo, double hi) {
  const double d1 = g1 + g2 - 3 * (f1 - f2) / (x1 - x2);
  const double d2_square = d1 * d1 - g1 * g2;
  if (d2_square < 0) return (lo + hi) / 2;
  const double d2 = std::sqrt(d2_square);
  const double min_pos = x1 <= x2 ? x2 - (x2 - x1) * ((g2 + d2 - d1) / (g2 - g1 + 2 * d2))
                                  : x1 - (x1 - x2) * ((g1 + d2 - d1) / (g1 - g2 + 2 * d2));
  return std::min(std::max(min_pos, lo), hi);
}

double cubic_interpolate(double x1, double f1, double g1, double x2, double f2, double g2) {
  return cubic_interpolate(x1, f1, g1, x2, f2, g2, std::min(x1, x2), std::max(x1, x2));
}

}  // namespace

Lbfgs::Lbfgs(std::vector<at::Tensor> params, std::function<double()> objective, int history, int max_line_search)
    : params_(std::move(params)), objective_(std::move(objective)), history_(history),
      max_line_search_(max_line_search) {
  for (const auto& p : params_) size_ += p.numel();
}

void Lbfgs::move_to(double t) {
  int64_t offset = 0;
  for (auto& p : params_) {
    const int64_t n = p.numel();
    at::add_out(p, x0_.narrow(0, offset, n).view_as(p), d_.narrow(0, offset, n).view_as(p), t);
    offset += n;
  }
}

double Lbfgs::evaluate_at(double t) {
  move_to(t);
  double f = 0;
  {
    c10::AutoGradMode grad_on(true);  // step() runs without autograd; the objective needs it for its gradient
    f = objective_();
  }
  int64_t offset = 0;
  for (const auto& p : params_) {
    g_new_.narrow(0, offset, p.numel()).copy_(p.grad().reshape(-1));
    offset += p.numel();
  }
  return f;
}

double Lbfgs::gradient_norm() const { return started_ ? std::sqrt(fixed_order_dot(g_, g_)) : 0.0; }

double Lbfgs::strong_wolfe(double t, double gtd) {
  constexpr double c1 = 1e-4, c2 = 0.9, tolerance_change = 1e-9;
  const double d_norm = d_.abs().max().item<double>();
  const double f = value_;
  double f_new = evaluate_at(t);
  double gtd_new = fixed_order_dot(g_new_, d_);
  // A bracket [t_0, t_1] with values, gradients and slopes along d; g_ stays the gradient at t = 0 until the end.
  double t_prev = 0, f_prev = f, gtd_prev = gtd;
  at::Tensor g_prev = g_;
  std::array<double, 2> bracket{}, bracket_f{}, bracket_gtd{};
  std::array<at::Tensor, 2> bracket_g;
  int points = 0;  // in the bracket: 1 when the first phase found a point meeting both conditions
  bool done = false;
  int ls_iter = 0;
  while (ls_iter < max_line_search_) {
    if (f_new > f + c1 * t * gtd || (ls_iter > 1 && f_new >= f_prev) || gtd_new >= 0) {
      bracket = {t_prev, t}, bracket_f = {f_prev, f_new}, bracket_gtd = {gtd_prev, gtd_new};
      bracket_g = {g_prev, g_new_.clone()};
      points = 2;
      break;
    }
    if (std::abs(gtd_new) <= -c2 * gtd) {
      bracket[0] = t, bracket_f[0] = f_new, bracket_g[0] = g_new_.clone();
      points = 1;
      done = true;
      break;
    }
    const double min_step = t + 0.01 * (t - t_prev), max_step = t * 10, tried = t;
    t = cubic_interpolate(t_prev, f_prev, gtd_prev, t, f_new, gtd_new, min_step, max_step);
    t_prev = tried, f_prev = f_new, gtd_prev = gtd_new;
    g_prev = g_new_.clone();
    f_new = evaluate_at(t);
    gtd_new = fixed_order_dot(g_new_, d_);
    ++ls_iter;
  }
  if (ls_iter == max_line_search_) {
    bracket = {0, t}, bracket_f = {f, f_new}, bracket_gtd = {gtd, gtd_new};
    bracket_g = {g_, g_new_.clone()};
    points = 2;
  }
  // Zoom: shrink the bracket until a point meets both Wolfe conditions.
  bool insufficient_progress = false;
  int low = 0, high = 1;
  if (points == 2 && bracket_f[0] > bracket_f[1]) low = 1, high = 0;
  while (!done && ls_iter < max_line_search_) {
    if (std::abs(bracket[1] - bracket[0]) * d_norm < tolerance_change) break;
    t = cubic_interpolate(bracket[0], bracket_f[0], bracket_gtd[0], bracket[1], bracket_f[1], bracket_gtd[1]);
    // Near an end of the bracket twice running (or beyond it): 0.1 of the bracket away from that end instead.
    const double top = std::max(bracket[0], bracket[1]), bottom = std::min(bracket[0], bracket[1]);
    const double eps = 0.1 * (top - bottom);
    if (std::min(top - t, t - bottom) < eps) {
      if (insufficient_progress || t >= top || t <= bottom) {
        t = std::abs(t - top) < std::abs(t - bottom) ? top - eps : bottom + eps;
        insufficient_progress = false;
      } else {
        insufficient_progress = true;
      }
    } else {
      insufficient_progress = false;
    }
    f_new = evaluate_at(t);
    gtd_new = fixed_order_dot(g_new_, d_);
    ++ls_iter;
    if (f_new > f + c1 * t * gtd || f_new >= bracket_f[low]) {
      bracket[high] = t, bracket_f[high] = f_new, bracket_g[high] = g_new_.clone(), bracket_gtd[high] = gtd_new;
      if (bracket_f[0] <= bracket_f[1]) low = 0, high = 1;
      else low = 1, high = 0;
    } else {
      if (std::abs(gtd_new) <= -c2 * gtd) {
        done = true;
      } else if (gtd_new * (bracket[high] - bracket[low]) >= 0) {
        bracket[high] = bracket[low], bracket_f[high] = bracket_f[low];
        bracket_g[high] = bracket_g[low], bracket_gtd[high] = bracket_gtd[low];
      }
      bracket[low] = t, bracket_f[low] = f_new, bracket_g[low] = g_new_.clone(), bracket_gtd[low] = gtd_new;
    }
  }
  value_ = bracket_f[low];
  g_ = bracket_g[low];
  return bracket[low];
}

double Lbfgs::step() {
  c10::NoGradGuard no_grad;
  if (!started_) {
    const at::TensorOptions options = params_.front().options().requires_grad(false);
    x0_ = at::empty({size_}, options);
    g_new_ = at::empty({size_}, options);
    int64_t offset = 0;
    for (const auto& p : params_) x0_.narrow(0, offset, p.numel()).copy_(p.reshape(-1)), offset += p.numel();
    d_ = at::zeros({size_}, options);
    value_ = evaluate_at(0);
    g_ = g_new_.clone();
    started_ = true;
  }
  constexpr double tolerance_grad = 1e-12;
  if (g_.abs().max().item<double>() <= tolerance_grad) return value_;
  const bool first = !g_prev_.defined();
  if (first) {
    d_ = -g_;
  } else {
    at::Tensor s = d_ * t_, y = g_ - g_prev_;
    const double ys = fixed_order_dot(y, s);
    if (ys > 1e-10) {  // curvature pairs must be positive for H to stay positive definite
      if (static_cast<int>(sy_.size()) == history_) sy_.pop_front(), rho_.pop_front();
      h_diag_ = ys / fixed_order_dot(y, y);
      sy_.emplace_back(std::move(s), std::move(y));
      rho_.push_back(1 / ys);
    }
    // Two-loop recursion: d = -H·g.
    at::Tensor q = -g_;
    std::vector<double> alpha(sy_.size());
    for (std::size_t i = sy_.size(); i-- > 0;) {
      alpha[i] = fixed_order_dot(sy_[i].first, q) * rho_[i];
      q.sub_(sy_[i].second, alpha[i]);
    }
    q.mul_(h_diag_);
    for (std::size_t i = 0; i < sy_.size(); ++i) {
      const double beta = fixed_order_dot(sy_[i].second, q) * rho_[i];
      q.add_(sy_[i].first, alpha[i] - beta);
    }
    d_ = q;
  }
  g_prev_ = g_;
  // The first step moves by at most 1 in the 1-norm of the gradient; later ones try the quasi-Newton step.
  const double t = first ? std::min(1.0, 1.0 / fixed_order_abs_sum(g_)) : 1.0;
  const double gtd = fixed_order_dot(g_, d_);
  if (gtd > 0) return value_;  // not a descent direction: the parameters stay
  // x0_ is the current point; the line search leaves the parameters wherever it evaluated last.
  int64_t offset = 0;
  for (const auto& p : params_) x0_.narrow(0, offset, p.numel()).copy_(p.reshape(-1)), offset += p.numel();
  t_ = strong_wolfe(t, gtd);
  move_to(t_);
  return value_;
}

}  // namespace trellis
