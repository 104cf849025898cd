// The faults the process tests inject (see fault_injection.h).
#include "train/fault_injection.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/log.h"

namespace viaduct {

FaultInjection FaultInjection::from_environment() {
  FaultInjection f;
  const char* restart = std::getenv("VIADUCT_RESTART_COUNT");
  const bool first_attempt = restart == nullptr || std::string(restart) == "0";
  if (const char* kill = std::getenv("VIADUCT_FAULT_KILL"); kill != nullptr && first_attempt) {
    int r = -1;
    long long st = -1;
    if (std::sscanf(kill, "%d:%lld", &r, &st) == 2) {
      f.kill_rank = r;
      f.kill_step = st;
    }
  }
  if (const char* slow = std::getenv("VIADUCT_FAULT_SLOW_SAVE_MS")) {
    f.slow_save = std::chrono::milliseconds(std::atoll(slow));
  }
  return f;
}

void FaultInjection::kill_if_due(int rank, int64_t step) const {
  if (rank != kill_rank || step != kill_step) return;
  log::error("VIADUCT_FAULT_KILL: killing rank ", rank, " at step ", step);
  std::raise(SIGKILL);
}

}  // namespace viaduct
