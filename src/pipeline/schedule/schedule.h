// Pipeline schedules: per rank, the ordered list of actions it runs.
//
// Note [Schedule lifecycle]
// 1. A generator (or a CSV) gives each rank's *compute* actions (F, B, I, W,
//    OVERLAP_F_B) in the order torch.distributed.pipelining runs them.
// 2. validate_schedule checks it: every stage forwards every micro-batch
//    once, each B/I after its F, each W after its I, I and W paired, a stage
//    on one rank.
// 3. lower_schedule inserts SEND_F/RECV_F/SEND_B/RECV_B. A send and its
//    receive are appended at the same moment, so every pair of ranks sees its
//    messages in one order on both sides; adjacent stages on one rank (the V
//    placement) exchange nothing.
// 4. simulate() (simulate.h) runs the lowered lists against costs: proof of
//    deadlock freedom, makespan, bubble, peak activations.
// 5. The runtime executes `lowered.ranks[my_rank]` front to back.
//
// Pure: no LibTorch. Every rank builds the same schedule alone.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pipeline/schedule/action.h"
#include "pipeline/split/split.h"

namespace viaduct::pipeline {

enum class ScheduleType {
  kGPipe,
  k1F1B,
  kInterleaved1F1B,
  kLoopedBFS,
  kInterleavedZeroBubble,
  kZBVZeroBubble,
  kDualPipeV,
};

struct ScheduleTraits {
  ScheduleType type;
  const char* name;         // torch's spelling
  bool single_stage;        // one stage per rank (torch PipelineScheduleSingle)
  Placement placement;      // loop or V
  int64_t min_stages_per_rank;
  int64_t max_stages_per_rank;  // 0: no upper bound
  int64_t default_stages_per_rank;
  bool splits_backward;     // emits I and W
};

const ScheduleTraits& schedule_traits(ScheduleType type);
const std::vector<ScheduleTraits>& all_schedule_traits();
// Case-insensitive, as torch's get_schedule_class. Throws ConfigError
// naming the closest valid name.
ScheduleType schedule_type_from_name(const std::string& name);
// The rule the split applies (torchtitan's: single-stage schedules run 1
// stage per rank, multi-stage ones at least 2, V schedules exactly 2).
StagesPerRankRule stages_per_rank_rule(ScheduleType type);

struct Schedule {
  std::string name;  // schedule name or "csv:<file>"
  int64_t pp = 1;
  int64_t num_stages = 1;
  int64_t microbatches = 1;
  std::vector<int64_t> stage_to_rank;
  // Per rank, the actions in execution order (no idle slots).
  std::vector<std::vector<Action>> ranks;
  bool with_comms = false;  // lowered: SEND_*/RECV_* present
};

// The compute actions of a built-in schedule, in torch's order. Throws
// ConfigError for the shapes torch refuses (e.g. 1F1B with fewer
// micro-batches than stages), naming the nearest shapes that work.
Schedule generate_schedule(ScheduleType type, int64_t pp,
                           int64_t stages_per_rank, int64_t microbatches);

// torch's _validate_schedule, stricter on duplicates. Comm and REDUCE_GRAD
// actions are skipped. Returns the stage -> rank map the actions imply and
// checks it against `schedule.stage_to_rank` when that is set. Throws Error
// naming the rank, the step and the action.
std::vector<int64_t> validate_schedule(const Schedule& schedule);

struct LowerOptions {
  // Insert <stage>REDUCE_GRAD after each stage's last B or W (DP sync point).
  bool reduce_grad = false;
};

// Insert the paired sends and receives (torch's _add_send_recv: ranks in
// round-robin order, an action is placed once its input is on the rank).
// Throws Error when the compute order cannot make progress.
Schedule lower_schedule(const Schedule& compute, const LowerOptions& options = {});

// The compute actions of a lowered schedule (inverse of lowering).
Schedule compute_only(const Schedule& schedule);

// Per rank, one line: "rank 0: 0F0 0F1 ...".
std::string schedule_to_text(const Schedule& schedule);

}  // namespace viaduct::pipeline
