// Which computation answers each of the LLM head's quantities, decided in one place: choose_route() looks at the
// device, dtype, shape and options, and linear_cross_entropy.cpp runs what it returns. Tests force any route with
// ForcedHeadRoute, so that every route is checked against the reference whatever the device and options would pick
// (docs/architecture.md describes the routes and why each is chosen where it is).
#pragma once

#include <array>
#include <optional>

#include "lib/src/head/head_problem.h"
#include "lib/src/head/head_slice.h"

namespace trellis::head_detail {

enum class HeadQuantity {
  kStatistics,  // each row's lse, target logit, Σ z, Σ p·z: linear_logsumexp, token_logprobs, the loss's value
  kGradients,   // the loss's gradients for x, W and the bias, given the rows' weights
};

enum class HeadRoute {
  // Statistics:
  kFusedStatistics,  // head_fused.cpp: cuda/linear_lse_sm90.cu keeps the logits on chip (Hopper, 16-bit inputs)
  kColumnChunks,     // head_column_chunks.cpp: a chunk of vocabulary columns at a time, (max, sum) merged; no Σ p·z
  kRowSlabs,         // head_row_slabs.cpp: a slab of rows' logits at a time
  // Gradients:
  kTrainingSlabs,    // head_row_slabs.cpp: a slab of rows' logits becomes dL/dz, then dx rows and dW += dzᵀ·x
  kInputTypeSlabs,   // head_row_slabs.cpp: the same with a slab in x's type (16-bit): the fused kernel writes each
                     // logit's exponential relative to its tile's maximum beside the statistics, a pass turns them
                     // into dL/dz in place (Hopper; the CPU runs the same steps as their reference)
  kRecomputed,       // head_column_chunks.cpp: the logits formed again a chunk of columns at a time by a GEMM
  kRecomputedFused,  // the same chunks, dz formed on the fused kernel's tiles (Hopper, 16-bit inputs, targets given)
};

HeadQuantity quantity_of(HeadRoute route);
const char* route_name(HeadRoute route);

// Whether `route` can compute its quantity for h. want_expected: the statistics include Σ p·z (the entropy).
bool route_applies(HeadRoute route, const Head& h, bool want_expected = false);

// The route for `quantity`: the one forced for it while a ForcedHeadRoute lives on this thread (an Error naming it
// when it does not apply), else the fastest that applies (the recompute routes under recompute_logits or a memory
// budget that picks them).
HeadRoute choose_route(HeadQuantity quantity, const Head& h, bool want_expected = false);

// For tests: while alive, choose_route on this thread returns `route` for the route's quantity (the other quantity's
// choice is left as it was). Scopes nest; each restores the one before.
class ForcedHeadRoute {
 public:
  explicit ForcedHeadRoute(HeadRoute route);
  ~ForcedHeadRoute();
  ForcedHeadRoute(const ForcedHeadRoute&) = delete;
  ForcedHeadRoute& operator=(const ForcedHeadRoute&) = delete;

 private:
  HeadQuantity quantity_;
  std::optional<HeadRoute> previous_;
};

// The routes' entry points.
// head_fused.cpp: every row's statistics from the fused kernel (Σ z and Σ p·z when want_sums).
SlabStats fused_row_stats(const Head& h, bool want_sums);
// head_column_chunks.cpp: lse, target logit and (want_sum) Σ z a chunk of vocabulary columns at a time.
SlabStats chunked_stats(const Head& h, bool want_sum);
// head_row_slabs.cpp: every row's statistics a slab of rows at a time.
SlabStats slab_row_stats(const Head& h, bool want_sum, bool want_expected);

// head_row_slabs.cpp, the training slabs: gradients of Σ_i g_i·loss_i (g is 0 for ignored rows). lse, when given,
// saves recomputing it; loss, when given, receives the per-row loss. merge, when given: W is a slice of the
// vocabulary, and each slab's statistics (lse, target logit, Σ z) become the whole vocabulary's through it before the
// slab's gradient is formed; `merged` receives them for every row.
Gradients slab_gradients(const Head& h, const at::Tensor& g, at::Tensor lse, const LossOptions& o,
                         std::array<bool, 3> want, at::Tensor* loss = nullptr, const head_slice::Merge* merge = nullptr,
                         SlabStats* merged = nullptr);
// head_row_slabs.cpp: gradients of Σ_i (a_i·lse_i + b_i·log p_i(t_i) + c_i·H_i) (a, b or c undefined: 0), the
// backward of the statistics, a slab of rows at a time.
// head_row_slabs.cpp, the training slabs in x's type (HeadRoute::kInputTypeSlabs): as slab_gradients without a merge
// (lse, when given, is the gradient's; each slab forms its own statistics all the same).
Gradients input_type_slab_gradients(const Head& h, const at::Tensor& g, const at::Tensor& lse, const LossOptions& o,
                                    std::array<bool, 3> want, at::Tensor* loss = nullptr);
Gradients statistics_gradients(const Head& h, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                               std::array<bool, 3> want);
// head_column_chunks.cpp, the recompute routes: gradients of Σ_i g_i·loss_i given every row's lse, the logits formed
// again a chunk of vocabulary columns at a time; fused: dz on the fused kernel's tiles (HeadRoute::kRecomputedFused).
Gradients recomputed_gradients(const Head& h, const at::Tensor& g, const at::Tensor& lse, const LossOptions& o,
                               std::array<bool, 3> want, bool fused);

}  // namespace trellis::head_detail
