// The column-chunk routes (HeadOptions::recompute_logits): no slab of rows' logits. The statistics a chunk of
// vocabulary columns at a time, each chunk's (max, Σ e^(z−max)) merged into the row's; and the gradients from every
// row's log-sum-exp, the logits formed again a chunk at a time, by a GEMM or on the fused kernel's tiles.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "cuda/linear_head.h"  // the kernels, or the stubs of a build without nvcc (cuda/no_kernels.cpp)
#include "lib/src/head/head_maths.h"
#include "lib/src/head/head_routes.h"

namespace trellis::head_detail {
namespace {

// Columns of the small slab that recompute_logits holds at most: 2 KiB per row, and no more than chunk_bytes; whole
// multiples of 8 where that leaves any (the GEMMs' leading dimensions, see recomputed_gradients).
int64_t small_slab_columns(const Head& h, int64_t element_size) {
  if (h.chunk_columns > 0) return h.chunk_columns;  // memory_budget's
  const int64_t c =
      std::clamp<int64_t>(h.chunk_bytes / (std::max<int64_t>(h.rows(), 1) * element_size), 1, 2048 / element_size);
  return c >= 8 ? c / 8 * 8 : c;
}

}  // namespace

SlabStats chunked_stats(const Head& h, bool want_sum) {
  const int64_t N = h.rows(), V = h.vocabulary(), columns = small_slab_columns(h, at::elementSize(h.acc));
  const auto opts = h.x.options().dtype(h.acc);
  at::Tensor slab = at::empty({N * columns}, opts);
  // Each row's (max, Σ e^(z−max)) so far; each chunk moves the sum onto the new maximum (head_maths::rescale) and adds
  // its own terms relative to it, as the fused kernel folds its tiles.
  head_maths::MaxSum<at::Tensor> row{at::full({N}, -INFINITY, opts), at::zeros({N}, opts)};
  SlabStats out;
  if (h.targets.defined()) out.target_logit = at::zeros({N}, opts);
  if (want_sum) out.logit_sum = at::zeros({N}, opts);
  for (int64_t v0 = 0; v0 < V; v0 += columns) {
    const int64_t c = std::min(columns, V - v0);
    at::Tensor z = slab.narrow(0, 0, N * c).view({N, c});
    mm_into(z, h.x, h.weight.narrow(0, v0, c).t(), true);
    finish_logits(h, z, v0);
    SlabStats part;
    target_and_sum(h, z, 0, v0, want_sum, part);
    if (h.targets.defined()) out.target_logit += part.target_logit;
    if (want_sum) out.logit_sum += part.logit_sum;
    const at::Tensor top = head_maths::max_of(row.max, std::get<0>(z.max(1)));
    row.sum = row.sum * head_maths::rescale(row.max, top) + z.sub_(top.unsqueeze(1)).exp_().sum(1);
    row.max = top;
  }
  out.lse = row.max + row.sum.log();
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
                               std::array<bool, 3> want, bool fused) {
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
      if (!fused) {  // the soft-cap where dz is formed
        mm_into(slab, h.x, wc.t(), true);
        finish_logits(h, slab, v0, /*capped=*/false);
        dz = logit_gradient(h, slab, lse, g, 0, v0, o, /*capped=*/false);
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

}  // namespace trellis::head_detail
