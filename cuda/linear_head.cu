// The LLM head's elementwise pass: a slab of float32 logits becomes its loss gradient in the GEMM's input type with
// one read and one write, where the same formula in tensor operations takes about eight passes over the slab.
#include <ATen/Dispatch.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "cuda/cuda_check.h"
#include "cuda/launch.cuh"
#include "cuda/linear_head.h"
#include "cuda/linear_lse_sm90.h"
#include "lib/src/head/head_maths.h"

namespace trellis::cuda {
namespace {

namespace hm = trellis::head_maths;  // the loss gradient and the (max, sum) merge, shared with the CPU path

constexpr int kThreads = 256;
static_assert(kExponentialTileColumns == sm90::kExponentialTileColumns, "linear_head.h's tile is the fused kernel's");

// z and dz may be one array (not restrict): each thread reads its element before writing it.
template <class Acc, class Out>
__global__ void logit_gradient_kernel(const Acc* z, int64_t z_stride, const Acc* __restrict__ lse,
                                      const Acc* __restrict__ g, const int64_t* __restrict__ targets, Out* dz,
                                      int64_t dz_stride, int64_t rows, int64_t cols, int64_t first,
                                      hm::LossTerms<Acc> terms, hm::SoftCap<Acc> cap, bool cap_on_load) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const Acc l = lse[r];
    const hm::RowGradient<Acc> row = hm::row_gradient(g[r], l, terms);
    const int64_t t = targets[r] - first;
    const Acc* zr = z + r * z_stride;
    Out* dr = dz + r * dz_stride;
    for (int64_t v = blockIdx.x * int64_t(kThreads) + threadIdx.x; v < cols; v += int64_t(gridDim.x) * kThreads) {
      const Acc zv = cap_on_load ? cap(zr[v]) : zr[v];
      dr[v] = static_cast<Out>(hm::logit_gradient(exp(zv - l), zv, row, v == t, cap));
    }
  }
}

// The block's reduction of one value per thread by `op` (max or +), returned to every thread.
template <class Acc, class Op>
__device__ Acc block_reduce(Acc v, Op op, Acc* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read from a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < kThreads / 32; ++w) v = op(v, scratch[w]);
  return v;
}

// A row's gradient from one read of its logits: a cluster of blocks holds the row in shared memory (a slice
// each) and writes dz from the slices. With form_lse the cluster also merges the slices' (max, Σ e^(z−max)) through
// distributed shared memory into the row's log-sum-exp, so no separate pass over the slab forms it. With cap_on_load
// each slice is soft-capped on its way into shared memory (no passes of the cap's own over the slab). Every block of
// the cluster has its slice on chip before any block writes, so dz (row stride dz_stride) may overlay the row's own
// memory (z and dz are not restrict).
// Blocks per row: always the most when forming the log-sum-exp (whole vocabulary rows), else the fewest whose shared
// memory holds the row.
constexpr unsigned kMaxCluster = 8;

template <class Acc, class Out>
__global__ void __launch_bounds__(kThreads)
    logit_gradient_in_place_kernel(const Acc* z, int64_t z_stride, const Acc* __restrict__ g,
                                   const int64_t* __restrict__ targets, Out* dz, int64_t dz_stride,
                                   Acc* __restrict__ lse, bool form_lse, int64_t V, int64_t first, int64_t slice,
                                   hm::LossTerms<Acc> terms, hm::SoftCap<Acc> cap, bool cap_on_load) {
  namespace cg = cooperative_groups;
  extern __shared__ __align__(16) unsigned char raw_smem[];
  Acc* zs = reinterpret_cast<Acc*>(raw_smem);
  __shared__ Acc scratch[kThreads / 32];
  __shared__ Acc slice_stats[2];  // this block's (max, Σ e^(z−max)), read by the whole cluster
  const cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank();
  const int64_t r = blockIdx.y;
  const int64_t c0 = rank * slice < V ? rank * slice : V, c1 = c0 + slice < V ? c0 + slice : V, n = c1 - c0;
  const Acc* zr = z + r * z_stride + c0;
  const auto max_op = [](Acc a, Acc b) { return a > b ? a : b; };
  const auto sum_op = [](Acc a, Acc b) { return a + b; };
  // The slice into shared memory in 16-byte loads where it is aligned (always, when V is a multiple of 4), so that
  // enough bytes are in flight per SM for the read to run at the memory's speed.
  using Vec = std::conditional_t<sizeof(Acc) == 4, float4, double2>;
  constexpr int kPer = sizeof(Vec) / sizeof(Acc);
  const int64_t head = reinterpret_cast<uintptr_t>(zr) % sizeof(Vec) == 0 ? n / kPer * kPer : 0;
  Acc m = -INFINITY;
#pragma unroll 4
  for (int64_t i = threadIdx.x * int64_t(kPer); i < head; i += kThreads * int64_t(kPer)) {
    Vec v = *reinterpret_cast<const Vec*>(zr + i);
    Acc* e = reinterpret_cast<Acc*>(&v);
    if (cap_on_load) {
#pragma unroll
      for (int k = 0; k < kPer; ++k) e[k] = cap(e[k]);
    }
    *reinterpret_cast<Vec*>(zs + i) = v;
#pragma unroll
    for (int k = 0; k < kPer; ++k) m = max_op(m, e[k]);
  }
  for (int64_t i = head + threadIdx.x; i < n; i += kThreads) {
    const Acc v = cap_on_load ? cap(zr[i]) : zr[i];
    zs[i] = v;
    m = max_op(m, v);
  }
  Acc l;
  if (form_lse) {
    m = block_reduce(m, max_op, scratch);
    Acc s = 0;
    if (m != -INFINITY)
      for (int64_t i = threadIdx.x; i < n; i += kThreads) s += exp(zs[i] - m);
    s = block_reduce(s, sum_op, scratch);
    if (threadIdx.x == 0) slice_stats[0] = m, slice_stats[1] = s;
    cluster.sync();
    hm::MaxSum<Acc> row{-INFINITY, 0};
    for (unsigned q = 0; q < cluster.num_blocks(); ++q) {
      const Acc* peer = cluster.map_shared_rank(slice_stats, q);
      row = hm::merge(row, {peer[0], peer[1]});
    }
    cluster.sync();  // no block leaves while a peer may still read its statistics
    l = row.log_sum_exp();
    if (rank == 0 && threadIdx.x == 0) lse[r] = l;
  } else {
    cluster.sync();  // every slice of the row is on chip before any of its gradient overwrites it
    l = lse[r];
  }
  const hm::RowGradient<Acc> row = hm::row_gradient(g[r], l, terms);
  const int64_t t = targets[r] - first - c0;
  Out* dr = dz + r * dz_stride + c0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const Acc zv = zs[i];
    dr[i] = static_cast<Out>(hm::logit_gradient(exp(zv - l), zv, row, i == t, cap));
  }
}

// Calls launch(Acc{}, Out{}) with z's accumulation type (double for float64 logits, else float) and dz's type.
template <class Launch>
void dispatch_types(const at::Tensor& z, const at::Tensor& dz, Launch&& launch) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dz.scalar_type(), "linear_head_logit_gradient", [&] {
    if (z.scalar_type() == at::kDouble) launch(double(0), scalar_t(0));
    else launch(float(0), scalar_t(0));
  });
}

}  // namespace

void linear_head_logit_gradient(const at::Tensor& z, const at::Tensor& lse, const at::Tensor& g,
                                const at::Tensor& targets, LogitColumns columns, double label_smoothing, double z_loss,
                                double softcap, at::Tensor& dz) {
  const int64_t rows = z.size(0), cols = z.size(1);
  if (rows == 0 || cols == 0) return;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((cols + kThreads - 1) / kThreads, 64)),
                  static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  const c10::cuda::CUDAGuard guard(z.device());
  const auto stream = at::cuda::getCurrentCUDAStream(z.get_device());
  dispatch_types(z, dz, [&](auto acc_zero, auto out_zero) {
    using Acc = decltype(acc_zero);
    using Out = decltype(out_zero);
    logit_gradient_kernel<Acc, Out>
        <<<grid, kThreads, 0, stream>>>(z.data_ptr<Acc>(), z.stride(0), lse.data_ptr<Acc>(), g.data_ptr<Acc>(),
                                        targets.data_ptr<int64_t>(), dz.data_ptr<Out>(), dz.stride(0), rows, cols,
                                        columns.first, hm::loss_terms<Acc>(label_smoothing, z_loss, columns.vocabulary),
                                        hm::SoftCap<Acc>(Acc(softcap)), !columns.capped && softcap > 0);
  });
  check_launch("linear_head_logit_gradient");
}

bool linear_head_logit_gradient_in_place(const at::Tensor& z, const at::Tensor& g, const at::Tensor& targets,
                                         LogitColumns columns, double label_smoothing, double z_loss, double softcap,
                                         bool form_lse, at::Tensor& lse, at::Tensor& dz) {
  const int64_t rows = z.size(0), cols = z.size(1);
  const auto* prop = at::cuda::getDeviceProperties(z.get_device());
  const std::size_t smem_limit = static_cast<std::size_t>(prop->sharedMemPerBlockOptin) - 1024;
  // Each block's slice in whole 16-byte loads where cols allow.
  auto slice_of = [&](unsigned blocks) { return ((cols + blocks - 1) / blocks + 3) / 4 * 4; };
  unsigned blocks = form_lse ? kMaxCluster : 1;
  while (blocks < kMaxCluster && slice_of(blocks) * z.element_size() > smem_limit) blocks *= 2;
  const int64_t slice = slice_of(blocks);
  const std::size_t smem = slice * z.element_size();
  if (prop->major < 9 || smem > smem_limit || rows == 0) return false;
  const c10::cuda::CUDAGuard guard(z.device());
  const auto stream = at::cuda::getCurrentCUDAStream(z.get_device());
  dispatch_types(z, dz, [&](auto acc_zero, auto out_zero) {
    using Acc = decltype(acc_zero);
    using Out = decltype(out_zero);
    const auto kernel = logit_gradient_in_place_kernel<Acc, Out>;
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
          "linear head: shared memory");
    for (int64_t r0 = 0; r0 < rows; r0 += 65535) {  // the grid's y limit
      const int64_t n = std::min<int64_t>(65535, rows - r0);
      const LaunchShape shape{dim3(blocks, static_cast<unsigned>(n)), dim3(kThreads), smem, stream, blocks};
      check(launch_kernel(kernel, shape, z.data_ptr<Acc>() + r0 * z.stride(0), z.stride(0), g.data_ptr<Acc>() + r0,
                          targets.data_ptr<int64_t>() + r0, dz.data_ptr<Out>() + r0 * dz.stride(0), dz.stride(0),
                          lse.data_ptr<Acc>() + r0, form_lse, cols, columns.first, slice,
                          hm::loss_terms<Acc>(label_smoothing, z_loss, columns.vocabulary),
                          hm::SoftCap<Acc>(Acc(softcap)), !columns.capped && softcap > 0),
            "linear head: logit gradient kernel");
    }
  });
  return true;
}

bool fused_linear_head_applies(const at::Tensor& x, const at::Tensor& weight) {
  const auto type = x.scalar_type();
  auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  return x.is_cuda() && (type == at::kBFloat16 || type == at::kHalf) && x.size(0) > 0 && x.size(1) > 0 &&
         x.size(1) % 8 == 0 && weight.size(0) > 0 && aligned(x) && aligned(weight) &&
         sm90::linear_lse_available(x.get_device());
}

namespace {

sm90::LinearLseArgs fused_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& targets, double softcap) {
  sm90::LinearLseArgs a;
  a.dtype = x.scalar_type() == at::kBFloat16 ? sm90::HalfType::bfloat16 : sm90::HalfType::float16;
  a.x = x.data_ptr();
  a.weight = weight.data_ptr();
  a.bias = bias.defined() ? bias.data_ptr() : nullptr;
  a.targets = targets.defined() ? targets.data_ptr<int64_t>() : nullptr;
  a.softcap = static_cast<float>(softcap);
  a.N = x.size(0);
  a.V = weight.size(0);
  a.D = x.size(1);
  return a;
}

}  // namespace

bool fused_linear_logit_gradient(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                 const at::Tensor& targets, LogitColumns columns, const at::Tensor& lse,
                                 const at::Tensor& g, double label_smoothing, double z_loss, double softcap,
                                 at::Tensor& dz) {
  const int64_t cols = dz.size(1);
  if (cols == 0 || dz.stride(1) != 1 || reinterpret_cast<uintptr_t>(dz.data_ptr()) % 4 != 0 || !targets.defined())
    return false;
  const at::Tensor w = weight.narrow(0, columns.first, cols);
  if (!fused_linear_head_applies(x, w)) return false;
  const c10::cuda::CUDAGuard guard(x.device());
  sm90::LinearLseArgs a =
      fused_args(x, w, bias.defined() ? bias.narrow(0, columns.first, cols) : bias, targets, softcap);
  sm90::LogitGradientArgs grad;
  grad.dz = dz.data_ptr();
  grad.dz_stride = dz.stride(0);
  grad.lse = lse.data_ptr<float>();
  grad.g = g.data_ptr<float>();
  grad.target_offset = columns.first;
  grad.terms = head_maths::loss_terms<float>(label_smoothing, z_loss, columns.vocabulary);
  check(sm90::linear_logit_gradient(a, grad, at::cuda::getCurrentCUDAStream(x.get_device())),
        "fused linear logit gradient kernel");
  return true;
}

namespace {

// fused_linear_lse, and with slab the exponentials beside the statistics (fused_linear_exponentials).
bool fused_statistics(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& targets,
                      double softcap, bool want_sums, HeadRowStats& out, const sm90::ExponentialSlabArgs* slab) {
  const int64_t N = x.size(0);
  if (!fused_linear_head_applies(x, weight)) return false;
  const c10::cuda::CUDAGuard guard(x.device());
  // Each row's (max, Σ e^(z−max)) as two float32 in one int64, starting at (−inf, 0).
  const float start[2] = {-INFINITY, 0.f};
  int64_t packed_start;
  std::memcpy(&packed_start, start, sizeof packed_start);
  const auto longs = x.options().dtype(at::kLong), floats = x.options().dtype(at::kFloat);
  at::Tensor lse_pairs = at::full({N}, packed_start, longs), pz_pairs;
  out.target_logit = targets.defined() ? at::zeros({N}, floats) : at::Tensor();
  sm90::LinearLseArgs a = fused_args(x, weight, bias, targets, softcap);
  a.lse_pairs = reinterpret_cast<unsigned long long*>(lse_pairs.data_ptr<int64_t>());
  a.target_logit = targets.defined() ? out.target_logit.data_ptr<float>() : nullptr;
  if (want_sums) {
    pz_pairs = at::full({N}, packed_start, longs);
    out.logit_sum = at::zeros({N}, floats);
    a.pz_pairs = reinterpret_cast<unsigned long long*>(pz_pairs.data_ptr<int64_t>());
    a.logit_sum = out.logit_sum.data_ptr<float>();
  }
  const auto stream = at::cuda::getCurrentCUDAStream(x.get_device());
  if (slab) check(sm90::linear_lse_exponentials(a, *slab, stream), "fused linear exponentials kernel");
  else check(sm90::linear_lse(a, stream), "fused linear_lse kernel");
  const at::Tensor pairs = lse_pairs.view(at::kFloat).view({N, 2});
  const at::Tensor sum_exp = pairs.select(1, 1);
  out.lse = pairs.select(1, 0) + sum_exp.log();
  // Both pair sets saw the same maxima, so their ratio is Σ softmax·z.
  if (want_sums)
    out.expected_logit = head_maths::expected_logit(pz_pairs.view(at::kFloat).view({N, 2}).select(1, 1), sum_exp);
  return true;
}

}  // namespace

bool fused_linear_lse(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& targets,
                      double softcap, bool want_sums, HeadRowStats& out) {
  return fused_statistics(x, weight, bias, targets, softcap, want_sums, out, nullptr);
}

bool fused_linear_exponentials(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& targets, double softcap, bool want_sums, HeadRowStats& out,
                               at::Tensor& e, at::Tensor& ref) {
  if (!targets.defined() || e.stride(1) != 1 || ref.stride(1) != 1 || e.scalar_type() != x.scalar_type() ||
      reinterpret_cast<uintptr_t>(e.data_ptr()) % 4 != 0)
    return false;
  sm90::ExponentialSlabArgs slab;
  slab.e = e.data_ptr();
  slab.e_stride = e.stride(0);
  slab.ref = ref.data_ptr<float>();
  slab.ref_stride = ref.stride(0);
  return fused_statistics(x, weight, bias, targets, softcap, want_sums, out, &slab);
}

namespace {

// exponential_slab_gradient's pass: kPer consecutive columns per thread (inside one reference's tile), in one 16-byte
// load and store where rows are aligned for it (kVector).
template <class Out, bool kVector>
__global__ void exponential_gradient_kernel(Out* e, int64_t e_stride, const float* __restrict__ ref, int64_t ref_stride,
                                            const float* __restrict__ lse, const float* __restrict__ g,
                                            const int64_t* __restrict__ targets, const float* __restrict__ target_logit,
                                            int64_t rows, int64_t cols, hm::LossTerms<float> terms,
                                            hm::SoftCap<float> cap) {
  constexpr int kPer = 8;
  static_assert(sm90::kExponentialTileColumns % kPer == 0, "a thread's columns share one reference");
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float l = lse[r];
    const hm::RowGradient<float> row = hm::row_gradient(g[r], l, terms);
    const int64_t t = targets[r];
    Out* er = e + r * e_stride;
    const float* rr = ref + r * ref_stride;
    for (int64_t v0 = (blockIdx.x * int64_t(kThreads) + threadIdx.x) * kPer; v0 < cols;
         v0 += int64_t(gridDim.x) * kThreads * kPer) {
      const float tile_ref = rr[v0 / sm90::kExponentialTileColumns];
      const float factor = expf(tile_ref - l);
      const int64_t n = cols - v0 < kPer ? cols - v0 : kPer;
      alignas(16) Out vals[kPer];
      if (kVector && n == kPer) {
        *reinterpret_cast<uint4*>(vals) = *reinterpret_cast<const uint4*>(er + v0);
      } else {
#pragma unroll
        for (int k = 0; k < kPer; ++k)
          if (k < n) vals[k] = er[v0 + k];
      }
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        float d;
        if (v0 + k == t) {
          const float zt = target_logit[r];
          d = hm::logit_gradient(expf(zt - l), zt, row, true, cap);
        } else {
          d = hm::exponential_logit_gradient(static_cast<float>(vals[k]), tile_ref, factor, row, cap);
        }
        vals[k] = static_cast<Out>(d);
      }
      if (kVector && n == kPer) {
        *reinterpret_cast<uint4*>(er + v0) = *reinterpret_cast<const uint4*>(vals);
      } else {
#pragma unroll
        for (int k = 0; k < kPer; ++k)
          if (k < n) er[v0 + k] = vals[k];
      }
    }
  }
}

}  // namespace

void exponential_slab_gradient(at::Tensor& e, const at::Tensor& ref, const at::Tensor& lse, const at::Tensor& g,
                               const at::Tensor& targets, const at::Tensor& target_logit, double label_smoothing,
                               double z_loss, int64_t vocabulary, double softcap) {
  const int64_t rows = e.size(0), cols = e.size(1);
  if (rows == 0 || cols == 0) return;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((cols + kThreads * 8 - 1) / (kThreads * 8), 64)),
                  static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  const c10::cuda::CUDAGuard guard(e.device());
  const auto stream = at::cuda::getCurrentCUDAStream(e.get_device());
  const bool vector = e.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(e.data_ptr()) % 16 == 0;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(e.scalar_type(), "exponential_slab_gradient", [&] {
    const auto kernel =
        vector ? exponential_gradient_kernel<scalar_t, true> : exponential_gradient_kernel<scalar_t, false>;
    kernel<<<grid, kThreads, 0, stream>>>(
        e.data_ptr<scalar_t>(), e.stride(0), ref.data_ptr<float>(), ref.stride(0), lse.data_ptr<float>(),
        g.data_ptr<float>(), targets.data_ptr<int64_t>(), target_logit.data_ptr<float>(), rows, cols,
        hm::loss_terms<float>(label_smoothing, z_loss, vocabulary), hm::SoftCap<float>(static_cast<float>(softcap)));
  });
  check_launch("exponential_slab_gradient");
}

}  // namespace trellis::cuda
