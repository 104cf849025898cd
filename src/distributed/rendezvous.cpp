// Rendezvous from the environment: torchrun / viaduct launch, Slurm's srun and
// Open MPI's mpirun each describe a rank in their own variables; this reads
// them into one RendezvousInfo and refuses malformed values by name.
#include <cctype>
#include <cstdlib>
#include <limits>

#include "core/check.h"
#include "distributed/distributed.h"

namespace viaduct::distributed {
namespace {

std::optional<std::string> getenv_lookup(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

// A whole-string decimal integer; anything else names the variable.
int parse_int(const std::string& name, const std::string& value, int lo,
              int hi) {
  std::string s = value;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back())))
    s.pop_back();
  size_t start = 0;
  while (start < s.size() && std::isspace(static_cast<unsigned char>(s[start])))
    ++start;
  s = s.substr(start);
  bool ok = !s.empty();
  long long v = 0;
  for (size_t i = 0; ok && i < s.size(); ++i) {
    if (i == 0 && s[i] == '-' && s.size() > 1) continue;
    if (!std::isdigit(static_cast<unsigned char>(s[i])) ||
        v > 1'000'000'000LL) {
      ok = false;
      break;
    }
    v = v * 10 + (s[i] - '0');
  }
  if (ok && s[0] == '-') v = -v;
  VIADUCT_CHECK(ok, "environment variable ", name, "='", value,
                "' is not an integer");
  VIADUCT_CHECK(v >= lo && v <= hi, "environment variable ", name, "=", v,
                " is out of range [", lo, ", ", hi, "]");
  return static_cast<int>(v);
}

constexpr int kMaxInt = std::numeric_limits<int>::max();

int require_int(const EnvLookup& env, const std::string& name, int lo, int hi,
                const std::string& why) {
  auto value = env(name);
  VIADUCT_CHECK(value.has_value(), "environment variable ", name,
                " is not set (", why, ")");
  return parse_int(name, *value, lo, hi);
}

int optional_int(const EnvLookup& env, const std::string& name, int fallback,
                 int lo, int hi) {
  auto value = env(name);
  if (!value.has_value() || value->empty()) return fallback;
  return parse_int(name, *value, lo, hi);
}

void read_master(const EnvLookup& env, RendezvousInfo& info) {
  if (auto addr = env("MASTER_ADDR"); addr.has_value() && !addr->empty()) {
    info.master_addr = *addr;
  }
  info.master_port =
      optional_int(env, "MASTER_PORT", kDefaultMasterPort, 1, 65535);
}

void check_consistent(const RendezvousInfo& info, const std::string& rank_var,
                      const std::string& world_var,
                      const std::string& local_rank_var,
                      const std::string& local_size_var) {
  VIADUCT_CHECK(info.rank < info.world_size, rank_var, "=", info.rank,
                " must be smaller than ", world_var, "=", info.world_size);
  VIADUCT_CHECK(info.local_world_size <= info.world_size, local_size_var, "=",
                info.local_world_size, " must not exceed ", world_var, "=",
                info.world_size);
  VIADUCT_CHECK(info.local_rank < info.local_world_size, local_rank_var, "=",
                info.local_rank, " must be smaller than ", local_size_var, "=",
                info.local_world_size);
}

// Slurm's compressed task counts: "4", "4(x2)", "2(x3),1" -> count on node
// `node_id`.
int slurm_tasks_on_node(const std::string& name, const std::string& value,
                        int node_id) {
  int node = 0;
  size_t pos = 0;
  while (pos < value.size()) {
    size_t comma = value.find(',', pos);
    std::string item = value.substr(
        pos, comma == std::string::npos ? std::string::npos : comma - pos);
    int repeat = 1;
    std::string count_text = item;
    if (auto paren = item.find("(x"); paren != std::string::npos) {
      VIADUCT_CHECK(item.back() == ')', "environment variable ", name, "='",
                    value, "' is not a Slurm task count list");
      count_text = item.substr(0, paren);
      repeat = parse_int(name, item.substr(paren + 2, item.size() - paren - 3),
                         1, kMaxInt);
    }
    int count = parse_int(name, count_text, 1, kMaxInt);
    if (node_id < node + repeat) return count;
    node += repeat;
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  VIADUCT_CHECK(false, "environment variable ", name, "='", value, "' lists ",
                node, " nodes but SLURM_NODEID is ", node_id);
  return 0;
}

RendezvousInfo from_torchrun(const EnvLookup& env) {
  RendezvousInfo info;
  info.source = "env";
  info.rank = require_int(env, "RANK", 0, kMaxInt, "RANK is set");
  info.world_size =
      require_int(env, "WORLD_SIZE", 1, kMaxInt, "RANK is set, so is expected");
  info.local_rank = optional_int(env, "LOCAL_RANK", info.rank, 0, kMaxInt);
  info.local_world_size =
      optional_int(env, "LOCAL_WORLD_SIZE", info.world_size, 1, kMaxInt);
  read_master(env, info);
  check_consistent(info, "RANK", "WORLD_SIZE", "LOCAL_RANK",
                   "LOCAL_WORLD_SIZE");
  return info;
}

RendezvousInfo from_slurm(const EnvLookup& env) {
  RendezvousInfo info;
  info.source = "slurm";
  info.rank = require_int(env, "SLURM_PROCID", 0, kMaxInt, "");
  std::string world_var = env("SLURM_STEP_NUM_TASKS").has_value()
                              ? "SLURM_STEP_NUM_TASKS"
                              : "SLURM_NTASKS";
  info.world_size = require_int(env, world_var, 1, kMaxInt,
                                "SLURM_PROCID is set; run the job with srun");
  info.local_rank = optional_int(env, "SLURM_LOCALID", 0, 0, kMaxInt);
  int node_id = optional_int(env, "SLURM_NODEID", 0, 0, kMaxInt);
  std::string local_var;
  for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                           "SLURM_NTASKS_PER_NODE"}) {
    if (auto value = env(name); value.has_value() && !value->empty()) {
      local_var = name;
      info.local_world_size = slurm_tasks_on_node(name, *value, node_id);
      break;
    }
  }
  if (local_var.empty()) {
    local_var = "SLURM_NTASKS_PER_NODE";
    info.local_world_size = info.world_size;
  }
  read_master(env, info);
  if (!env("MASTER_ADDR").has_value() || env("MASTER_ADDR")->empty()) {
    std::optional<std::string> nodelist = env("SLURM_STEP_NODELIST");
    if (!nodelist.has_value()) nodelist = env("SLURM_JOB_NODELIST");
    if (!nodelist.has_value()) nodelist = env("SLURM_NODELIST");
    if (nodelist.has_value() && !nodelist->empty()) {
      info.master_addr = first_slurm_host(*nodelist);
    } else {
      VIADUCT_CHECK(info.local_world_size == info.world_size,
                    "Slurm job over several nodes: set MASTER_ADDR (neither "
                    "SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set)");
    }
  }
  check_consistent(info, "SLURM_PROCID", world_var, "SLURM_LOCALID", local_var);
  return info;
}

RendezvousInfo from_mpi(const EnvLookup& env) {
  RendezvousInfo info;
  info.source = "mpi";
  info.rank = require_int(env, "OMPI_COMM_WORLD_RANK", 0, kMaxInt, "");
  info.world_size = require_int(env, "OMPI_COMM_WORLD_SIZE", 1, kMaxInt,
                                "OMPI_COMM_WORLD_RANK is set");
  info.local_rank =
      optional_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", info.rank, 0, kMaxInt);
  info.local_world_size = optional_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE",
                                       info.world_size, 1, kMaxInt);
  read_master(env, info);
  VIADUCT_CHECK(
      env("MASTER_ADDR").has_value() ||
          info.local_world_size == info.world_size,
      "mpirun job over several nodes (OMPI_COMM_WORLD_SIZE=", info.world_size,
      ", OMPI_COMM_WORLD_LOCAL_SIZE=", info.local_world_size,
      "): set MASTER_ADDR to the host of rank 0 (mpirun -x MASTER_ADDR=...)");
  check_consistent(info, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                   "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE");
  return info;
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // The first top-level item: commas inside [...] do not split.
  int depth = 0;
  size_t end = nodelist.size();
  for (size_t i = 0; i < nodelist.size(); ++i) {
    if (nodelist[i] == '[') ++depth;
    if (nodelist[i] == ']') --depth;
    if (nodelist[i] == ',' && depth == 0) {
      end = i;
      break;
    }
  }
  std::string item = nodelist.substr(0, end);
  size_t open = item.find('[');
  if (open == std::string::npos) {
    VIADUCT_CHECK(!item.empty(), "SLURM_JOB_NODELIST='", nodelist,
                  "' has no host; set MASTER_ADDR");
    return item;
  }
  size_t close = item.find(']', open);
  VIADUCT_CHECK(close != std::string::npos && close > open + 1,
                "SLURM_JOB_NODELIST='", nodelist,
                "' is not a node list this parser knows; set MASTER_ADDR");
  std::string range = item.substr(open + 1, close - open - 1);
  size_t stop = range.find_first_of(",-");
  std::string first = range.substr(0, stop);
  VIADUCT_CHECK(!first.empty() &&
                    first.find_first_not_of("0123456789") == std::string::npos,
                "SLURM_JOB_NODELIST='", nodelist,
                "' is not a node list this parser knows; set MASTER_ADDR");
  VIADUCT_CHECK(item.find('[', close) == std::string::npos,
                "SLURM_JOB_NODELIST='", nodelist,
                "' has several bracket ranges in one name; set MASTER_ADDR");
  return item.substr(0, open) + first + item.substr(close + 1);
}

std::string RendezvousInfo::to_string() const {
  return str("rank ", rank, "/", world_size, " (local ", local_rank, "/",
             local_world_size, ", master ", master_addr, ":", master_port,
             ", from ", source, ")");
}

bool operator==(const RendezvousInfo& a, const RendezvousInfo& b) {
  return a.rank == b.rank && a.world_size == b.world_size &&
         a.local_rank == b.local_rank &&
         a.local_world_size == b.local_world_size &&
         a.master_addr == b.master_addr && a.master_port == b.master_port &&
         a.source == b.source;
}

RendezvousInfo rendezvous_from_env(const EnvLookup& env) {
  if (env("RANK").has_value()) return from_torchrun(env);
  if (env("SLURM_PROCID").has_value()) return from_slurm(env);
  if (env("OMPI_COMM_WORLD_RANK").has_value()) return from_mpi(env);
  RendezvousInfo info;
  read_master(env, info);
  return info;
}

RendezvousInfo rendezvous_from_env() {
  return rendezvous_from_env(getenv_lookup);
}

}  // namespace viaduct::distributed
