// The statistics route of the fused Hopper kernel (cuda/linear_lse_sm90.cu through cuda/linear_head.cu): every row's
// statistics at once, the logits kept on chip. Its gradient mode runs inside the recompute route
// (head_column_chunks.cpp), which hands it the chunks.
#include <ATen/ATen.h>

#include "cuda/linear_head.h"  // the kernels, or the stubs of a build without nvcc (cuda/no_kernels.cpp)
#include "lib/src/head/head_routes.h"

namespace trellis::head_detail {

SlabStats fused_row_stats(const Head& h, bool want_sums) {
  SlabStats s;
  TORCH_CHECK(cuda::fused_linear_lse(h.x, h.weight, h.bias, h.targets, h.softcap.value_or(0), want_sums, s),
              "linear head: the fused kernel did not take the rows it was chosen for");
  if (h.targets.defined()) s.target_logit.mul_(valid_targets(h.targets, h.ignore_index));
  return s;
}

}  // namespace trellis::head_detail
