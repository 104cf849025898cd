// Rendezvous from torchrun, Slurm and Open MPI variables against the structs
// they must give, and the refusals of malformed values (the message names the
// variable).
#include <gtest/gtest.h>

#include <map>

#include "core/check.h"
#include "distributed/distributed.h"

namespace viaduct::distributed {
namespace {

using Env = std::map<std::string, std::string>;

RendezvousInfo parse(const Env& vars) {
  return rendezvous_from_env(
      [&](const std::string& name) -> std::optional<std::string> {
        auto it = vars.find(name);
        if (it == vars.end()) return std::nullopt;
        return it->second;
      });
}

RendezvousInfo reference(int rank, int world, int local_rank, int local_world,
                        std::string addr, int port, std::string source) {
  RendezvousInfo info;
  info.rank = rank;
  info.world_size = world;
  info.local_rank = local_rank;
  info.local_world_size = local_world;
  info.master_addr = std::move(addr);
  info.master_port = port;
  info.source = std::move(source);
  return info;
}

std::string error_of(const Env& vars) {
  try {
    parse(vars);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Rendezvous, NothingSetIsOneProcess) {
  EXPECT_EQ(parse({}), reference(0, 1, 0, 1, "127.0.0.1", 29500, "single"));
}

TEST(Rendezvous, Torchrun) {
  Env env = {{"RANK", "5"},
             {"WORLD_SIZE", "8"},
             {"LOCAL_RANK", "1"},
             {"LOCAL_WORLD_SIZE", "4"},
             {"MASTER_ADDR", "node0"},
             {"MASTER_PORT", "29512"},
             {"GROUP_RANK", "1"}};
  EXPECT_EQ(parse(env), reference(5, 8, 1, 4, "node0", 29512, "env"));
}

TEST(Rendezvous, TorchrunDefaults) {
  EXPECT_EQ(parse({{"RANK", "1"}, {"WORLD_SIZE", "2"}}),
            reference(1, 2, 1, 2, "127.0.0.1", 29500, "env"));
}

TEST(Rendezvous, TorchrunTakesPrecedenceOverSlurm) {
  Env env = {{"RANK", "0"},
             {"WORLD_SIZE", "2"},
             {"SLURM_PROCID", "3"},
             {"SLURM_NTASKS", "4"}};
  EXPECT_EQ(parse(env).source, "env");
}

TEST(Rendezvous, SlurmSrun) {
  Env env = {{"SLURM_PROCID", "6"},
             {"SLURM_NTASKS", "8"},
             {"SLURM_STEP_NUM_TASKS", "8"},
             {"SLURM_LOCALID", "2"},
             {"SLURM_NODEID", "1"},
             {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"},
             {"SLURM_JOB_NODELIST", "gpu[017-018]"}};
  EXPECT_EQ(parse(env), reference(6, 8, 2, 4, "gpu017", 29500, "slurm"));
}

TEST(Rendezvous, SlurmUnevenTasksAndMasterAddr) {
  Env env = {{"SLURM_PROCID", "4"},
             {"SLURM_NTASKS", "5"},
             {"SLURM_LOCALID", "0"},
             {"SLURM_NODEID", "2"},
             {"SLURM_TASKS_PER_NODE", "2(x2),1"},
             {"SLURM_JOB_NODELIST", "a,b,c"},
             {"MASTER_ADDR", "10.0.0.1"},
             {"MASTER_PORT", "1234"}};
  EXPECT_EQ(parse(env), reference(4, 5, 0, 1, "10.0.0.1", 1234, "slurm"));
}

TEST(Rendezvous, SlurmNtasksPerNode) {
  Env env = {{"SLURM_PROCID", "1"},
             {"SLURM_NTASKS", "2"},
             {"SLURM_LOCALID", "1"},
             {"SLURM_NTASKS_PER_NODE", "2"},
             {"SLURM_JOB_NODELIST", "login1"}};
  EXPECT_EQ(parse(env), reference(1, 2, 1, 2, "login1", 29500, "slurm"));
}

TEST(Rendezvous, SlurmNodeLists) {
  EXPECT_EQ(first_slurm_host("node1"), "node1");
  EXPECT_EQ(first_slurm_host("node1,node2"), "node1");
  EXPECT_EQ(first_slurm_host("n[003-006,9]"), "n003");
  EXPECT_EQ(first_slurm_host("n[7,9-10],m[1-2]"), "n7");
  EXPECT_EQ(first_slurm_host("rack1-n[02-04]-ib"), "rack1-n02-ib");
  EXPECT_THROW(first_slurm_host("n[a-b]"), Error);
  EXPECT_THROW(first_slurm_host(""), Error);
}

TEST(Rendezvous, OpenMpi) {
  Env env = {{"OMPI_COMM_WORLD_RANK", "3"},
             {"OMPI_COMM_WORLD_SIZE", "4"},
             {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
             {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}};
  EXPECT_EQ(parse(env), reference(3, 4, 3, 4, "127.0.0.1", 29500, "mpi"));
  env["OMPI_COMM_WORLD_SIZE"] = "8";  // two nodes: MASTER_ADDR is required
  EXPECT_NE(error_of(env).find("MASTER_ADDR"), std::string::npos);
  env["MASTER_ADDR"] = "host-a";
  EXPECT_EQ(parse(env), reference(3, 8, 3, 4, "host-a", 29500, "mpi"));
}

TEST(Rendezvous, BadValuesNameTheVariable) {
  EXPECT_NE(error_of({{"RANK", "x1"}, {"WORLD_SIZE", "2"}}).find("RANK='x1'"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}}).find("WORLD_SIZE"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}).find("RANK=2"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}).find("WORLD_SIZE"),
            std::string::npos);
  EXPECT_NE(
      error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}})
          .find("MASTER_PORT"),
      std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"},
                      {"WORLD_SIZE", "4"},
                      {"LOCAL_RANK", "2"},
                      {"LOCAL_WORLD_SIZE", "2"}})
                .find("LOCAL_RANK=2"),
            std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "two"}})
                .find("SLURM_NTASKS"),
            std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"},
                      {"SLURM_NTASKS", "4"},
                      {"SLURM_NODEID", "3"},
                      {"SLURM_TASKS_PER_NODE", "2(x2)"}})
                .find("SLURM_TASKS_PER_NODE"),
            std::string::npos);
  EXPECT_NE(
      error_of({{"OMPI_COMM_WORLD_RANK", "-1"}, {"OMPI_COMM_WORLD_SIZE", "2"}})
          .find("OMPI_COMM_WORLD_RANK"),
      std::string::npos);
}

TEST(MeshShape, PipelinesAreContiguous) {
  MeshShape shape{4, 2};
  EXPECT_EQ(shape.global_rank(3, 1), 7);
  EXPECT_EQ(shape.pp_rank(6), 2);
  EXPECT_EQ(shape.dp_rank(6), 1);
  EXPECT_EQ(shape.pp_group_ranks(1), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(shape.dp_group_ranks(2), (std::vector<int>{2, 6}));
}

TEST(Mesh, ShapeMustMatchWorldSize) {
  RendezvousInfo info = reference(0, 6, 0, 6, "127.0.0.1", 1, "env");
  try {
    init_mesh(info, 4, 2, at::kCPU, std::chrono::seconds(1));
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("parallelism.pipeline_parallel_degree"),
              std::string::npos);
    EXPECT_NE(what.find("parallelism.data_parallel_degree"), std::string::npos);
    EXPECT_NE(what.find("WORLD_SIZE is 6"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace viaduct::distributed
