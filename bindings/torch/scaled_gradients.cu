// The backward of a reduced log-likelihood whose gradients were formed in the forward pass (torch_ops_structured.cpp,
// CrfScoreFunction): each gradient times upstream / divisor, all of them in one launch, the upstream gradient read on
// the device. The grid covers the largest gradient (the emissions', B·T·K values) over the whole device, and its first
// threads the parameters' (K² + 2K): one launch after the autograd engine reaches the node instead of one per gradient
// or group of them.
#include "bindings/torch/scaled_gradients.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>

namespace trellis_ops {
namespace {

constexpr int kMaxTensors = 4;

template <class T>
struct Segments {
  const T* src[kMaxTensors];
  T* dst[kMaxTensors];
  int64_t n[kMaxTensors];  // 0 past the tensors given
};

// Every thread walks each tensor with the grid's stride (the loop over tensors unrolled, so that the parameters are
// indexed by constants).
template <class T>
__global__ void scale_kernel(Segments<T> seg, const T* __restrict__ upstream, double divisor) {
  const T scale = static_cast<T>(static_cast<double>(*upstream) / divisor);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
#pragma unroll
  for (int q = 0; q < kMaxTensors; ++q)
    for (int64_t i = first; i < seg.n[q]; i += stride) seg.dst[q][i] = seg.src[q][i] * scale;
}

}  // namespace

bool scales_in_one_launch(const std::vector<at::Tensor>& gradients, const at::Tensor& upstream) {
  if (gradients.empty() || gradients.size() > kMaxTensors || !upstream.is_cuda() || upstream.numel() != 1) return false;
  const at::ScalarType type = upstream.scalar_type();
  if (type != at::kFloat && type != at::kDouble) return false;
  return std::all_of(gradients.begin(), gradients.end(), [&](const at::Tensor& g) {
    return g.is_cuda() && g.scalar_type() == type && g.device() == upstream.device() && g.is_contiguous();
  });
}

std::vector<at::Tensor> scaled_in_one_launch(const std::vector<at::Tensor>& gradients, const at::Tensor& upstream,
                                             double divisor) {
  std::vector<at::Tensor> out;
  out.reserve(gradients.size());
  for (const at::Tensor& g : gradients) out.push_back(at::empty_like(g, at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES(upstream.scalar_type(), "trellis_scaled_gradients", [&] {
    Segments<scalar_t> seg{};
    int64_t largest = 0;
    for (std::size_t q = 0; q < gradients.size(); ++q) {
      seg.src[q] = gradients[q].data_ptr<scalar_t>();
      seg.dst[q] = out[q].data_ptr<scalar_t>();
      seg.n[q] = gradients[q].numel();
      largest = std::max(largest, seg.n[q]);
    }
    if (largest == 0) return;
    constexpr int threads = 256;
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const int64_t blocks = std::min<int64_t>((largest + threads - 1) / threads, int64_t(sms) * 8);
    scale_kernel<scalar_t><<<static_cast<unsigned>(blocks), threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        seg, upstream.data_ptr<scalar_t>(), divisor);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace trellis_ops
