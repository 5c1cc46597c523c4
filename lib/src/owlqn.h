// OWL-QN (Andrew & Gao 2007): L-BFGS for f(θ) + c1·‖θ‖₁ with smooth f, as CRFsuite and Wapiti train L1 CRFs.
// Internal to the library; works on a list of parameter tensors in place.
#pragma once
#include <ATen/core/Tensor.h>

#include <deque>
#include <functional>
#include <vector>

namespace trellis {

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
  std::vector<at::Tensor> grad_;                                                  // smooth gradient at the point
  double value_ = 0;
  bool started_ = false;
};

}  // namespace trellis
