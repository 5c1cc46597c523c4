#include "trellis/distributed/distributed.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <thread>

#include "lib/src/distributed/distributed_backends.h"
#include "trellis/error.h"

namespace trellis {
namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

int64_t env_integer(const char* name, int64_t low, int64_t high) {
  const std::string v = env(name).value();
  std::size_t used = 0;
  int64_t x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || x < low || x > high)
    throw Error("environment variable " + std::string(name) + "='" + v + "' must be an integer in [" +
                std::to_string(low) + ", " + std::to_string(high) + "]");
  return x;
}

std::chrono::milliseconds timeout_from_environment() {
  const std::optional<std::string> v = env("TRELLIS_DIST_TIMEOUT");
  if (!v) return std::chrono::seconds(300);
  char* end = nullptr;
  const double seconds = std::strtod(v->c_str(), &end);
  if (end != v->c_str() + v->size() || !std::isfinite(seconds) || seconds <= 0 || seconds > 1e7)
    throw Error("TRELLIS_DIST_TIMEOUT='" + *v + "' must be a number of seconds > 0");
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000)));
}

// The message of an exception from LibTorch without its C++ backtrace.
std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace

struct DistributedContext::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::string backend = "none";
  at::Device device = at::kCPU;  // where the backend's tensors live
  mutable int64_t checks = 0;    // status checks so far (each posts failures under its own keys)
  mutable int64_t barriers = 0;  // wait_for_all calls so far

  ~Impl() {
    if (group) {
      try {
        group->shutdown();
      } catch (const std::exception&) {
        // Shutting down after a peer failed may itself fail; the process is ending with the first error.
      }
    }
  }
};

DistributedContext::DistributedContext() : impl_(std::make_unique<Impl>()) {}
DistributedContext::~DistributedContext() = default;
DistributedContext::DistributedContext(DistributedContext&&) noexcept = default;
DistributedContext& DistributedContext::operator=(DistributedContext&&) noexcept = default;

DistributedContext DistributedContext::from_environment(c10::Device device, std::chrono::milliseconds timeout) {
  if (!device.is_cpu() && !device.is_cuda())
    throw Error("a process group runs on the CPU or CUDA, not " + device.str());
  DistributedContext ctx;
  ctx.timeout_ = timeout.count() > 0 ? timeout : timeout_from_environment();
  if (!env("WORLD_SIZE")) return ctx;  // not launched by torchrun: one process
  const int world = static_cast<int>(env_integer("WORLD_SIZE", 1, 1 << 20));
  if (!env("RANK")) throw Error("WORLD_SIZE is set but RANK is not: launch the processes with torchrun");
  const int rank = static_cast<int>(env_integer("RANK", 0, world - 1));
  const int local_rank = env("LOCAL_RANK") ? static_cast<int>(env_integer("LOCAL_RANK", 0, 1 << 20)) : 0;
  const std::optional<std::string> host = env("MASTER_ADDR");
  if (!host || !env("MASTER_PORT"))
    throw Error("WORLD_SIZE is set but MASTER_ADDR or MASTER_PORT is not: launch the processes with torchrun");
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(env_integer("MASTER_PORT", 1, 65535));
  so.timeout = ctx.timeout_;
  // Under torchrun the agent already serves a store at MASTER_ADDR:MASTER_PORT and every worker is its client
  // (torch.distributed's env:// rendezvous does the same); launched otherwise, rank 0 serves it.
  const bool agent_store = env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  so.isServer = !agent_store && rank == 0;
  so.numWorkers = static_cast<std::size_t>(world);
  so.multiTenant = true;
  Impl& impl = *ctx.impl_;
  try {
    impl.store = c10::make_intrusive<c10d::PrefixStore>("trellis/", c10::make_intrusive<c10d::TCPStore>(*host, so));
    if (device.is_cpu()) {
      impl.group = make_gloo_process_group(impl.store, rank, world, ctx.timeout_);
      impl.backend = "gloo";
    } else {
      impl.group = c10::make_intrusive<c10d::ProcessGroup>(impl.store, rank, world);
      const c10::intrusive_ptr<c10d::Backend> backend = make_nccl_backend(
          c10::make_intrusive<c10d::PrefixStore>("nccl/", impl.store), rank, world, ctx.timeout_, local_rank);
      impl.backend = "nccl";
      impl.device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
      impl.group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, backend);
      impl.group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error("rank " + std::to_string(rank) + " of " + std::to_string(world) +
                ": cannot join the process group at " + *host + ":" + std::to_string(so.port) + " within " +
                std::to_string(ctx.timeout_.count() / 1000) + " s (TRELLIS_DIST_TIMEOUT): " + message_of(e));
  }
  ctx.rank_ = rank;
  ctx.world_size_ = world;
  return ctx;
}

bool DistributedContext::distributed() const { return static_cast<bool>(impl_->group); }
std::string DistributedContext::backend() const { return impl_->backend; }
std::string DistributedContext::describe() const {
  return "rank " + std::to_string(rank_) + " of " + std::to_string(world_size_);
}
c10::intrusive_ptr<c10d::ProcessGroup> DistributedContext::group() const { return impl_->group; }

namespace {

// Starts a collective and waits for it; a failure (a peer gone, the timeout) becomes an Error naming this rank.
template <class Start>
void wait(const Start& start, const std::string& who, const char* what, std::chrono::milliseconds timeout) {
  try {
    start()->wait(timeout);
  } catch (const std::exception& e) {
    throw Error(who + ": " + what +
                " over the process group failed (another rank has probably stopped: see its "
                "messages): " +
                message_of(e));
  }
}

}  // namespace

void DistributedContext::check_all(const std::optional<std::string>& local_failure) const {
  if (!impl_->group) {
    if (local_failure) throw Error(*local_failure);
    return;
  }
  // Failed ranks post their messages in the store, then one all-reduce of a flag per rank tells everyone who failed.
  const std::string key = "failure/" + std::to_string(++impl_->checks) + "/";
  if (local_failure) impl_->store->set(key + std::to_string(rank_), *local_failure);
  at::Tensor flags = at::zeros({world_size_}, at::TensorOptions().dtype(at::kInt).device(impl_->device));
  if (local_failure) flags[rank_].fill_(1);
  std::vector<at::Tensor> buffers{flags};
  wait([&] { return impl_->group->allreduce(buffers); }, describe(), "a status check", timeout_);
  const at::Tensor failed = flags.cpu();
  std::string message;
  for (int r = 0; r < world_size_; ++r) {
    if (!failed[r].item<int>()) continue;
    std::string m;
    if (r == rank_) {
      m = *local_failure;
    } else {
      try {
        const std::vector<uint8_t> bytes = impl_->store->get(key + std::to_string(r));
        m.assign(bytes.begin(), bytes.end());
      } catch (const std::exception& e) {
        m = "(its message could not be read: " + message_of(e) + ")";
      }
    }
    message +=
        (message.empty() ? "" : "; ") + ("rank " + std::to_string(r) + " of " + std::to_string(world_size_) + ": " + m);
  }
  if (message.empty()) return;
  // Every rank has read the messages before any leaves (rank 0 may be serving the store).
  std::vector<at::Tensor> done{at::zeros({1}, flags.options())};
  try {
    impl_->group->allreduce(done)->wait(timeout_);
  } catch (const std::exception&) {
    // The messages are what matters; a rank that has already gone does not change them.
  }
  throw Error(message);
}

void DistributedContext::all_reduce_sum(const std::vector<at::Tensor>& tensors,
                                        const std::optional<std::string>& local_failure) const {
  check_all(local_failure);
  if (!impl_->group) return;
  // One flat buffer per dtype: one collective for each instead of one per tensor.
  std::map<at::ScalarType, std::vector<at::Tensor>> by_type;
  for (const at::Tensor& t : tensors) by_type[t.scalar_type()].push_back(t);
  for (auto& [type, group] : by_type) {
    std::vector<at::Tensor> flat;
    for (const at::Tensor& t : group) flat.push_back(t.detach().reshape({-1}).to(impl_->device));
    std::vector<at::Tensor> buffers{at::cat(flat)};
    wait([&] { return impl_->group->allreduce(buffers); }, describe(), "all_reduce", timeout_);
    int64_t offset = 0;
    for (const at::Tensor& t : group) {
      const int64_t n = t.numel();
      at::NoGradGuard no_grad;
      t.copy_(buffers[0].narrow(0, offset, n).view(t.sizes()));
      offset += n;
    }
  }
}

int64_t DistributedContext::all_reduce_max(int64_t value) const {
  if (!impl_->group) return value;
  std::vector<at::Tensor> buffers{at::full({1}, value, at::TensorOptions().dtype(at::kLong).device(impl_->device))};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  wait([&] { return impl_->group->allreduce(buffers, options); }, describe(), "all_reduce (max)", timeout_);
  return buffers[0].item<int64_t>();
}

void DistributedContext::broadcast(const at::Tensor& tensor, int root) const {
  if (!impl_->group) return;
  std::vector<at::Tensor> buffers{tensor.detach().contiguous().to(impl_->device)};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  wait([&] { return impl_->group->broadcast(buffers, options); }, describe(), "broadcast", timeout_);
  at::NoGradGuard no_grad;
  if (!buffers[0].is_same(tensor)) tensor.copy_(buffers[0]);
}

void DistributedContext::send(const at::Tensor& tensor, int destination) const {
  if (!impl_->group) throw Error("send: a single process has no other rank");
  std::vector<at::Tensor> buffers{tensor.detach().contiguous().to(impl_->device)};
  wait([&] { return impl_->group->send(buffers, destination, 0); }, describe(), "send", timeout_);
}

void DistributedContext::receive(const at::Tensor& tensor, int source) const {
  if (!impl_->group) throw Error("receive: a single process has no other rank");
  std::vector<at::Tensor> buffers{tensor.device() == impl_->device && tensor.is_contiguous()
                                      ? tensor
                                      : at::empty(tensor.sizes(), tensor.options().device(impl_->device))};
  wait([&] { return impl_->group->recv(buffers, source, 0); }, describe(), "receive", timeout_);
  at::NoGradGuard no_grad;
  if (!buffers[0].is_same(tensor)) tensor.copy_(buffers[0]);
}

c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_process_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                               int size, std::chrono::milliseconds timeout) {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  const c10::intrusive_ptr<c10d::Backend> backend =
      make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>("gloo/", store), rank, size, timeout);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  return group;
}

std::optional<std::string> failure_of(const std::function<void()>& work) {
  try {
    work();
    return std::nullopt;
  } catch (const std::bad_alloc&) {
    return std::string("out of memory");
  } catch (const std::exception& e) {
    return message_of(e);
  }
}

void DistributedContext::mark_progress() const {
  if (impl_->group) impl_->store->add("progress/" + std::to_string(rank_), 1);
}

void DistributedContext::signal(const std::string& name) const {
  if (impl_->group) impl_->store->set("signal/" + std::to_string(impl_->barriers) + "/" + name, std::string("1"));
}

void DistributedContext::await(const std::string& name, int rank) const {
  if (!impl_->group) return;
  const std::string key = "signal/" + std::to_string(impl_->barriers) + "/" + name;
  const std::string progress = "progress/" + std::to_string(rank);
  // Polls (a store wait that times out logs a warning each time): the key, and whether `rank` has moved since.
  int64_t seen = -1;
  auto last_move = std::chrono::steady_clock::now();
  auto pause = std::chrono::milliseconds(1);
  try {
    while (!impl_->store->check({key})) {
      const int64_t now_at = impl_->store->add(progress, 0);
      if (now_at != seen) {
        seen = now_at;
        last_move = std::chrono::steady_clock::now();
      } else if (std::chrono::steady_clock::now() - last_move > timeout_) {
        throw Error(describe() + ": rank " + std::to_string(rank) + " made no progress in " +
                    std::to_string(timeout_.count() / 1000) +
                    " s (TRELLIS_DIST_TIMEOUT) while this rank waited for it (it may be waiting for another rank in "
                    "turn: see the messages of all ranks)");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(100));
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(describe() + ": lost the process group's store while waiting for rank " + std::to_string(rank) +
                " (it has probably stopped): " + message_of(e));
  }
}

void DistributedContext::wait_for_all() const {
  if (!impl_->group) return;
  const std::string name = "all/" + std::to_string(++impl_->barriers) + "/";
  signal(name + std::to_string(rank_));
  for (int r = 0; r < world_size_; ++r)
    if (r != rank_) await(name + std::to_string(r), r);
}

std::vector<int64_t> balanced_shares(const std::vector<int64_t>& weights, int parts) {
  if (parts < 1) throw Error("balanced_shares: parts must be >= 1");
  std::vector<int64_t> prefix(weights.size() + 1, 0);
  for (std::size_t i = 0; i < weights.size(); ++i) prefix[i + 1] = prefix[i] + weights[i];
  const int64_t n = static_cast<int64_t>(weights.size());
  std::vector<int64_t> bounds{0};
  for (int r = 1; r < parts; ++r) {
    // The boundary whose prefix is nearest r/parts of the total, never before the previous one.
    const double target = static_cast<double>(prefix.back()) * r / parts;
    int64_t i =
        std::lower_bound(prefix.begin(), prefix.end(), static_cast<int64_t>(std::ceil(target))) - prefix.begin();
    i = std::min(i, n);
    if (i > 0 && target - static_cast<double>(prefix[i - 1]) < static_cast<double>(prefix[i]) - target) --i;
    bounds.push_back(std::max(i, bounds.back()));
  }
  bounds.push_back(n);
  return bounds;
}

}  // namespace trellis
