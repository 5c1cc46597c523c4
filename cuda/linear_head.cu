// The LLM head's elementwise pass: a slab of float32 logits becomes its loss gradient in the GEMM's input type with
// one read and one write, where the same formula in tensor operations takes about eight passes over the slab.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/linear_head.h"

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

}  // namespace trellis::cuda
