// The LLM head's elementwise pass: a slab of float32 logits becomes its loss gradient in the GEMM's input type with
// one read and one write, where the same formula in tensor operations takes about eight passes over the slab.
#include <ATen/Dispatch.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cuda/cuda_check.h"
#include "cuda/linear_head.h"
#include "cuda/linear_lse_sm90.h"

namespace trellis::cuda {
namespace {

constexpr int kThreads = 256;

template <class Acc, class Out>
__global__ void logit_gradient_kernel(const Acc* __restrict__ z, const Acc* __restrict__ lse,
                                      const Acc* __restrict__ g, const int64_t* __restrict__ targets,
                                      Out* __restrict__ dz, int64_t rows, int64_t V, Acc smooth, Acc target_weight,
                                      Acc z_loss2, Acc softcap) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const Acc l = lse[r], gr = g[r];
    const Acc p_weight = gr * (1 + z_loss2 * l), shift = gr * smooth, hit = gr * target_weight;
    const int64_t t = targets[r];
    const Acc* zr = z + r * V;
    Out* dr = dz + r * V;
    for (int64_t v = blockIdx.x * int64_t(kThreads) + threadIdx.x; v < V; v += int64_t(gridDim.x) * kThreads) {
      const Acc zv = zr[v];
      Acc d = p_weight * exp(zv - l) - shift - (v == t ? hit : Acc(0));
      if (softcap > 0) {
        const Acc u = zv / softcap;
        d *= 1 - u * u;
      }
      dr[v] = static_cast<Out>(d);
    }
  }
}

}  // namespace

void linear_head_logit_gradient(const at::Tensor& z, const at::Tensor& lse, const at::Tensor& g,
                                const at::Tensor& targets, double label_smoothing, double z_loss, double softcap,
                                at::Tensor& dz) {
  const int64_t rows = z.size(0), V = z.size(1);
  if (rows == 0) return;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((V + kThreads - 1) / kThreads, 64)),
                  static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  const c10::cuda::CUDAGuard guard(z.device());
  const auto stream = at::cuda::getCurrentCUDAStream(z.get_device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dz.scalar_type(), "linear_head_logit_gradient", [&] {
    using Out = scalar_t;
    auto launch = [&](auto acc_zero) {
      using Acc = decltype(acc_zero);
      logit_gradient_kernel<Acc, Out><<<grid, kThreads, 0, stream>>>(
          z.data_ptr<Acc>(), lse.data_ptr<Acc>(), g.data_ptr<Acc>(), targets.data_ptr<int64_t>(), dz.data_ptr<Out>(),
          rows, V, Acc(label_smoothing / static_cast<double>(V)), Acc(1 - label_smoothing), Acc(2 * z_loss),
          Acc(softcap));
    };
    if (z.scalar_type() == at::kDouble) launch(double(0));
    else launch(float(0));
  });
  check_launch("linear_head_logit_gradient");
}

bool fused_linear_lse(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& targets,
                      double softcap, bool want_sums, HeadRowStats& out) {
  const auto type = x.scalar_type();
  const int64_t N = x.size(0), V = weight.size(0), D = x.size(1);
  auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  if (!x.is_cuda() || (type != at::kBFloat16 && type != at::kHalf) || N == 0 || D == 0 || D % 8 != 0 ||
      !aligned(x) || !aligned(weight) || !sm90::linear_lse_available(x.get_device()))
    return false;
  const c10::cuda::CUDAGuard guard(x.device());
  // Each row's (max, Σ e^(z−max)) as two float32 in one int64, starting at (−inf, 0).
  const float start[2] = {-INFINITY, 0.f};
  int64_t packed_start;
  std::memcpy(&packed_start, start, sizeof packed_start);
  const auto longs = x.options().dtype(at::kLong), floats = x.options().dtype(at::kFloat);
  at::Tensor lse_pairs = at::full({N}, packed_start, longs), pz_pairs;
  out.target_logit = targets.defined() ? at::zeros({N}, floats) : at::Tensor();
  sm90::LinearLseArgs a;
  a.dtype = type == at::kBFloat16 ? sm90::HalfType::bfloat16 : sm90::HalfType::float16;
  a.x = x.data_ptr();
  a.weight = weight.data_ptr();
  a.bias = bias.defined() ? bias.data_ptr() : nullptr;
  a.targets = targets.defined() ? targets.data_ptr<int64_t>() : nullptr;
  a.softcap = static_cast<float>(softcap);
  a.N = N;
  a.V = V;
  a.D = D;
  a.lse_pairs = reinterpret_cast<unsigned long long*>(lse_pairs.data_ptr<int64_t>());
  a.target_logit = targets.defined() ? out.target_logit.data_ptr<float>() : nullptr;
  if (want_sums) {
    pz_pairs = at::full({N}, packed_start, longs);
    out.logit_sum = at::zeros({N}, floats);
    a.pz_pairs = reinterpret_cast<unsigned long long*>(pz_pairs.data_ptr<int64_t>());
    a.logit_sum = out.logit_sum.data_ptr<float>();
  }
  check(sm90::linear_lse(a, at::cuda::getCurrentCUDAStream(x.get_device())), "fused linear_lse kernel");
  const at::Tensor pairs = lse_pairs.view(at::kFloat).view({N, 2});
  const at::Tensor sum_exp = pairs.select(1, 1);
  out.lse = pairs.select(1, 0) + sum_exp.log();
  // Both pair sets saw the same maxima, so their ratio is Σ softmax·z.
  if (want_sums) out.expected_logit = pz_pairs.view(at::kFloat).view({N, 2}).select(1, 1) / sum_exp;
  return true;
}

}  // namespace trellis::cuda
