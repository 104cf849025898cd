// Faults the process tests inject into real runs (test_survive, the
// launcher's restarts), read from the environment once at start-up and
// nowhere else:
//   VIADUCT_FAULT_KILL="<rank>:<step>"  that rank dies of SIGKILL as the step
//       starts, in the first attempt only (VIADUCT_RESTART_COUNT unset or 0),
//       so that `viaduct launch --max-restarts` can be seen to recover;
//   VIADUCT_FAULT_SLOW_SAVE_MS="<ms>"   every background checkpoint write is
//       held back that long, as a slow disk would.
// A run with neither set behaves exactly as without this file.
#pragma once

#include <chrono>
#include <cstdint>

namespace viaduct {

struct FaultInjection {
  int kill_rank = -1;
  int64_t kill_step = -1;
  std::chrono::milliseconds slow_save{0};

  static FaultInjection from_environment();
  // SIGKILL when this is the rank and step to kill.
  void kill_if_due(int rank, int64_t step) const;
};

}  // namespace viaduct
