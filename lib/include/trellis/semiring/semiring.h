// Semiring policy types shared by the CPU loops (lib/) and the CUDA kernels (cuda/).
//
// A semiring here is (⊕, ⊗, zero, one) over log-space scores; every dynamic program in Trellis is written once
// against this interface and instantiated with LogSemiring (sums: partition functions, marginals) or MaxSemiring
// (Viterbi). ⊕ over many terms is accumulated online in an Accumulator, which can also merge with another partial
// accumulator: this is how reductions are split across tiles, blocks and devices.
//
// This header must stay free of LibTorch so that nvcc device code can include it.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

// Marks the policies' functions for both host and device code under nvcc (inline elsewhere).
#if defined(__CUDACC__)
#define TRELLIS_HD __host__ __device__ __forceinline__
#else
#define TRELLIS_HD inline
#endif

namespace trellis {

// The semirings' zero: log 0 = -inf in T.
template <class T>
TRELLIS_HD T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// exp/log overloaded for float and double on host and device alike.
template <class T>
TRELLIS_HD T exp_(T x) {
#if defined(__CUDA_ARCH__)
  return ::exp(x);
#else
  return std::exp(x);
#endif
}
// The natural logarithm, as exp_.
template <class T>
TRELLIS_HD T log_(T x) {
#if defined(__CUDA_ARCH__)
  return ::log(x);
#else
  return std::log(x);
#endif
}

// What both semirings share: scores in log space, ⊗ = +, zero = -inf, one = 0.
struct LogSpaceScores {
  // ⊕'s identity: -inf.
  template <class T>
  TRELLIS_HD static T zero() {
    return neg_inf<T>();
  }
  // ⊗'s identity: 0.
  template <class T>
  TRELLIS_HD static T one() {
    return T(0);
  }
  // a ⊗ b = a + b.
  template <class T>
  TRELLIS_HD static T times(T a, T b) {
    return a + b;
  }
};

// Back-pointers: what a semiring's ⊕ records for its backward pass and backtrace (the index of the term that made the
// result), as a policy of its own, so that a dynamic program stores and loads them the same way whichever semiring it
// runs. A record is an array of indices (int64 in memory, int where a kernel stages them), `at` a position in it.

// No back-pointers (LogSemiring: every term has a weight). Records stay unallocated (null pointers) and are never
// touched: a load is the constant -1, a store does nothing.
struct NoBackpointers {
  static constexpr bool kRecorded = false;

  // The length of a staging array for n indices: 1 (an array may not be empty), so that it costs no memory.
  TRELLIS_HD static constexpr int slots(int /*n*/) { return 1; }
  // Records nothing.
  template <class I>
  TRELLIS_HD static void store(I* /*record*/, int64_t /*at*/, int64_t /*index*/) {}
  // No recorded index: -1.
  template <class I>
  TRELLIS_HD static int64_t load(const I* /*record*/, int64_t /*at*/) {
    return -1;
  }
};

// The argmax of each ⊕ is recorded (MaxSemiring: the Viterbi back-pointers).
struct ArgmaxBackpointers {
  static constexpr bool kRecorded = true;

  // The length of a staging array for n indices.
  TRELLIS_HD static constexpr int slots(int n) { return n; }
  // record[at] = index.
  template <class I>
  TRELLIS_HD static void store(I* record, int64_t at, int64_t index) {
    record[at] = static_cast<I>(index);
  }
  // record[at]: the index recorded there (-1 for an empty ⊕).
  template <class I>
  TRELLIS_HD static int64_t load(const I* record, int64_t at) {
    return record[at];
  }
};

// ⊕ = log-sum-exp, ⊗ = +. The accumulator is the (max, sum) pair:
//   (m1,s1) ⊕ (m2,s2) = (M, s1·e^(m1−M) + s2·e^(m2−M)),  M = max(m1, m2),
// so no term is ever exponentiated above 1 and -inf terms contribute exactly zero (never NaN).
struct LogSemiring : LogSpaceScores {
  using Backpointers = NoBackpointers;  // a sum: every term has a weight, no argmax to record
  // ⊕ is the log of a sum of probabilities, so a product of log-space matrices can run scaled, as an ordinary GEMM
  // (lib/src/semiring/scaled_log_matmul.h), and a step of a chain likewise.
  static constexpr bool kHasScaledForm = true;

  // ⊕ of the terms added so far, as (max, sum of e^(term − max)).
  template <class T>
  struct Accumulator {
    T max = neg_inf<T>();  // the largest term so far (-inf while empty)
    T sum = T(0);          // Σ e^(term − max) over the terms so far

    TRELLIS_HD void add(T x, int64_t /*index*/) {
      if (x > max) {
        sum = sum * exp_(max - x) + T(1);  // exp(-inf) = 0 while still empty
        max = x;
      } else if (x > neg_inf<T>()) {
        sum += exp_(x - max);
      }
    }
    // Adds another accumulator's terms (a partial ⊕ from another tile, block or device).
    TRELLIS_HD void merge(const Accumulator& o) {
      if (o.max > max) {
        sum = sum * exp_(max - o.max) + o.sum;
        max = o.max;
      } else if (o.max > neg_inf<T>()) {
        sum += o.sum * exp_(o.max - max);
      }
    }
    // log Σ e^term: max + log(sum), or -inf when no finite term was added.
    TRELLIS_HD T value() const { return max > neg_inf<T>() ? max + log_(sum) : neg_inf<T>(); }
    // No argmax: -1.
    TRELLIS_HD int64_t arg() const { return -1; }
    // No index to renumber (see MaxSemiring's).
    TRELLIS_HD void renumber(int64_t /*first*/, int64_t /*stride*/) {}
    // This accumulator with f applied to each field (f a warp shuffle: lanes exchange whole accumulators).
    template <class F>
    TRELLIS_HD Accumulator transformed(F f) const {
      Accumulator a;
      a.max = f(max);
      a.sum = f(sum);
      return a;
    }
  };

  // ⊕ of term(0), ..., term(n-1) in two passes: the maximum, then the sum of exponentials. Unlike n online adds,
  // the exponentials do not depend on each other, so they pipeline (the critical path of a chain kernel's step).
  // Four partial maxima and sums keep four independent chains in flight.
  template <class T, class F>
  TRELLIS_HD static Accumulator<T> reduce(int n, F term) {
    T m[4] = {neg_inf<T>(), neg_inf<T>(), neg_inf<T>(), neg_inf<T>()};
    int k = 0;
    for (; k + 4 <= n; k += 4)
      for (int u = 0; u < 4; ++u) m[u] = term(k + u) > m[u] ? term(k + u) : m[u];
    for (; k < n; ++k) m[0] = term(k) > m[0] ? term(k) : m[0];
    Accumulator<T> acc;
    acc.max = (m[0] > m[1] ? m[0] : m[1]) > (m[2] > m[3] ? m[2] : m[3]) ? (m[0] > m[1] ? m[0] : m[1])
                                                                        : (m[2] > m[3] ? m[2] : m[3]);
    if (!(acc.max > neg_inf<T>())) return acc;
    T s[4] = {T(0), T(0), T(0), T(0)};
    for (k = 0; k + 4 <= n; k += 4)
      for (int u = 0; u < 4; ++u) s[u] += exp_(term(k + u) - acc.max);
    for (; k < n; ++k) s[0] += exp_(term(k) - acc.max);
    acc.sum = (s[0] + s[1]) + (s[2] + s[3]);
    return acc;
  }

  // ∂(⊕_k x_k)/∂x_k: the softmax weight of the term; zero when the whole sum is -inf.
  template <class T>
  TRELLIS_HD static T weight(T term, T result, int64_t /*k*/, int64_t /*arg*/) {
    return result > neg_inf<T>() ? exp_(term - result) : T(0);
  }
};

// ⊕_k a[k] ⊗ w[k·stride], term by term in log space: one output of a log-space matrix product computed exactly, which
// the scaled (probability-space) paths fall back to wherever their scaled sum may have lost terms to underflow.
template <class T>
TRELLIS_HD T exact_log_dot(const T* a, const T* w, int64_t n, int64_t stride) {
  LogSemiring::Accumulator<T> acc;
  for (int64_t k = 0; k < n; ++k) acc.add(a[k] + w[k * stride], k);
  return acc.value();
}

// ⊕ = max (remembering the first index that reached it), ⊗ = +. The gradient is routed to that one argmax, so
// differentiating a Viterbi score gives the indicator of one best path even when several tie.
struct MaxSemiring : LogSpaceScores {
  using Backpointers = ArgmaxBackpointers;  // a maximum: the argmax is recorded
  static constexpr bool kHasScaledForm = false;

  // ⊕ of the terms added so far: the maximum and the first index that reached it.
  template <class T>
  struct Accumulator {
    T max = neg_inf<T>();  // the largest term so far
    int64_t index = -1;    // its index (the smallest one among ties); -1 while empty

    // Adds term x of index k.
    TRELLIS_HD void add(T x, int64_t k) {
      if (x > max || index < 0) {
        max = x;
        index = k;
      }
    }
    // Adds another accumulator's terms; ties go to the smaller index, as one pass over all terms would.
    TRELLIS_HD void merge(const Accumulator& o) {
      if (o.index >= 0 && (o.max > max || index < 0 || (o.max == max && o.index < index))) {
        max = o.max;
        index = o.index;
      }
    }
    // The maximum (-inf while empty).
    TRELLIS_HD T value() const { return max; }
    // The index of the maximum, -1 while empty.
    TRELLIS_HD int64_t arg() const { return index; }
    // The terms were added with indices 0, 1, 2, ... but stand for first, first + stride, first + 2·stride, ... (one
    // lane's share of a ⊕ split over lanes): the index is renamed accordingly.
    TRELLIS_HD void renumber(int64_t first, int64_t stride) {
      if (index >= 0) index = first + index * stride;
    }
    // This accumulator with f applied to each field (f a warp shuffle: lanes exchange whole accumulators).
    template <class F>
    TRELLIS_HD Accumulator transformed(F f) const {
      Accumulator a;
      a.max = f(max);
      a.index = f(index);
      return a;
    }
  };

  // ⊕ of term(0), ..., term(n-1), in index order.
  template <class T, class F>
  TRELLIS_HD static Accumulator<T> reduce(int n, F term) {
    Accumulator<T> acc;
    for (int k = 0; k < n; ++k) acc.add(term(k), k);
    return acc;
  }

  // ∂(⊕_k x_k)/∂x_k: 1 for the recorded argmax, 0 for every other term.
  template <class T>
  TRELLIS_HD static T weight(T /*term*/, T /*result*/, int64_t k, int64_t arg) {
    return k == arg ? T(1) : T(0);
  }
};

}  // namespace trellis
