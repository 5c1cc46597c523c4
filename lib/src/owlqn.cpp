#include "owlqn.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>

namespace trellis {
namespace {

using Tensors = std::vector<at::Tensor>;

double dot(const Tensors& a, const Tensors& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d += (a[i] * b[i]).sum().item<double>();
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
    f += c1_ * p.abs().sum().item<double>();
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
      decrease += (pg[i] * (x - x0[i])).sum().item<double>();
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
