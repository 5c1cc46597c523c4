// The LLM output head: log-sum-exp over the vocabulary of the logits x·Wᵀ (+ bias), per-token log-probabilities and
// the linear cross-entropy loss with its gradients, without allocating the N×V logits whole. CPU and CUDA tensors;
// float32 and float64, and bfloat16/float16 inputs with float32 accumulation.
//
// On Hopper GPUs (compute capability 9.0) with bfloat16/float16 inputs and D % 8 == 0, everything without gradients
// (linear_logsumexp, token_logprobs, and the loss's forward when no gradient is wanted or the reduction is none)
// runs in one fused tensor-core kernel that keeps the logits on chip: O(N) extra memory. Otherwise, and for training,
// rows go a slab at a time through GEMMs that write the slab's logits (see HeadOptions::chunk_bytes).
//
// x is [..., D] (leading dimensions are flattened to N rows), weight [V, D], bias [V] or undefined, targets [...] of
// integer type with values in [0, V) or ignore_index. Logits are formed in float32 (float64 for float64 inputs) and,
// with a softcap c, replaced by c·tanh(logit / c) (Gemma's soft-capping). Results are float32 (float64 for float64).
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>

namespace trellis {

// How a loss over rows is reduced: one value per row, their sum, or their mean over the counted rows.
enum class Reduction { none, sum, mean };
// "none", "sum" or "mean"; anything else is an error naming the value.
Reduction parse_reduction(const std::string& name);

// The head's parameters beside x and the weight, and how it uses memory.
struct HeadOptions {
  at::Tensor bias;                // [V], the dtype of x; undefined for none
  std::optional<double> softcap;  // c > 0: logits become c·tanh(logit / c)
  int64_t ignore_index = -100;    // targets equal to it are skipped (loss 0, no gradient, not counted)
  // Bytes of float32 logits held at once (a slab of rows × V; on CUDA the slab's dL/dz takes the slab's own memory
  // where the types match or on compute capability 9.0, else it sits beside it in x's type); smaller saves memory,
  // larger feeds the GEMMs better and, for bfloat16/float16 weights, rounds dW fewer times (once per slab). Where the
  // fused Hopper kernel runs (bfloat16, or float16 without a soft-cap) the training slab holds exponentials in x's type
  // instead (as under memory_budget below): chunk_bytes of them hold twice the rows.
  int64_t chunk_bytes = int64_t(1) << 30;
  // Training without a slab of logits: the loss takes each row's log-sum-exp from the forward pass (the fused kernel
  // where it applies, else a chunk of vocabulary columns at a time) and the gradients form the logits again, a chunk
  // at a time, in memory that nothing needs yet (dW's unwritten rows, dx's buffer) or a small slab of at most 2 KiB per
  // row (and chunk_bytes).
  // Extra memory is then O(N) beyond the gradients, at the price of forming the logits twice (about one GEMM more).
  // For 16-bit inputs dx sums in float32 inside dW's last rows, whose chunks run twice; where those rows cannot hold it
  // (N·D·4 bytes over half of dW) or dW is not wanted, the float32 sum takes N·D·4 bytes of its own.
  bool recompute_logits = false;
  // Bytes that training may hold beyond its inputs, its gradients and the loss: when set (>= 0), it picks the route,
  // the slab and the slab's type for x and W's shapes (plan_head_memory says which) and overrides chunk_bytes and
  // recompute_logits. Where it holds a slab of at least kBudgetMinSlabRows rows, the slab route (three GEMMs) with the
  // largest such slab: of float32 logits, or where the fused Hopper kernel runs (bfloat16, or float16 without a
  // soft-cap) a slab in x's type, twice the rows: the kernel forms each slab's statistics and writes every logit's
  // exponential relative to its 256-column tile's maximum, rounded once to x's type, and one pass turns them into
  // dL/dz in place (the target's from its float32 logit). Else recompute_logits, whose vocabulary chunks take the
  // budget (16-bit inputs: the fused kernel writes their gradient in x's type) and, where it fits beside them, dx's
  // float32 sum (so that no chunk runs twice). A budget below the recompute route's least (O(N): a few bytes per row
  // and kBudgetMinColumns columns of a chunk) is an error. The budget assumes gradients for both x and W and is kept on
  // CUDA devices; the CPU path (the reference) may take more for temporaries where a chunk lands in dW's unwritten
  // rows. Negative: chunk_bytes and recompute_logits decide.
  int64_t memory_budget = -1;
};

// The least rows of a slab that memory_budget picks the slab route for: below it the per-slab GEMMs (dW read, added to
// and written again over a short K; dx's few row tiles) cost more than forming the logits twice (the H100 rows in
// docs/benchmarks.md: 256-row slabs of the Llama-3 8B head were slower than the recompute route).
inline constexpr int64_t kBudgetMinSlabRows = 512;
// The least vocabulary columns of the recompute route's chunk slab under a budget.
inline constexpr int64_t kBudgetMinColumns = 8;

// What memory_budget (or, unset, chunk_bytes and recompute_logits) picks for training on x [..., D] and weight [V, D]
// with gradients for both (and the bias when head.bias is given).
struct HeadMemoryPlan {
  bool recompute_logits = false;  // the route: logits formed twice, or a slab of rows' logits at a time
  int64_t slab_bytes = 0;  // one slab: rows × V float32 logits, rows × (V values in x's type and a float32 reference
                           // per 256 columns), or the recompute route's chunk of columns
  at::ScalarType slab_type = at::kFloat;  // the slab's element type: float32/float64 logits, or x's type for the slab
                                          // route's exponentials and the recompute route's fused gradient chunks
  bool own_dx_sum = false;  // recompute route, 16-bit x: dx's float32 sum in a buffer of its own (not in dW)
  int64_t extra_bytes = 0;  // the most the step allocates beyond inputs and gradients (an upper estimate)
};
// The plan that training with these shapes and options follows (no work is done).
HeadMemoryPlan plan_head_memory(const at::Tensor& x, const at::Tensor& weight, const HeadOptions& head = {});

// The loss: its reduction, label smoothing and z-loss.
struct LossOptions {
  Reduction reduction = Reduction::mean;  // mean: over the targets that are not ignore_index
  double label_smoothing = 0;             // ε: loss = (1-ε)·NLL + ε·(mean over the vocabulary of -log p)
  double z_loss = 0;                      // adds z_loss·lse² per counted token (PaLM's z-loss)
};

// log Σ_v exp(logit_v) per row: [...]. No autograd state (head_statistics_backward is its backward).
at::Tensor linear_logsumexp(const at::Tensor& x, const at::Tensor& weight, const HeadOptions& head = {});

// What token_logprobs returns.
struct TokenLogprobs {
  at::Tensor logprobs;  // [...]: log p(target); 0 where the target is ignore_index
  at::Tensor entropy;   // [...]: -Σ_v p_v log p_v of each row; undefined unless asked for
};
// The inference path: log-probabilities of the targets (and optionally each row's entropy), no autograd state
// (head_statistics_backward is its backward).
TokenLogprobs token_logprobs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                             const HeadOptions& head = {}, bool with_entropy = false);

// Cross-entropy of the targets under softmax(x·Wᵀ + b), with autograd for x, weight and bias. With a mean or sum
// reduction the gradients are formed in the same pass as the loss (the logits are needed for both), so backward only
// scales them (with recompute_logits, the forward forms the gradients by recomputation); with no reduction, backward
// recomputes the logits.
at::Tensor linear_cross_entropy(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                const HeadOptions& head = {}, const LossOptions& loss = {});

// linear_cross_entropy in its two halves, for callers that wire autograd themselves (the PyTorch operators, which
// torch.compile traces as a forward and a backward operator). want: which of x, weight, bias need gradients.
struct LinearCrossEntropyForward {
  at::Tensor loss;     // what linear_cross_entropy returns
  at::Tensor lse;      // [N], each row's log-sum-exp: backward's input where it forms the gradients
  at::Tensor dx;       // the loss's gradient for x where the forward formed it (a mean or sum reduction)
  at::Tensor dweight;  // the same for the weight
  at::Tensor dbias;    // the same for the bias
};
// The forward half: the loss, the rows' log-sum-exp and, with a mean or sum reduction, the wanted gradients.
LinearCrossEntropyForward linear_cross_entropy_forward(const at::Tensor& x, const at::Tensor& weight,
                                                       const at::Tensor& targets, const HeadOptions& head,
                                                       const LossOptions& loss, std::array<bool, 3> want);
// The gradients of grad·loss for x, weight and bias (undefined where not wanted), given the forward's results; grad
// has the loss's shape. With a mean or sum reduction they are the forward's, scaled by grad (handed over as they are
// when grad is 1).
std::array<at::Tensor, 3> linear_cross_entropy_backward(const at::Tensor& grad, const at::Tensor& x,
                                                        const at::Tensor& weight, const at::Tensor& targets,
                                                        const HeadOptions& head, const LossOptions& loss,
                                                        const LinearCrossEntropyForward& forward,
                                                        std::array<bool, 3> want);

// The backward of linear_logsumexp and token_logprobs: the gradients for x, weight and bias (undefined where not
// wanted) of Σ_i (grad_lse_i·lse_i + grad_logprob_i·log p_i(target_i) + grad_entropy_i·H_i). Each grad has one entry
// per row or is undefined (zero); targets are needed with grad_logprob or grad_entropy. The logits are formed again
// a slab of rows at a time (head.chunk_bytes); with grad_logprob alone this is the unreduced loss's backward, whose
// fused kernels and recompute_logits apply.
std::array<at::Tensor, 3> head_statistics_backward(const at::Tensor& x, const at::Tensor& weight,
                                                   const at::Tensor& targets, const HeadOptions& head,
                                                   const at::Tensor& grad_lse, const at::Tensor& grad_logprob,
                                                   const at::Tensor& grad_entropy, std::array<bool, 3> want);

}  // namespace trellis
