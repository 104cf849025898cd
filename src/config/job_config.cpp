// The typed sections of a loaded config (see job_config.h): the one place
// that reads every key by name.
#include "config/job_config.h"

#include "config/config.h"
#include "core/check.h"

namespace viaduct {

JobConfig JobConfig::from(Config raw) {
  JobConfig j;
  j.raw_ = std::make_shared<const Config>(std::move(raw));
  const Config& c = *j.raw_;

  j.job.dump_folder = c.get_string("job.dump_folder");
  j.job.description = c.get_string("job.description");
  j.job.log_level = c.get_string("job.log_level");

  auto& t = j.training;
  t.steps = c.get_int("training.steps");
  t.seed = c.get_int("training.seed");
  t.local_batch_size = c.get_int("training.local_batch_size");
  t.seq_len = c.get_int("training.seq_len");
  t.gradient_accumulation_steps = c.get_int("training.gradient_accumulation_steps");
  t.max_norm = c.get_float("training.max_norm");
  t.dtype = c.get_string("training.dtype");
  t.device = c.get_string("training.device");
  t.deterministic = c.get_bool("training.deterministic");
  t.cuda_graphs = c.get_bool_opt("training.cuda_graphs");
  t.num_threads = c.get_int("training.num_threads");
  t.eval_interval = c.get_int("training.eval_interval");

  auto& o = j.optimizer;
  o.name = c.get_string("optimizer.name");
  o.lr = c.get_float("optimizer.lr");
  o.beta1 = c.get_float("optimizer.beta1");
  o.beta2 = c.get_float("optimizer.beta2");
  o.eps = c.get_float("optimizer.eps");
  o.weight_decay = c.get_float("optimizer.weight_decay");

  auto& lr = j.lr_scheduler;
  lr.warmup_steps = c.get_int("lr_scheduler.warmup_steps");
  lr.decay_type = c.get_string("lr_scheduler.decay_type");
  lr.min_lr_factor = c.get_float("lr_scheduler.min_lr_factor");

  auto& ck = j.checkpoint;
  ck.enable = c.get_bool("checkpoint.enable");
  ck.folder = c.get_string("checkpoint.folder");
  ck.interval = c.get_int("checkpoint.interval");
  ck.keep_latest_k = c.get_int("checkpoint.keep_latest_k");
  ck.resume = c.get_bool("checkpoint.resume");
  ck.move_old_run_aside = c.get_bool("checkpoint.move_old_run_aside");
  ck.resume_with_new_optimizer = c.get_bool("checkpoint.resume_with_new_optimizer");
  ck.save_initial = c.get_bool("checkpoint.save_initial");
  ck.save_final = c.get_bool("checkpoint.save_final");
  ck.async_mode = c.get_string("checkpoint.async_mode");
  ck.initial_load_path = c.get_string("checkpoint.initial_load_path");
  ck.initial_load_in_hf = c.get_bool("checkpoint.initial_load_in_hf");
  ck.initial_load_model_only = c.get_bool("checkpoint.initial_load_model_only");
  ck.exclude_from_loading = c.get_string_list("checkpoint.exclude_from_loading");
  ck.last_save_in_hf = c.get_bool("checkpoint.last_save_in_hf");

  auto& m = j.metrics;
  m.log_freq = c.get_int("metrics.log_freq");
  m.enable_jsonl = c.get_bool("metrics.enable_jsonl");
  m.progress_bar = c.get_bool("metrics.progress_bar");
  m.pipeline_timing = c.get_bool("metrics.pipeline_timing");
  m.profile_step = c.get_int("metrics.profile_step");
  m.profile_host_ops = c.get_bool("metrics.profile_host_ops");
  m.loss_spike_factor = c.get_float("metrics.loss_spike_factor");

  j.activation_checkpoint.mode = c.get_string("activation_checkpoint.mode");
  j.activation_checkpoint.selective_ac_option =
      c.get_string("activation_checkpoint.selective_ac_option");

  auto& md = j.model;
  md.family = c.get_string("model.family");
  md.flavor = c.get_string("model.flavor");
  md.cuda_kernels = c.get_bool("model.cuda_kernels");
  md.swiglu_recompute = c.get_bool("model.swiglu_recompute");
  md.moe_capacity_factor = c.get_float("model.moe_capacity_factor");
  md.attn_mask_type = c.get_string("model.attn_mask_type");
  md.reset_position_ids = c.get_bool_opt("model.reset_position_ids");
  md.keys = ModelKeys(j.raw_);

  auto& d = j.data;
  d.path = c.get_string("data.path");
  d.paths = c.get_string_list("data.paths");
  d.weights = c.get_float_list("data.weights");
  d.val_path = c.get_string("data.val_path");
  d.format = c.get_string("data.format");
  d.shuffle = c.get_bool("data.shuffle");
  d.eval_batches = c.get_int("data.eval_batches");
  d.tokenizer = c.get_string("data.tokenizer");

  auto& p = j.parallelism;
  p.pipeline_parallel_degree = c.get_int("parallelism.pipeline_parallel_degree");
  p.pipeline_parallel_schedule = c.get_string("parallelism.pipeline_parallel_schedule");
  p.pipeline_parallel_schedule_csv = c.get_string("parallelism.pipeline_parallel_schedule_csv");
  p.pipeline_parallel_layers_per_stage =
      c.get_int_opt("parallelism.pipeline_parallel_layers_per_stage");
  p.pipeline_parallel_stages_per_rank =
      c.get_int_opt("parallelism.pipeline_parallel_stages_per_rank");
  p.pipeline_parallel_first_stage_less_layers =
      c.get_int("parallelism.pipeline_parallel_first_stage_less_layers");
  p.pipeline_parallel_last_stage_less_layers =
      c.get_int("parallelism.pipeline_parallel_last_stage_less_layers");
  p.pipeline_parallel_balance = c.get_string("parallelism.pipeline_parallel_balance");
  if (c.is_set("parallelism.module_fqns_per_model_part")) {
    p.module_fqns_per_model_part =
        c.get_string_list_list("parallelism.module_fqns_per_model_part");
  }
  p.pipeline_parallel_microbatches = c.get_int_opt("parallelism.pipeline_parallel_microbatches");
  p.data_parallel_degree = c.get_int("parallelism.data_parallel_degree");
  p.expert_parallel_degree = c.get_int("parallelism.expert_parallel_degree");
  p.expert_gradient_sum = c.get_string("parallelism.expert_gradient_sum");
  p.comm_timeout_seconds = c.get_int("parallelism.comm_timeout_seconds");
  p.dp_bucket_mb = c.get_int("parallelism.dp_bucket_mb");
  p.dp_shard_optimizer = c.get_bool("parallelism.dp_shard_optimizer");
  p.attn_res_cache = c.get_bool("parallelism.attn_res_cache");
  p.attn_res_cache_backward = c.get_string("parallelism.attn_res_cache_backward");
  p.attn_res_cache_offload = c.get_bool("parallelism.attn_res_cache_offload");
  return j;
}

JobConfig JobConfig::load(const std::string& path, const std::vector<std::string>& overrides) {
  return from(Config::load(path, overrides));
}

JobConfig JobConfig::parse(const std::string& toml_text, const std::string& origin,
                           const std::vector<std::string>& overrides) {
  return from(Config::parse(toml_text, origin, overrides));
}

JobConfig JobConfig::defaults() { return from(Config()); }

std::string JobConfig::to_toml() const { return raw().to_toml(); }
std::string JobConfig::source(const std::string& key) const { return raw().source(key); }
const std::string& JobConfig::origin() const { return raw().origin(); }

const Config& JobConfig::raw() const {
  VIADUCT_ASSERT(raw_ != nullptr, "a JobConfig not made by JobConfig::from");
  return *raw_;
}

// ---- ModelKeys -------------------------------------------------------------

const std::vector<std::string>& ModelKeys::names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto& k : config_schema()) {
      if (k.section == "model") out.push_back(k.dotted());
    }
    return out;
  }();
  return names;
}

const Config& ModelKeys::raw(const std::string& key) const {
  VIADUCT_ASSERT(raw_ != nullptr, "ModelKeys of a JobConfig not made by JobConfig::from");
  VIADUCT_ASSERT(key.rfind("model.", 0) == 0, "ModelKeys asked for '", key,
                 "', which is not a [model] key");
  return *raw_;
}

std::optional<int64_t> ModelKeys::get_int_opt(const std::string& key) const {
  return raw(key).get_int_opt(key);
}
std::optional<double> ModelKeys::get_float_opt(const std::string& key) const {
  return raw(key).get_float_opt(key);
}
std::optional<bool> ModelKeys::get_bool_opt(const std::string& key) const {
  return raw(key).get_bool_opt(key);
}
int64_t ModelKeys::get_int(const std::string& key) const { return raw(key).get_int(key); }
double ModelKeys::get_float(const std::string& key) const { return raw(key).get_float(key); }
bool ModelKeys::get_bool(const std::string& key) const { return raw(key).get_bool(key); }
bool ModelKeys::is_set(const std::string& key) const { return raw(key).is_set(key); }
bool ModelKeys::differs_from_default(const std::string& key) const {
  return raw(key).differs_from_default(key);
}
std::string ModelKeys::source(const std::string& key) const { return raw(key).source(key); }

}  // namespace viaduct
