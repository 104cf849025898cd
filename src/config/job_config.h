// The job config as typed sections (torchtitan's JobConfig): built once from
// the loaded raw config (config/config.h: TOML, overrides, schema, checks)
// and handed down. Code below apps/ and train/ receives the section it needs
// and never a string key; a model family parses its own [model] keys into
// its options struct through ModelSection::keys.
//
// Each field is the schema key of the same name in its section
// (config/schema_*.cpp), of the schema's type; std::optional where the key
// has no default (the flavor or the plan decides). The sections are plain
// values: a copy may be changed (`viaduct plan` sizes a run under other
// activation checkpointing), while to_toml() and source() keep answering
// for the config as loaded.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace viaduct {

class Config;

struct JobSection {
  std::string dump_folder;
  std::string description;
  std::string log_level;  // debug | info | warning | error
};

struct TrainingSection {
  int64_t steps = 0;
  int64_t seed = 0;
  int64_t local_batch_size = 0;
  int64_t seq_len = 0;
  int64_t gradient_accumulation_steps = 0;
  double max_norm = 0;
  std::string dtype;   // auto | float32 | bfloat16
  std::string device;  // auto | cpu | cuda
  bool deterministic = false;
  // Unset: the step graph where the run allows it; true: required (a run
  // that cannot take it is refused); false: eager steps.
  std::optional<bool> cuda_graphs;
  int64_t num_threads = 0;
  int64_t eval_interval = 0;
};

struct OptimizerSection {
  std::string name;  // AdamW | SGD
  double lr = 0;
  double beta1 = 0;
  double beta2 = 0;
  double eps = 0;
  double weight_decay = 0;
};

struct LrSchedulerSection {
  int64_t warmup_steps = 0;  // at most training.steps (Config::parse clamps it)
  std::string decay_type;    // cosine | linear | constant
  double min_lr_factor = 0;
};

struct DataSection {
  std::string path;  // not in effect while `paths` is non-empty
  std::vector<std::string> paths;
  std::vector<double> weights;
  std::string val_path;
  std::string format;
  bool shuffle = false;
  int64_t eval_batches = 0;
  std::string tokenizer;
};

struct CheckpointSection {
  bool enable = false;
  std::string folder;
  int64_t interval = 0;
  int64_t keep_latest_k = 0;
  bool resume = false;
  bool move_old_run_aside = false;
  bool resume_with_new_optimizer = false;
  bool save_initial = false;
  bool save_final = false;
  std::string async_mode;  // disabled | async
  std::string initial_load_path;
  bool initial_load_in_hf = false;
  bool initial_load_model_only = false;
  std::vector<std::string> exclude_from_loading;  // of optimizer, data, step
  bool last_save_in_hf = false;
};

struct MetricsSection {
  int64_t log_freq = 0;
  bool enable_jsonl = false;
  bool progress_bar = false;
  bool pipeline_timing = false;
  int64_t profile_step = 0;
  bool profile_host_ops = false;
  double loss_spike_factor = 0;
};

struct ParallelismSection {
  int64_t pipeline_parallel_degree = 0;
  std::string pipeline_parallel_schedule;
  std::string pipeline_parallel_schedule_csv;
  std::optional<int64_t> pipeline_parallel_layers_per_stage;
  std::optional<int64_t> pipeline_parallel_stages_per_rank;
  int64_t pipeline_parallel_first_stage_less_layers = 0;
  int64_t pipeline_parallel_last_stage_less_layers = 0;
  std::string pipeline_parallel_balance;  // layers | flops
  std::optional<std::vector<std::vector<std::string>>> module_fqns_per_model_part;
  std::optional<int64_t> pipeline_parallel_microbatches;
  int64_t data_parallel_degree = 0;
  int64_t expert_parallel_degree = 0;
  std::string expert_gradient_sum;  // replica_order | local
  int64_t comm_timeout_seconds = 0;
  int64_t dp_bucket_mb = 0;
  bool dp_shard_optimizer = false;
  bool attn_res_cache = false;
  std::string attn_res_cache_backward;  // deposit | whole_stack
  bool attn_res_cache_offload = false;
};

struct ActivationCheckpointSection {
  std::string mode;                 // none | full | selective
  std::string selective_ac_option;  // a positive integer N, or "op"
};

// The [model] keys of the loaded config, read by name: what a family's parse
// of its options struct reads (model/<family>.cpp), and the registry's check
// that the config sets no key of another family (model/family.cpp). Any key
// outside [model] is an internal error.
class ModelKeys {
 public:
  ModelKeys() = default;
  explicit ModelKeys(std::shared_ptr<const Config> raw) : raw_(std::move(raw)) {}

  // `key` is dotted ("model.n_layers"). The _opt forms are nullopt for a key
  // the config leaves unset (the flavor decides); the others throw
  // ConfigError for one.
  std::optional<int64_t> get_int_opt(const std::string& key) const;
  std::optional<double> get_float_opt(const std::string& key) const;
  std::optional<bool> get_bool_opt(const std::string& key) const;
  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  // Config::is_set, differs_from_default and source of the key.
  bool is_set(const std::string& key) const;
  bool differs_from_default(const std::string& key) const;
  std::string source(const std::string& key) const;
  // Every [model] key of the schema, dotted, in schema order.
  static const std::vector<std::string>& names();

 private:
  const Config& raw(const std::string& key) const;
  std::shared_ptr<const Config> raw_;
};

// model.family and model.flavor pick the family; the other typed fields are
// the [model] keys read outside the family (the kernel choice of every
// family, the MoE capacity the registry checks against the family's
// experts). The rest the family parses from `keys`.
struct ModelSection {
  std::string family;
  std::string flavor;
  bool cuda_kernels = false;
  bool swiglu_recompute = false;
  double moe_capacity_factor = 0;
  // See Note [Document boundaries] (ops/documents.h): "causal" or
  // "block_causal"; positions restart at documents under block_causal unless
  // reset_position_ids is set false (true under causal is refused at load).
  std::string attn_mask_type = "causal";
  std::optional<bool> reset_position_ids;
  bool block_causal() const { return attn_mask_type == "block_causal"; }
  bool resets_positions() const { return reset_position_ids.value_or(block_causal()); }
  ModelKeys keys;
};

struct JobConfig {
  JobSection job;
  ModelSection model;
  TrainingSection training;
  OptimizerSection optimizer;
  LrSchedulerSection lr_scheduler;
  DataSection data;
  CheckpointSection checkpoint;
  MetricsSection metrics;
  ParallelismSection parallelism;
  ActivationCheckpointSection activation_checkpoint;

  // The sections of a loaded config (Config::load / parse have run its
  // checks). The config is kept for to_toml(), source() and the model keys.
  static JobConfig from(Config raw);
  // Config::load(path, overrides), then from().
  static JobConfig load(const std::string& path, const std::vector<std::string>& overrides = {});
  // Config::parse(toml_text, origin, overrides), then from() (for tests).
  static JobConfig parse(const std::string& toml_text, const std::string& origin,
                         const std::vector<std::string>& overrides = {});
  // Defaults only (Config()).
  static JobConfig defaults();

  // The loaded config: as TOML (Config::to_toml, what a checkpoint records),
  // where a key's value came from (Config::source, for error messages), the
  // file it came from (Config::origin), and the store itself for apps/ and
  // train/.
  std::string to_toml() const;
  std::string source(const std::string& key) const;
  const std::string& origin() const;
  const Config& raw() const;

 private:
  std::shared_ptr<const Config> raw_;
};

}  // namespace viaduct
