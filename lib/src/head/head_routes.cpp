#include "lib/src/head/head_routes.h"

#include <string>

#include "lib/src/io/message.h"
#include "trellis/error.h"

namespace trellis::head_detail {
namespace {

thread_local std::optional<HeadRoute> forced_statistics, forced_gradients;

std::optional<HeadRoute>& forced(HeadQuantity q) {
  return q == HeadQuantity::kStatistics ? forced_statistics : forced_gradients;
}

// The automatic choice, route by route in order of preference.
HeadRoute automatic_route(HeadQuantity q, const Head& h, bool want_expected) {
  if (q == HeadQuantity::kStatistics) {
    if (route_applies(HeadRoute::kFusedStatistics, h, want_expected)) return HeadRoute::kFusedStatistics;
    if (h.recompute && route_applies(HeadRoute::kColumnChunks, h, want_expected)) return HeadRoute::kColumnChunks;
    return HeadRoute::kRowSlabs;
  }
  if (!h.recompute)
    return h.input_type_slabs && route_applies(HeadRoute::kInputTypeSlabs, h) ? HeadRoute::kInputTypeSlabs
                                                                              : HeadRoute::kTrainingSlabs;
  return route_applies(HeadRoute::kRecomputedFused, h) ? HeadRoute::kRecomputedFused : HeadRoute::kRecomputed;
}

}  // namespace

HeadQuantity quantity_of(HeadRoute route) {
  switch (route) {
    case HeadRoute::kFusedStatistics:
    case HeadRoute::kColumnChunks:
    case HeadRoute::kRowSlabs: return HeadQuantity::kStatistics;
    case HeadRoute::kTrainingSlabs:
    case HeadRoute::kInputTypeSlabs:
    case HeadRoute::kRecomputed:
    case HeadRoute::kRecomputedFused: return HeadQuantity::kGradients;
  }
  return HeadQuantity::kStatistics;
}

const char* route_name(HeadRoute route) {
  switch (route) {
    case HeadRoute::kFusedStatistics: return "fused statistics";
    case HeadRoute::kColumnChunks: return "column chunks";
    case HeadRoute::kRowSlabs: return "row slabs";
    case HeadRoute::kTrainingSlabs: return "training slabs";
    case HeadRoute::kInputTypeSlabs: return "training slabs in x's type";
    case HeadRoute::kRecomputed: return "recomputed gradients";
    case HeadRoute::kRecomputedFused: return "recomputed gradients on the fused kernel";
  }
  return "?";
}

bool route_applies(HeadRoute route, const Head& h, bool want_expected) {
  switch (route) {
    case HeadRoute::kFusedStatistics: return fused_applies(h);
    case HeadRoute::kColumnChunks: return !want_expected && h.rows() > 0;  // no Σ p·z: it needs the whole row's lse
    case HeadRoute::kRowSlabs:
    case HeadRoute::kTrainingSlabs:
    case HeadRoute::kRecomputed: return true;
    case HeadRoute::kRecomputedFused: return h.targets.defined() && fused_applies(h);
    case HeadRoute::kInputTypeSlabs:
      return h.targets.defined() && input_type_slabs_apply(h) && (!h.x.is_cuda() || fused_applies(h));
  }
  return false;
}

HeadRoute choose_route(HeadQuantity quantity, const Head& h, bool want_expected) {
  const std::optional<HeadRoute> route = forced(quantity);
  if (!route) return automatic_route(quantity, h, want_expected);
  if (!route_applies(*route, h, want_expected))
    throw Error(message::text("linear head: the forced route '", route_name(*route), "' does not apply to x ",
                              h.x.sizes(), " ", h.x.scalar_type(), " on ", h.x.device(),
                              want_expected ? " with the entropy" : ""));
  return *route;
}

ForcedHeadRoute::ForcedHeadRoute(HeadRoute route) : quantity_(quantity_of(route)), previous_(forced(quantity_)) {
  forced(quantity_) = route;
}
ForcedHeadRoute::~ForcedHeadRoute() { forced(quantity_) = previous_; }

}  // namespace trellis::head_detail
