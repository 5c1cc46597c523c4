#include "trellis/crf/chain_inputs.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cuda/kernels_built.h"
#include "cuda/mask_summary.h"
#include "trellis/error.h"

namespace trellis {
namespace {

bool is_score_type(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

std::string type_name(const at::Tensor& t) { return c10::toString(t.scalar_type()); }

// The shape a per-position tensor must have: [B,T] batch-first, else [T,B].
std::vector<int64_t> positions_shape(BatchShape s, bool batch_first) {
  return batch_first ? std::vector<int64_t>{s.batch, s.steps} : std::vector<int64_t>{s.steps, s.batch};
}

const char* positions_layout(bool batch_first) { return batch_first ? "[B,T]" : "[T,B]"; }

// An index [b][t] of a batch-first tensor as the caller's tensor spells it.
std::string caller_index(int64_t b, int64_t t, bool batch_first) {
  return batch_first ? "[" + std::to_string(b) + "][" + std::to_string(t) + "]"
                     : "[" + std::to_string(t) + "][" + std::to_string(b) + "]";
}

// A score tensor's shape against the one the emissions imply.
void check_shape(const at::Tensor& t, const char* name, const std::vector<int64_t>& shape, const char* layout,
                 const char* what) {
  if (t.defined() && t.sizes().vec() != shape)
    throw Error(std::string(what) + ": " + name + " has shape " + shape_string(t.sizes()) + ", expected " + layout +
                " = " + shape_string(shape) + " (K from the emissions)");
}

void check_on_device(const at::Tensor& t, const char* name, const at::Tensor& emissions, const char* what) {
  if (t.defined() && t.device() != emissions.device())
    throw Error(std::string(what) + ": " + name + " is on " + t.device().str() + " but the emissions are on " +
                emissions.device().str());
}

}  // namespace

std::string shape_string(at::IntArrayRef sizes) {
  std::string text = "[";
  for (std::size_t i = 0; i < sizes.size(); ++i) text += (i ? ", " : "") + std::to_string(sizes[i]);
  return text + "]";
}

at::ScalarType chain_compute_type(std::initializer_list<std::pair<const char*, at::Tensor>> scores, const char* what) {
  at::ScalarType type = at::kFloat;
  for (const auto& [name, t] : scores) {
    if (!t.defined()) continue;
    if (!is_score_type(t.scalar_type()))
      throw Error(std::string(what) + ": " + name + " must be float16, bfloat16, float32 or float64, got " +
                  type_name(t));
    if (t.scalar_type() == at::kDouble) type = at::kDouble;
  }
  return type;
}

BatchShape batch_shape(const at::Tensor& sequences, bool batch_first) {
  return batch_first ? BatchShape{sequences.size(0), sequences.size(1)}
                     : BatchShape{sequences.size(1), sequences.size(0)};
}

at::Tensor sequence_lengths(const at::Tensor& mask, const at::Tensor& lengths, bool batch_first, BatchShape shape,
                            const at::Device& device, const char* what) {
  const std::string prefix = std::string(what) + ": ";
  if (mask.defined() && lengths.defined()) throw Error(prefix + "give a mask or lengths, not both");
  if (lengths.defined()) {
    if (!at::isIntegralType(lengths.scalar_type(), /*includeBool=*/false))
      throw Error(prefix + "lengths must be an integer tensor, got " + type_name(lengths));
    if (lengths.dim() != 1 || lengths.size(0) != shape.batch)
      throw Error(prefix + "lengths has shape " + shape_string(lengths.sizes()) + ", expected [B] = [" +
                  std::to_string(shape.batch) + "]");
    return shape.batch == 0 ? at::Tensor() : lengths.to(device, at::kLong);  // no sequences: nothing to bound
  }
  if (!mask.defined()) return {};
  const MaskSummary summary = summarize_mask(mask, batch_first, shape, device, what);
  if (shape.batch == 0) return {};
  if (shape.steps == 0) return summary.lengths;  // the library rejects T = 0 by name
  const at::Tensor flags = summary.flags.cpu();
  if (!flags[0].item<bool>() && !flags[1].item<bool>()) return summary.lengths;
  // An error: its position, found on the host (a mask is small).
  at::Tensor on = mask.to(at::kCPU, at::kBool);
  if (!batch_first) on = on.t();
  if (flags[0].item<bool>()) {
    const int64_t b = (~on.select(1, 0)).nonzero()[0][0].item<int64_t>();
    throw Error(prefix + "mask of the first timestep must all be on (mask" + caller_index(b, 0, batch_first) +
                " is off: every sequence needs at least one position)");
  }
  const at::Tensor where = (on.slice(1, 1) & ~on.slice(1, 0, -1)).nonzero()[0];
  const int64_t b = where[0].item<int64_t>(), t = where[1].item<int64_t>() + 1;
  throw Error(prefix + "mask" + caller_index(b, t, batch_first) +
              " is on after an off position of the same sequence: masks must be right-padded (no holes)");
}

namespace {

// summarize_mask on the host: one pass over the mask's bytes (bool or uint8: nonzero is on), the sequences split over
// threads, where framework operations would take a dozen passes and allocations.
MaskSummary summarize_mask_on_host(const at::Tensor& mask, bool batch_first, BatchShape shape) {
  const at::Tensor bytes = mask.to(at::kCPU).contiguous();
  const auto* on = static_cast<const uint8_t*>(bytes.data_ptr());
  const int64_t B = shape.batch, T = shape.steps;
  const int64_t sequence_stride = batch_first ? T : 1, step_stride = batch_first ? 1 : B;
  at::Tensor lengths = at::empty({B}, at::kLong);
  int64_t* length = lengths.data_ptr<int64_t>();
  std::atomic<bool> first_off{false}, hole{false};
  at::parallel_for(0, B, std::max<int64_t>(1, 32768 / std::max<int64_t>(T, 1)), [&](int64_t begin, int64_t end) {
    bool some_first_off = false, some_hole = false;
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* sequence = on + b * sequence_stride;
      int64_t count = 0;
      bool previous = true;  // the first position cannot follow an off one
      for (int64_t t = 0; t < T; ++t) {
        const bool here = sequence[t * step_stride] != 0;
        count += here;
        some_hole |= here && !previous;
        previous = here;
      }
      some_first_off |= T > 0 && sequence[0] == 0;
      length[b] = count;
    }
    if (some_first_off) first_off.store(true, std::memory_order_relaxed);
    if (some_hole) hole.store(true, std::memory_order_relaxed);
  });
  at::Tensor flags = at::empty({2}, at::kBool);
  flags.data_ptr<bool>()[0] = first_off.load();
  flags.data_ptr<bool>()[1] = hole.load();
  return {lengths, flags};
}

}  // namespace

MaskSummary summarize_mask(const at::Tensor& mask, bool batch_first, BatchShape shape, const at::Device& device,
                           const char* what) {
  const std::string prefix = std::string(what) + ": ";
  if (mask.scalar_type() != at::kBool && mask.scalar_type() != at::kByte)
    throw Error(prefix + "mask must be a bool or uint8 tensor, got " + type_name(mask));
  const std::vector<int64_t> expected = positions_shape(shape, batch_first);
  if (mask.sizes().vec() != expected)
    throw Error(prefix + "mask has shape " + shape_string(mask.sizes()) + ", expected " +
                positions_layout(batch_first) + " = " + shape_string(expected));
  if (device.is_cuda() && cuda::kernels_built()) {
    MaskSummary summary{at::empty({shape.batch}, at::TensorOptions(device).dtype(at::kLong)),
                        at::empty({2}, at::TensorOptions(device).dtype(at::kBool))};
    cuda::mask_summary(mask.to(device), batch_first, summary.lengths, summary.flags);
    return summary;
  }
  // Elsewhere on the host (a CUDA device of a build without the kernels: the results are copied there).
  MaskSummary summary = summarize_mask_on_host(mask, batch_first, shape);
  if (!device.is_cpu()) summary = {summary.lengths.to(device), summary.flags.to(device)};
  return summary;
}

ChainPotentials chain_potentials(const ChainInputs& in, const char* what) {
  const std::string prefix = std::string(what) + ": ";
  const at::Tensor& e = in.emissions;
  if (!e.defined() || e.dim() != 3)
    throw Error(prefix + "emissions must be a " + (in.batch_first ? "[B,T,K]" : "[T,B,K]") + " tensor" +
                (e.defined() ? ", got shape " + shape_string(e.sizes()) : ""));
  if (!in.transitions.defined()) throw Error(prefix + "transitions are required");
  const at::ScalarType type = chain_compute_type(
      {{"emissions", e}, {"transitions", in.transitions}, {"start", in.start}, {"end", in.end}}, what);
  const int64_t K = e.size(2);
  check_shape(in.transitions, "transitions", {K, K}, "[K,K]", what);
  check_shape(in.start, "start", {K}, "[K]", what);
  check_shape(in.end, "end", {K}, "[K]", what);
  check_on_device(in.transitions, "transitions", e, what);
  check_on_device(in.start, "start", e, what);
  check_on_device(in.end, "end", e, what);
  ChainPotentials p;
  p.emissions = (in.batch_first ? e : e.transpose(0, 1)).to(type);
  p.transitions = in.transitions.to(type);
  if (in.start.defined()) p.start = in.start.to(type);
  if (in.end.defined()) p.end = in.end.to(type);
  p.lengths = sequence_lengths(in.mask, in.lengths, in.batch_first, batch_shape(e, in.batch_first), e.device(), what);
  return p;
}

at::Tensor batch_first_tags(const at::Tensor& tags, const ChainInputs& in, const char* what) {
  const std::string prefix = std::string(what) + ": ";
  if (!tags.defined()) throw Error(prefix + "tags are required");
  if (!at::isIntegralType(tags.scalar_type(), /*includeBool=*/false))
    throw Error(prefix + "tags must be an integer tensor, got " + type_name(tags));
  if (in.emissions.defined() && in.emissions.dim() == 3) {
    const std::vector<int64_t> expected = positions_shape(batch_shape(in.emissions, in.batch_first), in.batch_first);
    if (tags.sizes().vec() != expected)
      throw Error(prefix + "tags have shape " + shape_string(tags.sizes()) + ", expected " +
                  positions_layout(in.batch_first) + " = " + shape_string(expected) +
                  " (the emissions' batch and steps)");
  }
  return (in.batch_first ? tags : tags.t()).to(in.emissions.device(), at::kLong);
}

TransitionConstraints allowed_constraints(const at::Tensor& allowed, const at::Tensor& allowed_start,
                                          const at::Tensor& allowed_end, int64_t num_tags, const at::Device& device,
                                          const char* what) {
  const auto convert = [&](const at::Tensor& t, const char* name, std::vector<int64_t> shape) -> at::Tensor {
    if (!t.defined()) return {};
    if (t.scalar_type() != at::kBool && t.scalar_type() != at::kByte)
      throw Error(std::string(what) + ": " + name + " must be a bool or uint8 tensor, got " + type_name(t));
    if (t.sizes().vec() != shape)
      throw Error(std::string(what) + ": " + name + " has shape " + shape_string(t.sizes()) + ", expected " +
                  shape_string(shape) + " (K = " + std::to_string(num_tags) + " tags)");
    return t.to(device, at::kBool);
  };
  return {convert(allowed, "allowed", {num_tags, num_tags}), convert(allowed_start, "allowed_start", {num_tags}),
          convert(allowed_end, "allowed_end", {num_tags})};
}

AutogradScope::AutogradScope() {
  if (c10::InferenceMode::is_enabled()) outside_inference_.emplace(false);
  const c10::impl::LocalDispatchKeySet keys = c10::impl::tls_local_dispatch_key_set();
  autograd_keys_.emplace(keys.included_, keys.excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView);
}

at::Tensor AutogradScope::usable(const at::Tensor& t) const { return t.defined() && t.is_inference() ? t.clone() : t; }

ChainPotentials AutogradScope::usable(const ChainPotentials& p) const {
  ChainPotentials q = p;
  for (at::Tensor* t : {&q.emissions, &q.transitions, &q.start, &q.end}) *t = usable(*t);
  return q;
}

at::Tensor batch_log_partition(const ChainPotentials& p) {
  return p.emissions.size(0) == 0 ? at::zeros({0}, p.emissions.options()) : log_partition(p);
}

at::Tensor batch_log_likelihood(const ChainPotentials& p, const at::Tensor& tags) {
  return p.emissions.size(0) == 0 ? at::zeros({0}, p.emissions.options()) : log_likelihood(p, tags);
}

Marginals batch_marginals(const ChainPotentials& p, bool with_edges) {
  if (p.emissions.size(0) != 0) return marginals(p, with_edges);
  const int64_t T = p.emissions.size(1), K = p.emissions.size(2);
  return {at::zeros({0}, p.emissions.options()), at::zeros_like(p.emissions),
          with_edges ? at::zeros({0, std::max<int64_t>(T - 1, 0), K, K}, p.emissions.options()) : at::Tensor()};
}

ViterbiResult batch_viterbi(const ChainPotentials& p) {
  if (p.emissions.size(0) != 0) return viterbi(p);
  return {at::full({0, p.emissions.size(1)}, -1, p.emissions.options().dtype(at::kLong)),
          at::zeros({0}, p.emissions.options())};
}

at::Tensor caller_layout(const at::Tensor& batch_first_result, bool batch_first) {
  return (batch_first ? batch_first_result : batch_first_result.transpose(0, 1)).contiguous();
}

ViterbiResult caller_layout(const ViterbiResult& r, bool batch_first) {
  return {caller_layout(r.path, batch_first), r.score.contiguous()};
}

KBestResult caller_layout(const KBestResult& r, bool batch_first, const at::Device& device) {
  const at::Tensor paths = batch_first ? r.paths : r.paths.permute({2, 0, 1});  // [B,k,T] -> [T,B,k]
  return {paths.to(device).contiguous(), r.scores.to(device).contiguous()};
}

Marginals caller_layout(const Marginals& m, bool batch_first) {
  return {m.log_partition, caller_layout(m.nodes, batch_first),
          m.edges.defined() ? caller_layout(m.edges, batch_first) : at::Tensor()};
}

}  // namespace trellis
