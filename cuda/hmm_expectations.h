// Posteriors and E-step factors of many-state HMM batches from their every-step messages (cuda/hmm_expectations.cu).
#pragma once
#include <ATen/core/Tensor.h>

namespace trellis::cuda {

// Given a batch longest first (lengths [B] non-increasing, int64; order [B]: each row's sequence in the caller's
// batch), the forward messages forward [S,B,K] of cuda::rebased_scaled_chain_messages over emissions [B,T',K] (that
// order), and backward [S,B,K], the same over each sequence reversed within its length with the transposed transitions
// and the end scores as start: writes the node posteriors of position t of row b to nodes[order[b]][t] ([B,T,K],
// zeros elsewhere left as they are). With u and v ([pairs,K], pairs = Σ (length − 1), pair_start [B] int64: each
// row's first pair), also each pair of positions' factors of the expected transition counts: the counts are
// exp(W − colmax) ∘ (uᵀ v), colmax [K] being the forward's scaled transitions' column maxima.
void hmm_posterior_rows(const at::Tensor& forward, const at::Tensor& backward, const at::Tensor& emissions,
                        const at::Tensor& lengths, const at::Tensor& order, const at::Tensor& pair_start,
                        const at::Tensor& colmax, at::Tensor& nodes, at::Tensor* u, at::Tensor* v);

}  // namespace trellis::cuda
