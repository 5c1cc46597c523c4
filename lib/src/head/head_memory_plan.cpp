// How much memory the head's training routes take and which route and slab a memory budget picks
// (HeadOptions::memory_budget, plan_head_memory).
#include <ATen/ATen.h>

#include <algorithm>

#include "cuda/linear_head.h"  // the kernels, or the stubs of a build without nvcc (cuda/no_kernels.cpp)
#include "lib/src/head/head_problem.h"
#include "lib/src/io/message.h"
#include "trellis/error.h"

namespace trellis {
namespace head_detail {

// Rows of a slab of `bytes` of logits: whole multiples of 256 where that leaves any (whole GEMM tiles: no ragged last
// wave), at least one.
int64_t slab_rows(const Head& h, int64_t bytes) {
  const int64_t rows = std::max<int64_t>(1, bytes / (h.vocabulary() * static_cast<int64_t>(at::elementSize(h.acc))));
  return rows >= 256 ? rows - rows % 256 : rows;
}

bool fused_applies(const Head& h) { return h.x.is_cuda() && cuda::fused_linear_head_applies(h.x, h.weight); }

int64_t input_type_slab_row_bytes(const Head& h) {
  const int64_t tiles = (h.vocabulary() + cuda::kExponentialTileColumns - 1) / cuda::kExponentialTileColumns;
  return h.vocabulary() * h.x.element_size() + tiles * static_cast<int64_t>(sizeof(float));
}

int64_t input_type_slab_rows(const Head& h, int64_t bytes) {
  const int64_t rows = std::max<int64_t>(1, bytes / input_type_slab_row_bytes(h));
  return rows >= 256 ? rows - rows % 256 : rows;
}

bool input_type_slabs_apply(const Head& h) {
  const at::ScalarType t = h.x.scalar_type();
  return t == at::kBFloat16 || (t == at::kHalf && !h.softcap);
}

namespace {

// Bytes beside the per-row values for the small temporaries of a route's steps: ATen's tensor operations, or the
// training slabs in x's type, whose steps are kernels and GEMMs into the buffers they hold.
constexpr int64_t kTemporariesMargin = int64_t(1) << 20;
constexpr int64_t kInputTypeSlabsMargin = int64_t(64) << 10;
// The training slabs in x's type: bytes per slab row beside the slab for the slab's statistics and loss.
constexpr int64_t kInputTypeSlabRowValues = 256;

// What training allocates beyond inputs and gradients, by route (an upper estimate, HeadMemoryPlan::extra_bytes).
struct Footprint {
  int64_t fixed = 0;          // per-row values (targets, weights, lse, loss), the bias' float sums
  int64_t slab_element = 0;   // bytes per logit of a slab: the logits, and the gradient where it cannot take their
                              // memory (CUDA writes it over them where the types match or the in-place kernel runs)
  int64_t chunk_element = 0;  // bytes per logit of the recompute route's chunks (forward statistics and gradient)
  int64_t dx_sum = 0;         // 16-bit x: dx's float32 sum
};

Footprint footprint(const Head& h) {
  const int64_t acc = at::elementSize(h.acc), in = h.x.element_size(), N = h.rows(), V = h.vocabulary();
  const bool cuda = h.x.is_cuda(), fused = fused_applies(h), half = in != acc;
  Footprint f;
  f.fixed = N * 64 + (h.bias.defined() ? 2 * V * acc : 0) + kTemporariesMargin;
  // CPU: the logits and the gradient in x's type beside them, with a second slab of float32 as a margin for ATen's
  // temporaries; CUDA: the gradient beside 16-bit logits only where the in-place kernel (compute capability 9.0) does
  // not run.
  f.slab_element = cuda ? acc + (half && !fused ? in : 0) : 2 * acc + (half ? in : 0);
  // The fused kernel writes a chunk's gradient in x's type from its tiles; elsewhere a chunk is a slab (and the
  // forward's chunked statistics hold a chunk of logits and their exponentials).
  f.chunk_element = fused ? in : std::max(f.slab_element, 2 * acc);
  f.dx_sum = half ? N * h.x.size(1) * acc : 0;
  return f;
}

}  // namespace

HeadMemoryPlan memory_plan(const Head& h, const HeadOptions& o) {
  const Footprint f = footprint(h);
  const int64_t N = std::max<int64_t>(h.rows(), 1), V = h.vocabulary(), D = h.x.size(1);
  const int64_t acc = at::elementSize(h.acc), row_bytes = D * h.weight.element_size();
  const bool fused = fused_applies(h);
  // dx's sum fits in dW's last rows when it takes at most half of dW (recomputed_gradients).
  const bool sum_in_dw = f.dx_sum > 0 && f.dx_sum <= V * row_bytes / 2;
  HeadMemoryPlan p;
  const auto recompute = [&](int64_t columns, bool own_sum) {
    p.recompute_logits = true;
    p.slab_type = fused ? h.x.scalar_type() : h.acc;
    p.own_dx_sum = own_sum;
    p.slab_bytes = N * columns * static_cast<int64_t>(at::elementSize(p.slab_type));
    p.extra_bytes = f.fixed + (own_sum || !sum_in_dw ? f.dx_sum : 0) + N * columns * f.chunk_element;
  };
  // Where the fused kernel runs, slabs in x's type (half the bytes of float32 logits per row: twice the rows), with or
  // without a budget.
  const bool input_type = fused && input_type_slabs_apply(h);
  const int64_t slab_fixed = input_type ? f.fixed - kTemporariesMargin + kInputTypeSlabsMargin : f.fixed;
  const int64_t slab_row = input_type ? input_type_slab_row_bytes(h) + kInputTypeSlabRowValues : V * f.slab_element;
  if (o.memory_budget < 0) {
    if (o.recompute_logits) {
      const int64_t size = at::elementSize(fused ? h.x.scalar_type() : h.acc);
      const int64_t columns = std::clamp<int64_t>(o.chunk_bytes / (N * size), 1, 2048 / size);
      recompute(columns >= 8 ? columns / 8 * 8 : columns, false);
    } else if (input_type) {
      p.slab_type = h.x.scalar_type();
      p.slab_bytes = o.chunk_bytes;
      p.extra_bytes = slab_fixed + std::min(input_type_slab_rows(h, o.chunk_bytes), N) * slab_row;
    } else {
      p.slab_bytes = o.chunk_bytes;
      const int64_t rows = std::min(slab_rows(h, o.chunk_bytes), N);
      p.extra_bytes = f.fixed + rows * V * f.slab_element;
    }
    return p;
  }
  const int64_t budget = o.memory_budget - f.fixed;
  const int64_t rows = o.memory_budget > slab_fixed ? (o.memory_budget - slab_fixed) / slab_row : 0;
  const auto slabs = [&] {
    const int64_t whole = std::min(rows >= 256 ? rows - rows % 256 : rows, N);
    p.slab_type = input_type ? h.x.scalar_type() : h.acc;
    p.slab_bytes = whole * (input_type ? input_type_slab_row_bytes(h) : V * acc);
    p.extra_bytes = slab_fixed + whole * slab_row;
    return p;
  };
  if (rows >= std::min(kBudgetMinSlabRows, N)) return slabs();
  // dx's sum beside the chunks where both fit, so that no chunk runs twice; in dW's last rows where it can go there.
  const int64_t least = N * kBudgetMinColumns * f.chunk_element;
  const bool own_sum = f.dx_sum > 0 && (!sum_in_dw || budget - f.dx_sum >= least);
  const int64_t for_chunks = budget - (own_sum ? f.dx_sum : 0);
  if (for_chunks < least && rows >= 1) return slabs();  // dx's sum alone would exceed it: the slabs that fit
  if (for_chunks < least)
    throw Error(message::text("linear head: memory_budget = ", o.memory_budget, " bytes is below the least that ",
                              "training on N = ", h.rows(), ", V = ", V, ", D = ", D, " needs: ",
                              f.fixed + (own_sum ? f.dx_sum : 0) + least, " bytes (HeadOptions::memory_budget)"));
  const int64_t columns = std::min(for_chunks / (N * f.chunk_element), V);
  recompute(columns >= 8 ? columns / 8 * 8 : columns, own_sum);
  return p;
}

}  // namespace head_detail

HeadMemoryPlan plan_head_memory(const at::Tensor& x, const at::Tensor& weight, const HeadOptions& head) {
  return head_detail::memory_plan(head_detail::prepare(x, weight, {}, head), head);
}

}  // namespace trellis
