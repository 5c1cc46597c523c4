#include "lib/src/crf/chain_routes.h"

#include <c10/core/GradMode.h>

#include <string>

#include "cuda/chain_kernels.h"
#include "lib/src/crf/chain_fused.h"
#include "trellis/error.h"
#include "trellis/semiring/semiring.h"

namespace trellis::detail {
namespace {

thread_local std::optional<ChainRoute> forced_route;

bool well_formed(const ChainPotentials& p) { return p.emissions.defined() && p.emissions.dim() == 3; }

// The automatic choice, route by route in order of preference.
ChainRoute automatic_route(ChainQuantity q, const ChainPotentials& p, bool with_edges) {
  if (!well_formed(p)) return ChainRoute::kComposed;  // (the caller's check reports the shape)
  if (q == ChainQuantity::kViterbi && route_applies(ChainRoute::kManyLabelViterbi, q, p) &&
      !cuda::chain_supported(p.emissions.size(2), at::kDouble))
    return ChainRoute::kManyLabelViterbi;  // rebases every step, so a long float32 chain needs no widening
  if (float32_widened_on_gpu(p)) return ChainRoute::kWidened;
  const int64_t B = p.emissions.size(0), K = p.emissions.size(2);
  const bool scaled_pays =
      K >= kScaledMinLabels || (p.emissions.is_cpu() && K >= kScaledMinLabelsCpu && B >= kScaledMinSequencesCpu);
  if (q == ChainQuantity::kLogPartition && scaled_pays && route_applies(ChainRoute::kScaledForward, q, p))
    return ChainRoute::kScaledForward;
  if (route_applies(ChainRoute::kFused, q, p, with_edges)) return ChainRoute::kFused;
  return ChainRoute::kComposed;
}

}  // namespace

bool needs_grad(const ChainPotentials& p) {
  if (!c10::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : {&p.emissions, &p.transitions, &p.start, &p.end})
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

bool float32_widened_on_gpu(const ChainPotentials& p) {
  if (!well_formed(p) || !p.emissions.is_cuda() || p.emissions.scalar_type() != at::kFloat) return false;
  const int64_t T = p.emissions.size(1);
  const bool rebased = shared_chain_kernels_take(p.emissions) && p.emissions.size(2) < kScaledMinLabels;
  return T > (rebased ? kGpuRebasedFloat32MaxSteps : kGpuFloat32MaxSteps);
}

const char* route_name(ChainRoute route) {
  switch (route) {
    case ChainRoute::kComposed: return "composed";
    case ChainRoute::kFused: return "fused";
    case ChainRoute::kScaledForward: return "scaled forward";
    case ChainRoute::kManyLabelViterbi: return "many-label Viterbi";
    case ChainRoute::kWidened: return "widened to float64";
  }
  return "?";
}

const char* quantity_name(ChainQuantity quantity) {
  switch (quantity) {
    case ChainQuantity::kLogPartition: return "log_partition";
    case ChainQuantity::kLogLikelihood: return "log_likelihood";
    case ChainQuantity::kMarginals: return "marginals";
    case ChainQuantity::kViterbi: return "viterbi";
  }
  return "?";
}

bool route_applies(ChainRoute route, ChainQuantity q, const ChainPotentials& p, bool with_edges) {
  if (!well_formed(p)) return route == ChainRoute::kComposed;
  const at::Tensor& em = p.emissions;
  switch (route) {
    case ChainRoute::kComposed: return true;
    case ChainRoute::kFused:
      if (q == ChainQuantity::kMarginals && with_edges) return false;  // edge marginals need per-position transitions
      return q == ChainQuantity::kViterbi ? fused_chain_supported<MaxSemiring>(em)
                                          : fused_chain_supported<LogSemiring>(em);
    case ChainRoute::kScaledForward: return q == ChainQuantity::kLogPartition && !needs_grad(p);
    case ChainRoute::kManyLabelViterbi:
      return q == ChainQuantity::kViterbi && em.is_cuda() && cuda::many_label_viterbi_supported(em.size(2));
    case ChainRoute::kWidened: return em.is_cuda() && em.scalar_type() == at::kFloat;
  }
  return false;
}

ChainRoute choose_route(ChainQuantity q, const ChainPotentials& p, bool with_edges) {
  if (!forced_route) return automatic_route(q, p, with_edges);
  if (!route_applies(*forced_route, q, p, with_edges))
    throw Error(std::string("the ") + route_name(*forced_route) + " route cannot compute " + quantity_name(q) +
                " for these potentials (" + (well_formed(p) ? p.emissions.toString() : std::string("malformed")) + ")");
  return *forced_route;
}

ForcedChainRoute::ForcedChainRoute(std::optional<ChainRoute> route) : previous_(forced_route) { forced_route = route; }
ForcedChainRoute::~ForcedChainRoute() { forced_route = previous_; }

}  // namespace trellis::detail
