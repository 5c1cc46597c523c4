// head_maths.h's overloads for tensors of rows.
#include "lib/src/head/head_maths.h"

#include <ATen/ATen.h>

namespace trellis::head_maths {

at::Tensor max_of(const at::Tensor& a, const at::Tensor& b) { return at::maximum(a, b); }

at::Tensor rescale(const at::Tensor& from, const at::Tensor& to) {
  return at::where(to == -INFINITY, 0, (from - to).exp());
}

}  // namespace trellis::head_maths
