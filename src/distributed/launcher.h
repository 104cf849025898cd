// The local launcher behind `viaduct launch`: starts this node's ranks with
// the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// GROUP_RANK, MASTER_ADDR, MASTER_PORT), prefixes every line they print with
// "[rank N] ", forwards SIGINT/SIGTERM/SIGUSR1, and when one rank fails ends
// the others (SIGTERM to its process group, SIGKILL after a grace period) and,
// with --max-restarts, starts them all again (VIADUCT_RESTART_COUNT tells a
// rank which attempt it is; a trainer resumes from its latest checkpoint).
//
// Signals: the first SIGINT/SIGTERM/SIGUSR1 is forwarded to every rank and
// the launcher waits for them (a trainer saves and exits with 75, see Note [Save
// and exit on a signal]); a second one is forwarded too and starts the grace
// period, after which the ranks are killed. A rank that exits with 75 stopped
// on purpose: it is not a failure, it ends no other rank and is not
// restarted.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace viaduct::distributed {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free local port (one node), else 29500
  // Wall-clock limit for the whole job; 0 = none. Past it every rank is
  // ended and the launcher fails.
  std::chrono::milliseconds timeout{0};
  // SIGTERM -> SIGKILL delay when ending ranks.
  std::chrono::milliseconds grace{5000};
  // Times every rank is started again after one fails; 0: never.
  int max_restarts = 0;
  std::vector<std::string> command;  // argv of every rank
};

struct LaunchResult {
  int exit_code = 0;     // 0 only when every rank exited 0
  int failed_rank = -1;  // global rank of the first failure, -1 if none
  int restarts = 0;      // how many times the ranks were started again
  std::string
      message;  // "rank 1 exited with status 3", "rank 0 killed by SIGKILL"
};

// Receives one line a rank printed (without its newline) and whether it came
// from stderr. The default writes "[rank N] line\n" to our stdout/stderr.
using LineSink =
    std::function<void(int rank, bool is_stderr, const std::string& line)>;

// Parses `viaduct launch` arguments (argv[0] == "launch"); throws
// viaduct::Error on a bad flag. Everything after "--" is the command.
LaunchOptions parse_launch_args(int argc, char** argv);
std::string launch_usage();

// Runs the ranks to completion. Throws viaduct::Error if a rank cannot be
// started at all.
LaunchResult launch(const LaunchOptions& options, const LineSink& sink = {});

// A TCP port that was free on 127.0.0.1 a moment ago.
int find_free_port();

}  // namespace viaduct::distributed
