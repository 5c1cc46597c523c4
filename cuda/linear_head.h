// Launchers for the LLM head's kernels (cuda/linear_head.cu), called by lib/ with contiguous CUDA tensors; they
// launch on the current stream and check the launch.
#pragma once
#include <ATen/core/Tensor.h>

#include "lib/src/head/row_stats.h"

namespace trellis::cuda {

using trellis::HeadRowStats;  // lib/src/head/row_stats.h

// The columns that share one reference in the training slabs in x's type (fused_linear_exponentials): the fused
// kernel's tile (sm90::kExponentialTileColumns, kept equal to it there).
constexpr int64_t kExponentialTileColumns = 256;

// The fused Hopper kernel (cuda/linear_lse_sm90.cu), which never forms the logits in device memory, when it applies:
// a compute capability 9.0 device, bfloat16/float16 x and W with D % 8 == 0. Returns false otherwise (nothing is done).
// x [N,D], weight [V,D], bias [V] or undefined, targets [N] int64 or undefined; all contiguous.
bool fused_linear_lse(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& targets,
                      double softcap, bool want_sums, HeadRowStats& out);

// Which logits a slab holds: its columns are vocabulary entries [first, first + z.size(1)) of `vocabulary`, soft-capped
// already or not (then the kernels below apply the soft-cap as they read each logit, and their lse and dz are those of
// the capped logits).
struct LogitColumns {
  int64_t first = 0, vocabulary = 0;
  bool capped = true;
};

// The gradient of the head's loss with respect to a slab of logits z [n,c] (float32 or float64), in one pass:
//   dz[r,v] = g[r]·(p·(1 + 2·z_loss·lse[r]) - ε/V - (1-ε)·[v = t[r]]) · (1 - (z/c)²  when softcap c > 0),
// p = exp(z[r,v] - lse[r]); dz [n,c] of the input type (float32, float64, bfloat16 or float16), ready for the GEMMs.
// Both have unit column stride; dz may be z itself when the types match (each element is read before it is written).
void linear_head_logit_gradient(const at::Tensor& z, const at::Tensor& lse, const at::Tensor& g,
                                const at::Tensor& targets, LogitColumns columns, double label_smoothing, double z_loss,
                                double softcap, at::Tensor& dz);

// The same gradient reading z once through shared memory: a cluster of thread blocks per row on compute capability
// 9.0 and later. With form_lse the rows' log-sum-exp is formed on the way (the slab then holds whole rows) and written
// to lse [n]; otherwise lse is read. Returns false (nothing done) elsewhere, or when a row's slice does not fit in
// shared memory. dz ([n, c], unit column stride) may overlay z's own memory as long as row r of dz lies inside row r
// of z (dz.stride(0)·sizeof(dz) == z.stride(0)·sizeof(z)): each row is on chip before any of its gradient is written,
// but rows (clusters) are not ordered against each other.
bool linear_head_logit_gradient_in_place(const at::Tensor& z, const at::Tensor& g, const at::Tensor& targets,
                                         LogitColumns columns, double label_smoothing, double z_loss, double softcap,
                                         bool form_lse, at::Tensor& lse, at::Tensor& dz);

// Whether the fused Hopper kernel takes x [N, D] and weight [V, D] (contiguous): bfloat16/float16, D % 8 == 0, 16-byte
// aligned rows, a compute capability 9.0 device.
bool fused_linear_head_applies(const at::Tensor& x, const at::Tensor& weight);

// The loss gradient of vocabulary columns [columns.first, columns.first + dz.size(1)) formed on the fused kernel's
// tiles: the logits never reach device memory. The formula is linear_head_logit_gradient's, with each row's lse [N]
// and weight g [N] (float32) given; targets are required. Applies where fused_linear_lse does (and dz's unit column
// stride and row stride are in elements of x's type); returns false otherwise, with nothing done.
bool fused_linear_logit_gradient(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                 const at::Tensor& targets, LogitColumns columns, const at::Tensor& lse,
                                 const at::Tensor& g, double label_smoothing, double z_loss, double softcap,
                                 at::Tensor& dz);

// The training slabs in x's type (16-bit), in two passes over a slab of rows. First the fused kernel's statistics of
// x's rows, as fused_linear_lse with the targets (want_sums: Σ z and Σ p·z too), and beside them the exponentials
// e = e^(z − ref) rounded to x's type into e [N, V] (unit column stride) and each row's reference per 256-column tile
// into ref [N, ceil(V / 256)] float32 (sm90::ExponentialSlabArgs). Applies where fused_linear_lse does; returns false
// otherwise, with nothing done.
bool fused_linear_exponentials(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& targets, double softcap, bool want_sums, HeadRowStats& out,
                               at::Tensor& e, at::Tensor& ref);
// Then the loss gradient written over e (linear_head_logit_gradient's formula, rows in order, V = e.size(1) columns of
// a vocabulary of `vocabulary` for label smoothing): p = e·e^(ref − lse) (head_maths::exponential_logit_gradient),
// but the target's p = e^(target_logit − lse) from its float32 logit. lse, g and target_logit float32 [N].
void exponential_slab_gradient(at::Tensor& e, const at::Tensor& ref, const at::Tensor& lse, const at::Tensor& g,
                               const at::Tensor& targets, const at::Tensor& target_logit, double label_smoothing,
                               double z_loss, int64_t vocabulary, double softcap);

}  // namespace trellis::cuda
