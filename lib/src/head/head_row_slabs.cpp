// The row-slab routes: rows `chunk_bytes` of logits at a time against the whole vocabulary (one GEMM into the
// accumulation type), the statistics the results need (log-sum-exp through the tree-reduced kernel, target logits by
// gathers, Σ z, Σ p·z), and for training the slab's loss gradient, which two more GEMMs turn into dx rows (complete
// per slab) and a dW accumulation. The same code runs on CPU and CUDA tensors.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <utility>
#include <vector>

#include "cuda/linear_head.h"  // the kernels, or the stubs of a build without nvcc (cuda/no_kernels.cpp)
#include "lib/src/head/head_maths.h"
#include "lib/src/head/head_routes.h"
#include "trellis/semiring/semiring_ops.h"

namespace trellis::head_detail {
namespace {

// Statistics of one slab of logits.
SlabStats slab_stats(const Head& h, const at::Tensor& z, int64_t r0, bool want_sum, bool want_expected) {
  SlabStats s;
  s.lse = trellis::logsumexp(z, 1);
  target_and_sum(h, z, r0, 0, want_sum, s);
  if (want_expected) s.expected_logit = ((z - s.lse.unsqueeze(1)).exp() * z).sum(1);
  return s;
}

}  // namespace

SlabStats slab_row_stats(const Head& h, bool want_sum, bool want_expected) {
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

namespace {

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

}  // namespace

Gradients slab_gradients(const Head& h, const at::Tensor& g, at::Tensor lse, const LossOptions& o,
                         std::array<bool, 3> want, at::Tensor* loss, const head_slice::Merge* merge,
                         SlabStats* merged) {
  const int64_t N = h.rows();
  Gradients out = empty_gradients(h, want);
  std::vector<SlabStats> merged_slabs;
  // The slabs hold the logits before the soft-cap, which the gradient (on CUDA the kernels, as they read each logit)
  // applies, but where statistics are read from them first: the merge over a split vocabulary, label smoothing's Σ z.
  const bool capped = merge || (loss && !lse.defined() && o.label_smoothing != 0);
  for (int64_t r0 = 0; r0 < N; r0 += h.rows_per_slab) {
    const int64_t n = std::min(h.rows_per_slab, N - r0);
    at::Tensor z = slab_logits(h, r0, n, capped);
    bool z_capped = capped;
    at::Tensor slab_lse, dz;
    if (lse.defined()) {
      slab_lse = lse.narrow(0, r0, n);
    } else if (merge) {
      merged_slabs.push_back((*merge)(slab_stats(h, z, r0, o.label_smoothing != 0, false)));
      slab_lse = merged_slabs.back().lse;
    } else {
      SlabStats s;
      if (loss) {
        target_and_sum(h, z, r0, 0, o.label_smoothing != 0, s);  // before dz may take z's memory
        if (!capped) soft_cap(h, s.target_logit);
      }
      // On CUDA the log-sum-exp comes with the gradient, from one read of the slab. The kernel holds each row on chip
      // before writing its gradient, so dz takes the slab's own memory (the first half of each float32 row for 16-bit
      // inputs) instead of a second slab-sized buffer.
      if (z.is_cuda()) {
        at::Tensor row_lse = at::empty({n}, z.options());
        at::Tensor d = z.view(h.x.scalar_type()).narrow(1, 0, h.vocabulary());
        if (cuda::linear_head_logit_gradient_in_place(z, g.narrow(0, r0, n).contiguous(),
                                                      h.targets.narrow(0, r0, n).contiguous(),
                                                      {0, h.smoothing_vocabulary(), capped}, o.label_smoothing,
                                                      o.z_loss, h.softcap.value_or(0), /*form_lse=*/true, row_lse, d))
          s.lse = row_lse, dz = d;
      }
      if (!s.lse.defined()) {  // the CPU, or no kernel for it (before compute capability 9.0, rows too long)
        if (!capped) soft_cap(h, z);
        z_capped = true;
        s.lse = trellis::logsumexp(z, 1);
      }
      slab_lse = s.lse;
      if (loss)
        loss->narrow(0, r0, n).copy_(row_loss(h, s, valid_targets(h.targets.narrow(0, r0, n), h.ignore_index), o));
    }
    if (!dz.defined()) dz = logit_gradient(h, std::move(z), slab_lse, g.narrow(0, r0, n), r0, 0, o, z_capped);
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

namespace {

// The CPU's steps of the training slabs in x's type, the reference for the fused kernel and its pass: the slab's
// statistics from float32 logits (formed whole here: the CPU path is not the one that saves memory), the exponentials
// e^(z − ref) rounded to x's type into e and each tile's reference into ref, where ref is the tile's own maximum (the
// kernel's is the largest up to the tile within its work unit: as good a reference, e ≤ 1 either way).
SlabStats cpu_exponentials(const Head& h, int64_t r0, int64_t n, bool want_sum, at::Tensor& e, at::Tensor& ref) {
  const int64_t V = h.vocabulary(), tiles = ref.size(1), padded = tiles * cuda::kExponentialTileColumns;
  const at::Tensor z = slab_logits(h, r0, n);
  SlabStats s;
  s.lse = trellis::logsumexp(z, 1);
  target_and_sum(h, z, r0, 0, want_sum, s);
  const at::Tensor by_tile = at::constant_pad_nd(z, {0, padded - V}, -INFINITY).view({n, tiles, -1});
  const at::Tensor tile_max = std::get<0>(by_tile.max(2));
  ref.copy_(tile_max);
  e.copy_((by_tile - tile_max.unsqueeze(2)).exp_().view({n, padded}).narrow(1, 0, V));
  return s;
}

// cuda::exponential_slab_gradient's pass on the CPU: the same formulas, row by row, in parallel over rows.
void cpu_exponential_gradient(const Head& h, at::Tensor& e, const at::Tensor& ref, const at::Tensor& row_lse,
                              const at::Tensor& row_target_logit, const at::Tensor& g, const at::Tensor& targets,
                              const LossOptions& o) {
  const int64_t n = e.size(0), V = e.size(1), tiles = ref.size(1);
  const auto terms = head_maths::loss_terms<float>(o.label_smoothing, o.z_loss, h.smoothing_vocabulary());
  const head_maths::SoftCap<float> cap(static_cast<float>(h.softcap.value_or(0)));
  const at::Tensor lse = row_lse.contiguous(), target_logit = row_target_logit.contiguous(), row_g = g.contiguous(),
                   t = targets.contiguous();
  const float *lp = lse.data_ptr<float>(), *zp = target_logit.data_ptr<float>(), *gp = row_g.data_ptr<float>(),
              *rp = ref.data_ptr<float>();
  const int64_t* tp = t.data_ptr<int64_t>();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(e.scalar_type(), "linear head: exponential slab gradient", [&] {
    scalar_t* ep = e.data_ptr<scalar_t>();
    at::parallel_for(0, n, std::max<int64_t>(1, 32768 / V), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float l = lp[r];
        const head_maths::RowGradient<float> row = head_maths::row_gradient(gp[r], l, terms);
        scalar_t* er = ep + r * e.stride(0);
        for (int64_t v = 0; v < V; ++v) {
          const float tile_ref = rp[r * tiles + v / cuda::kExponentialTileColumns];
          const float d = v == tp[r] ? head_maths::logit_gradient(std::exp(zp[r] - l), zp[r], row, true, cap)
                                     : head_maths::exponential_logit_gradient(static_cast<float>(er[v]), tile_ref,
                                                                              std::exp(tile_ref - l), row, cap);
          er[v] = static_cast<scalar_t>(d);
        }
      }
    });
  });
}

}  // namespace

// A slab of rows at a time: the statistics and exponentials (the fused kernel), dL/dz over the exponentials (one pass),
// then dx rows and dW += dzᵀ·x as the float32 slabs do. One slab buffer for every slab; each slab's statistics give its
// rows' loss, and its lse the gradient's unless lse is given (a vocabulary slice's gradient needs the whole one's).
Gradients input_type_slab_gradients(const Head& h, const at::Tensor& g, const at::Tensor& lse, const LossOptions& o,
                                    std::array<bool, 3> want, at::Tensor* loss) {
  const int64_t N = h.rows(), V = h.vocabulary();
  Gradients out = empty_gradients(h, want);
  const int64_t slab_rows = std::min(h.input_type_rows_per_slab, N);
  const int64_t tiles = (V + cuda::kExponentialTileColumns - 1) / cuda::kExponentialTileColumns;
  const at::Tensor e_slab = at::empty({slab_rows, V}, h.x.options());
  const at::Tensor ref_slab = at::empty({slab_rows, tiles}, h.x.options().dtype(at::kFloat));
  const bool want_sum = o.label_smoothing != 0;
  for (int64_t r0 = 0; r0 < N; r0 += slab_rows) {
    const int64_t n = std::min(slab_rows, N - r0);
    at::Tensor e = e_slab.narrow(0, 0, n), ref = ref_slab.narrow(0, 0, n);
    const at::Tensor targets = h.targets.narrow(0, r0, n), row_g = g.narrow(0, r0, n);
    SlabStats s;
    if (h.x.is_cuda()) {
      TORCH_CHECK(cuda::fused_linear_exponentials(h.x.narrow(0, r0, n), h.weight, h.bias, targets,
                                                  h.softcap.value_or(0), want_sum, s, e, ref),
                  "linear head: the fused kernel did not take the slab of exponentials it was chosen for");
    } else {
      s = cpu_exponentials(h, r0, n, want_sum, e, ref);
    }
    const at::Tensor slab_lse = lse.defined() ? lse.narrow(0, r0, n).contiguous() : s.lse;
    if (h.x.is_cuda())
      cuda::exponential_slab_gradient(e, ref, slab_lse, row_g.contiguous(), targets, s.target_logit, o.label_smoothing,
                                      o.z_loss, h.smoothing_vocabulary(), h.softcap.value_or(0));
    else cpu_exponential_gradient(h, e, ref, slab_lse, s.target_logit, row_g, targets, o);
    if (loss) loss->narrow(0, r0, n).copy_(row_loss(h, s, valid_targets(targets, h.ignore_index), o));
    add_slab_gradients(h, e, r0, want, out);
  }
  if (want[2]) out.bias = out.bias.to(h.weight.scalar_type());
  return out;
}

// The logits formed again a slab at a time. For one row, d lse/dz_v = p_v, d log p(t)/dz_v = [v = t] - p_v and dH/dz_v
// = -p_v·(log p_v + H) (head_maths::entropy_logit_gradient).
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
      dz += head_maths::entropy_logit_gradient(p, log_p, entropy) * c.narrow(0, r0, n).unsqueeze(1);
    }
    if (row_b.defined()) {
      const auto [column, hit] = target_columns(h, h.targets.narrow(0, r0, n), 0, z.size(1));
      dz.scatter_add_(1, column.unsqueeze(1), (row_b * hit).unsqueeze(1));
    }
    // head_maths::SoftCap::derivative, 1 - (z/c)², in z's own memory.
    if (h.softcap) dz.mul_(z.div_(*h.softcap).square_().neg_().add_(1));
    add_slab_gradients(h, dz.to(h.x.scalar_type()), r0, want, out);
  }
  if (want[2]) out.bias = out.bias.to(h.weight.scalar_type());
  return out;
}

}  // namespace trellis::head_detail
