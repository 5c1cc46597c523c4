// The head's inputs checked and flattened, and the pieces its routes share (head_problem.h).
#include "lib/src/head/head_problem.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "cuda/kernels_built.h"
#include "cuda/linear_head.h"  // the kernels, or the stubs of a build without nvcc (cuda/no_kernels.cpp)
#include "lib/src/head/head_maths.h"
#include "lib/src/io/message.h"
#include "trellis/error.h"

namespace trellis::head_detail {

namespace {
bool supported(at::ScalarType t) { return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf; }
}  // namespace

Head prepare(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets, const HeadOptions& o,
             bool check_targets) {
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
  h.input_type_rows_per_slab = input_type_slab_rows(h, h.chunk_bytes);
  h.input_type_slabs = !plan.recompute_logits && plan.slab_type == h.x.scalar_type() && plan.slab_type != h.acc;
  return h;
}

at::Tensor mm_acc(const at::Tensor& a, const at::Tensor& b, at::ScalarType acc) {
  if (a.scalar_type() == acc && b.scalar_type() == acc) return at::mm(a, b);
  if (a.is_cuda()) return at::mm(a, b, acc);
  return at::mm(a.to(acc), b.to(acc));
}

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

void soft_cap(const Head& h, at::Tensor& z) {
  if (h.softcap) z.div_(*h.softcap).tanh_().mul_(*h.softcap);
}

void finish_logits(const Head& h, at::Tensor& z, int64_t v0, bool capped) {
  if (h.bias.defined()) z.add_(h.bias.narrow(0, v0, z.size(1)).to(h.acc));
  if (capped) soft_cap(h, z);
}

at::Tensor slab_logits(const Head& h, int64_t r0, int64_t n, bool capped) {
  at::Tensor z = mm_acc(h.x.narrow(0, r0, n), h.weight.t(), h.acc);
  finish_logits(h, z, 0, capped);
  return z;
}

at::Tensor valid_targets(const at::Tensor& targets, int64_t ignore_index) { return targets != ignore_index; }

std::pair<at::Tensor, at::Tensor> target_columns(const Head& h, const at::Tensor& t, int64_t v0, int64_t c) {
  const at::Tensor column = t - v0, hit = valid_targets(t, h.ignore_index) & (column >= 0) & (column < c);
  return {at::where(hit, column, 0), hit};
}

void target_and_sum(const Head& h, const at::Tensor& z, int64_t r0, int64_t v0, bool want_sum, SlabStats& s) {
  if (h.targets.defined()) {
    const auto [column, hit] = target_columns(h, h.targets.narrow(0, r0, z.size(0)), v0, z.size(1));
    s.target_logit = z.gather(1, column.unsqueeze(1)).squeeze(1) * hit;
  }
  if (want_sum) s.logit_sum = z.sum(1);
}

at::Tensor row_loss(const Head& h, const SlabStats& s, const at::Tensor& valid, const LossOptions& o) {
  const auto terms = head_maths::loss_terms<double>(o.label_smoothing, o.z_loss, h.smoothing_vocabulary());
  return head_maths::row_loss(s.lse, s.target_logit, s.logit_sum, terms) * valid;
}

namespace {

// The CPU's logit gradient: one pass over each row, in parallel over rows.
at::Tensor cpu_logit_gradient(const Head& h, const at::Tensor& z, const at::Tensor& lse, const at::Tensor& g,
                              const at::Tensor& t, int64_t v0, const LossOptions& o) {
  const at::Tensor logits = z.contiguous(), row_lse = lse.contiguous(), row_g = g.contiguous(),
                   targets = t.contiguous();
  at::Tensor dz = at::empty(logits.sizes(), logits.options().dtype(h.x.scalar_type()));
  const int64_t n = logits.size(0), c = logits.size(1);
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "linear head: logit gradient", [&] {
    using Acc = scalar_t;
    const auto terms = head_maths::loss_terms<Acc>(o.label_smoothing, o.z_loss, h.smoothing_vocabulary());
    const head_maths::SoftCap<Acc> cap(static_cast<Acc>(h.softcap.value_or(0)));
    const Acc* zp = logits.data_ptr<Acc>();
    const Acc* lp = row_lse.data_ptr<Acc>();
    const Acc* gp = row_g.data_ptr<Acc>();
    const int64_t* tp = targets.data_ptr<int64_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dz.scalar_type(), "linear head: logit gradient", [&] {
      using Out = scalar_t;
      Out* dp = dz.data_ptr<Out>();
      at::parallel_for(0, n, std::max<int64_t>(1, 32768 / std::max<int64_t>(c, 1)), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const Acc l = lp[r];
          const head_maths::RowGradient<Acc> row = head_maths::row_gradient(gp[r], l, terms);
          const int64_t target = tp[r] - v0;  // g is 0 for ignored rows, so an ignore_index among the columns is moot
          const Acc* zr = zp + r * c;
          Out* dr = dp + r * c;
          for (int64_t v = 0; v < c; ++v)
            dr[v] = static_cast<Out>(head_maths::logit_gradient(std::exp(zr[v] - l), zr[v], row, v == target, cap));
        }
      });
    });
  });
  return dz;
}

}  // namespace

at::Tensor logit_gradient(const Head& h, at::Tensor z, const at::Tensor& lse, const at::Tensor& g, int64_t r0,
                          int64_t v0, const LossOptions& o, bool capped) {
  const at::Tensor t = h.targets.narrow(0, r0, z.size(0));
  const bool kernels = z.is_cuda() && cuda::kernels_built();
  if (!capped && !kernels) soft_cap(h, z);
  if (!z.is_cuda()) return cpu_logit_gradient(h, z, lse, g, t, v0, o);
  // A build without nvcc has no kernel for it: the CPU's loop, on copies.
  if (!kernels) return cpu_logit_gradient(h, z.cpu(), lse.cpu(), g.cpu(), t.cpu(), v0, o).to(z.device());
  const at::ScalarType type = h.x.scalar_type();
  const cuda::LogitColumns columns{v0, h.smoothing_vocabulary(), capped};
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

}  // namespace trellis::head_detail
