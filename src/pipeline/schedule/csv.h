// Schedules as CSV in torch.distributed.pipelining's format: one row per
// rank, one action per cell in torch's text form ("0F0", "1B3",
// "(0F3;7B2)OVERLAP_F_B"); an empty cell is an idle slot. A compute-only
// file (torch's "compute_only") is lowered after loading; a file with
// SEND/RECV actions ("compute_comms") is taken as is and simulated.
#pragma once

#include <cstdint>
#include <string>

#include "pipeline/schedule/schedule.h"

namespace viaduct::pipeline {

std::string schedule_to_csv(const Schedule& schedule);

// Parse CSV text. `pp`: the expected rank count (0: the row count);
// `num_stages` / `microbatches`: expected values (0: inferred as the largest
// index + 1). The stage -> rank map is inferred from the actions (torch
// does the same) and the schedule is validated. Throws Error naming
// `origin`, the row and the cell.
Schedule schedule_from_csv(const std::string& text, const std::string& origin,
                           int64_t pp = 0, int64_t num_stages = 0,
                           int64_t microbatches = 0);

// Read a file and parse it (FileError when it cannot be read).
Schedule load_schedule_csv(const std::string& path, int64_t pp = 0,
                           int64_t num_stages = 0, int64_t microbatches = 0);

}  // namespace viaduct::pipeline
