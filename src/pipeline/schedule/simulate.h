// Simulation of a lowered schedule: every rank runs its list front to back;
// a compute waits for its input (a local predecessor or a received message);
// sends and receive posts cost no rank time, a message arrives `p2p` after
// both its send and its receive are posted. Proves deadlock freedom and
// that each pair of ranks sees its messages in one order on both sides, and
// measures makespan, bubble and peak live activations.
#pragma once

#include <cstdint>
#include <vector>

#include "pipeline/schedule/schedule.h"

namespace viaduct::pipeline {

struct CostModel {
  double forward = 1.0;
  double backward = 2.0;         // B = I + W by default
  double backward_input = 1.0;   // I
  double backward_weight = 1.0;  // W
  double p2p = 0.0;              // one message, send posted -> data usable
  // Optional per-stage multiplier of every compute cost (uneven splits).
  std::vector<double> stage_scale;

  double cost(const Action& leaf) const;
};

struct TimedAction {
  Action action;  // a leaf compute action (OVERLAP_F_B is split)
  double start = 0;
  double end = 0;
};

struct SimulationResult {
  double makespan = 0;
  // Idle rank-time over all rank-time: 1 - sum(busy) / (pp * makespan).
  double bubble_fraction = 0;
  std::vector<double> busy;  // per rank
  // Per rank, the most micro-batch activations held at once: a forward
  // holds one from its start until its B ends (or its W, when split).
  std::vector<int64_t> peak_activations;
  std::vector<std::vector<TimedAction>> timeline;  // per rank, compute only
  int64_t messages = 0;
};

// `schedule` may be compute-only (it is lowered first) or lowered. Throws
// Error on a deadlock (naming each rank's blocked action), on a receive
// posted after the compute that needs it, and on a pair of ranks whose
// sends and receives disagree in order.
SimulationResult simulate(const Schedule& schedule, const CostModel& costs = {});

}  // namespace viaduct::pipeline
