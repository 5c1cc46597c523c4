// The LLM head's formulas, written once for its three implementations: the CPU path (lib/src/head/), the slab
// kernels (cuda/linear_head.cu) and the fused Hopper kernel (cuda/linear_lse_sm90.cu). No LibTorch, so that nvcc device
// code includes it; at::Tensor is only declared, for the overloads that let the row formulas take a whole column of
// rows at once (lib/src/head/head_maths.cpp defines them).
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>

// By its path from the project root: the sm_90a object library (cuda/CMakeLists.txt) has no lib/include.
#include "lib/include/trellis/semiring/semiring.h"  // TRELLIS_HD, exp_, neg_inf

namespace at {
class Tensor;
}

namespace trellis::head_maths {

#if defined(__CUDACC__)
// 2^x and 1/x by the special-function unit alone: exp2f adds range handling for results below 2^-126 (flushed to 0
// here, where they only ever add nothing to a sum), and 1/x rounded to nearest takes a refinement and a slow path.
__device__ __forceinline__ float approx_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float approx_reciprocal(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

// ---- A row's log-sum-exp in parts ----
// Kernels and chunked passes see a row's logits a tile or chunk at a time and keep (m, s) = (the largest logit seen,
// Σ e^(z − m) over the logits seen); two such pairs merge as
//   (m1,s1) + (m2,s2) = (M, s1·e^(m1−M) + s2·e^(m2−M)),  M = max(m1, m2),
// and so does any other sum kept relative to the same maximum (Σ e^(z − m)·z, the entropy's).

// The larger of a and b (the other where one is NaN, as fmax).
template <class T>
TRELLIS_HD T max_of(T a, T b) {
#if defined(__CUDA_ARCH__)
  return fmax(a, b);
#else
  return std::fmax(a, b);
#endif
}
at::Tensor max_of(const at::Tensor& a, const at::Tensor& b);

// e^(from − to): the factor that moves a sum kept relative to `from` onto a reference `to` ≥ from; 0 when to is −inf
// (nothing seen yet: −inf − (−inf) would make NaN).
// float on a GPU: 2^((from − to)·log2 e), the form of the fused kernel's own exponentials.
template <class T>
TRELLIS_HD T rescale(T from, T to) {
  if (to == neg_inf<T>()) return T(0);
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) return exp2f((from - to) * 1.4426950408889634f);
#endif
  return exp_(from - to);
}
at::Tensor rescale(const at::Tensor& from, const at::Tensor& to);  // to finite: no guard (head_maths.cpp)

// The common maximum of two partial pairs and each one's factor onto it.
template <class T>
struct Rebase {
  T max, first, second;  // M, e^(m1−M), e^(m2−M)
};
template <class T>
TRELLIS_HD Rebase<T> rebase(const T& m1, const T& m2) {
  const T M = max_of(m1, m2);
  return {M, rescale(m1, M), rescale(m2, M)};
}
// s1·e^(m1−M) + s2·e^(m2−M): a sum of the first pair and one of the second, merged.
template <class T>
TRELLIS_HD T rebased_sum(const Rebase<T>& r, const T& s1, const T& s2) {
  return s1 * r.first + s2 * r.second;
}

// A row's (max, Σ e^(z − max)) and its merge; log_sum_exp() is the row's log Σ e^z (−inf for no logits).
template <class T>
struct MaxSum {
  T max, sum;
  TRELLIS_HD T log_sum_exp() const { return max + log_(sum); }
};
template <class T>
TRELLIS_HD MaxSum<T> merge(const MaxSum<T>& a, const MaxSum<T>& b) {
  const Rebase<T> r = rebase(a.max, b.max);
  return {r.max, rebased_sum(r, a.sum, b.sum)};
}

// ---- The loss and its gradient with respect to the logits ----
// Per row: loss = lse − (1−ε)·z_t − (ε/V)·Σ_v z_v + z_loss·lse² (0 for ignored rows), and for a row weight g (the
// upstream gradient; 0 for ignored rows)
//   dL/dz_v = g·(p_v·(1 + 2·z_loss·lse) − ε/V − (1−ε)·[v = t]) · (1 − (z_v/c)²  when the soft-cap c > 0),
// p_v = e^(z_v − lse), z the soft-capped logit.

// The loss options as the formulas use them, in the type T of the computation.
template <class T>
struct LossTerms {
  T smooth = T(0);         // ε / V, V the whole vocabulary's size
  T target_weight = T(1);  // 1 − ε
  T z_loss2 = T(0);        // 2·z_loss
};
// Formed in double, then rounded to T once.
template <class T>
LossTerms<T> loss_terms(double label_smoothing, double z_loss, int64_t vocabulary) {
  return {T(label_smoothing / static_cast<double>(vocabulary)), T(1 - label_smoothing), T(2 * z_loss)};
}

// A row's loss from its statistics (tensors of rows or one row's numbers): lse, the target's logit, and Σ_v z_v
// (read only with label smoothing).
template <class T, class U>
T row_loss(const T& lse, const T& target_logit, const T& logit_sum, const LossTerms<U>& terms) {
  T loss = lse - terms.target_weight * target_logit;
  if (terms.smooth != 0) loss = loss - terms.smooth * logit_sum;
  if (terms.z_loss2 != 0) loss = loss + (terms.z_loss2 / 2) * lse * lse;
  return loss;
}

// A row's factors of its logits' gradients: g·(1 + 2·z_loss·lse), g·ε/V and g·(1−ε).
template <class T>
struct RowGradient {
  T p_weight, shift, hit;
};
template <class T>
TRELLIS_HD RowGradient<T> row_gradient(T g, T lse, const LossTerms<T>& terms) {
  return {g * (T(1) + terms.z_loss2 * lse), g * terms.smooth, g * terms.target_weight};
}

// The soft-cap (Gemma-2's final logits): z = c·tanh(y/c) of the logit y, and its derivative dz/dy = 1 − (z/c)²,
// written with the capped logit z; c ≤ 0: no cap. It keeps 1/c, so that no logit pays a division.
template <class T>
struct SoftCap {
  T cap = T(0), inverse = T(0);
  T exp2_scale = T(0);  // 2·log2(e)/c: tanh(y/c) = 1 − 2/(2^(y·exp2_scale) + 1)

  SoftCap() = default;
  TRELLIS_HD explicit SoftCap(T c)
      : cap(c > 0 ? c : T(0)), inverse(c > 0 ? T(1) / c : T(0)), exp2_scale(c > 0 ? T(2.8853900817779268) / c : T(0)) {}
  TRELLIS_HD bool on() const { return cap > 0; }

  // c·tanh(y/c). float on a GPU: c − 2c/(2^(y·2·log2 e/c) + 1), one exponential and one reciprocal of the
  // special-function unit (within 1e-6·c of the exact value, near 0 as near ±c), where tanhf adds a polynomial branch
  // and y/c a division: the fused kernel caps every logit in the epilogue that its tensor cores wait for.
  TRELLIS_HD T operator()(T y) const {
#if defined(__CUDA_ARCH__)
    if constexpr (std::is_same_v<T, float>) {
      return fmaf(-2.f * cap, approx_reciprocal(approx_exp2(y * exp2_scale) + 1.f), cap);
    } else {
      return cap * ::tanh(y * inverse);
    }
#else
    return cap * std::tanh(y * inverse);
#endif
  }
  // dz/dy at the capped logit z.
  TRELLIS_HD T derivative(T z) const {
    const T u = z * inverse;
    return T(1) - u * u;
  }
};

// One logit's gradient, given its probability p = e^(z − lse) (each implementation forms the exponential its own
// way); target: whether this column is the row's target.
template <class T>
TRELLIS_HD T logit_gradient(T p, T z, const RowGradient<T>& row, bool target, const SoftCap<T>& cap) {
  T d = row.p_weight * p - row.shift;
  if (target) d -= row.hit;
  if (cap.on()) d *= cap.derivative(z);
  return d;
}

// One logit's gradient from its exponential relative to a reference, e = e^(z − ref) (the training slabs in x's type:
// e was rounded to 16 bits, ref is its tile's reference), and factor = e^(ref − lse), so that p = e·factor; not the
// target's column (its p comes from its float32 logit). The soft-cap's derivative needs z = ref + log e, taken as −c
// (where it is 0) for an e that underflowed, which only a cap over 43 leaves room for (capped logits differ by < 2c).
template <class T>
TRELLIS_HD T exponential_logit_gradient(T e, T ref, T factor, const RowGradient<T>& row, const SoftCap<T>& cap) {
  const T z = cap.on() ? (e > T(0) ? ref + log_(e) : -cap.cap) : T(0);
  return logit_gradient(e * factor, z, row, false, cap);
}

// ---- The entropy ----
// Σ_v p_v·z_v from the two sums kept relative to one maximum, Σ e^(z−m)·z and Σ e^(z−m).
template <class T>
T expected_logit(const T& weighted_sum, const T& sum) {
  return weighted_sum / sum;
}
// H = −Σ_v p_v·log p_v = lse − Σ_v p_v·z_v.
template <class T>
T entropy(const T& lse, const T& expected) {
  return lse - expected;
}
// dH/dz_v = −p_v·(log p_v + H).
template <class T>
T entropy_logit_gradient(const T& p, const T& log_p, const T& entropy) {
  return -(p * (log_p + entropy));
}

}  // namespace trellis::head_maths
