// ProcessGroup and Work: a thin RAII wrapper over one c10d backend that gives
// every operation the group's timeout and turns every failure into a
// viaduct::Error carrying the caller's context (see Note [Timeouts]).
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "core/check.h"
#include "distributed/backend.h"
#include "distributed/distributed.h"
#include "distributed/job_store.h"

namespace viaduct::distributed {
namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::kProduct:
      return c10d::ReduceOp::PRODUCT;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
  }
  VIADUCT_ASSERT(false, "unknown ReduceOp");
  return c10d::ReduceOp::SUM;
}

// c10::Error appends a backtrace to its message; keep what precedes it.
std::string first_line(const std::string& message) {
  auto cut = message.find("\nException raised from");
  return cut == std::string::npos ? message : message.substr(0, cut);
}

const char* kind_name(BackendKind kind) {
  return kind == BackendKind::kGloo ? "gloo" : "nccl";
}

}  // namespace

// ---------------------------------------------------------------- stores

c10::intrusive_ptr<c10d::Store> make_store(const RendezvousInfo& info,
                                           std::chrono::milliseconds timeout) {
  VIADUCT_CHECK(
      info.world_size >= 1 && info.rank >= 0 && info.rank < info.world_size,
      "bad rendezvous: ", info.to_string());
  if (info.world_size == 1) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    store->setTimeout(timeout);
    return store;
  }
  VIADUCT_CHECK(info.master_port > 0 && info.master_port <= 65535,
                "MASTER_PORT=", info.master_port, " is not a TCP port");
  // Where the store listens and what a rank must prove: see Note [Job store].
  const std::string address = store_address(info);
  const std::string token = job_token(info, [](const std::string& name) {
    const char* value = std::getenv(name.c_str());
    return value == nullptr ? std::nullopt : std::optional<std::string>(value);
  });
  std::shared_ptr<JobStoreServer> server;
  if (info.rank == 0) {
    try {
      server = std::make_shared<JobStoreServer>(address, info.master_port, token);
    } catch (const Error& e) {
      const std::string cause = e.what();
      throw Error(str(
          "rank 0 ", cause, " (MASTER_PORT, from ", info.source, "; MASTER_ADDR ",
          info.master_addr, ")",
          cause.find(std::strerror(EADDRINUSE)) != std::string::npos
              ? "; another process holds the port: choose a free MASTER_PORT, or start "
                "the ranks with `viaduct launch`, which picks one"
              : ""));
    }
  }
  try {
    return c10::make_intrusive<JobStore>(address, info.master_port, token, timeout,
                                         std::move(server));
  } catch (const std::exception& e) {
    throw Error(str("rank ", info.rank, ": cannot reach the rendezvous store at ", address,
                    ":", info.master_port, " (MASTER_ADDR ", info.master_addr,
                    "/MASTER_PORT, from ", info.source, ") with ", info.world_size,
                    " ranks (timeout ", timeout.count() / 1000, " s): ", e.what()));
  }
}

c10::intrusive_ptr<c10d::Store> make_group_store(
    const c10::intrusive_ptr<c10d::Store>& store, const std::string& name) {
  return c10::make_intrusive<c10d::PrefixStore>(name, store);
}

bool backend_available(at::DeviceType device) {
  if (device == at::kCPU) return detail::gloo_available();
  if (device == at::kCUDA) return detail::nccl_available();
  return false;
}

// ------------------------------------------------------------------ Work

Work::Work(c10::intrusive_ptr<c10d::Work> work, std::string what,
           std::chrono::milliseconds timeout, bool blocking)
    : work_(std::move(work)),
      what_(std::move(what)),
      timeout_(timeout),
      blocking_(blocking) {}

void Work::wait(const std::string& context) {
  if (!work_) return;
  auto work = std::move(work_);
  auto prefix = [&] {
    return context.empty() ? what_ : context + ": " + what_;
  };
  bool done = false;
  try {
    done = blocking_ ? work->wait(timeout_) : work->wait();
  } catch (const std::exception& e) {
    std::string cause = first_line(e.what());
    bool timed_out = cause.find("imed out") != std::string::npos ||
                     cause.find("imeout") != std::string::npos;
    throw Error(str(prefix(), timed_out ? " timed out" : " failed",
                    " (timeout ", timeout_.count(), " ms): ", cause));
  }
  // c10d's wait rethrows the error a work completed with; isSuccess() is not
  // asked (2.x's NCCL work throws "deprecated" from it).
  VIADUCT_CHECK(done, prefix(), " was aborted (timeout ", timeout_.count(),
                " ms)");
}

bool Work::is_completed() const { return !work_ || work_->isCompleted(); }

// ---------------------------------------------------------- ProcessGroup

ProcessGroup::ProcessGroup(c10::intrusive_ptr<c10d::Store> store, int rank,
                           int size, at::Device device,
                           std::chrono::milliseconds timeout, std::string name,
                           std::vector<int> global_ranks,
                           std::string gloo_hostname)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      device_(device),
      timeout_(timeout),
      name_(std::move(name)),
      global_ranks_(std::move(global_ranks)),
      kind_(device.is_cuda() ? BackendKind::kNccl : BackendKind::kGloo) {
  VIADUCT_CHECK(size_ >= 1 && rank_ >= 0 && rank_ < size_, "group ", name_,
                ": rank ", rank_, " is not in [0, ", size_, ")");
  VIADUCT_CHECK(timeout_.count() > 0, "group ", name_,
                ": the timeout must be positive, got ", timeout_.count(),
                " ms");
  VIADUCT_CHECK(device_.is_cpu() || device_.is_cuda(), "group ", name_,
                ": no process group backend for device ", device_);
  if (global_ranks_.empty()) {
    for (int r = 0; r < size_; ++r) global_ranks_.push_back(r);
  }
  VIADUCT_CHECK(static_cast<int>(global_ranks_.size()) == size_, "group ",
                name_, ": ", global_ranks_.size(),
                " global ranks for a group of ", size_);
  try {
    backend_ =
        kind_ == BackendKind::kGloo
            ? detail::make_gloo(store_, rank_, size_, timeout_, gloo_hostname)
            : detail::make_nccl(store_, rank_, size_, timeout_);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    std::string cause = first_line(e.what());
    throw Error(str("global rank ", global_ranks_[rank_],
                    ": cannot create the ", kind_name(kind_), " group ", name_,
                    " (rank ", rank_, " of ", size_, ", timeout ",
                    timeout_.count(), " ms): ", cause));
  }
  VIADUCT_ASSERT(backend_, "no backend for group ", name_);
}

ProcessGroup::~ProcessGroup() {
  if (backend_ && kind_ == BackendKind::kNccl) {
    // Destroyed while an exception unwinds (a failed step, a bad config
    // found after the groups exist): abort, do not wait for the peers.
    detail::shutdown_nccl(*backend_, std::uncaught_exceptions() > 0);
  }
}

int ProcessGroup::global_rank(int group_rank) const {
  VIADUCT_CHECK(group_rank >= 0 && group_rank < size_, "group ", name_,
                ": rank ", group_rank, " is not in [0, ", size_, ")");
  return global_ranks_[group_rank];
}

std::string ProcessGroup::describe_peer(int group_rank) const {
  return str(name_, " rank ", group_rank, " (global ", global_rank(group_rank),
             ")");
}

namespace {

void check_tensors(const ProcessGroup& pg, const std::vector<at::Tensor>& ts,
                   const char* op) {
  VIADUCT_CHECK(!ts.empty(), op, " on group ", pg.name(), ": no tensors");
  for (const at::Tensor& t : ts) {
    VIADUCT_CHECK(t.defined(), op, " on group ", pg.name(),
                  ": undefined tensor");
    VIADUCT_CHECK(
        t.device().type() == pg.device().type(), op, " on group ", pg.name(),
        ": tensor on ", t.device(), " but the group is ",
        pg.backend_kind() == BackendKind::kGloo ? "gloo (cpu)" : "nccl (cuda)");
    VIADUCT_CHECK(t.is_contiguous() && !t.is_sparse(), op, " on group ",
                  pg.name(), ": tensors must be dense and contiguous");
  }
}

// Starts one c10d operation; a backend that throws at once (bad argument,
// broken connection) is reported like a failed wait.
template <typename Call>
Work start(std::string what, std::chrono::milliseconds timeout, bool blocking,
           Call&& call) {
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = call();
  } catch (const std::exception& e) {
    throw Error(str(what, " could not start: ", first_line(e.what())));
  }
  VIADUCT_ASSERT(work, what, " returned no Work");
  return Work(std::move(work), std::move(what), timeout, blocking);
}

}  // namespace

Work ProcessGroup::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  check_tensors(*this, tensors, "send");
  VIADUCT_CHECK(dst != rank_, "send on group ", name_, " to itself (rank ", dst,
                ")");
  return start(str("send to ", describe_peer(dst), " tag ", tag, " [",
                   kind_name(kind_), "]"),
               timeout_, kind_ == BackendKind::kGloo,
               [&] { return backend_->send(tensors, dst, tag); });
}

Work ProcessGroup::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  check_tensors(*this, tensors, "recv");
  VIADUCT_CHECK(src != rank_, "recv on group ", name_, " from itself (rank ",
                src, ")");
  return start(str("recv from ", describe_peer(src), " tag ", tag, " [",
                   kind_name(kind_), "]"),
               timeout_, kind_ == BackendKind::kGloo,
               [&] { return backend_->recv(tensors, src, tag); });
}

Work ProcessGroup::allreduce(std::vector<at::Tensor>& tensors, ReduceOp op) {
  check_tensors(*this, tensors, "allreduce");
  c10d::AllreduceOptions options;
  options.reduceOp = to_c10d(op);
  options.timeout = timeout_;
  return start(str("allreduce over ", name_, " (", size_, " ranks) [",
                   kind_name(kind_), "]"),
               timeout_, kind_ == BackendKind::kGloo,
               [&] { return backend_->allreduce(tensors, options); });
}

Work ProcessGroup::broadcast(std::vector<at::Tensor>& tensors, int root) {
  check_tensors(*this, tensors, "broadcast");
  c10d::BroadcastOptions options;
  options.rootRank = root;
  options.rootTensor = 0;
  options.timeout = timeout_;
  return start(
      str("broadcast from ", describe_peer(root), " [", kind_name(kind_), "]"),
      timeout_, kind_ == BackendKind::kGloo,
      [&] { return backend_->broadcast(tensors, options); });
}

Work ProcessGroup::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                             std::vector<at::Tensor>& inputs) {
  check_tensors(*this, inputs, "allgather");
  VIADUCT_CHECK(outputs.size() == inputs.size(), "allgather on group ", name_,
                ": ", outputs.size(), " output lists for ", inputs.size(),
                " inputs");
  for (auto& list : outputs) {
    VIADUCT_CHECK(static_cast<int>(list.size()) == size_, "allgather on group ",
                  name_, ": an output list needs ", size_, " tensors, got ",
                  list.size());
    check_tensors(*this, list, "allgather");
  }
  c10d::AllgatherOptions options;
  options.timeout = timeout_;
  return start(str("allgather over ", name_, " (", size_, " ranks) [",
                   kind_name(kind_), "]"),
               timeout_, kind_ == BackendKind::kGloo,
               [&] { return backend_->allgather(outputs, inputs, options); });
}

Work ProcessGroup::alltoall(at::Tensor& output, at::Tensor& input,
                            std::vector<int64_t> output_splits,
                            std::vector<int64_t> input_splits) {
  std::vector<at::Tensor> both{output, input};
  check_tensors(*this, both, "alltoall");
  VIADUCT_CHECK(output.dim() == 1 && input.dim() == 1 &&
                    output.scalar_type() == input.scalar_type(),
                "alltoall on group ", name_, ": needs two 1-D tensors of one dtype, got ",
                output.sizes(), " ", output.scalar_type(), " and ", input.sizes(), " ",
                input.scalar_type());
  auto check_splits = [&](const std::vector<int64_t>& splits, const at::Tensor& t,
                          const char* which) {
    VIADUCT_CHECK(static_cast<int>(splits.size()) == size_, "alltoall on group ", name_, ": ",
                  splits.size(), " ", which, " splits for ", size_, " ranks");
    int64_t n = 0;
    for (int64_t v : splits) {
      VIADUCT_CHECK(v >= 0, "alltoall on group ", name_, ": a negative ", which, " split");
      n += v;
    }
    VIADUCT_CHECK(n == t.numel(), "alltoall on group ", name_, ": ", which, " splits add up to ",
                  n, ", the tensor has ", t.numel(), " elements");
  };
  check_splits(output_splits, output, "output");
  check_splits(input_splits, input, "input");
  // Gloo has no bfloat16 all-to-all; the bits move the same as half's.
  at::Tensor out = output, in = input;
  if (kind_ == BackendKind::kGloo && out.scalar_type() == at::kBFloat16) {
    out = out.view(at::kHalf);
    in = in.view(at::kHalf);
  }
  c10d::AllToAllOptions options;
  options.timeout = timeout_;
  // The backend may move from the split vectors: they are this call's copies.
  return start(str("alltoall over ", name_, " (", size_, " ranks) [", kind_name(kind_), "]"),
               timeout_, kind_ == BackendKind::kGloo, [&] {
                 return backend_->alltoall_base(out, in, output_splits, input_splits, options);
               });
}

Work ProcessGroup::barrier() {
  c10d::BarrierOptions options;
  options.timeout = timeout_;
  if (device_.is_cuda() && device_.has_index()) {
    options.device_ids = {static_cast<int64_t>(device_.index())};
  }
  return start(str("barrier over ", name_, " (", size_, " ranks) [",
                   kind_name(kind_), "]"),
               timeout_, kind_ == BackendKind::kGloo,
               [&] { return backend_->barrier(options); });
}

}  // namespace viaduct::distributed
