// The c10d backends, each built in a translation unit of its own: distributed_gloo.cpp is the only one that includes
// Gloo's headers, distributed_nccl.cpp the only one that includes NCCL's.
#pragma once
#include <c10/util/intrusive_ptr.h>

#include <chrono>

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace trellis {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout);
// Makes GPU `device` the current one first.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout, int device);

}  // namespace trellis
