// The host side of a semiring's back-pointers (trellis/semiring/semiring.h, S::Backpointers): the int64 tensor that
// records them, allocated only where the semiring records any, and raw pointers into optional tensors for the CPU
// loops and the kernel launchers.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace trellis::detail {

// An int64 record of S's back-pointers shaped `sizes` on options' device, or an undefined tensor where S records none.
template <class S>
at::Tensor backpointer_record(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if constexpr (S::Backpointers::kRecorded) return at::empty(sizes, options.dtype(at::kLong));
  else return at::Tensor();
}

// A tensor's data, or nullptr for an undefined or empty one (an unrecorded back-pointer record, absent lengths or
// tags).
template <class T>
T* data_or_null(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.data_ptr<T>() : nullptr;
}

}  // namespace trellis::detail
