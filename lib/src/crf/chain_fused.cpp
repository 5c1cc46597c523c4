#include "lib/src/crf/chain_fused.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "lib/src/semiring/scaled_log_matmul.h"
#include "trellis/error.h"
#include "trellis/semiring/semiring.h"
#include "cuda/chain_kernels.h"

namespace trellis::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One step of the recursion for one sequence, pre[j] = ⊕_i a[i] ⊗ W[i][j], and its reverse mode. This one
// accumulates every term in the semiring (MaxSemiring: compares only).
template <class S, class T>
class SemiringStep {
 public:
  SemiringStep(const T* w, const T* wt, int64_t k) : W_(w), Wt_(wt), K_(k) {}

  void forward(const T* a, T* pre, int64_t* arg) {
    for (int64_t j = 0; j < K_; ++j) {
      const T* w = Wt_ + j * K_;
      const auto acc = S::template reduce<T>(K_, [&](int64_t i) { return S::times(a[i], w[i]); });
      pre[j] = acc.value();
      if (arg) arg[j] = acc.arg();
    }
  }

  // Adds the adjoint of a (given adj, the adjoint of pre) to next, and the transitions' gradient to gw.
  void backward(const T* a, const T* pre, const int64_t* arg, const T* adj, T* next, T* gw) {
    for (int64_t j = 0; j < K_; ++j) {
      if (adj[j] == T(0)) continue;
      for (int64_t i = 0; i < K_; ++i) {
        const T c = adj[j] * S::weight(S::times(a[i], W_[i * K_ + j]), pre[j], i, arg ? arg[j] : -1);
        next[i] += c;
        gw[i * K_ + j] += c;
      }
    }
  }

 private:
  const T *W_, *Wt_;
  int64_t K_;
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

  void forward(const T* a, T* pre, int64_t*) {
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

  void backward(const T* a, const T* pre, const int64_t*, const T* adj, T* next, T* gw) {
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
    if constexpr (S::kIsMax) {
      aux_ = trans.t().contiguous();
    } else {
      const ScaledRight r = scale_right(trans.unsqueeze(0));
      aux_ = r.scaled.squeeze(0).contiguous();
      colmax_ = r.colmax.flatten().contiguous();
    }
  }
  auto make() const {
    if constexpr (S::kIsMax) return SemiringStep<S, T>(trans_.data_ptr<T>(), aux_.data_ptr<T>(), K_);
    else return ScaledLogStep<T>(trans_.data_ptr<T>(), aux_.data_ptr<T>(), colmax_.data_ptr<T>(), K_);
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
void forward_cpu(const at::Tensor& em, const at::Tensor& trans, const at::Tensor& start, const at::Tensor& end,
                 const at::Tensor& lengths, const at::Tensor& tags, at::Tensor& alpha, at::Tensor& pre, at::Tensor& arg,
                 at::Tensor& end_arg, at::Tensor& score, at::Tensor& frame_score, at::Tensor& loglik) {
  const int64_t B = em.size(0), Tn = em.size(1), K = em.size(2);
  const StepFactory<S, T> steps(trans);
  const T *E = em.data_ptr<T>(), *St = start.data_ptr<T>(), *En = end.data_ptr<T>(), *W = trans.data_ptr<T>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* Y = tags.numel() ? tags.data_ptr<int64_t>() : nullptr;
  T *A = alpha.data_ptr<T>(), *P = pre.data_ptr<T>(), *Z = score.data_ptr<T>(), *FZ = frame_score.data_ptr<T>();
  T* LL = Y ? loglik.data_ptr<T>() : nullptr;
  int64_t* I = S::kIsMax ? arg.data_ptr<int64_t>() : nullptr;
  int64_t* IE = S::kIsMax ? end_arg.data_ptr<int64_t>() : nullptr;
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
        step.forward(a + (t - 1) * K, p + t * K, I ? I + off + t * K : nullptr);
        for (int64_t j = 0; j < K; ++j) a[t * K + j] = S::times(p[t * K + j], e[t * K + j]);
        offset += rebase(a + t * K, K);
      }
      typename S::template Accumulator<T> acc;
      for (int64_t k = 0; k < K; ++k) acc.add(S::times(a[(L - 1) * K + k], En[k]), k);
      FZ[b] = acc.value();
      const double z = offset + FZ[b];
      Z[b] = static_cast<T>(z);
      if (IE) IE[b] = acc.arg();
      if (Y) {  // log-likelihood: the tagged sequence's score minus the ⊕ of all
        const int64_t* y = Y + b * Tn;
        double g = double(St[y[0]]) + e[y[0]] + En[y[L - 1]];
        for (int64_t t = 1; t < L; ++t) g += double(W[y[t - 1] * K + y[t]]) + e[t * K + y[t]];
        LL[b] = static_cast<T>(g - z);
      }
    }
  });
}

// Reverse mode of forward_cpu. adj holds ∂score/∂alpha_t for one sequence. The transitions' gradient is summed per
// chunk of sequences, one buffer each, and the buffers are added in order at the end: no two threads write the same
// memory, and as the chunks depend on B and K alone, any thread count gives the same bits.
template <class S, class T>
void backward_cpu(const at::Tensor& grad, const at::Tensor& trans, const at::Tensor& end, const at::Tensor& lengths,
                  const at::Tensor& tags, const at::Tensor& alpha, const at::Tensor& pre, const at::Tensor& arg,
                  const at::Tensor& end_arg, const at::Tensor& frame_score, at::Tensor& g_em, at::Tensor& g_trans,
                  at::Tensor& g_start, at::Tensor& g_end) {
  const int64_t B = alpha.size(0), Tn = alpha.size(1), K = alpha.size(2);
  // At most 64 chunks, fewer when their K×K buffers would pass 64 MiB, but at least 4 (while B allows) so that large
  // K stays parallel.
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>(B, 64));
  const int64_t chunks =
      std::clamp<int64_t>((int64_t(64) << 20) / (K * K * sizeof(T)), std::min<int64_t>(most, 4), most);
  const StepFactory<S, T> steps(trans);
  at::Tensor part_w = at::zeros({chunks, K, K}, alpha.options());
  at::Tensor part_s = at::zeros({chunks, K}, alpha.options()), part_e = at::zeros({chunks, K}, alpha.options());
  const T *G = grad.data_ptr<T>(), *En = end.data_ptr<T>(), *A = alpha.data_ptr<T>(), *P = pre.data_ptr<T>(),
          *Z = frame_score.data_ptr<T>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* Y = tags.numel() ? tags.data_ptr<int64_t>() : nullptr;
  const int64_t* I = S::kIsMax ? arg.data_ptr<int64_t>() : nullptr;
  const int64_t* IE = S::kIsMax ? end_arg.data_ptr<int64_t>() : nullptr;
  T* GE = g_em.data_ptr<T>();
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    auto step = steps.make();
    std::vector<T> adj(K), next(K);
    for (int64_t c = c0; c < c1; ++c) {
      T *gw = part_w.data_ptr<T>() + c * K * K, *gs = part_s.data_ptr<T>() + c * K, *ge = part_e.data_ptr<T>() + c * K;
      for (int64_t b = B * c / chunks; b < B * (c + 1) / chunks; ++b) {
        const int64_t off = b * Tn * K, L = len[b];
        const T *a = A + off, *p = P + off;
        T* gem = GE + off;
        const T gb = Y ? -G[b] : G[b];  // with tags the output was gold − score
        for (int64_t k = 0; k < K; ++k) {
          adj[k] = gb * S::weight(S::times(a[(L - 1) * K + k], En[k]), Z[b], k, IE ? IE[b] : -1);
          ge[k] += adj[k];
        }
        for (int64_t t = L - 1; t >= 1; --t) {
          std::copy(adj.begin(), adj.end(), gem + t * K);
          std::fill(next.begin(), next.end(), T(0));
          step.backward(a + (t - 1) * K, p + t * K, I ? I + off + t * K : nullptr, adj.data(), next.data(), gw);
          std::swap(adj, next);
          if constexpr (!S::kIsMax) {
            // adj_t is gb times position t's marginals, which sum to one: restoring that total at each step keeps
            // rounding from compounding over a long sequence (float32 drifts by 2e-4 over 1e5 steps otherwise).
            double total = 0;
            for (int64_t k = 0; k < K; ++k) total += adj[k];
            if (total != 0 && std::isfinite(total)) {
              const T scale = static_cast<T>(gb / total);
              for (int64_t k = 0; k < K; ++k) adj[k] *= scale;
            }
          }
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
  g_trans.copy_(part_w.sum(0));
  g_start.copy_(part_s.sum(0));
  g_end.copy_(part_e.sum(0));
}

// Which kernels run the fused chain: the CPU loops, the CUDA kernels with the transitions in one block's shared memory,
// the many-label CUDA kernels (LogSemiring: scaled, the transitions split over a cluster), or none.
enum class Backend { kCpu, kCudaShared, kCudaScaled, kNone };

template <class S>
Backend backend(const at::Tensor& em) {
  if (!em.is_cuda()) return Backend::kCpu;
  if (cuda::chain_supported(em.size(2), em.scalar_type())) return Backend::kCudaShared;
  if (!S::kIsMax && cuda::scaled_chain_crf_supported(em.size(2), em.scalar_type())) return Backend::kCudaScaled;
  return Backend::kNone;
}

at::TensorOptions long_options(const at::Tensor& like) { return like.options().dtype(at::kLong); }

// Lengths as the CPU loops and the many-label kernels read them: every sequence T long where none are given (the
// shared-memory kernels take none, which spares the launch that would fill them).
at::Tensor materialised(const at::Tensor& lengths, const at::Tensor& em) {
  return lengths.defined() ? lengths : at::full({em.size(0)}, em.size(1), long_options(em));
}

at::Tensor contiguous_or_none(const at::Tensor& t) { return t.defined() ? t.contiguous() : t; }

// What the fused forward pass keeps for its backward pass: its inputs and its messages.
struct ChainRecord {
  at::Tensor trans, end, lengths, tags, alpha, pre, arg, end_arg, frame_score;
  at::Tensor scaled, colmax;  // the scaled transitions, for the many-label CUDA kernels
};

// The fused forward pass: the score [B] (with tags: the log-likelihood), and its record.
template <class S>
at::Tensor forward_pass(const at::Tensor& em, const at::Tensor& trans, const at::Tensor& start, const at::Tensor& end,
                        const at::Tensor& lengths, const at::Tensor& tags, ChainRecord& r) {
  const int64_t B = em.size(0);
  r.trans = trans;
  r.end = end;
  r.lengths = backend<S>(em) == Backend::kCudaShared ? lengths : materialised(lengths, em);
  r.tags = tags;
  r.alpha = at::empty_like(em);
  r.pre = at::empty_like(em);
  // The [B] results in one allocation, the returned one first (an operator's output starts its storage).
  const at::Tensor results = at::empty({tags.numel() ? 3 : 2, B}, em.options());
  at::Tensor loglik = tags.numel() ? results[0] : at::empty({0}, em.options()), score = results[tags.numel() ? 1 : 0];
  r.frame_score = results[tags.numel() ? 2 : 1];
  const auto long_opts = em.options().dtype(at::kLong);
  if (S::kIsMax) {
    r.arg = at::empty(em.sizes(), long_opts);
    r.end_arg = at::empty({B}, long_opts);
  }
  if (em.is_cuda()) {
    if (backend<S>(em) == Backend::kCudaScaled) {
      const ScaledRight w = scale_right(trans.unsqueeze(0));
      r.scaled = w.scaled[0].contiguous();
      r.colmax = w.colmax.view({em.size(2)});
      cuda::scaled_chain_crf_forward(em, trans, r.scaled, r.colmax, start, end, r.lengths, tags,
                                     underflow_threshold(em.scalar_type(), em.size(2)), r.alpha, r.pre, score, loglik);
      r.frame_score = score;  // the scaled kernel keeps its alphas in the score's frame
    } else {
      cuda::chain_forward<S>(em, trans, start, end, r.lengths, tags, r.alpha, r.pre, r.arg, r.end_arg, score,
                             r.frame_score, loglik);
    }
  } else {
    AT_DISPATCH_FLOATING_TYPES(em.scalar_type(), "fused_chain_forward", [&] {
      forward_cpu<S, scalar_t>(em, trans, start, end, r.lengths, tags, r.alpha, r.pre, r.arg, r.end_arg, score,
                               r.frame_score, loglik);
    });
  }
  return tags.numel() ? loglik : score;
}

// The gradients (emissions, transitions, start, end) of Σ_b grad[b]·score[b] (grad undefined: Σ_b score[b]), from the
// forward pass' record.
template <class S>
std::array<at::Tensor, 4> backward_pass(const at::Tensor& grad, const ChainRecord& r) {
  const bool shared = r.alpha.is_cuda() && !r.scaled.defined();
  const at::Tensor g = grad.defined() ? grad.contiguous()
                       : shared       ? grad  // the shared-memory kernel reads no gradient as all ones
                                      : at::ones({r.alpha.size(0)}, r.alpha.options());
  // The CUDA kernel writes the padding's zeros itself.
  at::Tensor g_em = r.alpha.is_cuda() ? at::empty_like(r.alpha) : at::zeros_like(r.alpha),
             g_trans = at::empty_like(r.trans), g_start = at::empty_like(r.end), g_end = at::empty_like(r.end);
  if (r.alpha.is_cuda()) {
    if (r.scaled.defined())
      cuda::scaled_chain_crf_backward(g, r.trans, r.scaled, r.colmax, r.end, r.lengths, r.tags, r.alpha, r.pre,
                                      r.frame_score, underflow_threshold(r.alpha.scalar_type(), r.alpha.size(2)), g_em,
                                      g_trans, g_start, g_end);
    else
      cuda::chain_backward<S>(g, r.trans, r.end, r.lengths, r.tags, r.alpha, r.pre, r.arg, r.end_arg, r.frame_score,
                              g_em, g_trans, g_start, g_end);
  } else {
    AT_DISPATCH_FLOATING_TYPES(r.alpha.scalar_type(), "fused_chain_backward", [&] {
      backward_cpu<S, scalar_t>(g, r.trans, r.end, r.lengths, r.tags, r.alpha, r.pre, r.arg, r.end_arg, r.frame_score,
                                g_em, g_trans, g_start, g_end);
    });
  }
  return {g_em, g_trans, g_start, g_end};
}

template <class S>
struct FusedChainFunction : torch::autograd::Function<FusedChainFunction<S>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& em, const at::Tensor& trans,
                            const at::Tensor& start, const at::Tensor& end, const at::Tensor& lengths,
                            const at::Tensor& tags) {
    ChainRecord r;
    const at::Tensor out = forward_pass<S>(em, trans, start, end, lengths.numel() ? lengths : at::Tensor(), tags, r);
    ctx->save_for_backward(
        {r.trans, r.end, r.lengths, r.tags, r.alpha, r.pre, r.arg, r.end_arg, r.frame_score, r.scaled, r.colmax});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const ChainRecord r{s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10]};
    auto [g_em, g_trans, g_start, g_end] = backward_pass<S>(grads[0], r);
    return {g_em, g_trans, g_start, g_end, at::Tensor(), at::Tensor()};
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
std::array<at::Tensor, 5> fused_chain_score_and_gradients(const at::Tensor& emissions, const at::Tensor& transitions,
                                                          const at::Tensor& start, const at::Tensor& end,
                                                          const at::Tensor& lengths, const at::Tensor& tags) {
  ChainRecord r;
  const at::Tensor score = forward_pass<S>(
      emissions.contiguous(), transitions.contiguous(), start.contiguous(), end.contiguous(),
      contiguous_or_none(lengths), tags.defined() ? tags.contiguous() : at::empty({0}, long_options(emissions)), r);
  auto [g_em, g_trans, g_start, g_end] = backward_pass<S>(at::Tensor(), r);
  return {score, g_em, g_trans, g_start, g_end};
}

std::pair<at::Tensor, at::Tensor> fused_viterbi(const at::Tensor& emissions, const at::Tensor& transitions,
                                                const at::Tensor& start, const at::Tensor& end,
                                                const at::Tensor& lengths) {
  const at::Tensor em = emissions.contiguous(), trans = transitions.contiguous(), st = start.contiguous(),
                   en = end.contiguous(), no_tags = at::empty({0}, long_options(em));
  const at::Tensor len = em.is_cuda() ? contiguous_or_none(lengths) : materialised(lengths, em).contiguous();
  const int64_t B = em.size(0), Tn = em.size(1);
  // The CUDA backtrace needs only the argmax record: the messages are not written there.
  at::Tensor alpha = em.is_cuda() ? at::Tensor() : at::empty_like(em),
             pre = em.is_cuda() ? at::Tensor() : at::empty_like(em);
  at::Tensor score = at::empty({B}, em.options()), frame_score = at::empty({B}, em.options()),
             loglik = at::empty({0}, em.options()), arg = at::empty(em.sizes(), no_tags.options()),
             end_arg = at::empty({B}, no_tags.options()), path = at::empty({B, Tn}, no_tags.options());
  if (em.is_cuda()) {
    cuda::chain_forward<MaxSemiring>(em, trans, st, en, len, no_tags, alpha, pre, arg, end_arg, score, frame_score,
                                     loglik);
    cuda::chain_backtrace(arg, end_arg, len, score, path);
    return {path, score};
  }
  AT_DISPATCH_FLOATING_TYPES(em.scalar_type(), "fused_viterbi", [&] {
    forward_cpu<MaxSemiring, scalar_t>(em, trans, st, en, len, no_tags, alpha, pre, arg, end_arg, score, frame_score,
                                       loglik);
    const int64_t K = em.size(2);
    const int64_t *A = arg.data_ptr<int64_t>(), *E = end_arg.data_ptr<int64_t>(), *L = len.data_ptr<int64_t>();
    const scalar_t* S = score.data_ptr<scalar_t>();
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
  return {path, score};
}

template std::array<at::Tensor, 5> fused_chain_score_and_gradients<LogSemiring>(const at::Tensor&, const at::Tensor&,
                                                                                const at::Tensor&, const at::Tensor&,
                                                                                const at::Tensor&, const at::Tensor&);
template bool fused_chain_supported<LogSemiring>(const at::Tensor&);
template bool fused_chain_supported<MaxSemiring>(const at::Tensor&);
template at::Tensor fused_chain_score<LogSemiring>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, const at::Tensor&, const at::Tensor&);
template at::Tensor fused_chain_score<MaxSemiring>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, const at::Tensor&, const at::Tensor&);

}  // namespace trellis::detail
