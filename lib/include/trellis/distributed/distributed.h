// Data parallelism over the processes of a torchrun job: a c10d process group (Gloo for CPU work, NCCL for CUDA
// work) built from the environment torchrun gives each worker (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT), with the few collectives Trellis' tasks need. Without that environment it is a single process and
// every collective is a no-op.
//
// Errors: a local failure on one rank becomes the same Error on every rank at the next collective that carries a
// status (check_all, all_reduce_sum with a failure), naming the rank and its message ("rank 1 of 3: cannot open
// data.h5: ..."). A rank that dies makes the others' collectives fail when its connections close, or at the timeout
// (TRELLIS_DIST_TIMEOUT seconds, default 300), never hang; waits that are long by design are bounded by the awaited
// rank's progress instead (wait_for_all, await). docs/distributed.md describes the launch and the protocol.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
class Store;
}  // namespace c10d

namespace trellis {

// The processes of a data-parallel run (torchrun) and the collectives Trellis uses between them. Every collective is
// called by every rank in the same order; one object per process, used from one thread.
class DistributedContext {
 public:
  // A single process (rank 0 of 1).
  DistributedContext();
  // From torchrun's environment. `device`'s type picks the backend: Gloo for the CPU, NCCL for CUDA (on the
  // GPU LOCAL_RANK, made the current device). The group exists whenever WORLD_SIZE is set, world size 1 included (a
  // one-process torchrun job goes through the same collectives). timeout: 0 reads TRELLIS_DIST_TIMEOUT (seconds), else
  // 300 s.
  static DistributedContext from_environment(c10::Device device,
                                             std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  ~DistributedContext();
  // Moves the process group; the moved-from object is left without one.
  DistributedContext(DistributedContext&&) noexcept;
  // Moves the process group; the moved-from object is left without one.
  DistributedContext& operator=(DistributedContext&&) noexcept;

  // This process's rank, from 0.
  int rank() const { return rank_; }
  // The number of processes.
  int world_size() const { return world_size_; }
  bool distributed() const;      // a process group exists
  std::string backend() const;   // "gloo", "nccl", or "none"
  std::string describe() const;  // "rank 1 of 3"
  // How long a collective waits for the other ranks before it fails.
  std::chrono::milliseconds timeout() const { return timeout_; }
  c10::intrusive_ptr<c10d::ProcessGroup> group() const;  // null for a single process

  // Collective: every rank passes the outcome of its own work since the last check (nullopt: success, else the
  // error's message). If any rank failed, every rank throws the same Error naming each failed rank and its message.
  void check_all(const std::optional<std::string>& local_failure) const;

  // Collective: sums the tensors in place over the ranks (any dtype and device; moved to the backend's device and
  // back when they differ). A local failure rides along as in check_all, so that a rank which failed to compute its
  // share still takes part (its tensors' values are then ignored) and every rank stops with its message.
  void all_reduce_sum(const std::vector<at::Tensor>& tensors,
                      const std::optional<std::string>& local_failure = std::nullopt) const;
  // Collective: the largest value over the ranks.
  int64_t all_reduce_max(int64_t value) const;
  // Collective: `tensor` on every rank becomes root's (shapes and dtypes must agree).
  void broadcast(const at::Tensor& tensor, int root = 0) const;

  // Point to point: rank 0 gathering results in order. Shapes and dtypes must agree on both sides.
  void send(const at::Tensor& tensor, int destination) const;
  // Fills `tensor` with what rank `source` sends (see send).
  void receive(const at::Tensor& tensor, int source) const;

  // Waits that are long by design (a rank done before the others, a rank waiting for rank 0 to write the ranks before
  // it) are bounded by the others' progress rather than by the timeout alone: a rank marks progress (e.g. after each
  // batch), and a waiter fails only when the rank it waits for has marked none for the timeout.
  void mark_progress() const;
  // Collective: returns when every rank has called it, each wait bounded as above. Precedes a collective that would
  // otherwise wait, with the timeout alone, for the slowest rank.
  void wait_for_all() const;
  // A turn that rank `rank` gives: it signals `name`, the others await it (a name is used once between two
  // wait_for_all calls).
  void signal(const std::string& name) const;
  // Returns once rank `rank` has signalled `name`, bounded as the waits above.
  void await(const std::string& name, int rank) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int rank_ = 0, world_size_ = 1;
  std::chrono::milliseconds timeout_{0};
};

// A Gloo process group (CPU tensors) of `size` ranks meeting through `store`, for programs that build their groups
// themselves instead of reading torchrun's environment (DistributedContext::from_environment does for --device cpu):
// one rank per process, the processes sharing a store (a c10d::FileStore or TCPStore; a HashStore for a group of one).
// A build without Gloo's headers throws Error.
c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_process_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                               int size, std::chrono::milliseconds timeout);

// Runs `work` and returns nullopt, or the message of the exception it threw (for DistributedContext::check_all).
std::optional<std::string> failure_of(const std::function<void()>& work);

// Contiguous shares of `weights` (e.g. sequence lengths) for `parts` ranks, as nearly equal in total weight as
// consecutive ranges allow: part r is [bounds[r], bounds[r + 1]). Every rank computes the same bounds.
std::vector<int64_t> balanced_shares(const std::vector<int64_t>& weights, int parts);

}  // namespace trellis
