// The pipeline split: which top-level modules each stage owns, which rank
// runs each stage, and which stage holds each layer.
//
// Note [Split units]
// A unit is what the split counts: the embedding (weight
// `first_stage_weight`), each transformer layer (1), the head (weight
// `last_stage_weight`). U = L + w_in + w_out units go to S stages: base =
// U / S, the first U % S stages take one more; stage 0 gives w_in of its share
// to the embedding, the last stage w_out of its share to the head. This is
// torchtitan's generator, so a config moved between the two splits alike.
// Pinned modules (a vision tower after the embedding, an AttnRes final
// aggregation after the head) ride with the first / last stage and count as
// no unit. S comes from exactly one of layers_per_stage, stages_per_rank or an
// explicit per-stage module list.
//
// Pure: no LibTorch, no config. Every rank computes the same split alone.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace viaduct::pipeline {

// Stage placement: loop (rank r holds r, r+pp, ...) or V (2 stages per rank,
// rank r holds r and S-1-r). kCustom: an explicit stage->rank map (loaded
// from a schedule CSV).
enum class Placement { kLoop, kV, kCustom };

const char* placement_name(Placement p);

// The model's top-level modules as the split sees them.
struct ModelLayout {
  int64_t n_layers = 0;
  std::vector<std::string> first_modules{"tok_embeddings"};
  std::vector<std::string> pinned_first;  // after the embedding, no unit
  std::vector<std::string> last_modules{"norm", "lm_head"};
  std::vector<std::string> pinned_last;  // after the head, no unit
  std::string layer_prefix = "layers.";

  // Every module in model order.
  std::vector<std::string> all_modules() const;
};

// Parse a model's ordered module list: `tok_embeddings, [pinned first],
// layers.0 .. layers.L-1, norm, lm_head, [pinned last]`. The modules before
// `layers.0` are the embedding (the first) and the pinned-first ones; after
// the last layer everything up to and including `lm_head` is the head, the
// rest pinned-last. Throws ConfigError when the list does not have this form.
ModelLayout model_layout_from_fqns(const std::vector<std::string>& fqns);

// What the schedule accepts for stages per rank (from schedule_traits()).
struct StagesPerRankRule {
  std::string schedule_name;  // for messages
  int64_t default_value = 1;  // when no source is given
  int64_t min_value = 1;
  int64_t max_value = 0;  // 0: no upper bound
};

struct SplitSpec {
  ModelLayout model;
  int64_t pp = 1;
  int64_t first_stage_weight = 1;  // pipeline_parallel_first_stage_less_layers
  int64_t last_stage_weight = 1;   // pipeline_parallel_last_stage_less_layers
  // At most one of these three; none: rule.default_value stages per rank.
  std::optional<int64_t> layers_per_stage;
  std::optional<int64_t> stages_per_rank;
  std::optional<std::vector<std::vector<std::string>>> module_fqns_per_stage;
  StagesPerRankRule rule;
  Placement placement = Placement::kLoop;
  // Only with Placement::kCustom: stage -> rank, one entry per stage.
  std::vector<int64_t> custom_stage_to_rank;
};

struct Split {
  int64_t pp = 1;
  int64_t num_stages = 1;
  int64_t stages_per_rank = 1;
  int64_t n_layers = 0;
  Placement placement = Placement::kLoop;
  // Per stage: its top-level module FQNs in model order.
  std::vector<std::vector<std::string>> stage_modules;
  // Per stage: its layers [first, end) (first == end: no layer).
  std::vector<std::pair<int64_t, int64_t>> stage_layers;
  std::vector<int64_t> stage_to_rank;
  // Per rank: its stages ascending.
  std::vector<std::vector<int64_t>> rank_to_stages;
  std::vector<int64_t> layer_to_stage;

  bool is_first(int64_t stage) const { return stage == 0; }
  bool is_last(int64_t stage) const { return stage == num_stages - 1; }
};

// torchtitan's generator: the module lists for `num_stages` stages. Throws
// ConfigError for an impossible shape (S < 1, an empty stage, a weight above
// the smallest share).
std::vector<std::vector<std::string>> generate_stage_modules(
    const ModelLayout& model, int64_t num_stages, int64_t first_stage_weight,
    int64_t last_stage_weight);

// Stage -> rank for a placement (kLoop / kV).
std::vector<int64_t> stage_to_rank_map(Placement placement, int64_t pp,
                                       int64_t num_stages);

// The whole split. Throws ConfigError naming the key and the nearest shapes
// that work.
Split make_split(const SplitSpec& spec);

// The candidate nearest to `name` by edit distance (case-insensitive);
// empty when `candidates` is empty. Used by every "did you mean" message.
std::string closest_name(const std::string& name,
                         const std::vector<std::string>& candidates);

// True when the generator accepts (stages, model, weights).
bool split_feasible(int64_t n_layers, int64_t num_stages, int64_t first_weight,
                    int64_t last_weight);

}  // namespace viaduct::pipeline
