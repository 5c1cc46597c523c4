// The CRF trainer's full-batch quasi-Newton optimisers: L-BFGS with a strong Wolfe line search, and OWL-QN (Andrew &
// Gao 2007): L-BFGS for f(θ) + c1·‖θ‖₁ with smooth f, as CRFsuite and Wapiti train L1 CRFs. Their sums are
// fixed-order (fixed_order_sum.h), so their iterates are the same bits on any number of threads. Internal to the
// library; both work on a list of parameter tensors in place.
#pragma once
#include <ATen/core/Tensor.h>

#include <deque>
#include <functional>
#include <vector>

namespace trellis {

// LibTorch's torch::optim::LBFGS step (max_iter 1, line_search_fn "strong_wolfe", after PyTorch's and minFunc's),
// whose dot products and sums are ATen's and MKL's: their rounding, and so every iterate after the first, depends on
// the thread count. Scalars here are float64; vectors are the parameters' flattened float32 or float64 values.
class Lbfgs {
 public:
  // `objective` sets each parameter's .grad() to the gradient at the current values and returns the value.
  Lbfgs(std::vector<at::Tensor> params, std::function<double()> objective, int history = 6, int max_line_search = 25);

  // One quasi-Newton step. Returns the objective at the new point, or at the old one when no direction descends
  // (then the parameters are unchanged).
  double step();
  double gradient_norm() const;  // at the current point (0 before the first step)

 private:
  double evaluate_at(double t);  // the objective at x0_ + t·d_, its gradient left in g_new_
  void move_to(double t);        // parameters = x0_ + t·d_
  // The strong Wolfe line search along d_ from x0_: the step taken; value_ and g_ become those at it.
  double strong_wolfe(double t, double gtd);

  std::vector<at::Tensor> params_;
  std::function<double()> objective_;
  int history_, max_line_search_;
  int64_t size_ = 0;
  std::deque<std::pair<at::Tensor, at::Tensor>> sy_;  // (s, y) pairs, newest last
  std::deque<double> rho_;                            // 1 / (y·s) of each pair
  double h_diag_ = 1;                                 // scale of the initial inverse Hessian
  at::Tensor x0_, d_, g_, g_prev_, g_new_;            // flat: start point, direction, gradients
  double value_ = 0, t_ = 0;                          // the objective at the current point; the last step taken
  bool started_ = false;
};

class OwlQn {
 public:
  // `smooth` sets each parameter's .grad() to ∂f/∂θ at the current values and returns f (a double).
  OwlQn(std::vector<at::Tensor> params, double c1, std::function<double()> smooth, int history = 6,
        int max_line_search = 25);

  // One quasi-Newton step with a backtracking line search that stays in the orthant of the current point. Returns
  // the objective f + c1·‖θ‖₁ at the new point, or the old one when the line search found no lower point (then the
  // parameters are unchanged).
  double step();
  // The norm of the pseudo-gradient (the gradient of the L1 objective, minimal-norm at zeros) at the current point.
  double pseudo_gradient_norm() const;

 private:
  std::vector<at::Tensor> pseudo_gradient() const;
  double evaluate();  // smooth() + c1·‖θ‖₁, and keeps the gradients

  std::vector<at::Tensor> params_;
  double c1_;
  std::function<double()> smooth_;
  int history_, max_line_search_;
  std::deque<std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>> sy_;  // (s, y) pairs, newest last
  std::vector<at::Tensor> grad_;                                                // smooth gradient at the point
  double value_ = 0;
  bool started_ = false;
};

}  // namespace trellis
