// The linear-chain dynamic program as ONE autograd node for the whole batch and every position: the forward pass
// runs the semiring recursion per sequence and keeps its messages; the backward pass is its exact reverse-mode
// derivative (an adjoint recursion weighted by S::weight), so the gradient of the LogSemiring score gives the node
// marginals and the gradient of the MaxSemiring score the indicator of the Viterbi path. CPU loops here, CUDA kernels
// in cuda/chain_fused.cu; both are generic over the semiring.
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <utility>

namespace trellis::detail {

// Whether fused_chain_score<S> takes these emissions (always on CPU; on CUDA while the transitions fit in the shared
// memory of a block, or for LogSemiring of a cluster of blocks).
template <class S>
bool fused_chain_supported(const at::Tensor& emissions);

// score [B] = ⊕ over label sequences of start ⊗ emissions ⊗ transitions ⊗ end, each sequence up to lengths[b];
// with tags [B,T] (int64), the tagged sequence's score minus that, i.e. the log-likelihood for LogSemiring.
// emissions [B,T,K], transitions [K,K], start [K], end [K] share dtype and device; lengths [B] int64 on that device,
// or undefined when every sequence is T long (the shared-memory CUDA kernels then read no lengths at all).
// Lengths in [1, T] and tags in [0, K) are the caller's to check unless shared_chain_kernels_take the emissions.
template <class S>
at::Tensor fused_chain_score(const at::Tensor& emissions, const at::Tensor& transitions, const at::Tensor& start,
                             const at::Tensor& end, const at::Tensor& lengths, const at::Tensor& tags = {});

// fused_chain_score's score [B], its sum divided by `divisor` (0-dim; on the shared-memory CUDA kernels written by the
// backward pass's last launch) and the gradients of its sum w.r.t. emissions, transitions, start and end (in that
// order), by the fused forward and backward passes called directly: no autograd graph is built.
template <class S>
std::array<at::Tensor, 6> fused_chain_score_and_gradients(const at::Tensor& emissions, const at::Tensor& transitions,
                                                          const at::Tensor& start, const at::Tensor& end,
                                                          const at::Tensor& lengths, const at::Tensor& tags = {},
                                                          double divisor = 1.0);

// Whether these emissions run on the CUDA kernels whose transitions live in one block's shared memory (any semiring).
// Those kernels keep each step's messages rebased (float32 stays exact on long sequences) and check lengths and tags
// themselves: a sequence with either out of range scores NaN, with no synchronisation with the host.
bool shared_chain_kernels_take(const at::Tensor& emissions);

// Viterbi through the fused MaxSemiring forward and a backtrace of its argmax record (no autograd): the best label
// sequence [B,T] (int64, -1 at padding) and its score [B]. Same arguments as fused_chain_score.
std::pair<at::Tensor, at::Tensor> fused_viterbi(const at::Tensor& emissions, const at::Tensor& transitions,
                                                const at::Tensor& start, const at::Tensor& end,
                                                const at::Tensor& lengths);

}  // namespace trellis::detail
