// The LLM head's validated inputs and the pieces every route shares: the logits of a block of rows and columns (GEMMs
// into the accumulation type, bias, soft-cap), the target's column in a block, a block's loss gradient, a row's loss.
// The routes (head_routes.h) build on these: row slabs (head_row_slabs.cpp), vocabulary chunks and the recomputed
// gradients (head_column_chunks.cpp), the fused Hopper kernel (head_fused.cpp); head_memory_plan.cpp sizes them.
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "lib/src/head/row_stats.h"
#include "trellis/head/linear_cross_entropy.h"

namespace trellis::head_detail {

// Validated, flattened inputs and the slab size.
struct Head {
  at::Tensor x, weight, bias, targets;  // [N,D], [V,D], [V] or undefined, [N] int64 or undefined
  std::optional<double> softcap;
  int64_t ignore_index = -100;
  at::ScalarType acc = at::kFloat;  // the type logits and statistics are formed in
  std::vector<int64_t> row_shape;   // x's leading dimensions, the shape of per-row results
  int64_t rows_per_slab = 1;
  // The training slabs in x's type (HeadRoute::kInputTypeSlabs): the rows of one (chunk_bytes of them), and whether
  // the plan picks them.
  int64_t input_type_rows_per_slab = 1;
  bool input_type_slabs = false;
  int64_t chunk_bytes = 0;
  bool recompute = false;  // HeadOptions::recompute_logits
  // Under a memory_budget: the recompute route's chunk of vocabulary columns (0: chunk_bytes and 2 KiB per row
  // decide), and whether dx's float32 sum has a buffer of its own (else it may sit in dW's last rows).
  int64_t chunk_columns = 0;
  bool own_dx_sum = false;
  int64_t total_vocabulary = 0;  // when W is one slice of a vocabulary split over ranks: the whole one's size

  int64_t rows() const { return x.size(0); }
  int64_t vocabulary() const { return weight.size(0); }
  // The V of label smoothing's ε/V: the whole vocabulary's size, also where W holds a slice of it.
  int64_t smoothing_vocabulary() const { return total_vocabulary ? total_vocabulary : vocabulary(); }
};

// Per-row statistics (lse, target logit, Σ z, Σ p·z), the same whichever route forms them.
using SlabStats = HeadRowStats;

struct Gradients {
  at::Tensor x, weight, bias;  // undefined where not wanted
};

// Checks and flattens the inputs and plans the memory (memory_plan). check_targets: whether to look at every target
// (one device-to-host copy); backward skips it, forward has done it.
Head prepare(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets, const HeadOptions& o,
             bool check_targets = true);

// head_memory_plan.cpp: rows of a slab of `bytes` of logits, and the route, slab and type that o picks for h
// (HeadOptions::memory_budget, else chunk_bytes and recompute_logits), assuming gradients for x and W.
int64_t slab_rows(const Head& h, int64_t bytes);
// The same for the training slabs in x's type, whose row is V values in x's type and a float32 reference per 256
// columns (input_type_slab_row_bytes); input_type_slabs_apply: x is 16-bit, and not float16 with a soft-cap (whose
// derivative needs logits that float16's exponentials may have lost to underflow).
int64_t input_type_slab_row_bytes(const Head& h);
int64_t input_type_slab_rows(const Head& h, int64_t bytes);
bool input_type_slabs_apply(const Head& h);
HeadMemoryPlan memory_plan(const Head& h, const HeadOptions& o);

// Whether the fused Hopper kernel forms the statistics and the recompute route's gradient chunks for x and W.
bool fused_applies(const Head& h);

// a·b in the accumulation type: CUDA GEMMs read bfloat16/float16 operands and write float32 logits directly; on the
// CPU the operands are converted (the CPU path is the reference, not the fast one).
at::Tensor mm_acc(const at::Tensor& a, const at::Tensor& b, at::ScalarType acc);
// out = a·b, or out += a·b unless `first`, in out's type (the inputs' or the accumulation type), the same way.
void mm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b, bool first);

// The soft-cap c·tanh(z/c) applied to logits z in place, where h has one.
void soft_cap(const Head& h, at::Tensor& z);
// Bias and, if capped, the soft-cap applied to logits of vocabulary columns [v0, v0 + z.size(1)), in place.
void finish_logits(const Head& h, at::Tensor& z, int64_t v0, bool capped = true);
// Logits of rows [r0, r0 + n), [n, V] in the accumulation type; soft-capped unless !capped (for a kernel that caps
// them as it reads them).
at::Tensor slab_logits(const Head& h, int64_t r0, int64_t n, bool capped = true);

at::Tensor valid_targets(const at::Tensor& targets, int64_t ignore_index);
// Where targets t fall among vocabulary columns [v0, v0 + c): each one's column there (0 where it is not there) and
// whether it is (never for ignored targets).
std::pair<at::Tensor, at::Tensor> target_columns(const Head& h, const at::Tensor& t, int64_t v0, int64_t c);
// The target logit (0 where the target is ignored or outside the block's columns [v0, ...)) and, if wanted, Σ z of
// each row of a block of logits z whose first row is r0.
void target_and_sum(const Head& h, const at::Tensor& z, int64_t r0, int64_t v0, bool want_sum, SlabStats& s);

// Per-row loss (0 for ignored rows) from the statistics (head_maths::row_loss).
at::Tensor row_loss(const Head& h, const SlabStats& s, const at::Tensor& valid, const LossOptions& o);

// dL/dz for a block of logits z (rows [r0, r0 + n) of vocabulary columns [v0, v0 + c)) in the input type, ready for
// the GEMMs: head_maths::logit_gradient with each row's lse and weight g (0 for ignored rows). z is consumed: on CUDA
// one pass writes dz over z's own memory (the first half of each float32 row for 16-bit inputs), soft-capping each
// logit as it reads it unless capped says z is capped already; on the CPU the cap by tensor operations (where not
// capped), then one loop over the rows.
at::Tensor logit_gradient(const Head& h, at::Tensor z, const at::Tensor& lse, const at::Tensor& g, int64_t r0,
                          int64_t v0, const LossOptions& o, bool capped);

}  // namespace trellis::head_detail
