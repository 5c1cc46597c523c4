// Which computation answers each quantity of the linear-chain CRF, decided in one place: choose_route() looks at the
// device, dtype, label count, length and whether gradients are wanted, and linear_chain_crf.cpp runs what it returns.
// Tests force any route with ForcedChainRoute, so that every route is checked against the reference whatever the
// thresholds (docs/architecture.md describes the routes and why each is chosen where it is).
#pragma once

#include <cstdint>
#include <optional>

#include "trellis/crf/linear_chain_crf.h"

namespace trellis::detail {

enum class ChainQuantity { kLogPartition, kLogLikelihood, kMarginals, kViterbi };

enum class ChainRoute {
  kComposed,          // the semiring recursion composed of ATen operations (one per step); autograd differentiates it
  kFused,             // one pass over all steps and its reverse (lib/src/crf/chain_fused.cpp): the CPU loops, or the
                      // CUDA kernels (shared-memory transitions; the scaled many-label kernels for LogSemiring)
  kScaledForward,     // log Z only, without gradients: one scaled GEMM per step (or cuda/scaled_chain_forward.cu)
  kManyLabelViterbi,  // cuda/many_label_viterbi.cu: Viterbi past the shared-memory kernels' reach
  kWidened,           // a long float32 chain on a GPU route that does not rebase its messages: run in float64
};

// From this many labels on, log Z without gradients takes a scaled GEMM per step rather than K² log-space terms; on
// the CPU also from kScaledMinLabelsCpu labels when at least kScaledMinSequencesCpu sequences share each step's GEMM
// (fewer leave the step's dozen ATen operations to dominate).
constexpr int64_t kScaledMinLabels = 128;
constexpr int64_t kScaledMinLabelsCpu = 64, kScaledMinSequencesCpu = 64;

// Log-space messages grow to about −T·(nats per step), where float32 keeps only about 1e-2 absolutely. The CPU
// recursion and the shared-memory CUDA kernels rebase their messages each step; the other CUDA routes keep them
// unshifted. Long float32 sequences on those routes therefore run in float64 and come back in float32 (with autograd
// through the conversion), and so do very long ones on the shared-memory kernels, whose backward pass does not
// renormalise its adjoints as the CPU's does (rounding drifts by about 2e-9 per step): marginals stay within 1e-4 of
// float64 at every length.
constexpr int64_t kGpuFloat32MaxSteps = 256, kGpuRebasedFloat32MaxSteps = 16384;
bool float32_widened_on_gpu(const ChainPotentials& p);

// Whether autograd would differentiate these potentials (grad mode on and any of them requiring grad).
bool needs_grad(const ChainPotentials& p);

const char* route_name(ChainRoute route);
const char* quantity_name(ChainQuantity quantity);

// Whether `route` can compute `quantity` for these potentials (on their device, dtype and shape). with_edges: the
// marginals include edge marginals (only the composed recursion takes per-position transitions).
bool route_applies(ChainRoute route, ChainQuantity quantity, const ChainPotentials& p, bool with_edges = false);

// The route for `quantity`: the forced one while a ForcedChainRoute lives on this thread (an Error naming both when it
// does not apply), else the fastest that applies.
ChainRoute choose_route(ChainQuantity quantity, const ChainPotentials& p, bool with_edges = false);

// For tests: while alive, choose_route on this thread returns `route` (std::nullopt: the automatic choice, as in the
// float64 recursion that the widened route runs). Scopes nest; each restores the one before.
class ForcedChainRoute {
 public:
  explicit ForcedChainRoute(std::optional<ChainRoute> route);
  ~ForcedChainRoute();
  ForcedChainRoute(const ForcedChainRoute&) = delete;
  ForcedChainRoute& operator=(const ForcedChainRoute&) = delete;

 private:
  std::optional<ChainRoute> previous_;
};

}  // namespace trellis::detail
