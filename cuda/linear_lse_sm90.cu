// Fused linear log-sum-exp for Hopper (sm_90a): logits z = x·Wᵀ (+ bias, soft-capped) are formed tile by tile on the
// tensor cores and reduced there to each row's online (max, sum); the N×V logits never reach device memory.
// One producer warp streams x and W k-blocks by TMA (128-byte swizzle, W multicast across a 2-CTA cluster) into a
// 4-stage ring; two consumer warpgroups each run m64n256k16 wgmmas into registers and fold every finished 128×256 tile
// into per-row running statistics. Work units (a row block and a run of column tiles) are spread over a persistent
// grid; a unit's per-row partials are merged into the row's global (max, sum) pair with a 64-bit compare-and-swap,
// the block-stats merge (m1,s1)+(m2,s2) = (M, s1·e^(m1−M) + s2·e^(m2−M)).
#include "cuda/linear_lse_sm90.h"
#include "cuda/launch.cuh"
#include "lib/src/head/head_maths.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "linear_lse_sm90.cu is built for sm_90a only (wgmma, setmaxnreg)"
#endif

namespace trellis::cuda::sm90 {
namespace {

namespace hm = trellis::head_maths;  // the loss gradient and the (max, sum) merge, shared with the CPU path

constexpr int kBlockRows = 128;  // two consumer warpgroups of 64 rows
constexpr int kBlockCols = 256;  // one m64n256k16 wgmma per warpgroup and k-step
static_assert(kBlockCols == kExponentialTileColumns, "one reference per tile of the exponentials mode");
constexpr int kBlockK = 64;  // 64 16-bit values = one 128-byte swizzle row
constexpr int kStages = 4;
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (kConsumers + 1);
// A cluster of two CTAs takes two row blocks side by side over the same column tiles: each loads its own x rows and
// half of the W tile, which the copy engine multicasts to both, halving W's traffic out of L2 (measured on the H100:
// 37 ms without, 27.3 ms with, for N=16384 D=4096 V=128256).
constexpr int kCluster = 2;
constexpr int kRowBlocksPerBand = 16;  // row blocks that share W tiles while they sit in L2
constexpr float kLog2e = 1.4426950408889634f;

template <class T>
struct SharedStorage {
  alignas(1024) T a[kStages][kBlockRows * kBlockK];
  alignas(1024) T b[kStages][kBlockCols * kBlockK];
  alignas(8) uint64_t full[kStages];
  alignas(8) uint64_t empty[kStages];
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void barrier_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void barrier_expect_bytes(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// Arrives on the barrier at the same shared-memory offset in CTA `rank` of the cluster (this CTA included).
__device__ __forceinline__ void barrier_arrive_cluster(uint64_t* bar, unsigned rank) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_addr(bar)),
      "r"(rank)
      : "memory");
}

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every CTA in the cluster: barrier initialisation before first use, shared memory alive until the
// last remote access.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// One box of a 2-D tensor map (inner coordinate first) into shared memory, completing on bar.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int inner, int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::
          "r"(smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(inner), "r"(outer)
      : "memory");
}

// The same box into the same offsets (data and barrier) of every CTA in `mask` of the cluster.
__device__ __forceinline__ void tma_load_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int inner,
                                                   int outer, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(inner), "r"(outer), "h"(mask)
      : "memory");
}

// Shared-memory matrix descriptor of a K-major tile with 128-byte swizzle: rows of 128 bytes, 8-row groups 1024
// bytes apart (the leading offset is unused in this mode).
__device__ __forceinline__ uint64_t smem_descriptor(const void* p) {
  const uint64_t addr = smem_addr(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// Keeps the compiler from moving accumulator reads or writes across the asynchronous matrix operations.
__device__ __forceinline__ void fence_accumulators(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <class T>
struct Wgmma;

#define TRELLIS_WGMMA_M64N256K16(TYPE)                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                       \
  asm volatile(                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                              \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                          \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                           \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                          \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                               \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                              \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                              \
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                              \
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                              \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                              \
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                              \
        "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                              \
        "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                              \
        "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                              \
        "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                              \
        "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                         \
        "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                    \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                    \
        "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                    \
        "+f"(d[126]), "+f"(d[127])                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                                           \
      : "l"(a), "l"(b), "r"(accumulate))

// d (+)= A·Bᵀ for a 64×16 A tile and a 256×16 B tile, both K-major in shared memory; accumulate = 0 overwrites d.
template <>
struct Wgmma<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&d)[128], uint64_t a, uint64_t b, int accumulate) {
    TRELLIS_WGMMA_M64N256K16("bf16");
  }
};
template <>
struct Wgmma<__half> {
  __device__ __forceinline__ static void run(float (&d)[128], uint64_t a, uint64_t b, int accumulate) {
    TRELLIS_WGMMA_M64N256K16("f16");
  }
};
#undef TRELLIS_WGMMA_M64N256K16

template <class T>
__device__ __forceinline__ float to_float(T v) {
  return static_cast<float>(v);
}

// The per-row running statistics of one thread: max m, Σ e^(z−m), and optionally Σ e^(z−m)·z (entropy) and Σ z
// (label smoothing), over the columns this thread has seen.
struct RowStats {
  float m = -INFINITY, s = 0.f, pz = 0.f, sum = 0.f;
};

__device__ __forceinline__ RowStats merge(const RowStats& a, const RowStats& b) {
  const hm::Rebase<float> r = hm::rebase(a.m, b.m);
  RowStats out;
  out.m = r.max;
  out.s = hm::rebased_sum(r, a.s, b.s);
  out.pz = hm::rebased_sum(r, a.pz, b.pz);
  out.sum = a.sum + b.sum;
  return out;
}

// Merges (m, v) into a row's global pair packed as two floats in 64 bits: (M, v·e^(m−M) + V·e^(m_old−M)).
__device__ __forceinline__ void merge_global(unsigned long long* slot, float m, float v) {
  unsigned long long seen = *reinterpret_cast<volatile unsigned long long*>(slot), expected;
  do {
    expected = seen;
    const float old_m = __uint_as_float(static_cast<unsigned>(expected));
    const float old_v = __uint_as_float(static_cast<unsigned>(expected >> 32));
    const hm::MaxSum<float> merged = hm::merge(hm::MaxSum<float>{old_m, old_v}, {m, v});
    const unsigned long long packed =
        (static_cast<unsigned long long>(__float_as_uint(merged.sum)) << 32) | __float_as_uint(merged.max);
    seen = atomicCAS(slot, expected, packed);
  } while (seen != expected);
}

// In the m64n256 accumulator, lane l of warp w holds rows 16w + l/4 (d[4c], d[4c+1]) and 16w + l/4 + 8 (d[4c+2],
// d[4c+3]), at columns 8c + 2(l%4) + {0,1} of the tile; h below picks the row.

// Bias, soft-cap and the vocabulary edge (columns past V become -inf), for the tiles that have any of them.
template <class T>
__device__ __forceinline__ void prepare_tile(float (&d)[128], const T* bias, const hm::SoftCap<float>& cap,
                                             int64_t col0, int64_t V, int quad_col) {
#pragma unroll
  for (int c = 0; c < 32; ++c) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t col = col0 + 8 * c + quad_col + j;
      const bool valid = col < V;
      const float b = (bias && valid) ? to_float(bias[col]) : 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float z = d[4 * c + 2 * h + j] + b;
        if (cap.on()) z = cap(z);
        d[4 * c + 2 * h + j] = valid ? z : -INFINITY;
      }
    }
  }
}

// Folds a finished tile of logits into the thread's running statistics of its two rows. Four partial maxima and sums
// per row keep the dependent chains short (two warps per scheduler have little else to interleave). kMaybeInf: the
// tile may hold -inf logits, which the sums of z and p·z skip. `out` sees the fold (StatisticsOnly: nothing more;
// ExponentialTile: the exponentials): out.row_max widens the thread's maximum of a row in this tile, out.exponentials
// takes each pair of the row's exponentials e^(z − m) and out.row_done the row's new maximum m.
template <bool kExtras, bool kMaybeInf, class Out>
__device__ __forceinline__ void fold_tile(const float (&d)[128], RowStats (&st)[2], const Out& out) {
  constexpr int kLanes = 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx[kLanes];
#pragma unroll
    for (int i = 0; i < kLanes; ++i) mx[i] = -INFINITY;
#pragma unroll
    for (int c = 0; c < 32; ++c)
#pragma unroll
      for (int j = 0; j < 2; ++j) mx[c % kLanes] = fmaxf(mx[c % kLanes], d[4 * c + 2 * h + j]);
    const float m = fmaxf(st[h].m, out.row_max(fmaxf(fmaxf(mx[0], mx[1]), fmaxf(mx[2], mx[3]))));
    const float scale = hm::rescale(st[h].m, m);
    const float ref = m == -INFINITY ? 0.f : m * kLog2e;
    float s[kLanes] = {}, pz[kLanes] = {}, sum[kLanes] = {};
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      float e[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float z = d[4 * c + 2 * h + j];
        e[j] = hm::approx_exp2(fmaf(z, kLog2e, -ref));
        s[c % kLanes] += e[j];
        if constexpr (kExtras) {
          if (!kMaybeInf || z != -INFINITY) {
            pz[c % kLanes] = fmaf(e[j], z, pz[c % kLanes]);
            sum[c % kLanes] += z;
          }
        }
      }
      out.exponentials(h, c, e);
    }
    out.row_done(h, m);
    st[h].m = m;
    st[h].s = st[h].s * scale + ((s[0] + s[1]) + (s[2] + s[3]));
    if constexpr (kExtras) {
      st[h].pz = st[h].pz * scale + ((pz[0] + pz[1]) + (pz[2] + pz[3]));
      st[h].sum += (sum[0] + sum[1]) + (sum[2] + sum[3]);
    }
  }
}

// fold_tile's output for the statistics alone.
struct StatisticsOnly {
  __device__ __forceinline__ float row_max(float m) const { return m; }
  __device__ __forceinline__ void exponentials(int, int, const float (&)[2]) const {}
  __device__ __forceinline__ void row_done(int, float) const {}
};

// bfloat16/float16 pairs and singles from float32, for the gradient and exponential tiles' stores.
template <class T>
struct Store;
template <>
struct Store<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat162 pair(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ __forceinline__ __nv_bfloat16 one(float a) { return __float2bfloat16_rn(a); }
};
template <>
struct Store<__half> {
  static __device__ __forceinline__ __half2 pair(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __forceinline__ __half one(float a) { return __float2half_rn(a); }
};

// One row's factors of the loss gradient (head_maths.h), and lse·log2(e) for its exponentials.
struct RowGradient {
  hm::RowGradient<float> factors{0.f, 0.f, 0.f};
  float ref = 0.f;
};

// The thread's accumulator entry of row h (0, 1) at tile column (col & ~6) + quad_col, given col & ~6 = 8c + j: the
// target's logit, picked by the thread that holds it.
__device__ __forceinline__ float held_entry(const float (&d)[128], int h, int local) {
  float z = 0.f;
#pragma unroll
  for (int c = 0; c < 32; ++c)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      if (8 * c + j == local) z = d[4 * c + 2 * h + j];
  return z;
}

// One logit's gradient (head_maths.h's), with p = e^(z - lse) from the special-function unit.
__device__ __forceinline__ float logit_gradient(float z, const RowGradient& rg, bool target,
                                                const hm::SoftCap<float>& cap) {
  return hm::logit_gradient(hm::approx_exp2(fmaf(z, kLog2e, -rg.ref)), z, rg.factors, target, cap);
}

// Writes a finished tile's loss gradient to the thread's two rows of dz (columns at or past V are not written). Pairs
// of columns go out as one 4-byte store where the row stride keeps them aligned. The one-hot target term is left to
// the one thread that holds the target's entry, which rewrites it: few tiles hold a target of the warp's rows, and the
// vote keeps the selection out of the others.
template <class T>
__device__ __forceinline__ void store_gradient_tile(const float (&d)[128], const LogitGradientArgs& grad,
                                                    const int64_t (&rows)[2], const int64_t (&target)[2],
                                                    const RowGradient (&rg)[2], int64_t N, int64_t V, int64_t col0,
                                                    int quad_col, const hm::SoftCap<float>& cap) {
  const bool paired = grad.dz_stride % 2 == 0;
  const int left = V - col0 < kBlockCols ? static_cast<int>(V - col0) : kBlockCols;  // the tile's columns inside V
  T* out[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    out[h] = static_cast<T*>(grad.dz) + rows[h] * grad.dz_stride + col0 + quad_col;
    if (rows[h] >= N) continue;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const int col = 8 * c + quad_col;
      const float v0 = logit_gradient(d[4 * c + 2 * h], rg[h], false, cap);
      const float v1 = logit_gradient(d[4 * c + 2 * h + 1], rg[h], false, cap);
      if (paired && col + 1 < left) {
        *reinterpret_cast<decltype(Store<T>::pair(0.f, 0.f))*>(out[h] + 8 * c) = Store<T>::pair(v0, v1);
      } else {
        if (col < left) out[h][8 * c] = Store<T>::one(v0);
        if (col + 1 < left) out[h][8 * c + 1] = Store<T>::one(v1);
      }
    }
  }
  bool hit[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t local = target[h] - col0;
    hit[h] = rows[h] < N && local >= 0 && local < left && (local & 6) == quad_col;
  }
  if (__any_sync(0xffffffffu, hit[0] || hit[1])) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!hit[h]) continue;
      const int local = static_cast<int>(target[h] - col0) & ~6;  // out[h] already adds quad_col
      out[h][local] = Store<T>::one(logit_gradient(held_entry(d, h, local), rg[h], true, cap));
    }
  }
}

// fold_tile's output in the exponentials mode (ExponentialSlabArgs): the four lanes that share a row first agree on
// its maximum, so that every exponential of the row in this tile has one reference, which one lane records; each
// exponential, rounded to T, goes to the slab (columns at or past V are not written, pairs as in store_gradient_tile).
template <class T>
struct ExponentialTile {
  const ExponentialSlabArgs& out;
  T* o[2];  // the thread's first column of each row's tile in the slab
  bool live[2];
  int left, tile, quad_col;
  bool paired;
  float* ref[2];

  __device__ __forceinline__ ExponentialTile(const ExponentialSlabArgs& out, const int64_t (&rows)[2], int64_t N,
                                             int64_t V, int tile, int quad_col)
      : out(out), tile(tile), quad_col(quad_col), paired(out.e_stride % 2 == 0) {
    const int64_t col0 = int64_t(tile) * kBlockCols;
    left = V - col0 < kBlockCols ? static_cast<int>(V - col0) : kBlockCols;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      live[h] = rows[h] < N;
      o[h] = static_cast<T*>(out.e) + rows[h] * out.e_stride + col0 + quad_col;
      ref[h] = out.ref + rows[h] * out.ref_stride + tile;
    }
  }
  __device__ __forceinline__ float row_max(float m) const {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    return fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
  }
  __device__ __forceinline__ void exponentials(int h, int c, const float (&e)[2]) const {
    const int col = 8 * c + quad_col;
    if (live[h] && paired && col + 1 < left) {
      *reinterpret_cast<decltype(Store<T>::pair(0.f, 0.f))*>(o[h] + 8 * c) = Store<T>::pair(e[0], e[1]);
    } else if (live[h]) {
      if (col < left) o[h][8 * c] = Store<T>::one(e[0]);
      if (col + 1 < left) o[h][8 * c + 1] = Store<T>::one(e[1]);
    }
  }
  __device__ __forceinline__ void row_done(int h, float m) const {
    if (live[h] && quad_col == 0) *ref[h] = m;
  }
};

struct Schedule {
  int row_blocks, col_tiles, tiles_per_unit, units_per_row_block, band;
  int64_t units;
  // Unit u: bands of `band` row blocks (of a cluster's rows); within a band the column range varies slowest, so the
  // blocks that run together share W tiles (in L2) and their x rows stay cached.
  __device__ __forceinline__ void unit(int64_t u, int& row_block, int& first_tile, int& last_tile) const {
    const int64_t band_units = int64_t(band) * units_per_row_block;
    const int b = static_cast<int>(u / band_units);
    const int within = static_cast<int>(u % band_units);
    const int band_rows = min(band, row_blocks - b * band);
    row_block = b * band + within % band_rows;
    first_tile = (within / band_rows) * tiles_per_unit;
    last_tile = min(first_tile + tiles_per_unit, col_tiles);
  }
};

// What the kernel makes of each tile: statistics; the loss gradient (to grad.dz) instead; or statistics and the
// tile's exponentials (to slab, ExponentialSlabArgs).
enum class Mode { kStatistics, kGradient, kExponentials };

template <class T, bool kExtras, Mode kMode>
__global__ void __launch_bounds__(kThreads, 1)
    linear_lse_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                      const T* __restrict__ bias, const int64_t* __restrict__ targets, hm::SoftCap<float> cap,
                      int64_t N, int64_t V, int64_t D, Schedule sched, unsigned long long* __restrict__ lse_pairs,
                      unsigned long long* __restrict__ pz_pairs, float* __restrict__ logit_sum,
                      float* __restrict__ target_logit, LogitGradientArgs grad, ExponentialSlabArgs slab) {
  constexpr bool kGradient = kMode == Mode::kGradient;
  extern __shared__ uint8_t raw_smem[];
  auto& smem = *reinterpret_cast<SharedStorage<T>*>((reinterpret_cast<uintptr_t>(raw_smem) + 1023) & ~uintptr_t(1023));
  const int warpgroup = threadIdx.x / 128;
  const int k_blocks = static_cast<int>((D + kBlockK - 1) / kBlockK);
  const unsigned rank = cluster_rank();
  const int64_t first_unit = blockIdx.x / kCluster, unit_stride = gridDim.x / kCluster;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&smem.full[s], 1);
      barrier_init(&smem.empty[s], kConsumers * 4 * kCluster);  // one arrival per consumer warp of the cluster
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();

  if (warpgroup == 0) {
    // Producer: one thread streams the k-blocks of every tile of this block's units through the stage ring.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int stage = 0;
      unsigned phase = 0;
      constexpr int kSlice = kBlockCols / kCluster;  // W rows this CTA loads for the cluster
      for (int64_t u = first_unit; u < sched.units; u += unit_stride) {
        int row_block, first, last;
        sched.unit(u, row_block, first, last);
        for (int tile = first; tile < last; ++tile) {
          for (int kb = 0; kb < k_blocks; ++kb) {
            barrier_wait(&smem.empty[stage], phase ^ 1);
            barrier_expect_bytes(&smem.full[stage], (kBlockRows + kBlockCols) * kBlockK * sizeof(T));
            tma_load(smem.a[stage], &x_map, &smem.full[stage], kb * kBlockK,
                     (row_block * kCluster + rank) * kBlockRows);
            tma_load_multicast(smem.b[stage] + rank * kSlice * kBlockK, &w_map, &smem.full[stage], kb * kBlockK,
                               tile * kBlockCols + rank * kSlice, (1 << kCluster) - 1);
            if (++stage == kStages) {
              stage = 0;
              phase ^= 1;
            }
          }
        }
      }
    }
  } else {
    // Consumers: warpgroup 1 takes rows 0-63 of the block, warpgroup 2 rows 64-127 (the layout is above prepare_tile).
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int consumer = warpgroup - 1;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int quad_col = 2 * (lane % 4);
    float d[128];
    int stage = 0;
    unsigned phase = 0;
    for (int64_t u = first_unit; u < sched.units; u += unit_stride) {
      int row_block, first, last;
      sched.unit(u, row_block, first, last);
      const int64_t row0 = (int64_t(row_block) * kCluster + rank) * kBlockRows + consumer * 64 + warp * 16 + lane / 4;
      const int64_t rows[2] = {row0, row0 + 8};
      int64_t target[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) target[h] = (targets && rows[h] < N) ? targets[rows[h]] : -1;
      RowGradient rg[2];
      if constexpr (kGradient) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (rows[h] >= N) continue;
          const float l = grad.lse[rows[h]];
          rg[h] = {hm::row_gradient(grad.g[rows[h]], l, grad.terms), l * kLog2e};
          target[h] -= grad.target_offset;  // the chunk's own column
        }
      }
      RowStats st[2];
      for (int tile = first; tile < last; ++tile) {
        // Each k-block's wgmmas complete before its stage goes back to the producers of the whole cluster (keeping a
        // group in flight measured no faster: the ring then has one stage less to prefetch into).
        for (int kb = 0; kb < k_blocks; ++kb) {
          barrier_wait(&smem.full[stage], phase);
          const T* a = smem.a[stage] + consumer * 64 * kBlockK;
          const T* b = smem.b[stage];
          fence_accumulators(d);
          wgmma_fence();
#pragma unroll
          for (int k = 0; k < kBlockK / 16; ++k)
            Wgmma<T>::run(d, smem_descriptor(a + k * 16), smem_descriptor(b + k * 16), kb > 0 || k > 0);
          wgmma_commit();
          wgmma_wait_all();
          fence_accumulators(d);
          if (lane == 0)
#pragma unroll
            for (unsigned r = 0; r < kCluster; ++r) barrier_arrive_cluster(&smem.empty[stage], r);
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
        // Epilogue. The tensor cores idle until both warpgroups are back, so it is kept short: bias, soft-cap and the
        // vocabulary edge only in tiles that have them, then the fold into the running row statistics.
        const int64_t col0 = int64_t(tile) * kBlockCols;
        const bool edge = col0 + kBlockCols > V;
        if constexpr (kGradient) {
          if (edge || bias || cap.on()) prepare_tile(d, bias, cap, col0, V, quad_col);
          store_gradient_tile<T>(d, grad, rows, target, rg, N, V, col0, quad_col, cap);
          continue;
        }
        if constexpr (kMode == Mode::kExponentials) {
          const ExponentialTile<T> exponentials(slab, rows, N, V, tile, quad_col);
          if (edge || bias || cap.on()) {
            prepare_tile(d, bias, cap, col0, V, quad_col);
            fold_tile<kExtras, true>(d, st, exponentials);
          } else {
            fold_tile<kExtras, false>(d, st, exponentials);
          }
        } else if (edge || bias || cap.on()) {
          prepare_tile(d, bias, cap, col0, V, quad_col);
          fold_tile<kExtras, true>(d, st, StatisticsOnly{});
        } else {
          fold_tile<kExtras, false>(d, st, StatisticsOnly{});
        }
        // The target's logit, stored by the one thread that holds it. Few tiles hold a target of the warp's rows: the
        // vote keeps the compiler from predicating the selection into every tile.
        bool hit[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t local = target[h] - col0;
          hit[h] = local >= 0 && local < kBlockCols && (local & 6) == quad_col && rows[h] < N;
        }
        if (__any_sync(0xffffffffu, hit[0] || hit[1])) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (!hit[h]) continue;
            target_logit[rows[h]] = held_entry(d, h, static_cast<int>(target[h] - col0) & ~6);
          }
        }
      }
      // The unit's partials: merge across the four lanes that share each row, then into the row's global pairs.
      if constexpr (!kGradient) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int offset = 1; offset < 4; offset <<= 1) {
            RowStats other;
            other.m = __shfl_xor_sync(0xffffffffu, st[h].m, offset);
            other.s = __shfl_xor_sync(0xffffffffu, st[h].s, offset);
            other.pz = __shfl_xor_sync(0xffffffffu, st[h].pz, offset);
            other.sum = __shfl_xor_sync(0xffffffffu, st[h].sum, offset);
            st[h] = merge(st[h], other);
          }
          if (lane % 4 == 0 && rows[h] < N) {
            merge_global(lse_pairs + rows[h], st[h].m, st[h].s);
            if constexpr (kExtras) {
              merge_global(pz_pairs + rows[h], st[h].m, st[h].pz);
              atomicAdd(logit_sum + rows[h], st[h].sum);
            }
          }
        }
      }
    }
  }
  cluster_sync();  // the peer may still arrive on this CTA's barriers
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's tensor-map encoder, looked up through the runtime so the library needs no link to libcuda.
EncodeTiled encoder() {
  static const EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found);
    return (e == cudaSuccess && found == cudaDriverEntryPointSuccess) ? reinterpret_cast<EncodeTiled>(p) : nullptr;
  }();
  return fn;
}

// [rows, D] row-major 16-bit matrix, read in boxes of box_rows × 64 with 128-byte swizzle; out-of-range reads are 0.
CUtensorMap tile_map(const void* data, bool bf16, int64_t rows, int64_t D, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(D) * 2};
  const cuuint32_t box[2] = {kBlockK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r =
      encoder()(&map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                const_cast<void*>(data), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw std::runtime_error("cuTensorMapEncodeTiled failed with error " + std::to_string(r));
  return map;
}

template <class T, bool kExtras, Mode kMode>
cudaError_t launch(const LinearLseArgs& a, const LogitGradientArgs& grad, const ExponentialSlabArgs& slab,
                   cudaStream_t stream) {
  const size_t smem_bytes = sizeof(SharedStorage<T>) + 1024;
  auto kernel = linear_lse_kernel<T, kExtras, kMode>;
  cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
  if (e != cudaSuccess) return e;
  int device = 0, sms = 0;
  if ((e = cudaGetDevice(&device)) != cudaSuccess) return e;
  if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return e;
  const bool bf16 = a.dtype == HalfType::bfloat16;
  const CUtensorMap x_map = tile_map(a.x, bf16, a.N, a.D, kBlockRows);
  const CUtensorMap w_map = tile_map(a.weight, bf16, a.V, a.D, kBlockCols / kCluster);
  Schedule s;
  const int64_t cluster_rows = int64_t(kBlockRows) * kCluster;
  s.row_blocks = static_cast<int>((a.N + cluster_rows - 1) / cluster_rows);
  s.band = std::max(1, kRowBlocksPerBand / kCluster);
  s.col_tiles = static_cast<int>((a.V + kBlockCols - 1) / kBlockCols);
  s.tiles_per_unit = std::min(s.col_tiles, a.tiles_per_unit);
  s.units_per_row_block = (s.col_tiles + s.tiles_per_unit - 1) / s.tiles_per_unit;
  s.units = int64_t(s.row_blocks) * s.units_per_row_block;
  const unsigned clusters = static_cast<unsigned>(std::min<int64_t>(sms / kCluster, s.units));
  const LaunchShape shape{dim3(clusters * kCluster), dim3(kThreads), smem_bytes, stream, kCluster};
  return launch_kernel(kernel, shape, x_map, w_map, static_cast<const T*>(a.bias), a.targets,
                       hm::SoftCap<float>(a.softcap), a.N, a.V, a.D, s, a.lse_pairs, a.pz_pairs, a.logit_sum,
                       a.target_logit, grad, slab);
}

}  // namespace

bool linear_lse_available(int device) {
  // Single attributes: cudaGetDeviceProperties costs far more than a small kernel.
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    return false;
  return major == 9 && minor == 0 && encoder() != nullptr;
}

cudaError_t linear_lse(const LinearLseArgs& a, cudaStream_t stream) {
  const bool sums = a.pz_pairs != nullptr;
  constexpr Mode kStats = Mode::kStatistics;
  if (a.dtype == HalfType::bfloat16)
    return sums ? launch<__nv_bfloat16, true, kStats>(a, {}, {}, stream)
                : launch<__nv_bfloat16, false, kStats>(a, {}, {}, stream);
  return sums ? launch<__half, true, kStats>(a, {}, {}, stream) : launch<__half, false, kStats>(a, {}, {}, stream);
}

cudaError_t linear_logit_gradient(const LinearLseArgs& a, const LogitGradientArgs& grad, cudaStream_t stream) {
  if (a.dtype == HalfType::bfloat16) return launch<__nv_bfloat16, false, Mode::kGradient>(a, grad, {}, stream);
  return launch<__half, false, Mode::kGradient>(a, grad, {}, stream);
}

cudaError_t linear_lse_exponentials(const LinearLseArgs& a, const ExponentialSlabArgs& slab, cudaStream_t stream) {
  const bool sums = a.pz_pairs != nullptr;
  constexpr Mode kExp = Mode::kExponentials;
  if (a.dtype == HalfType::bfloat16)
    return sums ? launch<__nv_bfloat16, true, kExp>(a, {}, slab, stream)
                : launch<__nv_bfloat16, false, kExp>(a, {}, slab, stream);
  return sums ? launch<__half, true, kExp>(a, {}, slab, stream) : launch<__half, false, kExp>(a, {}, slab, stream);
}

}  // namespace trellis::cuda::sm90
