// The pp × dp device mesh (see Note [Mesh layout] in dist.h): one store, the world
// group, and this rank's pipeline group and data-parallel group, each a
// c10d group over the same store with its own key prefix.
#include <cstdlib>
#include <thread>

#include "core/check.h"
#include "distributed/distributed.h"
#include "distributed/job_store.h"

namespace viaduct::distributed {

std::vector<int> MeshShape::pp_group_ranks(int dp_rank) const {
  std::vector<int> ranks;
  for (int p = 0; p < pp; ++p) ranks.push_back(global_rank(p, dp_rank));
  return ranks;
}

std::vector<int> MeshShape::dp_group_ranks(int pp_rank) const {
  std::vector<int> ranks;
  for (int d = 0; d < dp; ++d) ranks.push_back(global_rank(pp_rank, d));
  return ranks;
}

std::vector<int> MeshShape::ep_group_ranks(int global_rank) const {
  const int first = ep_block(global_rank) * ep, p = pp_rank(global_rank);
  std::vector<int> ranks;
  for (int e = 0; e < ep; ++e) ranks.push_back(this->global_rank(p, first + e));
  return ranks;
}

std::vector<int> MeshShape::expert_replica_ranks(int global_rank) const {
  const int e = ep_rank(global_rank), p = pp_rank(global_rank);
  std::vector<int> ranks;
  for (int b = 0; b < dp / ep; ++b) ranks.push_back(this->global_rank(p, b * ep + e));
  return ranks;
}

namespace {

// Gloo binds to loopback when the whole job is on this host and the user did
// not pick an interface; otherwise to this host's name.
std::string gloo_hostname_for(const RendezvousInfo& info) {
  bool one_host = job_on_one_host(info);
  bool loopback_master =
      info.master_addr == "localhost" || info.master_addr.rfind("127.", 0) == 0;
  return one_host || loopback_master ? "127.0.0.1" : "";
}

}  // namespace

Mesh::Mesh(const RendezvousInfo& info, MeshShape shape, at::Device device,
           std::chrono::milliseconds timeout)
    : rank_(info.rank), shape_(shape), device_(device), timeout_(timeout) {
  VIADUCT_CHECK_T(ConfigError, shape_.pp >= 1 && shape_.dp >= 1,
                  "parallelism.pipeline_parallel_degree (", shape_.pp,
                  ") and parallelism.data_parallel_degree (", shape_.dp,
                  ") must be at least 1");
  VIADUCT_CHECK_T(ConfigError, shape_.world_size() == info.world_size,
                  "parallelism.pipeline_parallel_degree (", shape_.pp,
                  ") × parallelism.data_parallel_degree (", shape_.dp,
                  ") = ", shape_.world_size(), " but WORLD_SIZE is ",
                  info.world_size, " (", info.to_string(), ")");
  VIADUCT_CHECK_T(ConfigError, shape_.ep >= 1 && shape_.dp % shape_.ep == 0,
                  "parallelism.expert_parallel_degree (", shape_.ep,
                  ") must divide parallelism.data_parallel_degree (", shape_.dp, ")");
  std::string hostname = gloo_hostname_for(info);
  // NCCL's bootstrap sockets listen on loopback too when the whole job is on
  // this host, unless the user chose an interface; NCCL reads the variable
  // when the first communicator is made, after this.
  if (device_.is_cuda() && job_on_one_host(info)) {
    ::setenv("NCCL_SOCKET_IFNAME", "lo", /*overwrite=*/0);
  }
  store_ = make_store(info, timeout_);

  std::vector<int> all(static_cast<size_t>(info.world_size));
  for (int r = 0; r < info.world_size; ++r) all[r] = r;
  world_ = std::make_unique<ProcessGroup>(make_group_store(store_, "world"),
                                          rank_, info.world_size, device_,
                                          timeout_, "world", all, hostname);
  // Every rank builds its own pp group, then its own dp group: the groups of
  // one kind partition the ranks, so this order cannot deadlock.
  std::string pp_name = str("pp", dp_rank());
  pp_group_ = std::make_unique<ProcessGroup>(
      make_group_store(store_, pp_name), pp_rank(), shape_.pp, device_,
      timeout_, pp_name, shape_.pp_group_ranks(dp_rank()), hostname);
  std::string dp_name = str("dp", pp_rank());
  dp_group_ = std::make_unique<ProcessGroup>(
      make_group_store(store_, dp_name), dp_rank(), shape_.dp, device_,
      timeout_, dp_name, shape_.dp_group_ranks(pp_rank()), hostname);
  if (shape_.ep == 1) return;
  // Both kinds partition the ranks too.
  const std::string ep_name = str("ep", pp_rank(), ".", shape_.ep_block(rank_));
  ep_group_ = std::make_unique<ProcessGroup>(make_group_store(store_, ep_name), ep_rank(),
                                             shape_.ep, device_, timeout_, ep_name,
                                             shape_.ep_group_ranks(rank_), hostname);
  const std::string er_name = str("expert_replicas", pp_rank(), ".", ep_rank());
  expert_replica_group_ = std::make_unique<ProcessGroup>(
      make_group_store(store_, er_name), shape_.ep_block(rank_), shape_.dp / shape_.ep, device_,
      timeout_, er_name, shape_.expert_replica_ranks(rank_), hostname);
}

std::unique_ptr<Mesh> init_mesh(const RendezvousInfo& info, int pp, int dp,
                                at::Device device,
                                std::chrono::milliseconds timeout, int ep) {
  return std::make_unique<Mesh>(info, MeshShape{pp, dp, ep}, device, timeout);
}

void Mesh::store_barrier(const std::string& key, const std::string& what,
                         std::chrono::milliseconds timeout) {
  store_->add(key, 1);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (store_->add(key, 0) < world_size()) {
    VIADUCT_CHECK(std::chrono::steady_clock::now() < deadline, "rank ", rank_,
                  ": the other ranks did not reach ", what, " within ",
                  std::chrono::duration_cast<std::chrono::seconds>(timeout).count(), " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace viaduct::distributed
