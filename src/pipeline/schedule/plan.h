// The pipeline plan: the split and the schedule of one job, built together
// so that they agree (the schedule decides the placement and the stages per
// rank the split may use; a CSV schedule decides the stage count). Every
// rank calls make_pipeline_plan with the same spec and gets the same plan.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "pipeline/schedule/schedule.h"
#include "pipeline/schedule/simulate.h"
#include "pipeline/split/split.h"

namespace viaduct::pipeline {

struct PlanSpec {
  // Model, pp, unit weights and at most one stage-count source. `rule` and
  // `placement` are filled in from the schedule.
  SplitSpec split;
  std::string schedule = "1F1B";  // parallelism.pipeline_parallel_schedule
  std::string schedule_csv_path;  // non-empty: the schedule comes from here
  // parallelism.pipeline_parallel_microbatches; unset: pp * stages per rank
  // (a CSV: its largest micro-batch + 1).
  std::optional<int64_t> microbatches;
  // Training FLOPs per token of each top-level module (ModelInfo's
  // module_flops); empty: no FLOP-weighted simulation.
  std::map<std::string, double> module_flops;
  // parallelism.pipeline_parallel_balance = "flops": choose the split's
  // first/last stage weights by the FLOP-weighted simulation (see Note [Split
  // balanced by FLOPs]); needs module_flops and a rule-based split.
  bool balance_flops = false;
};

struct PipelinePlan {
  Split split;
  Schedule compute;  // per rank, compute actions
  Schedule lowered;  // per rank, what the runtime executes
  SimulationResult simulation;  // default costs; proves deadlock freedom
  // Note [Bubble weighted by FLOPs]
  // With module FLOPs, each stage's FLOPs
  // per token and the simulation with every compute cost scaled by its
  // stage's FLOPs over the stages' mean (F 1, B 2, I 1, W 1 on average).
  // A split that counts the head as one layer (torchtitan's rule) is uneven
  // in FLOPs where the vocabulary is large; this simulation says what that
  // costs, the unit one does not.
  std::vector<double> stage_flops;
  std::optional<SimulationResult> simulation_flops;
  // See Note [Split balanced by FLOPs]: with module FLOPs and a rule-based
  // split, the embedding / head weights (0..4 split units each) whose split
  // has the smallest FLOP-weighted makespan, and its bubble -- the split's
  // own when `balanced` (PlanSpec::balance_flops), otherwise a hint.
  std::optional<std::pair<int64_t, int64_t>> balanced_weights;
  double balanced_bubble_flops = 0;
  bool balanced = false;
};

// Throws ConfigError for impossible shapes, Error for a malformed CSV.
PipelinePlan make_pipeline_plan(const PlanSpec& spec);

// The title of the plan's timeline picture: "1F1B: pp 2, 1 stage per rank,
// 8 micro-batches".
std::string timeline_title(const PipelinePlan& plan);

}  // namespace viaduct::pipeline
