#include "lib/src/crf/chain_fused.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "lib/src/semiring/backpointers.h"
#include "lib/src/semiring/scaled_log_matmul.h"
#include "trellis/error.h"
#include "trellis/semiring/semiring.h"
#include "cuda/chain_kernels.h"

namespace trellis::detail {
namespace {

using cuda::ChainGradients;
using cuda::ChainInputs;
using cuda::ChainRecord;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One step of the recursion for one sequence, pre[j] = ⊕_i a[i] ⊗ W[i][j], and its reverse mode. This one
// accumulates every term in the semiring (MaxSemiring: compares only).
template <class S, class T>
class SemiringStep {
 public:
  SemiringStep(const T* w, const T* wt, int64_t k) : W_(w), Wt_(wt), K_(k), from_(k) {}

  // pre[j] and the back-pointer of each j, at arg[at + j].
  void forward(const T* a, T* pre, int64_t* arg, int64_t at) {
    if constexpr (std::is_same_v<S, MaxSemiring>) {
      // Row by row of W, a vector of columns at a time: a compare and two selects per term, where a column's own
      // reduction branches on each term. The same terms in the same order per column (the first row taken, then a row
      // only on a strictly larger term), so the same maximum and argmax.
      typedef T Values __attribute__((vector_size(16)));
      typedef Lane Mask __attribute__((vector_size(16)));  // a comparison's result: all ones where true
      constexpr int64_t kLanes = 16 / sizeof(T);
      T* __restrict best = pre;
      Lane* __restrict from = from_.data();
      for (int64_t j = 0; j < K_; ++j) {
        best[j] = S::times(a[0], W_[j]);
        from[j] = 0;
      }
      for (int64_t i = 1; i < K_; ++i) {
        const T ai = a[i];
        const T* __restrict w = W_ + i * K_;
        int64_t j = 0;
        for (; j + kLanes <= K_; j += kLanes) {
          Values x, b;
          Mask f;
          std::memcpy(&x, w + j, sizeof x);
          std::memcpy(&b, best + j, sizeof b);
          std::memcpy(&f, from + j, sizeof f);
          x = ai + x;  // S::times
          const Mask larger = x > b;
          b = larger ? x : b;
          f = larger ? Mask{} + Lane(i) : f;
          std::memcpy(best + j, &b, sizeof b);
          std::memcpy(from + j, &f, sizeof f);
        }
        for (; j < K_; ++j) {
          const T x = S::times(ai, w[j]);
          if (x > best[j]) {
            best[j] = x;
            from[j] = Lane(i);
          }
        }
      }
      for (int64_t j = 0; j < K_; ++j) S::Backpointers::store(arg, at + j, int64_t(from[j]));
    } else {
      for (int64_t j = 0; j < K_; ++j) {
        const T* w = Wt_ + j * K_;
        const auto acc = S::template reduce<T>(K_, [&](int64_t i) { return S::times(a[i], w[i]); });
        pre[j] = acc.value();
        S::Backpointers::store(arg, at + j, acc.arg());
      }
    }
  }

  // Adds the adjoint of a (given adj, the adjoint of pre) to next, and the transitions' gradient to gw.
  void backward(const T* a, const T* pre, const int64_t* arg, int64_t at, const T* adj, T* next, T* gw) {
    for (int64_t j = 0; j < K_; ++j) {
      if (adj[j] == T(0)) continue;
      const int64_t best = S::Backpointers::load(arg, at + j);
      for (int64_t i = 0; i < K_; ++i) {
        const T c = adj[j] * S::weight(S::times(a[i], W_[i * K_ + j]), pre[j], i, best);
        next[i] += c;
        gw[i * K_ + j] += c;
      }
    }
  }

  // Nothing to restore: this step runs the semirings without a scaled form (MaxSemiring), whose adjoints are
  // indicators.
  void restore_total(T*, T) const {}

 private:
  // A row index as wide as T, so that a vector of them lines up with a vector of scores.
  using Lane = std::conditional_t<sizeof(T) == 8, int64_t, int32_t>;
  const T *W_, *Wt_;
  int64_t K_;
  std::vector<Lane> from_;  // MaxSemiring's forward: each column's best row so far
};

// LogSemiring's step in scaled probability space: with v = exp(a − max a) and P = exp(W − colmax) (computed once),
// pre = log(v·P) + max a + colmax costs K exponentials and K² multiply-adds instead of K² exponentials, and the
// reverse mode is the same two products transposed. A column whose scaled sum is too small for all its terms to have
// survived underflow (see scaled_log_matmul.h) is done exactly in log space instead, in both directions.
template <class T>
class ScaledLogStep {
 public:
  ScaledLogStep(const T* w, const T* p, const T* colmax, int64_t k)
      : W_(w), P_(p), cmax_(colmax), K_(k), v_(k), s_(k), q_(k),
        log_threshold_(std::log(underflow_threshold(c10::CppTypeToScalarType<T>::value, k))) {}

  void forward(const T* a, T* pre, int64_t*, int64_t) {
    const T m = scale(a);
    std::fill(s_.begin(), s_.end(), T(0));
    T* __restrict s = s_.data();
    for (int64_t i = 0; i < K_; ++i) {
      const T vi = v_[i];
      if (vi == T(0)) continue;
      const T* __restrict pi = P_ + i * K_;
      for (int64_t j = 0; j < K_; ++j) s[j] += vi * pi[j];
    }
    for (int64_t j = 0; j < K_; ++j) {
      const T lp = std::log(s[j]);
      pre[j] = lp >= log_threshold_ ? lp + m + cmax_[j] : exact(a, j);
    }
  }

  void backward(const T* a, const T* pre, const int64_t*, int64_t, const T* adj, T* next, T* gw) {
    const T m = scale(a);
    T* __restrict q = q_.data();
    for (int64_t j = 0; j < K_; ++j) {
      q[j] = T(0);
      if (adj[j] == T(0)) continue;
      const T lp = pre[j] - m - cmax_[j];  // log of the scaled sum the forward step saw
      if (lp >= log_threshold_) {
        q[j] = adj[j] * std::exp(-lp);
      } else {
        for (int64_t i = 0; i < K_; ++i) {
          const T c = adj[j] * LogSemiring::weight(a[i] + W_[i * K_ + j], pre[j], i, -1);
          next[i] += c;
          gw[i * K_ + j] += c;
        }
      }
    }
    for (int64_t i = 0; i < K_; ++i) {
      const T vi = v_[i];
      if (vi == T(0)) continue;
      const T* __restrict pi = P_ + i * K_;
      T* __restrict gwi = gw + i * K_;
      T r = 0;
      for (int64_t j = 0; j < K_; ++j) {
        const T pq = pi[j] * q[j];
        r += pq;
        gwi[j] += vi * pq;
      }
      next[i] += vi * r;
    }
  }

  // adj is `total` times a position's marginals, which sum to one: restoring that total at each step keeps rounding
  // from compounding over a long sequence (float32 drifts by 2e-4 over 1e5 steps otherwise).
  void restore_total(T* adj, T total) const {
    double sum = 0;
    for (int64_t k = 0; k < K_; ++k) sum += adj[k];
    if (sum != 0 && std::isfinite(sum)) {
      const T scale = static_cast<T>(total / sum);
      for (int64_t k = 0; k < K_; ++k) adj[k] *= scale;
    }
  }

 private:
  T scale(const T* a) {
    T m = -std::numeric_limits<T>::infinity();
    for (int64_t i = 0; i < K_; ++i) m = std::max(m, a[i]);
    if (std::isinf(m)) m = 0;
    for (int64_t i = 0; i < K_; ++i) v_[i] = std::exp(a[i] - m);
    return m;
  }
  T exact(const T* a, int64_t j) const { return exact_log_dot(a, W_ + j, K_, K_); }

  const T *W_, *P_, *cmax_;
  int64_t K_;
  std::vector<T> v_, s_, q_;
  T log_threshold_;
};

// The per-call state a step needs: the transposed transitions (SemiringStep) or their scaled exponentials.
template <class S, class T>
struct StepFactory {
  explicit StepFactory(const at::Tensor& trans) : trans_(trans), K_(trans.size(0)) {
    if constexpr (S::kHasScaledForm) {
      const ScaledRight r = scale_right(trans.unsqueeze(0));
      aux_ = r.scaled.squeeze(0).contiguous();
      colmax_ = r.colmax.flatten().contiguous();
    } else {
      aux_ = trans.t().contiguous();
    }
  }
  auto make() const {
    if constexpr (S::kHasScaledForm)
      return ScaledLogStep<T>(trans_.data_ptr<T>(), aux_.data_ptr<T>(), colmax_.data_ptr<T>(), K_);
    else return SemiringStep<S, T>(trans_.data_ptr<T>(), aux_.data_ptr<T>(), K_);
  }
  at::Tensor trans_, aux_, colmax_;
  int64_t K_;
};

// Subtracts the largest of a[0..K) from each (unless none is finite) and returns it.
template <class T>
T rebase(T* a, int64_t K) {
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t k = 0; k < K; ++k) m = std::max(m, a[k]);
  if (!std::isfinite(m)) return T(0);
  for (int64_t k = 0; k < K; ++k) a[k] -= m;
  return m;
}

// One sequence at a time, sequences in parallel; messages are [T,K] rows. A sequence's messages grow to about -T
// (log-probabilities of its prefixes), where a float32 keeps only about 1e-2 absolutely: each alpha_t is stored minus
// its largest entry, the offsets summed in float64. The recursion and its reverse mode only take differences of
// alpha_{t-1} and pre_t, which share an offset; frame_score is the score in the last alpha's frame, score the true one.
template <class S, class T>
void forward_cpu(const ChainInputs& in, ChainRecord& r) {
  const int64_t B = in.emissions.size(0), Tn = in.emissions.size(1), K = in.emissions.size(2);
  const StepFactory<S, T> steps(in.transitions);
  const T *E = in.emissions.data_ptr<T>(), *St = in.start.data_ptr<T>(), *En = in.end.data_ptr<T>(),
          *W = in.transitions.data_ptr<T>();
  const int64_t* len = in.lengths.data_ptr<int64_t>();
  const int64_t* Y = data_or_null<int64_t>(in.tags);
  T *A = r.alpha.data_ptr<T>(), *P = r.pre.data_ptr<T>(), *Z = r.score.data_ptr<T>(), *FZ = r.frame_score.data_ptr<T>();
  T* LL = Y ? r.loglik.data_ptr<T>() : nullptr;
  int64_t *I = data_or_null<int64_t>(r.arg), *IE = data_or_null<int64_t>(r.end_arg);
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    auto step = steps.make();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t off = b * Tn * K, L = len[b];
      const T* e = E + off;
      T *a = A + off, *p = P + off;
      for (int64_t j = 0; j < K; ++j) {
        p[j] = St[j];
        a[j] = S::times(St[j], e[j]);
      }
      double offset = rebase(a, K);
      for (int64_t t = 1; t < L; ++t) {
        step.forward(a + (t - 1) * K, p + t * K, I, off + t * K);
        for (int64_t j = 0; j < K; ++j) a[t * K + j] = S::times(p[t * K + j], e[t * K + j]);
        offset += rebase(a + t * K, K);
      }
      typename S::template Accumulator<T> acc;
      for (int64_t k = 0; k < K; ++k) acc.add(S::times(a[(L - 1) * K + k], En[k]), k);
      FZ[b] = acc.value();
      const double z = offset + FZ[b];
      Z[b] = static_cast<T>(z);
      S::Backpointers::store(IE, b, acc.arg());
      if (Y) {  // log-likelihood: the tagged sequence's score minus the ⊕ of all
        const int64_t* y = Y + b * Tn;
        double g = double(St[y[0]]) + e[y[0]] + En[y[L - 1]];
        for (int64_t t = 1; t < L; ++t) g += double(W[y[t - 1] * K + y[t]]) + e[t * K + y[t]];
        LL[b] = static_cast<T>(g - z);
      }
    }
  });
}

// Reverse mode of forward_cpu, from the record's frame_score. adj holds ∂score/∂alpha_t for one sequence. The
// transitions' gradient is summed per chunk of sequences, one buffer each, and the buffers are added in order at the
// end: no two threads write the same memory, and as the chunks depend on B and K alone, any thread count gives the same
// bits.
template <class S, class T>
void backward_cpu(const at::Tensor& grad, const ChainInputs& in, const ChainRecord& r, ChainGradients& grads) {
  const int64_t B = r.alpha.size(0), Tn = r.alpha.size(1), K = r.alpha.size(2);
  // At most 64 chunks, fewer when their K×K buffers would pass 64 MiB, but at least 4 (while B allows) so that large
  // K stays parallel.
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>(B, 64));
  const int64_t chunks =
      std::clamp<int64_t>((int64_t(64) << 20) / (K * K * sizeof(T)), std::min<int64_t>(most, 4), most);
  const StepFactory<S, T> steps(in.transitions);
  const at::TensorOptions options = r.alpha.options();
  at::Tensor part_w = at::zeros({chunks, K, K}, options);
  at::Tensor part_s = at::zeros({chunks, K}, options), part_e = at::zeros({chunks, K}, options);
  const T *G = grad.data_ptr<T>(), *En = in.end.data_ptr<T>(), *A = r.alpha.data_ptr<T>(), *P = r.pre.data_ptr<T>(),
          *Z = r.frame_score.data_ptr<T>();
  const int64_t g_stride = grad.stride(0);
  const int64_t* len = in.lengths.data_ptr<int64_t>();
  const int64_t* Y = data_or_null<int64_t>(in.tags);
  const int64_t *I = data_or_null<int64_t>(r.arg), *IE = data_or_null<int64_t>(r.end_arg);
  T* GE = grads.emissions.data_ptr<T>();
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    auto step = steps.make();
    std::vector<T> adj(K), next(K);
    for (int64_t c = c0; c < c1; ++c) {
      T *gw = part_w.data_ptr<T>() + c * K * K, *gs = part_s.data_ptr<T>() + c * K, *ge = part_e.data_ptr<T>() + c * K;
      for (int64_t b = B * c / chunks; b < B * (c + 1) / chunks; ++b) {
        const int64_t off = b * Tn * K, L = len[b];
        const T *a = A + off, *p = P + off;
        T* gem = GE + off;
        const T gb = Y ? -G[b * g_stride] : G[b * g_stride];  // with tags the output was gold − score
        const int64_t best_end = S::Backpointers::load(IE, b);
        for (int64_t k = 0; k < K; ++k) {
          adj[k] = gb * S::weight(S::times(a[(L - 1) * K + k], En[k]), Z[b], k, best_end);
          ge[k] += adj[k];
        }
        for (int64_t t = L - 1; t >= 1; --t) {
          std::copy(adj.begin(), adj.end(), gem + t * K);
          std::fill(next.begin(), next.end(), T(0));
          step.backward(a + (t - 1) * K, p + t * K, I, off + t * K, adj.data(), next.data(), gw);
          std::swap(adj, next);
          step.restore_total(adj.data(), gb);
        }
        for (int64_t k = 0; k < K; ++k) {
          gem[k] = adj[k];
          gs[k] += adj[k];
        }
        if (Y) {  // the tagged sequence's score was subtracted
          const int64_t* y = Y + b * Tn;
          gs[y[0]] -= gb;
          ge[y[L - 1]] -= gb;
          for (int64_t t = 0; t < L; ++t) {
            gem[t * K + y[t]] -= gb;
            if (t > 0) gw[y[t - 1] * K + y[t]] -= gb;
          }
        }
      }
    }
  });
  grads.transitions.copy_(part_w.sum(0));
  grads.start.copy_(part_s.sum(0));
  grads.end.copy_(part_e.sum(0));
}

// Which kernels run the fused chain: the CPU loops, the CUDA kernels with the transitions in one block's shared memory,
// the many-label CUDA kernels (LogSemiring: scaled, the transitions split over a cluster), or none.
enum class Backend { kCpu, kCudaShared, kCudaScaled, kNone };

template <class S>
Backend backend(const at::Tensor& em) {
  if (!em.is_cuda()) return Backend::kCpu;
  if (cuda::chain_supported(em.size(2), em.scalar_type())) return Backend::kCudaShared;
  if (S::kHasScaledForm && cuda::scaled_chain_crf_supported(em.size(2), em.scalar_type())) return Backend::kCudaScaled;
  return Backend::kNone;
}

at::TensorOptions long_options(const at::Tensor& like) { return like.options().dtype(at::kLong); }

// Lengths as the CPU loops and the many-label kernels read them: every sequence T long where none are given (the
// shared-memory kernels take none, which spares the launch that would fill them).
at::Tensor materialised(const at::Tensor& lengths, const at::Tensor& em) {
  return lengths.defined() ? lengths : at::full({em.size(0)}, em.size(1), long_options(em));
}

at::Tensor contiguous_or_none(const at::Tensor& t) { return t.defined() ? t.contiguous() : t; }

// Σ values / divisor as a 0-dim tensor (no division launched for a divisor of 1).
at::Tensor divided_sum(const at::Tensor& values, double divisor) {
  return divisor == 1 ? values.sum() : values.sum().div_(divisor);
}

// What the fused forward pass keeps for its backward pass: the inputs that pass reads (not the emissions and start),
// the record, and the scaled transitions of the many-label CUDA kernels (undefined for the other routes).
struct SavedChain {
  ChainInputs in;
  ChainRecord record;
  cuda::ScaledTransitions scaled;

  // The tensors autograd saves (the threshold follows from the dtype and K), and the state they restore.
  variable_list tensors() const {
    return {in.transitions, in.end,         in.lengths,         in.tags,       record.alpha, record.pre,
            record.arg,     record.end_arg, record.frame_score, scaled.scaled, scaled.colmax};
  }
  static SavedChain restored(const variable_list& v) {
    SavedChain s;
    s.in = {at::Tensor(), v[0], at::Tensor(), v[1], v[2], v[3]};
    s.record.alpha = v[4];
    s.record.pre = v[5];
    s.record.arg = v[6];
    s.record.end_arg = v[7];
    s.record.frame_score = v[8];
    if (v[9].defined()) s.scaled = {v[9], v[10], underflow_threshold(v[9].scalar_type(), v[9].size(0))};
    return s;
  }
};

// The fused forward pass: the score [B] (with tags: the log-likelihood), and what its backward pass needs.
template <class S>
at::Tensor forward_pass(const ChainInputs& inputs, SavedChain& saved) {
  const at::Tensor& em = inputs.emissions;
  const int64_t B = em.size(0), K = em.size(2);
  const bool tagged = inputs.tags.numel() > 0;
  ChainInputs in = inputs;
  in.lengths = backend<S>(em) == Backend::kCudaShared ? in.lengths : materialised(in.lengths, em);
  ChainRecord& r = saved.record;
  r.alpha = at::empty_like(em);
  r.pre = at::empty_like(em);
  r.arg = backpointer_record<S>(em.sizes(), em.options());
  r.end_arg = backpointer_record<S>({B}, em.options());
  // The [B] results in one allocation, the returned one first (an operator's output starts its storage).
  const at::Tensor results = at::empty({tagged ? 3 : 2, B}, em.options());
  r.loglik = tagged ? results[0] : at::empty({0}, em.options());
  r.score = results[tagged ? 1 : 0];
  r.frame_score = results[tagged ? 2 : 1];
  if (backend<S>(em) == Backend::kCudaScaled) {
    const ScaledRight w = scale_right(in.transitions.unsqueeze(0));
    saved.scaled = {w.scaled[0].contiguous(), w.colmax.view({K}), underflow_threshold(em.scalar_type(), K)};
    cuda::scaled_chain_crf_forward(in, saved.scaled, r);
    r.frame_score = r.score;  // the scaled kernel keeps its alphas in the score's frame
  } else if (em.is_cuda()) {
    cuda::chain_forward<S>(in, r);
  } else {
    AT_DISPATCH_FLOATING_TYPES(em.scalar_type(), "fused_chain_forward", [&] { forward_cpu<S, scalar_t>(in, r); });
  }
  saved.in = {at::Tensor(), in.transitions, at::Tensor(), in.end, in.lengths, in.tags};
  return tagged ? r.loglik : r.score;
}

// The gradients (emissions, transitions, start, end) of Σ_b grad[b]·score[b] (grad undefined: Σ_b score[b]), from what
// the forward pass kept; with loglik_divisor (a tagged forward pass), also loglik_sum = Σ_b loglik[b] / divisor.
template <class S>
ChainGradients backward_pass(const at::Tensor& grad, const SavedChain& saved,
                             std::optional<double> loglik_divisor = std::nullopt) {
  const ChainRecord& r = saved.record;
  const bool shared = r.alpha.is_cuda() && !saved.scaled.scaled.defined();
  // grad is read with its stride: 0 where it is one value expanded, as a sum's backward hands it out (a contiguous
  // copy would be a launch of its own). The shared-memory kernel reads no gradient as all ones.
  const at::Tensor g = grad.defined() || shared ? grad : at::ones({r.alpha.size(0)}, r.alpha.options());
  // The CUDA kernel writes the padding's zeros itself.
  ChainGradients grads;
  grads.emissions = r.alpha.is_cuda() ? at::empty_like(r.alpha) : at::zeros_like(r.alpha);
  grads.transitions = at::empty_like(saved.in.transitions);
  grads.start = at::empty_like(saved.in.end);
  grads.end = at::empty_like(saved.in.end);
  if (saved.scaled.scaled.defined()) {
    cuda::scaled_chain_crf_backward(g, saved.in, saved.scaled, r, grads);
  } else if (r.alpha.is_cuda()) {
    if (loglik_divisor) {  // written by the launch that sums the transitions' partials
      grads.loglik_sum = at::empty({}, r.loglik.options());
      grads.sum_divisor = *loglik_divisor;
    }
    cuda::chain_backward<S>(g, saved.in, r, grads);
  } else {
    AT_DISPATCH_FLOATING_TYPES(r.alpha.scalar_type(), "fused_chain_backward",
                               [&] { backward_cpu<S, scalar_t>(g, saved.in, r, grads); });
  }
  if (loglik_divisor && !grads.loglik_sum.defined()) grads.loglik_sum = divided_sum(r.loglik, *loglik_divisor);
  return grads;
}

template <class S>
struct FusedChainFunction : torch::autograd::Function<FusedChainFunction<S>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& em, const at::Tensor& trans,
                            const at::Tensor& start, const at::Tensor& end, const at::Tensor& lengths,
                            const at::Tensor& tags) {
    SavedChain s;
    const at::Tensor out = forward_pass<S>({em, trans, start, end, lengths.numel() ? lengths : at::Tensor(), tags}, s);
    ctx->save_for_backward(s.tensors());
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const ChainGradients g = backward_pass<S>(grads[0], SavedChain::restored(ctx->get_saved_variables()));
    return {g.emissions, g.transitions, g.start, g.end, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

template <class S>
bool fused_chain_supported(const at::Tensor& emissions) {
  return backend<S>(emissions) != Backend::kNone;
}

bool shared_chain_kernels_take(const at::Tensor& emissions) {
  return backend<LogSemiring>(emissions) == Backend::kCudaShared;
}

template <class S>
at::Tensor fused_chain_score(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& start,
                             const at::Tensor& end, const at::Tensor& lengths, const at::Tensor& tags) {
  return FusedChainFunction<S>::apply(
      emissions.contiguous(), transitions.contiguous(), start.contiguous(), end.contiguous(),
      // autograd takes defined inputs only: no lengths (all T long) and no tags are
      // empty tensors
      lengths.defined() ? lengths.contiguous() : at::empty({0}, long_options(emissions)),
      tags.defined() ? tags.contiguous() : at::empty({0}, long_options(emissions)));
}

template <class S>
std::array<at::Tensor, 6> fused_chain_score_and_gradients(const at::Tensor& emissions, const at::Tensor& transitions,
                                                          const at::Tensor& start, const at::Tensor& end,
                                                          const at::Tensor& lengths, const at::Tensor& tags,
                                                          double divisor) {
  SavedChain s;
  const at::Tensor score = forward_pass<S>(
      {emissions.contiguous(), transitions.contiguous(), start.contiguous(), end.contiguous(),
       contiguous_or_none(lengths), tags.defined() ? tags.contiguous() : at::empty({0}, long_options(emissions))},
      s);
  const bool tagged = tags.defined() && tags.numel() > 0;
  const ChainGradients g = backward_pass<S>(at::Tensor(), s, tagged ? std::optional(divisor) : std::nullopt);
  return {score, tagged ? g.loglik_sum : divided_sum(score, divisor), g.emissions, g.transitions, g.start, g.end};
}

std::pair<at::Tensor, at::Tensor> fused_viterbi(const at::Tensor& emissions, const at::Tensor& transitions,
                                                const at::Tensor& start, const at::Tensor& end,
                                                const at::Tensor& lengths) {
  const at::Tensor em = emissions.contiguous();
  const ChainInputs in{em,
                       transitions.contiguous(),
                       start.contiguous(),
                       end.contiguous(),
                       em.is_cuda() ? contiguous_or_none(lengths) : materialised(lengths, em).contiguous(),
                       at::empty({0}, long_options(em))};
  const int64_t B = em.size(0), Tn = em.size(1);
  at::Tensor path = at::empty({B, Tn}, long_options(em));
  // The CUDA backtrace needs only the back-pointers: the messages are not written there, and the forward pass writes
  // the path itself.
  ChainRecord r{em.is_cuda() ? at::Tensor() : at::empty_like(em),
                em.is_cuda() ? at::Tensor() : at::empty_like(em),
                backpointer_record<MaxSemiring>(em.sizes(), em.options()),
                backpointer_record<MaxSemiring>({B}, em.options()),
                at::empty({B}, em.options()),
                at::empty({B}, em.options()),
                at::empty({0}, em.options()),
                em.is_cuda() ? path : at::Tensor()};
  if (em.is_cuda()) {
    cuda::chain_forward<MaxSemiring>(in, r);
    return {path, r.score};
  }
  AT_DISPATCH_FLOATING_TYPES(em.scalar_type(), "fused_viterbi", [&] {
    forward_cpu<MaxSemiring, scalar_t>(in, r);
    const int64_t K = em.size(2);
    const int64_t *A = r.arg.data_ptr<int64_t>(), *E = r.end_arg.data_ptr<int64_t>(),
                  *L = in.lengths.data_ptr<int64_t>();
    const scalar_t* S = r.score.data_ptr<scalar_t>();
    int64_t* P = path.data_ptr<int64_t>();
    at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        int64_t* p = P + b * Tn;
        const bool nothing_allowed = S[b] == -std::numeric_limits<scalar_t>::infinity();
        std::fill(p + (nothing_allowed ? 0 : L[b]), p + Tn, int64_t(-1));
        if (nothing_allowed) continue;
        int64_t y = p[L[b] - 1] = E[b];
        for (int64_t t = L[b] - 1; t >= 1; --t) p[t - 1] = y = A[(b * Tn + t) * K + y];
      }
    });
  });
  return {path, r.score};
}

template std::array<at::Tensor, 6> fused_chain_score_and_gradients<LogSemiring>(const at::Tensor&, const at::Tensor&,
                                                                                const at::Tensor&, const at::Tensor&,
                                                                                const at::Tensor&, const at::Tensor&,
                                                                                double);
template bool fused_chain_supported<LogSemiring>(const at::Tensor&);
template bool fused_chain_supported<MaxSemiring>(const at::Tensor&);
template at::Tensor fused_chain_score<LogSemiring>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, const at::Tensor&, const at::Tensor&);
template at::Tensor fused_chain_score<MaxSemiring>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, const at::Tensor&, const at::Tensor&);

}  // namespace trellis::detail
