// The launchers of cuda/*.h for a build without nvcc (cuda/CMakeLists.txt builds this file instead of the kernels).
// Queries ("supported", "applies", kernels_built) answer false, so the library takes its ATen routes for CUDA tensors
// where it has one; a launcher reached anyway throws. lib/ calls the same functions in both builds.
#include <ATen/core/Tensor.h>

#include <vector>

#include "cuda/chain_kernels.h"
#include "cuda/hmm_expectations.h"
#include "cuda/kernels_built.h"
#include "cuda/linear_head.h"
#include "cuda/mask_summary.h"
#include "cuda/semiring_kernels.h"
#include "trellis/error.h"
#include "trellis/semiring/semiring.h"

namespace trellis::cuda {
namespace {

[[noreturn]] void no_kernels(const char* launcher) {
  throw Error(std::string("this Trellis build has no CUDA kernels (nvcc was not found when it was built): ") +
              launcher + " cannot run");
}

}  // namespace

bool kernels_built() { return false; }
int device_count(std::string*) { return -1; }
DeviceMemory device_memory(c10::Device) { return {}; }
void reset_peak_device_memory(c10::Device) {}

// cuda/semiring_kernels.h
template <class S>
void semiring_matmul_forward(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&) {
  no_kernels("semiring_matmul_forward");
}
template <class S>
void semiring_matmul_grad_left(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, at::Tensor&) {
  no_kernels("semiring_matmul_grad_left");
}
template <class S>
void semiring_reduce_forward(const at::Tensor&, at::Tensor&, at::Tensor&) {
  no_kernels("semiring_reduce_forward");
}
template <class S>
void semiring_reduce_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&) {
  no_kernels("semiring_reduce_backward");
}
void log_matmul_fixup(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, double) {
  no_kernels("log_matmul_fixup");
}

// cuda/chain_kernels.h
bool chain_supported(int64_t, at::ScalarType) { return false; }
template <class S>
void chain_forward(const ChainInputs&, ChainRecord&) {
  no_kernels("chain_forward");
}
template <class S>
void chain_backward(const at::Tensor&, const ChainInputs&, const ChainRecord&, ChainGradients&) {
  no_kernels("chain_backward");
}
void chain_backtrace(const ChainRecord&, const at::Tensor&, at::Tensor&) { no_kernels("chain_backtrace"); }
bool scaled_chain_crf_supported(int64_t, at::ScalarType) { return false; }
void scaled_chain_crf_forward(const ChainInputs&, const ScaledTransitions&, ChainRecord&) {
  no_kernels("scaled_chain_crf_forward");
}
void scaled_chain_crf_backward(const at::Tensor&, const ChainInputs&, const ScaledTransitions&, const ChainRecord&,
                               ChainGradients&) {
  no_kernels("scaled_chain_crf_backward");
}
bool scaled_chain_supported(int64_t, int64_t) { return false; }
at::Tensor scaled_chain_forward(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double) {
  no_kernels("scaled_chain_forward");
}
at::Tensor rebased_scaled_chain_forward(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const at::Tensor&, const at::Tensor&, const std::vector<int64_t>&, double,
                                        at::Tensor&) {
  no_kernels("rebased_scaled_chain_forward");
}
at::Tensor rebased_scaled_chain_messages(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, const std::vector<int64_t>&, double,
                                         at::Tensor&, at::Tensor&) {
  no_kernels("rebased_scaled_chain_messages");
}
bool many_label_viterbi_supported(int64_t) { return false; }
void many_label_viterbi(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        at::Tensor&, at::Tensor&) {
  no_kernels("many_label_viterbi");
}
bool many_label_infer_supported(const at::Tensor&, const at::Tensor&) { return false; }
void many_label_infer(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, double, at::Tensor&, at::Tensor&, at::Tensor&) {
  no_kernels("many_label_infer");
}

// cuda/mask_summary.h
void mask_summary(const at::Tensor&, bool, at::Tensor&, at::Tensor&) { no_kernels("mask_summary"); }

// cuda/hmm_expectations.h
void hmm_posterior_rows(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor*, at::Tensor*) {
  no_kernels("hmm_posterior_rows");
}

// cuda/linear_head.h
bool fused_linear_lse(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool,
                      HeadRowStats&) {
  return false;
}
void linear_head_logit_gradient(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                LogitColumns, double, double, double, at::Tensor&) {
  no_kernels("linear_head_logit_gradient");
}
bool linear_head_logit_gradient_in_place(const at::Tensor&, const at::Tensor&, const at::Tensor&, LogitColumns, double,
                                         double, double, bool, at::Tensor&, at::Tensor&) {
  return false;
}
bool fused_linear_head_applies(const at::Tensor&, const at::Tensor&) { return false; }
bool fused_linear_logit_gradient(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 LogitColumns, const at::Tensor&, const at::Tensor&, double, double, double,
                                 at::Tensor&) {
  return false;
}
bool fused_linear_exponentials(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                               bool, HeadRowStats&, at::Tensor&, at::Tensor&) {
  return false;
}
void exponential_slab_gradient(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, double, double, int64_t, double) {
  no_kernels("exponential_slab_gradient");
}

#define TRELLIS_SEMIRING_STUBS(S)                                                                           \
  template void semiring_matmul_forward<S>(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&); \
  template void semiring_matmul_grad_left<S>(const at::Tensor&, const at::Tensor&, const at::Tensor&,       \
                                             const at::Tensor&, const at::Tensor&, at::Tensor&);            \
  template void semiring_reduce_forward<S>(const at::Tensor&, at::Tensor&, at::Tensor&);                    \
  template void semiring_reduce_backward<S>(const at::Tensor&, const at::Tensor&, const at::Tensor&,        \
                                            const at::Tensor&, at::Tensor&);                                \
  template void chain_forward<S>(const ChainInputs&, ChainRecord&);                                         \
  template void chain_backward<S>(const at::Tensor&, const ChainInputs&, const ChainRecord&, ChainGradients&);
TRELLIS_SEMIRING_STUBS(LogSemiring)
TRELLIS_SEMIRING_STUBS(MaxSemiring)

}  // namespace trellis::cuda
