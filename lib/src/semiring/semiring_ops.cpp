#include "trellis/semiring/semiring_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "lib/src/semiring/backpointers.h"
#include "lib/src/semiring/scaled_log_matmul.h"
#include "trellis/error.h"
#include "cuda/semiring_kernels.h"

namespace trellis {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// From this inner size on, the log-semiring forward runs as one scaled GEMM (exact; see scaled_log_matmul.h).
constexpr int64_t kScaledMinInner = 128;

// ---- CPU reference loops (one per operation, generic over the semiring) ----

template <class S, class T>
void matmul_forward_cpu(const at::Tensor& a, const at::Tensor& b, at::Tensor& c, at::Tensor& arg) {
  const int64_t batch = c.size(0), M = c.size(1), N = c.size(2), K = a.size(2);
  const int64_t sa = a.size(0) == 1 ? 0 : M * K, sb = b.size(0) == 1 ? 0 : K * N;
  const T* A = a.data_ptr<T>();
  const T* B = b.data_ptr<T>();
  T* C = c.data_ptr<T>();
  int64_t* I = detail::data_or_null<int64_t>(arg);
  at::parallel_for(0, batch * M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t bi = row / M, i = row % M;
      const T* Ar = A + bi * sa + i * K;
      const T* Bb = B + bi * sb;
      for (int64_t j = 0; j < N; ++j) {
        typename S::template Accumulator<T> acc;
        for (int64_t k = 0; k < K; ++k) acc.add(S::times(Ar[k], Bb[k * N + j]), k);
        C[row * N + j] = acc.value();
        S::Backpointers::store(I, row * N + j, acc.arg());
      }
    }
  });
}

template <class S, class T>
void matmul_grad_left_cpu(const at::Tensor& gc, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                          const at::Tensor& arg, at::Tensor& ga) {
  const int64_t batch = c.size(0), M = c.size(1), N = c.size(2), K = a.size(2);
  const int64_t sa = a.size(0) == 1 ? 0 : M * K, sb = b.size(0) == 1 ? 0 : K * N;
  const T *A = a.data_ptr<T>(), *B = b.data_ptr<T>(), *C = c.data_ptr<T>(), *G = gc.data_ptr<T>();
  const int64_t* I = detail::data_or_null<int64_t>(arg);
  T* GA = ga.data_ptr<T>();
  at::parallel_for(0, batch * M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t bi = row / M, i = row % M;
      const T* Ar = A + bi * sa + i * K;
      const T* Bb = B + bi * sb;
      for (int64_t k = 0; k < K; ++k) {
        T g = 0;
        for (int64_t j = 0; j < N; ++j) {
          const T gcij = G[row * N + j];
          if (gcij != T(0))
            g += gcij *
                 S::weight(S::times(Ar[k], Bb[k * N + j]), C[row * N + j], k, S::Backpointers::load(I, row * N + j));
        }
        GA[row * K + k] = g;
      }
    }
  });
}

template <class S, class T>
void reduce_forward_cpu(const at::Tensor& x, at::Tensor& out, at::Tensor& arg) {
  const int64_t R = x.size(0), N = x.size(1);
  const T* X = x.data_ptr<T>();
  T* O = out.data_ptr<T>();
  int64_t* I = detail::data_or_null<int64_t>(arg);
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      typename S::template Accumulator<T> acc;
      for (int64_t n = 0; n < N; ++n) acc.add(X[r * N + n], n);
      O[r] = acc.value();
      S::Backpointers::store(I, r, acc.arg());
    }
  });
}

template <class S, class T>
void reduce_backward_cpu(const at::Tensor& g, const at::Tensor& x, const at::Tensor& out, const at::Tensor& arg,
                         at::Tensor& gx) {
  const int64_t R = x.size(0), N = x.size(1);
  const T *X = x.data_ptr<T>(), *O = out.data_ptr<T>(), *G = g.data_ptr<T>();
  const int64_t* I = detail::data_or_null<int64_t>(arg);
  T* GX = gx.data_ptr<T>();
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t n = 0; n < N; ++n)
        GX[r * N + n] = G[r] != T(0) ? G[r] * S::weight(X[r * N + n], O[r], n, S::Backpointers::load(I, r)) : T(0);
  });
}

// ---- device dispatch ----

template <class S>
void matmul_forward(const at::Tensor& a, const at::Tensor& b, at::Tensor& c, at::Tensor& arg) {
  if (a.is_cuda()) {
    return cuda::semiring_matmul_forward<S>(a, b, c, arg);
  }
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "semiring_matmul",
                             [&] { matmul_forward_cpu<S, scalar_t>(a, b, c, arg); });
}

template <class S>
at::Tensor matmul_grad_left(const at::Tensor& gc, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                            const at::Tensor& arg) {
  at::Tensor ga = at::empty({c.size(0), a.size(1), a.size(2)}, a.options());
  if (a.is_cuda()) {
    cuda::semiring_matmul_grad_left<S>(gc, a, b, c, arg, ga);
  } else {
    AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "semiring_matmul_backward",
                               [&] { matmul_grad_left_cpu<S, scalar_t>(gc, a, b, c, arg, ga); });
  }
  // A broadcast operand receives the sum of its batches' gradients.
  return a.size(0) == 1 && c.size(0) != 1 ? ga.sum(0, /*keepdim=*/true) : ga;
}

at::Tensor transposed(const at::Tensor& t) { return t.transpose(1, 2).contiguous(); }

template <class S>
struct SemiringMatmulFunction : torch::autograd::Function<SemiringMatmulFunction<S>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    const int64_t batch = std::max(a.size(0), b.size(0));
    at::Tensor c, arg;
    if (S::kHasScaledForm && a.size(2) >= kScaledMinInner) {
      c = detail::scaled_log_matmul(a, detail::scale_right(b));
    } else {
      c = at::empty({batch, a.size(1), b.size(2)}, a.options());
      arg = detail::backpointer_record<S>(c.sizes(), a.options());
      matmul_forward<S>(a, b, c, arg);
    }
    ctx->save_for_backward({a, b, c, arg});
    return c;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &a = saved[0], &b = saved[1], &c = saved[2], &arg = saved[3];
    const at::Tensor gc = grads[0].contiguous();
    at::Tensor ga, gb;
    if (ctx->needs_input_grad(0)) ga = matmul_grad_left<S>(gc, a, b, c, arg);
    if (ctx->needs_input_grad(1))  // C^T = B^T ⊗ A^T, with the same reduction index k.
      gb = transposed(matmul_grad_left<S>(transposed(gc), transposed(b), transposed(a), transposed(c),
                                          arg.defined() ? transposed(arg) : arg));
    return {ga, gb};
  }
};

template <class S>
struct SemiringSumFunction : torch::autograd::Function<SemiringSumFunction<S>> {
  // x is [R, N] contiguous; returns [R].
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    at::Tensor out = at::empty({x.size(0)}, x.options());
    at::Tensor arg = detail::backpointer_record<S>({x.size(0)}, x.options());
    if (x.is_cuda()) {
      cuda::semiring_reduce_forward<S>(x, out, arg);
    } else {
      AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "semiring_sum",
                                 [&] { reduce_forward_cpu<S, scalar_t>(x, out, arg); });
    }
    ctx->save_for_backward({x, out, arg});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor g = grads[0].contiguous();
    at::Tensor gx = at::empty_like(saved[0]);
    if (gx.is_cuda()) {
      cuda::semiring_reduce_backward<S>(g, saved[0], saved[1], saved[2], gx);
    } else {
      AT_DISPATCH_FLOATING_TYPES(gx.scalar_type(), "semiring_sum_backward",
                                 [&] { reduce_backward_cpu<S, scalar_t>(g, saved[0], saved[1], saved[2], gx); });
    }
    return {gx};
  }
};

void check_floating(const at::Tensor& t, const char* what) {
  if (!t.defined()) throw Error(std::string(what) + ": undefined tensor");
  if (t.scalar_type() != at::kFloat && t.scalar_type() != at::kDouble)
    throw Error(std::string(what) + ": expected float32 or float64, got " +
                std::string(c10::toString(t.scalar_type())));
}

}  // namespace

template <class S>
at::Tensor semiring_matmul(const at::Tensor& a, const at::Tensor& b) {
  check_floating(a, "semiring_matmul: A");
  check_floating(b, "semiring_matmul: B");
  if (a.dim() != 3 || b.dim() != 3)
    throw Error("semiring_matmul: expected A [batch,M,K] and B [batch,K,N], got " + std::to_string(a.dim()) +
                "-d and " + std::to_string(b.dim()) + "-d tensors");
  if (a.size(2) != b.size(1))
    throw Error("semiring_matmul: inner sizes differ: A has K=" + std::to_string(a.size(2)) +
                ", B has K=" + std::to_string(b.size(1)));
  if (a.size(0) != b.size(0) && a.size(0) != 1 && b.size(0) != 1)
    throw Error("semiring_matmul: batch sizes " + std::to_string(a.size(0)) + " and " + std::to_string(b.size(0)) +
                " do not broadcast");
  if (a.scalar_type() != b.scalar_type() || a.device() != b.device())
    throw Error("semiring_matmul: A and B must have the same dtype and device");
  return SemiringMatmulFunction<S>::apply(a.contiguous(), b.contiguous());
}

template <class S>
at::Tensor semiring_sum(const at::Tensor& x, int64_t dim) {
  check_floating(x, "semiring_sum");
  if (x.dim() == 0) throw Error("semiring_sum: expected at least a 1-d tensor");
  dim = c10::maybe_wrap_dim(dim, x.dim());
  at::Tensor moved = x.movedim(dim, -1);
  auto out_sizes = moved.sizes().vec();
  const int64_t n = out_sizes.back();
  out_sizes.pop_back();
  if (n == 0) return at::full(out_sizes, -std::numeric_limits<double>::infinity(), x.options());
  at::Tensor rows = moved.reshape({-1, n}).contiguous();
  return SemiringSumFunction<S>::apply(rows).view(out_sizes);
}

template at::Tensor semiring_matmul<LogSemiring>(const at::Tensor&, const at::Tensor&);
template at::Tensor semiring_matmul<MaxSemiring>(const at::Tensor&, const at::Tensor&);
template at::Tensor semiring_sum<LogSemiring>(const at::Tensor&, int64_t);
template at::Tensor semiring_sum<MaxSemiring>(const at::Tensor&, int64_t);

}  // namespace trellis
