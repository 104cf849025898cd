// The distributed layer: rendezvous from the environment, process groups over
// c10d (Gloo for CPU tensors, NCCL for CUDA tensors) with explicit timeouts,
// and the pp × dp device mesh. Everything version-specific about c10d lives
// in core/torch_compat.h; this header and its users never see it.
//
// Note [Mesh layout]
// global rank = dp_rank * pp + pp_rank: the ranks of one pipeline are
// contiguous (0..pp-1 is the first replica), so with `viaduct launch` or
// torchrun's block placement pipeline neighbours share a node, and the dp
// group is strided by pp.
//
// Note [Timeouts]
// Every group carries a timeout. Gloo ops give up after it; Work::wait blocks
// at most that long and throws viaduct::Error naming the caller's context
// ("rank 1 stage 3 microbatch 2 RECV_F"), the op, the peer and the group. On
// NCCL, wait() is stream-ordered (the CPU does not block) and a stuck op is
// ended by NCCL's watchdog after the same timeout.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/torch_compat.h"

namespace viaduct::distributed {

constexpr std::chrono::milliseconds kDefaultCommTimeout{300'000};
constexpr int kDefaultMasterPort = 29500;

// ---------------------------------------------------------------- rendezvous

// Where this process sits in the job. `source` says which environment was
// read: "env" (torchrun / viaduct launch), "slurm", "mpi" or "single".
struct RendezvousInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = kDefaultMasterPort;
  std::string source = "single";

  std::string to_string() const;
};

bool operator==(const RendezvousInfo& a, const RendezvousInfo& b);

// Looks up one environment variable; nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// Reads, in this order of precedence:
//  1. RANK + WORLD_SIZE (torchrun, viaduct launch): LOCAL_RANK,
//  LOCAL_WORLD_SIZE
//     (default: RANK, WORLD_SIZE), MASTER_ADDR (127.0.0.1), MASTER_PORT
//     (29500).
//  2. SLURM_PROCID (srun): world from SLURM_STEP_NUM_TASKS or SLURM_NTASKS,
//     SLURM_LOCALID, local size from SLURM_STEP_TASKS_PER_NODE /
//     SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE ("4", "4(x2)", "2,1" with
//     SLURM_NODEID); master = MASTER_ADDR, else the first host of
//     SLURM_STEP_NODELIST / SLURM_JOB_NODELIST ("n1,n2", "n[003-006,9]").
//  3. OMPI_COMM_WORLD_RANK (mpirun): _SIZE, _LOCAL_RANK, _LOCAL_SIZE; master =
//     MASTER_ADDR, required when the job spans nodes.
//  4. Nothing: one process (rank 0 of 1).
// A malformed or inconsistent value throws viaduct::Error naming the variable.
RendezvousInfo rendezvous_from_env();
RendezvousInfo rendezvous_from_env(const EnvLookup& env);

// The first host of a Slurm node list ("gpu[07-09],cpu1" -> "gpu07").
std::string first_slurm_host(const std::string& nodelist);

// ------------------------------------------------------------------- stores

// A JobStore client (rank 0 also runs the server, dist/job_store.h) at
// master_addr:master_port -- on loopback when the job is on one host -- that
// sends VIADUCT_JOB_TOKEN and waits at most `timeout` for rank 0's server.
// world_size == 1 gets an in-process store.
c10::intrusive_ptr<c10d::Store> make_store(const RendezvousInfo& info,
                                           std::chrono::milliseconds timeout);

// The store of one group: keys prefixed with "<name>/".
c10::intrusive_ptr<c10d::Store> make_group_store(
    const c10::intrusive_ptr<c10d::Store>& store, const std::string& name);

// ---------------------------------------------------------- process groups

enum class ReduceOp { kSum, kProduct, kMin, kMax };

// A pending c10d operation. wait(context) returns once it is done (for NCCL:
// ordered on the current stream) and throws viaduct::Error
// "<context>: <op> timed out|failed (timeout N ms): <cause>" otherwise. A
// default-constructed Work is already complete.
class Work {
 public:
  Work() = default;
  Work(c10::intrusive_ptr<c10d::Work> work, std::string what,
       std::chrono::milliseconds timeout, bool blocking);

  void wait(const std::string& context);
  bool is_completed() const;
  bool valid() const { return static_cast<bool>(work_); }
  const std::string& what() const { return what_; }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;  // "recv from pp0 rank 1 (global 1) tag 7 [gloo]"
  std::chrono::milliseconds timeout_{0};
  bool blocking_ = true;  // Gloo: CPU waits; NCCL: stream-ordered
};

enum class BackendKind { kGloo, kNccl };

// Whether this build can make groups for tensors on `device`: CPU needs Gloo
// headers at build time (absent from the wheel), CUDA needs torch_cuda.
bool backend_available(at::DeviceType device);

// One c10d group. Ranks in calls are ranks in this group; `global_ranks`
// maps them to world ranks for messages. The backend follows the device:
// CPU -> Gloo, CUDA -> NCCL.
class ProcessGroup {
 public:
  // `store` must already be prefixed for this group when it is a sub-group
  // (make_group_store). `gloo_hostname`: the address Gloo binds to; "" uses
  // GLOO_SOCKET_IFNAME when set, else this host's name.
  ProcessGroup(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
               at::Device device, std::chrono::milliseconds timeout,
               std::string name, std::vector<int> global_ranks = {},
               std::string gloo_hostname = "");
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int global_rank(int group_rank) const;
  const std::string& name() const { return name_; }
  at::Device device() const { return device_; }
  BackendKind backend_kind() const { return kind_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  Work send(std::vector<at::Tensor>& tensors, int dst_group_rank, int tag);
  Work recv(std::vector<at::Tensor>& tensors, int src_group_rank, int tag);
  Work allreduce(std::vector<at::Tensor>& tensors,
                 ReduceOp op = ReduceOp::kSum);
  Work broadcast(std::vector<at::Tensor>& tensors, int root_group_rank);
  // outputs[i] has size() tensors shaped like inputs[i].
  Work allgather(std::vector<std::vector<at::Tensor>>& outputs,
                 std::vector<at::Tensor>& inputs);
  // All-to-all of 1-D tensors: input's first input_splits[0] elements go to
  // group rank 0, the next input_splits[1] to rank 1, ...; output receives
  // output_splits[r] elements from rank r, in rank order. A pure data move,
  // so any dtype travels (on Gloo, bfloat16 moves as half).
  Work alltoall(at::Tensor& output, at::Tensor& input, std::vector<int64_t> output_splits,
                std::vector<int64_t> input_splits);
  Work barrier();

  // The raw backend, for what this wrapper does not cover.
  compat::PgBase& backend() { return *backend_; }

 private:
  std::string describe_peer(int group_rank) const;

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<compat::PgBase> backend_;
  int rank_;
  int size_;
  at::Device device_;
  std::chrono::milliseconds timeout_;
  std::string name_;
  std::vector<int> global_ranks_;
  BackendKind kind_;
};

// ---------------------------------------------------------------- the mesh

// Pure arithmetic of see Note [Mesh layout].
struct MeshShape {
  int pp = 1;
  int dp = 1;
  int ep = 1;  // divides dp
  int world_size() const { return pp * dp; }
  int global_rank(int pp_rank, int dp_rank) const {
    return dp_rank * pp + pp_rank;
  }
  int pp_rank(int global_rank) const { return global_rank % pp; }
  int dp_rank(int global_rank) const { return global_rank / pp; }
  std::vector<int> pp_group_ranks(int dp_rank) const;  // one pipeline
  std::vector<int> dp_group_ranks(int pp_rank) const;  // one stage's replicas
  int ep_rank(int global_rank) const { return dp_rank(global_rank) % ep; }
  int ep_block(int global_rank) const { return dp_rank(global_rank) / ep; }
  // The ep group of a global rank and the ranks holding its experts.
  std::vector<int> ep_group_ranks(int global_rank) const;
  std::vector<int> expert_replica_ranks(int global_rank) const;
};

class Mesh {
 public:
  Mesh(const RendezvousInfo& info, MeshShape shape, at::Device device,
       std::chrono::milliseconds timeout);

  int rank() const { return rank_; }
  int world_size() const { return shape_.world_size(); }
  const MeshShape& shape() const { return shape_; }
  int pp() const { return shape_.pp; }
  int dp() const { return shape_.dp; }
  int pp_rank() const { return shape_.pp_rank(rank_); }
  int dp_rank() const { return shape_.dp_rank(rank_); }
  int ep() const { return shape_.ep; }
  int ep_rank() const { return shape_.ep_rank(rank_); }
  at::Device device() const { return device_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  ProcessGroup& world() { return *world_; }
  ProcessGroup& pp_group() { return *pp_group_; }  // rank in it == pp_rank()
  ProcessGroup& dp_group() { return *dp_group_; }  // rank in it == dp_rank()
  // Null when ep == 1. Rank in the ep group == ep_rank(); in the expert
  // replica group, the block.
  ProcessGroup* ep_group() { return ep_group_.get(); }
  ProcessGroup* expert_replica_group() { return expert_replica_group_.get(); }
  c10d::Store& store() { return *store_; }
  // Returns once every rank of the job has reached `key` (each counts
  // itself in the store): a barrier for a thread that must not use the
  // process groups the main thread uses (the asynchronous checkpoint's
  // writer). An Error naming `what` when the others do not come within
  // `timeout`.
  void store_barrier(const std::string& key, const std::string& what,
                     std::chrono::milliseconds timeout);

 private:
  int rank_;
  MeshShape shape_;
  at::Device device_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::unique_ptr<ProcessGroup> world_;
  std::unique_ptr<ProcessGroup> pp_group_;
  std::unique_ptr<ProcessGroup> dp_group_;
  std::unique_ptr<ProcessGroup> ep_group_;
  std::unique_ptr<ProcessGroup> expert_replica_group_;
};

// Connects to the store and builds the world, pp and dp groups and, with
// ep > 1, the ep and expert-replica groups (the same order on every rank).
// pp * dp must equal info.world_size (ConfigError naming
// parallelism.pipeline_parallel_degree, parallelism.data_parallel_degree and
// WORLD_SIZE otherwise) and ep must divide dp.
std::unique_ptr<Mesh> init_mesh(
    const RendezvousInfo& info, int pp, int dp, at::Device device,
    std::chrono::milliseconds timeout = kDefaultCommTimeout, int ep = 1);

}  // namespace viaduct::distributed
