// The linear head a slab of rows at a time: logits of rows [r0, r1) against the whole vocabulary (one GEMM into the
// accumulation type), the per-row statistics the results need (log-sum-exp through the tree-reduced kernel, the target
// logit, the logit sum for label smoothing, the expected logit for the entropy), and for training the gradient of the
// loss with respect to those logits, which two more GEMMs turn into dx rows (complete per slab) and a dW accumulation.
// The same code runs on CPU and CUDA tensors; on CUDA the GEMMs take bfloat16/float16 operands straight to float32.
#include "trellis/head/linear_cross_entropy.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <cmath>
#include <optional>

#include "lib/src/head/head_slice.h"
#include "lib/src/io/message.h"
#include "trellis/error.h"
#include "trellis/semiring/semiring_ops.h"
#include "cuda/kernels_built.h"
#include "cuda/linear_head.h"  // the kernels, or the stubs of a build without nvcc (cuda/no_kernels.cpp)

namespace trellis {

Reduction parse_reduction(const std::string& name) {
  if (name == "none") return Reduction::none;
  if (name == "sum") return Reduction::sum;
  if (name == "mean") return Reduction::mean;
  throw Error("linear head: reduction '" + name + "' is not one of none, sum, mean");
}

namespace {

// Validated, flattened inputs and the slab size.
struct Head {
  at::Tensor x, weight, bias, targets;  // [N,D], [V,D], [V] or undefined, [N] int64 or undefined
  std::optional<double> softcap;
  int64_t ignore_index = -100;
  at::ScalarType acc = at::kFloat;  // the type logits and statistics are formed in
  std::vector<int64_t> row_shape;   // x's leading dimensions, the shape of per-row results
  int64_t rows_per_slab = 1;
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

bool supported(at::ScalarType t) { return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf; }

// Rows of a slab of `bytes` of logits: whole multiples of 256 where that leaves any (whole GEMM tiles: no ragged last
// wave), at least one.
int64_t slab_rows(const Head& h, int64_t bytes) {
  const int64_t rows = std::max<int64_t>(1, bytes / (h.vocabulary() * static_cast<int64_t>(at::elementSize(h.acc))));
  return rows >= 256 ? rows - rows % 256 : rows;
}

// Whether the fused Hopper kernel forms the statistics and the recompute route's gradient chunks for x and W.
bool fused_applies(const Head& h) { return h.x.is_cuda() && cuda::fused_linear_head_applies(h.x, h.weight); }

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
  f.fixed = N * 64 + (h.bias.defined() ? 2 * V * acc : 0) + (int64_t(1) << 20);
  // CPU: the logits, their exponentials and the gradient in x's type; CUDA: the gradient beside 16-bit logits only
  // where the in-place kernel (compute capability 9.0) does not run.
  f.slab_element = cuda ? acc + (half && !fused ? in : 0) : 2 * acc + (half ? in : 0);
  // The fused kernel writes a chunk's gradient in x's type from its tiles; elsewhere a chunk is a slab (and the
  // forward's chunked statistics hold a chunk of logits and their exponentials).
  f.chunk_element = fused ? in : std::max(f.slab_element, 2 * acc);
  f.dx_sum = half ? N * h.x.size(1) * acc : 0;
  return f;
}

// The route, slab and type that o picks for h (HeadOptions::memory_budget, else chunk_bytes and recompute_logits),
// assuming gradients for x and W.
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
  if (o.memory_budget < 0) {
    if (o.recompute_logits) {
      const int64_t size = at::elementSize(fused ? h.x.scalar_type() : h.acc);
      const int64_t columns = std::clamp<int64_t>(o.chunk_bytes / (N * size), 1, 2048 / size);
      recompute(columns >= 8 ? columns / 8 * 8 : columns, false);
    } else {
      p.slab_bytes = o.chunk_bytes;
      const int64_t rows = std::min(slab_rows(h, o.chunk_bytes), N);
      p.extra_bytes = f.fixed + rows * V * f.slab_element;
    }
    return p;
  }
  const int64_t budget = o.memory_budget - f.fixed;
  const int64_t rows = budget > 0 ? budget / (V * f.slab_element) : 0;
  const auto slabs = [&] {
    const int64_t whole = std::min(rows >= 256 ? rows - rows % 256 : rows, N);
    p.slab_bytes = whole * V * acc;
    p.extra_bytes = f.fixed + whole * V * f.slab_element;
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

// check_targets: whether to look at every target (one device-to-host copy); backward skips it, forward has done it.
Head prepare(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets, const HeadOptions& o,
             bool check_targets = true) {
  TORCH_CHECK(x.defined() && weight.defined(), "linear head: x and weight are required");
  if (x.dim() < 1) throw Error("linear head: x must have at least one dimension (its last is D)");
  if (weight.dim() != 2) throw Error(message::text("linear head: weight must be [V, D], got ", weight.sizes()));
  if (weight.size(0) < 1) throw Error("linear head: the vocabulary (weight's first dimension) is empty");
  if (x.size(-1) != weight.size(1))
    throw Error(message::text("linear head: x has D=", x.size(-1), " but weight is ", weight.sizes()));
  if (!supported(x.scalar_type()) || x.scalar_type() != weight.scalar_type())
    throw Error(message::text("linear head: x and weight must share one of float32, float64, bfloat16, float16; got ",
                              x.scalar_type(), " and ", weight.scalar_type()));
  if (x.device() != weight.device())
    throw Error(message::text("linear head: x is on ", x.device(), " but weight on ", weight.device()));
  Head h;
  h.acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  h.row_shape = x.sizes().vec();
  h.row_shape.pop_back();
  h.x = x.reshape({c10::multiply_integers(h.row_shape), x.size(-1)}).contiguous();
  h.weight = weight.contiguous();
  const int64_t V = weight.size(0);
  if (o.bias.defined()) {
    if (o.bias.dim() != 1 || o.bias.size(0) != V)
      throw Error(message::text("linear head: bias must be [V] = [", V, "], got ", o.bias.sizes()));
    if (o.bias.scalar_type() != x.scalar_type() || o.bias.device() != x.device())
      throw Error("linear head: bias must have x's dtype and device");
    h.bias = o.bias.contiguous();
  }
  if (o.softcap && !(std::isfinite(*o.softcap) && *o.softcap > 0))
    throw Error(message::text("linear head: softcap must be a positive number, got ", *o.softcap));
  h.softcap = o.softcap;
  h.ignore_index = o.ignore_index;
  if (targets.defined()) {
    if (!at::isIntegralType(targets.scalar_type(), /*includeBool=*/false))
      throw Error(message::text("linear head: targets must be integers, got ", targets.scalar_type()));
    if (targets.sizes().vec() != h.row_shape)
      throw Error(message::text("linear head: targets are ", targets.sizes(), " but x's rows are ",
                                at::IntArrayRef(h.row_shape)));
    if (targets.device() != x.device()) throw Error("linear head: targets must be on x's device");
    h.targets = targets.reshape({-1}).to(at::kLong).contiguous();  // kernels read it through a raw pointer
    if (check_targets) {
      const at::Tensor bad = (h.targets != o.ignore_index) & ((h.targets < 0) | (h.targets >= V));
      if (bad.any().item<bool>()) {
        const int64_t i = bad.nonzero()[0][0].item<int64_t>();
        throw Error(message::text("linear head: targets[", i, "] = ", h.targets[i].item<int64_t>(),
                                  " is outside the vocabulary [0, ", V, ") and is not ignore_index (", o.ignore_index,
                                  ")"));
      }
    }
  }
  const HeadMemoryPlan plan = memory_plan(h, o);
  h.recompute = plan.recompute_logits;
  h.own_dx_sum = plan.own_dx_sum;
  h.chunk_bytes = o.memory_budget >= 0 ? plan.slab_bytes : o.chunk_bytes;
  if (o.memory_budget >= 0 && plan.recompute_logits)
    h.chunk_columns = plan.slab_bytes / (std::max<int64_t>(h.rows(), 1) * at::elementSize(plan.slab_type));
  h.rows_per_slab = slab_rows(h, h.chunk_bytes);
  return h;
}

// a·b in the accumulation type: CUDA GEMMs read bfloat16/float16 operands and write float32 logits directly; on the
// CPU the operands are converted (the CPU path is the reference, not the fast one).
at::Tensor mm_acc(const at::Tensor& a, const at::Tensor& b, at::ScalarType acc) {
  if (a.scalar_type() == acc && b.scalar_type() == acc) return at::mm(a, b);
  if (a.is_cuda()) return at::mm(a, b, acc);
  return at::mm(a.to(acc), b.to(acc));
}

// out = a·b, or out += a·b unless `first`, in out's type (the inputs' or the accumulation type), the same way.
void mm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b, bool first) {
  const at::ScalarType type = out.scalar_type();
  if (a.scalar_type() == type && b.scalar_type() == type) {
    if (first) at::mm_out(out, a, b);
    else out.addmm_(a, b);
  } else if (a.is_cuda()) {
    if (first) at::mm_out(out, a, b, type);
    else at::addmm_out(out, out, a, b, type);
  } else if (first) {
    at::mm_out(out, a.to(type), b.to(type));
  } else {
    out.addmm_(a.to(type), b.to(type));
  }
}

// Bias and soft-cap applied to logits of vocabulary columns [v0, v0 + z.size(1)), in place.
void finish_logits(const Head& h, at::Tensor& z, int64_t v0) {
  if (h.bias.defined()) z.add_(h.bias.narrow(0, v0, z.size(1)).to(h.acc));
  if (h.softcap) z.div_(*h.softcap).tanh_().mul_(*h.softcap);
}

// Soft-capped logits of rows [r0, r0 + n), [n, V] in the accumulation type.
at::Tensor slab_logits(const Head& h, int64_t r0, int64_t n) {
  at::Tensor z = mm_acc(h.x.narrow(0, r0, n), h.weight.t(), h.acc);
  finish_logits(h, z, 0);
  return z;
}

// Per-row statistics (lse, target logit, Σ z, Σ p·z), the same whether a slab or the fused kernel forms them.
using SlabStats = HeadRowStats;

at::Tensor valid_targets(const at::Tensor& targets, int64_t ignore_index) { return targets != ignore_index; }

// Where targets t fall among vocabulary columns [v0, v0 + c): each one's column there (0 where it is not there) and
// whether it is (never for ignored targets).
std::pair<at::Tensor, at::Tensor> target_columns(const Head& h, const at::Tensor& t, int64_t v0, int64_t c) {
  const at::Tensor column = t - v0, hit = valid_targets(t, h.ignore_index) & (column >= 0) & (column < c);
  return {at::where(hit, column, 0), hit};
}

// The target logit (0 where the target is ignored or outside the slab's columns [v0, ...)) and, if wanted, Σ z of
// each row of a slab of logits.
void target_and_sum(const Head& h, const at::Tensor& z, int64_t r0, int64_t v0, bool want_sum, SlabStats& s) {
  if (h.targets.defined()) {
    const auto [column, hit] = target_columns(h, h.targets.narrow(0, r0, z.size(0)), v0, z.size(1));
    s.target_logit = z.gather(1, column.unsqueeze(1)).squeeze(1) * hit;
  }
  if (want_sum) s.logit_sum = z.sum(1);
}

// Statistics of one slab of logits.
SlabStats slab_stats(const Head& h, const at::Tensor& z, int64_t r0, bool want_sum, bool want_expected = false) {
  SlabStats s;
  s.lse = trellis::logsumexp(z, 1);
  target_and_sum(h, z, r0, 0, want_sum, s);
  if (want_expected) s.expected_logit = ((z - s.lse.unsqueeze(1)).exp() * z).sum(1);
  return s;
}

// The statistics of every row at once from the fused kernel, which keeps the logits on chip; nullopt where it does
// not apply (the CPU, float32/float64, an unsupported GPU or shape), and the slabs do the work.
std::optional<SlabStats> fused_stats(const Head& h, bool want_sum, bool want_expected) {
  SlabStats s;
  if (cuda::fused_linear_lse(h.x, h.weight, h.bias, h.targets, h.softcap.value_or(0), want_sum || want_expected, s)) {
    if (h.targets.defined()) s.target_logit.mul_(valid_targets(h.targets, h.ignore_index));
    return s;
  }
  (void)h, (void)want_sum, (void)want_expected;
  return std::nullopt;
}

// Per-row loss (0 for ignored rows) from the statistics: lse - (1-ε)·z_t - ε·mean_v z_v + z_loss·lse².
at::Tensor row_loss(const Head& h, const SlabStats& s, const at::Tensor& valid, const LossOptions& o) {
  at::Tensor l = s.lse - (1 - o.label_smoothing) * s.target_logit;
  if (o.label_smoothing != 0) l = l - (o.label_smoothing / static_cast<double>(h.smoothing_vocabulary())) * s.logit_sum;
  if (o.z_loss != 0) l = l + o.z_loss * s.lse * s.lse;
  return l * valid;
}

struct Gradients {
  at::Tensor x, weight, bias;  // undefined where not wanted
};

// dL/dz for a slab of logits z (rows [r0, r0 + n) of vocabulary columns [v0, v0 + c)) in the input type, ready for
// the GEMMs: g_i·[p_v·(1 + 2·z_loss·lse) - (1-ε)·[v = t_i] - ε/V], times the soft-cap's derivative 1 - (z/c)². g is 0
// for ignored rows. z is consumed: on CUDA one pass writes dz over z's own memory (the first half of each float32 row
// for 16-bit inputs); on the CPU, tensor operations.
at::Tensor slab_logit_gradient(const Head& h, at::Tensor z, const at::Tensor& lse, const at::Tensor& g, int64_t r0,
                               int64_t v0, const LossOptions& o) {
  const at::Tensor t = h.targets.narrow(0, r0, z.size(0));
  const at::ScalarType type = h.x.scalar_type();
  if (z.is_cuda() && cuda::kernels_built()) {
    const cuda::LogitColumns columns{v0, h.smoothing_vocabulary()};
    at::Tensor row_lse = lse.contiguous(), dz = z;
    const double cap = h.softcap.value_or(0);
    if (type != z.scalar_type()) {
      dz = z.view(type).narrow(1, 0, z.size(1));
      if (cuda::linear_head_logit_gradient_in_place(z, g.contiguous(), t.contiguous(), columns, o.label_smoothing,
                                                    o.z_loss, cap, /*form_lse=*/false, row_lse, dz))
        return dz;
      dz = at::empty(z.sizes(), z.options().dtype(type));  // before compute capability 9.0: beside the slab
    }
    cuda::linear_head_logit_gradient(z, row_lse, g.contiguous(), t.contiguous(), columns, o.label_smoothing, o.z_loss,
                                     cap, dz);
    return dz;
  }
  at::Tensor dz = (z - lse.unsqueeze(1)).exp_();
  if (h.softcap) z.div_(*h.softcap).square_().neg_().add_(1);  // z now holds the soft-cap derivative
  dz.mul_((o.z_loss != 0 ? g * (1 + 2 * o.z_loss * lse) : g).unsqueeze(1));
  if (o.label_smoothing != 0)
    dz.sub_((g * (o.label_smoothing / static_cast<double>(h.smoothing_vocabulary()))).unsqueeze(1));
  const auto [column, hit] = target_columns(h, t, v0, z.size(1));
  dz.scatter_add_(1, column.unsqueeze(1), (-(1 - o.label_smoothing) * g * hit).unsqueeze(1));
  if (h.softcap) dz.mul_(z);
  return dz.to(type);
}

// The gradients a slab loop fills: dx rows (written by their slab), dW (written by the first slab, then added to) and
// the bias (summed in the accumulation type).
Gradients empty_gradients(const Head& h, std::array<bool, 3> want) {
  Gradients out;
  if (want[0]) out.x = at::empty_like(h.x);
  // dW collects one GEMM per slab in the weight's own type (cuBLAS adds each float32 product to it before rounding),
  // so training needs no float32 copy of W's size; slabs are large, so few roundings.
  if (want[1]) out.weight = h.rows() ? at::empty_like(h.weight) : at::zeros_like(h.weight);
  if (want[2]) out.bias = at::zeros({h.vocabulary()}, h.x.options().dtype(h.acc));
  return out;
}

// A slab's logit gradient dz [n, V] (rows [r0, r0 + n), in the input type) into the gradients: dx rows = dz·W,
// dW += dzᵀ·x, bias += Σ dz.
void add_slab_gradients(const Head& h, const at::Tensor& dz, int64_t r0, std::array<bool, 3> want, Gradients& out) {
  const int64_t n = dz.size(0);
  if (want[0]) {
    at::Tensor dx = out.x.narrow(0, r0, n);
    at::mm_out(dx, dz, h.weight);
  }
  if (want[1] && r0 == 0) at::mm_out(out.weight, dz.t(), h.x.narrow(0, r0, n));
  else if (want[1]) out.weight.addmm_(dz.t(), h.x.narrow(0, r0, n));
  if (want[2]) out.bias.add_(dz.sum(0, false, h.acc));
}

// Gradients of Σ_i g_i·loss_i. lse, when given, saves recomputing it; loss, when given, receives the per-row loss.
// merge, when given: W is a slice of the vocabulary, and each slab's statistics (lse, target logit, Σ z) become the
// whole vocabulary's through it before the slab's gradient is formed; `merged` receives them for every row.
Gradients head_gradients(const Head& h, const at::Tensor& g, at::Tensor lse, const LossOptions& o,
                         std::array<bool, 3> want, at::Tensor* loss = nullptr, const head_slice::Merge* merge = nullptr,
                         SlabStats* merged = nullptr) {
  const int64_t N = h.rows();
  Gradients out = empty_gradients(h, want);
  std::vector<SlabStats> merged_slabs;
  for (int64_t r0 = 0; r0 < N; r0 += h.rows_per_slab) {
    const int64_t n = std::min(h.rows_per_slab, N - r0);
    at::Tensor z = slab_logits(h, r0, n);
    at::Tensor slab_lse, dz;
    if (lse.defined()) {
      slab_lse = lse.narrow(0, r0, n);
    } else if (merge) {
      merged_slabs.push_back((*merge)(slab_stats(h, z, r0, o.label_smoothing != 0)));
      slab_lse = merged_slabs.back().lse;
    } else {
      SlabStats s;
      if (loss) target_and_sum(h, z, r0, 0, o.label_smoothing != 0, s);  // before dz may take z's memory
      // On CUDA the log-sum-exp comes with the gradient, from one read of the slab. The kernel holds each row on chip
      // before writing its gradient, so dz takes the slab's own memory (the first half of each float32 row for 16-bit
      // inputs) instead of a second slab-sized buffer.
      if (z.is_cuda()) {
        at::Tensor row_lse = at::empty({n}, z.options());
        at::Tensor d = z.view(h.x.scalar_type()).narrow(1, 0, h.vocabulary());
        if (cuda::linear_head_logit_gradient_in_place(z, g.narrow(0, r0, n).contiguous(),
                                                      h.targets.narrow(0, r0, n).contiguous(),
                                                      {0, h.smoothing_vocabulary()}, o.label_smoothing, o.z_loss,
                                                      h.softcap.value_or(0), /*form_lse=*/true, row_lse, d))
          s.lse = row_lse, dz = d;
      }
      if (!s.lse.defined()) s.lse = trellis::logsumexp(z, 1);
      slab_lse = s.lse;
      if (loss)
        loss->narrow(0, r0, n).copy_(row_loss(h, s, valid_targets(h.targets.narrow(0, r0, n), h.ignore_index), o));
    }
    if (!dz.defined()) dz = slab_logit_gradient(h, std::move(z), slab_lse, g.narrow(0, r0, n), r0, 0, o);
    add_slab_gradients(h, dz, r0, want, out);
  }
  if (want[2]) out.bias = out.bias.to(h.weight.scalar_type());
  if (merged) {
    const auto join = [&](at::Tensor SlabStats::*field) {
      std::vector<at::Tensor> parts;
      for (const SlabStats& m : merged_slabs)
        if ((m.*field).defined()) parts.push_back(m.*field);
      return parts.empty() ? at::Tensor() : at::cat(parts);
    };
    merged->lse = join(&SlabStats::lse);
    merged->target_logit = join(&SlabStats::target_logit);
    merged->logit_sum = join(&SlabStats::logit_sum);
  }
  return out;
}

// Gradients of Σ_i (a_i·lse_i + b_i·log p_i(t_i) + c_i·H_i) (a, b or c undefined: 0), the logits formed again a slab
// at a time. For one row, d lse/dz_v = p_v, d log p(t)/dz_v = [v = t] - p_v and dH/dz_v = -p_v·(log p_v + H).
Gradients statistics_gradients(const Head& h, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                               std::array<bool, 3> want) {
  Gradients out = empty_gradients(h, want);
  const at::Tensor valid = h.targets.defined() ? valid_targets(h.targets, h.ignore_index) : at::Tensor();
  for (int64_t r0 = 0; r0 < h.rows(); r0 += h.rows_per_slab) {
    const int64_t n = std::min(h.rows_per_slab, h.rows() - r0);
    at::Tensor z = slab_logits(h, r0, n);
    const at::Tensor lse = trellis::logsumexp(z, 1).unsqueeze(1);
    at::Tensor log_p = z - lse, p = log_p.exp();
    at::Tensor row_b = b.defined() ? b.narrow(0, r0, n) * valid.narrow(0, r0, n) : at::Tensor();
    at::Tensor p_weight = at::zeros({n}, z.options());
    if (a.defined()) p_weight += a.narrow(0, r0, n);
    if (row_b.defined()) p_weight -= row_b;
    at::Tensor dz = p * p_weight.unsqueeze(1);
    if (c.defined()) {
      const at::Tensor entropy = -(p * log_p).sum(1, true);
      dz -= p * (log_p + entropy) * c.narrow(0, r0, n).unsqueeze(1);
    }
    if (row_b.defined()) {
      const auto [column, hit] = target_columns(h, h.targets.narrow(0, r0, n), 0, z.size(1));
      dz.scatter_add_(1, column.unsqueeze(1), (row_b * hit).unsqueeze(1));
    }
    if (h.softcap) dz.mul_(z.div_(*h.softcap).square_().neg_().add_(1));  // the soft-cap's derivative 1 - (z/c)²
    add_slab_gradients(h, dz.to(h.x.scalar_type()), r0, want, out);
  }
  if (want[2]) out.bias = out.bias.to(h.weight.scalar_type());
  return out;
}

// Columns of the small slab that recompute_logits holds at most: 2 KiB per row, and no more than chunk_bytes; whole
// multiples of 8 where that leaves any (the GEMMs' leading dimensions, see recomputed_gradients).
int64_t small_slab_columns(const Head& h, int64_t element_size) {
  if (h.chunk_columns > 0) return h.chunk_columns;  // memory_budget's
  const int64_t c =
      std::clamp<int64_t>(h.chunk_bytes / (std::max<int64_t>(h.rows(), 1) * element_size), 1, 2048 / element_size);
  return c >= 8 ? c / 8 * 8 : c;
}

// Per-row log-sum-exp, target logit and (want_sum) Σ z over vocabulary chunks of the small slab, for
// recompute_logits where the fused kernel does not apply: each chunk's (max, Σ e^(z−max)) merges into the row's
// running pair, (m1,s1)+(m2,s2) = (M, s1·e^(m1−M) + s2·e^(m2−M)).
SlabStats chunked_stats(const Head& h, bool want_sum) {
  const int64_t N = h.rows(), V = h.vocabulary(), columns = small_slab_columns(h, at::elementSize(h.acc));
  const auto opts = h.x.options().dtype(h.acc);
  at::Tensor m = at::full({N}, -INFINITY, opts), s = at::zeros({N}, opts), slab = at::empty({N * columns}, opts);
  SlabStats out;
  if (h.targets.defined()) out.target_logit = at::zeros({N}, opts);
  if (want_sum) out.logit_sum = at::zeros({N}, opts);
  for (int64_t v0 = 0; v0 < V; v0 += columns) {
    const int64_t c = std::min(columns, V - v0);
    at::Tensor z = slab.narrow(0, 0, N * c).view({N, c});
    mm_into(z, h.x, h.weight.narrow(0, v0, c).t(), true);
    finish_logits(h, z, v0);
    const at::Tensor top = at::maximum(m, std::get<0>(z.max(1)));
    s = s * (m - top).exp() + (z - top.unsqueeze(1)).exp_().sum(1);
    m = top;
    SlabStats part;
    target_and_sum(h, z, 0, v0, want_sum, part);
    if (h.targets.defined()) out.target_logit += part.target_logit;
    if (want_sum) out.logit_sum += part.logit_sum;
  }
  out.lse = m + s.log();
  return out;
}

// Training without a slab of logits (HeadOptions::recompute_logits), given every row's log-sum-exp: the vocabulary goes
// a chunk of columns at a time through its logits x·W[c]ᵀ, their gradient dz, dW[c] = dzᵀ·x (complete, written once
// in W's type) and dx += dz·W[c]. Where the fused Hopper kernel applies, it forms dz on its tiles (the logits stay on
// chip); elsewhere a GEMM writes the chunk's logits and dz takes their memory. A chunk's slab lives in memory that
// nothing needs yet: dW's rows after the chunk, dx's buffer before dx is written, or a slab of at most 2 KiB per row.
// For 16-bit inputs dx sums in float32 inside dW's last rows; the chunks over those rows run twice: for dx first, then,
// once dx is written, for dW. Where dW cannot hold that sum (it would take over half of dW, or dW is not wanted), the
// sum takes a buffer of its own.
Gradients recomputed_gradients(const Head& h, const at::Tensor& g, const at::Tensor& lse, const LossOptions& o,
                               std::array<bool, 3> want) {
  const int64_t N = h.rows(), V = h.vocabulary(), D = h.x.size(1);
  Gradients out;
  if (N == 0) {
    if (want[0]) out.x = at::zeros_like(h.x);
    if (want[1]) out.weight = at::zeros_like(h.weight);
    if (want[2]) out.bias = at::zeros_like(h.bias);
    return out;
  }
  // Every entry is written: dx by the first chunk's product, dW and the bias a chunk at a time.
  if (want[0]) out.x = at::empty_like(h.x);
  if (want[1]) out.weight = at::empty_like(h.weight);
  if (want[2]) out.bias = at::empty({V}, h.x.options().dtype(h.acc));
  bool fused = false;
  fused = h.targets.defined() && cuda::fused_linear_head_applies(h.x, h.weight);
  // The slab holds float32 logits (dz over them), or with the fused kernel dz itself in x's type.
  const at::ScalarType slab_type = fused ? h.x.scalar_type() : h.acc;
  const int64_t acc_size = static_cast<int64_t>(at::elementSize(h.acc)), row_bytes = D * h.weight.element_size();
  const int64_t slab_size = static_cast<int64_t>(at::elementSize(slab_type));
  const int64_t tail_columns = small_slab_columns(h, slab_size);
  const at::Tensor dw_bytes = want[1] ? out.weight.view({-1}).view(at::kByte) : at::Tensor();
  at::Tensor tail;  // the small slab, allocated when first needed
  // Chunks are whole multiples of 8 columns (but a phase's last) and slabs start on 256 bytes, so that every GEMM's
  // leading dimensions and pointers suit cuBLAS' Hopper kernels (odd ones fall back to much slower ones).
  constexpr int64_t kColumns = 8, kAlign = 256;
  auto whole = [&](int64_t c, int64_t rest) { return c >= rest ? rest : c / kColumns * kColumns; };
  auto slab_at = [&](const at::Tensor& bytes, int64_t begin, int64_t c, at::ScalarType type) {
    return bytes.narrow(0, begin, N * c * at::elementSize(type)).view(type).view({N, c});
  };

  // The chunk from column v0 (at most `rest` columns) and its slab of logits [N, c]: in dW after the chunk's own rows
  // up to byte dw_limit (0: not there), or in `spare` (a free buffer, or undefined), whichever holds more columns;
  // the small slab where neither holds as many as it does.
  auto next_slab = [&](int64_t v0, int64_t rest, int64_t dw_limit,
                       const at::Tensor& spare) -> std::pair<int64_t, at::Tensor> {
    const int64_t in_dw =
        dw_limit > 0
            ? whole(std::max<int64_t>(0, dw_limit - v0 * row_bytes - kAlign) / (N * slab_size + row_bytes), rest)
            : 0;
    const int64_t in_spare = spare.defined() ? whole(spare.numel() / (N * slab_size), rest) : 0;
    const int64_t c = std::max(in_dw, in_spare);
    if (c > 0 && c >= std::min(rest, tail_columns)) {
      if (in_dw >= in_spare)
        return {c, slab_at(dw_bytes, ((v0 + c) * row_bytes + kAlign - 1) / kAlign * kAlign, c, slab_type)};
      return {c, slab_at(spare, 0, c, slab_type)};
    }
    const int64_t t = std::min(rest, tail_columns);
    if (!tail.defined()) tail = at::empty({N * tail_columns}, h.x.options().dtype(slab_type));
    return {t, tail.narrow(0, 0, N * t).view({N, t})};
  };

  // dx's sum: dx itself for float32/float64; for 16-bit inputs float32 in dW's last bytes when they are at most half
  // of dW, else a float32 buffer of its own.
  at::Tensor dx_sum = out.x;
  int64_t v_split = V, sum_begin = 0;  // columns from v_split on run twice
  if (want[0] && h.x.scalar_type() != h.acc) {
    if (want[1] && D > 0 && !h.own_dx_sum) {
      const int64_t sum_bytes = N * D * acc_size;
      sum_begin = (dw_bytes.numel() - sum_bytes) / kAlign * kAlign;
      if (sum_begin >= dw_bytes.numel() / 2) {
        v_split = sum_begin / row_bytes / kColumns * kColumns;
        dx_sum = slab_at(dw_bytes, sum_begin, D, h.acc);
      }
    }
    if (v_split == V) dx_sum = at::empty({N, D}, h.x.options().dtype(h.acc));
  }
  const at::Tensor row_lse = lse.contiguous(), row_g = g.contiguous();
  bool first_dx = true;
  // Columns [v_begin, v_end): each chunk adds to dx (with_dx) and writes its dW rows and bias entries (with_dw).
  auto sweep = [&](int64_t v_begin, int64_t v_end, int64_t dw_limit, const at::Tensor& spare, bool with_dx,
                   bool with_dw) {
    for (int64_t v0 = v_begin; v0 < v_end;) {
      auto [c, slab] = next_slab(v0, v_end - v0, dw_limit, spare);
      const at::Tensor wc = h.weight.narrow(0, v0, c);
      at::Tensor dz = slab;
      if (fused)
        TORCH_CHECK(
            cuda::fused_linear_logit_gradient(h.x, h.weight, h.bias, h.targets, {v0, h.smoothing_vocabulary()}, row_lse,
                                              row_g, o.label_smoothing, o.z_loss, h.softcap.value_or(0), dz),
            "linear head: the fused gradient kernel did not take a chunk it was chosen for");
      if (!fused) {
        mm_into(slab, h.x, wc.t(), true);
        finish_logits(h, slab, v0);
        dz = slab_logit_gradient(h, slab, lse, g, 0, v0, o);
      }
      if (with_dx && want[0]) {
        mm_into(dx_sum, dz, wc, first_dx);
        first_dx = false;
      }
      if (with_dw && want[1]) mm_into(out.weight.narrow(0, v0, c), dz.t(), h.x, true);
      if (with_dw && want[2]) out.bias.narrow(0, v0, c).copy_(dz.sum(0, false, h.acc));
      v0 += c;
    }
  };
  const int64_t dw_end = want[1] ? dw_bytes.numel() : 0;
  // dx's own buffer is free until dx is written, when it is not the sum: the slabs that dW's rows cannot hold go there.
  const at::Tensor dx_bytes = want[0] && !dx_sum.is_same(out.x) ? out.x.view({-1}).view(at::kByte) : at::Tensor();
  if (v_split == V) {
    sweep(0, V, dw_end, dx_bytes, true, true);
    if (dx_bytes.defined()) out.x.copy_(dx_sum);
  } else {
    sweep(0, v_split, sum_begin, dx_bytes, true, true);
    sweep(v_split, V, 0, dx_bytes, true, false);
    out.x.copy_(dx_sum);
    sweep(v_split, V, dw_end, {}, false, true);
  }
  if (want[2]) out.bias = out.bias.to(h.weight.scalar_type());
  return out;
}

// Per-row results without gradients: lse, and optionally the per-row loss, target log-prob and entropy.
struct RowResults {
  at::Tensor lse, loss, logprob, entropy;
};

// Every row's statistics (lse, target logit, and Σ z and Σ p·z when wanted): from the fused kernel where it applies,
// else a chunk of vocabulary columns at a time (recompute_logits, without Σ p·z), else a slab of rows at a time.
SlabStats all_row_stats(const Head& h, bool want_sum, bool want_expected) {
  if (auto fused = fused_stats(h, want_sum, want_expected)) return *fused;
  if (h.recompute && !want_expected && h.rows() > 0) return chunked_stats(h, want_sum);
  std::vector<SlabStats> slabs;
  for (int64_t r0 = 0; r0 < h.rows(); r0 += h.rows_per_slab)
    slabs.push_back(
        slab_stats(h, slab_logits(h, r0, std::min(h.rows_per_slab, h.rows() - r0)), r0, want_sum, want_expected));
  const auto join = [&](at::Tensor SlabStats::*field) {
    if (slabs.empty()) return at::empty({0}, h.x.options().dtype(h.acc));
    if (!(slabs[0].*field).defined()) return at::Tensor();
    std::vector<at::Tensor> parts;
    for (const SlabStats& s : slabs) parts.push_back(s.*field);
    return at::cat(parts);
  };
  SlabStats all;
  all.lse = join(&SlabStats::lse);
  all.target_logit = join(&SlabStats::target_logit);
  all.logit_sum = join(&SlabStats::logit_sum);
  all.expected_logit = join(&SlabStats::expected_logit);
  return all;
}

RowResults head_rows(const Head& h, const LossOptions* loss, bool want_logprob, bool want_entropy) {
  c10::NoGradGuard no_grad;
  const SlabStats s = all_row_stats(h, loss && loss->label_smoothing != 0, want_entropy);
  RowResults r;
  r.lse = s.lse;
  if (loss || want_logprob) {
    const at::Tensor valid = valid_targets(h.targets, h.ignore_index);
    if (loss) r.loss = row_loss(h, s, valid, *loss);
    if (want_logprob) r.logprob = (s.target_logit - s.lse) * valid;
  }
  if (want_entropy) r.entropy = s.lse - s.expected_logit;  // H = lse - Σ_v p_v·z_v
  return r;
}

at::Tensor reduce(const at::Tensor& rows, const at::Tensor& valid, Reduction r) {
  if (r == Reduction::none) return rows;
  if (r == Reduction::sum) return rows.sum();
  return rows.sum() / valid.sum();  // NaN when every target is ignored, as in PyTorch
}

// The row weights g_i of a reduced loss: 1 (sum) or 1/count (mean) for counted rows, 0 for ignored ones.
at::Tensor row_weights(const at::Tensor& valid, Reduction r, at::ScalarType acc) {
  // With every target ignored the mean loss is NaN, but the gradients are zero (as in PyTorch), not NaN.
  const at::Tensor w = valid.to(acc);
  return r == Reduction::mean ? w / valid.sum().clamp_min(1) : w;
}

// The C++ API's autograd: the two halves below, with the options in the context.
struct LinearCrossEntropyFunction : torch::autograd::Function<LinearCrossEntropyFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& targets, const std::optional<at::Tensor>& bias, const HeadOptions* head,
                            const LossOptions* loss, bool grad_enabled) {
    HeadOptions ho = *head;
    ho.bias = bias ? *bias : at::Tensor();
    // Grad mode is off inside forward: the caller's mode says whether anyone will ask for gradients.
    const std::array<bool, 3> want = {grad_enabled && x.requires_grad(), grad_enabled && weight.requires_grad(),
                                      grad_enabled && bias && bias->requires_grad()};
    LinearCrossEntropyForward f = linear_cross_entropy_forward(x, weight, targets, ho, *loss, want);
    // The unreduced loss's backward forms the gradients from the inputs; a reduced one's come with the forward.
    if (loss->reduction == Reduction::none) ctx->save_for_backward({x, weight, targets, ho.bias, f.lse});
    else ctx->save_for_backward({f.dx, f.dweight, f.dbias});
    ctx->saved_data["bias"] = bias.has_value();
    ctx->saved_data["reduction"] = static_cast<int64_t>(loss->reduction);
    ctx->saved_data["label_smoothing"] = loss->label_smoothing;
    ctx->saved_data["z_loss"] = loss->z_loss;
    ctx->saved_data["softcap"] = head->softcap ? *head->softcap : 0.0;
    ctx->saved_data["ignore_index"] = head->ignore_index;
    ctx->saved_data["chunk_bytes"] = head->chunk_bytes;
    ctx->saved_data["recompute_logits"] = head->recompute_logits;
    ctx->saved_data["memory_budget"] = head->memory_budget;
    return f.loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    HeadOptions ho;
    const double cap = ctx->saved_data["softcap"].toDouble();
    if (cap > 0) ho.softcap = cap;
    ho.ignore_index = ctx->saved_data["ignore_index"].toInt();
    ho.chunk_bytes = ctx->saved_data["chunk_bytes"].toInt();
    ho.recompute_logits = ctx->saved_data["recompute_logits"].toBool();
    ho.memory_budget = ctx->saved_data["memory_budget"].toInt();
    LossOptions lo;
    lo.reduction = static_cast<Reduction>(ctx->saved_data["reduction"].toInt());
    lo.label_smoothing = ctx->saved_data["label_smoothing"].toDouble();
    lo.z_loss = ctx->saved_data["z_loss"].toDouble();
    const bool unreduced = lo.reduction == Reduction::none;
    LinearCrossEntropyForward f;
    at::Tensor x, weight, targets;
    if (unreduced) x = saved[0], weight = saved[1], targets = saved[2], ho.bias = saved[3], f.lse = saved[4];
    else f.dx = saved[0], f.dweight = saved[1], f.dbias = saved[2];
    const std::array<bool, 3> want = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                      ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(3)};
    auto d = linear_cross_entropy_backward(grad_out[0], x, weight, targets, ho, lo, f, want);
    return {d[0], d[1], at::Tensor(), d[2], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor linear_logsumexp(const at::Tensor& x, const at::Tensor& weight, const HeadOptions& head) {
  const Head h = prepare(x, weight, {}, head);
  return head_rows(h, nullptr, false, false).lse.view(h.row_shape);
}

TokenLogprobs token_logprobs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                             const HeadOptions& head, bool with_entropy) {
  if (!targets.defined()) throw Error("token_logprobs: targets are required");
  const Head h = prepare(x, weight, targets, head);
  RowResults r = head_rows(h, nullptr, true, with_entropy);
  return {r.logprob.view(h.row_shape), with_entropy ? r.entropy.view(h.row_shape) : at::Tensor()};
}

LinearCrossEntropyForward linear_cross_entropy_forward(const at::Tensor& x, const at::Tensor& weight,
                                                       const at::Tensor& targets, const HeadOptions& head,
                                                       const LossOptions& loss, std::array<bool, 3> want) {
  if (!targets.defined()) throw Error("linear_cross_entropy: targets are required");
  if (!(loss.label_smoothing >= 0 && loss.label_smoothing <= 1))
    throw Error(message::text("linear_cross_entropy: label_smoothing must be in [0, 1], got ", loss.label_smoothing));
  if (!(loss.z_loss >= 0)) throw Error(message::text("linear_cross_entropy: z_loss must be >= 0, got ", loss.z_loss));
  c10::NoGradGuard no_grad;
  const Head h = prepare(x, weight, targets, head);
  want[2] = want[2] && h.bias.defined();
  const at::Tensor valid = valid_targets(h.targets, h.ignore_index);
  LinearCrossEntropyForward out;
  if (loss.reduction != Reduction::none && (want[0] || want[1] || want[2])) {
    // Reduced loss: form the gradients now, from the same logits; backward scales them by the incoming gradient.
    const at::Tensor weights = row_weights(valid, loss.reduction, h.acc);
    at::Tensor rows;
    Gradients g;
    if (h.recompute) {
      RowResults r = head_rows(h, &loss, false, false);
      rows = r.loss;
      g = recomputed_gradients(h, weights, r.lse, loss, want);
    } else {
      rows = at::empty({h.rows()}, h.x.options().dtype(h.acc));
      g = head_gradients(h, weights, {}, loss, want, &rows);
    }
    out.loss = reduce(rows, valid, loss.reduction);
    out.dx = g.x.defined() ? g.x.view(x.sizes()) : g.x;
    out.dweight = g.weight;
    out.dbias = g.bias;
    return out;
  }
  RowResults r = head_rows(h, &loss, false, false);
  out.lse = r.lse;
  out.loss = reduce(r.loss, valid, loss.reduction)
                 .view(loss.reduction == Reduction::none ? h.row_shape : std::vector<int64_t>{});
  return out;
}

std::array<at::Tensor, 3> linear_cross_entropy_backward(const at::Tensor& grad, const at::Tensor& x,
                                                        const at::Tensor& weight, const at::Tensor& targets,
                                                        const HeadOptions& head, const LossOptions& loss,
                                                        const LinearCrossEntropyForward& forward,
                                                        std::array<bool, 3> want) {
  c10::NoGradGuard no_grad;
  if (loss.reduction != Reduction::none) {
    // loss.backward() passes 1: hand the gradients over as they are, without a scaled copy. A tensor that
    // torch.compile traces (fake or functional: the Python or Functionalize key) has no value to look at; it scales.
    const bool traced =
        grad.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
    const bool one = !traced && grad.item<double>() == 1;
    auto scale = [&](const at::Tensor& t, bool wanted) {
      return !wanted || !t.defined() ? at::Tensor() : one ? t : t * grad.to(t.scalar_type());
    };
    return {scale(forward.dx, want[0]), scale(forward.dweight, want[1]), scale(forward.dbias, want[2])};
  }
  const Head h = prepare(x, weight, targets, head, /*check_targets=*/false);
  want[2] = want[2] && h.bias.defined();
  const at::Tensor g = grad.reshape({-1}).to(h.acc) * valid_targets(h.targets, h.ignore_index);
  Gradients d =
      h.recompute ? recomputed_gradients(h, g, forward.lse, loss, want) : head_gradients(h, g, forward.lse, loss, want);
  return {d.x.defined() ? d.x.view(x.sizes()) : d.x, d.weight, d.bias};
}

std::array<at::Tensor, 3> head_statistics_backward(const at::Tensor& x, const at::Tensor& weight,
                                                   const at::Tensor& targets, const HeadOptions& head,
                                                   const at::Tensor& grad_lse, const at::Tensor& grad_logprob,
                                                   const at::Tensor& grad_entropy, std::array<bool, 3> want) {
  c10::NoGradGuard no_grad;
  if ((grad_logprob.defined() || grad_entropy.defined()) && !targets.defined())
    throw Error("head_statistics_backward: the log-probabilities' gradients need the targets");
  const Head h = prepare(x, weight, targets, head, /*check_targets=*/false);
  want[2] = want[2] && h.bias.defined();
  const auto rows = [&](const at::Tensor& g, const char* name) {
    if (!g.defined()) return g;
    if (g.numel() != h.rows())
      throw Error(
          message::text("head_statistics_backward: ", name, " has ", g.numel(), " entries for ", h.rows(), " rows"));
    return g.reshape({-1}).to(h.acc);
  };
  if (!grad_lse.defined() && !grad_entropy.defined() && grad_logprob.defined()) {
    // log p(t) = -(the unreduced loss): its backward, whose fused kernels and recompute_logits apply.
    LinearCrossEntropyForward f;
    LossOptions none;
    none.reduction = Reduction::none;
    return linear_cross_entropy_backward(-grad_logprob, x, weight, targets, head, none, f, want);
  }
  Gradients d = statistics_gradients(h, rows(grad_lse, "grad_lse"), rows(grad_logprob, "grad_logprob"),
                                     rows(grad_entropy, "grad_entropy"), want);
  return {d.x.defined() ? d.x.view(x.sizes()) : d.x, d.weight, d.bias};
}

HeadMemoryPlan plan_head_memory(const at::Tensor& x, const at::Tensor& weight, const HeadOptions& head) {
  return memory_plan(prepare(x, weight, {}, head), head);
}

namespace head_slice {

namespace {
HeadOptions slice_options(const HeadOptions& head) {
  HeadOptions o = head;
  o.ignore_index = -1;  // local targets: -1 where the target is not in the slice
  return o;
}
}  // namespace

HeadRowStats statistics(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& local_targets,
                        const HeadOptions& head, bool want_sum, bool want_expected) {
  c10::NoGradGuard no_grad;
  return all_row_stats(prepare(x, weight, local_targets, slice_options(head), /*check_targets=*/false), want_sum,
                       want_expected);
}

std::array<at::Tensor, 3> gradients(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& local_targets,
                                    const HeadOptions& head, const LossOptions& loss, const at::Tensor& lse,
                                    const at::Tensor& g, int64_t total_vocabulary, std::array<bool, 3> want) {
  c10::NoGradGuard no_grad;
  Head h = prepare(x, weight, local_targets, slice_options(head), /*check_targets=*/false);
  h.total_vocabulary = total_vocabulary;
  want[2] = want[2] && h.bias.defined();
  Gradients d = h.recompute ? recomputed_gradients(h, g, lse, loss, want) : head_gradients(h, g, lse, loss, want);
  return {d.x.defined() ? d.x.view(x.sizes()) : d.x, d.weight, d.bias};
}

std::array<at::Tensor, 3> gradients_in_one_pass(const at::Tensor& x, const at::Tensor& weight,
                                                const at::Tensor& local_targets, const HeadOptions& head,
                                                const LossOptions& loss, const at::Tensor& g, int64_t total_vocabulary,
                                                std::array<bool, 3> want, const Merge& merge, HeadRowStats& merged) {
  c10::NoGradGuard no_grad;
  Head h = prepare(x, weight, local_targets, slice_options(head), /*check_targets=*/false);
  h.total_vocabulary = total_vocabulary;
  want[2] = want[2] && h.bias.defined();
  Gradients d = head_gradients(h, g, {}, loss, want, nullptr, &merge, &merged);
  if (h.rows() == 0) merged = all_row_stats(h, loss.label_smoothing != 0, false);
  return {d.x.defined() ? d.x.view(x.sizes()) : d.x, d.weight, d.bias};
}

}  // namespace head_slice

at::Tensor linear_cross_entropy(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                const HeadOptions& head, const LossOptions& loss) {
  const std::optional<at::Tensor> bias = head.bias.defined() ? std::optional<at::Tensor>(head.bias) : std::nullopt;
  return LinearCrossEntropyFunction::apply(x, weight, targets, bias, &head, &loss, c10::GradMode::is_enabled());
}

}  // namespace trellis
