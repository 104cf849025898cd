// JobConfig (config/job_config.h) against the raw store it is built from:
// every schema key has one typed field (or, for a family's [model] keys, a
// ModelKeys read), and each holds what the raw getter returns, for the
// defaults and for a config that sets every key to a value of its own.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <optional>

#include "config/config.h"
#include "config/job_config.h"
#include "core/check.h"

using namespace viaduct;

namespace {

ConfigValue v(int64_t x) { return x; }
ConfigValue v(double x) { return x; }
ConfigValue v(bool x) { return x; }
ConfigValue v(const std::string& x) { return x; }
ConfigValue v(const StringList& x) { return x; }
ConfigValue v(const StringListList& x) { return x; }
ConfigValue v(const FloatList& x) { return x; }
template <typename T>
ConfigValue v(const std::optional<T>& x) {
  return x ? v(*x) : ConfigValue{};
}

using Field = std::function<ConfigValue(const JobConfig&)>;

// A [model] key the family parses: read through ModelKeys by its type.
Field model_key(ConfigType type, const std::string& key) {
  switch (type) {
    case ConfigType::kInt:
      return [key](const JobConfig& j) { return v(j.model.keys.get_int_opt(key)); };
    case ConfigType::kFloat:
      return [key](const JobConfig& j) { return v(j.model.keys.get_float_opt(key)); };
    case ConfigType::kBool:
      return [key](const JobConfig& j) { return v(j.model.keys.get_bool_opt(key)); };
    default:
      return nullptr;
  }
}

// Dotted key -> its typed field. The [model] keys other than the ones
// ModelSection types are added from the schema (model_key).
const std::map<std::string, Field>& typed_fields() {
  static const std::map<std::string, Field> fields = [] {
    std::map<std::string, Field> f{
#define FIELD(section, name) \
  {#section "." #name, [](const JobConfig& j) { return v(j.section.name); }}
        FIELD(job, dump_folder),
        FIELD(job, description),
        FIELD(job, log_level),
        FIELD(training, steps),
        FIELD(training, seed),
        FIELD(training, local_batch_size),
        FIELD(training, seq_len),
        FIELD(training, gradient_accumulation_steps),
        FIELD(training, max_norm),
        FIELD(training, dtype),
        FIELD(training, device),
        FIELD(training, deterministic),
        FIELD(training, cuda_graphs),
        FIELD(training, num_threads),
        FIELD(training, eval_interval),
        FIELD(optimizer, name),
        FIELD(optimizer, lr),
        FIELD(optimizer, beta1),
        FIELD(optimizer, beta2),
        FIELD(optimizer, eps),
        FIELD(optimizer, weight_decay),
        FIELD(lr_scheduler, warmup_steps),
        FIELD(lr_scheduler, decay_type),
        FIELD(lr_scheduler, min_lr_factor),
        FIELD(checkpoint, enable),
        FIELD(checkpoint, folder),
        FIELD(checkpoint, interval),
        FIELD(checkpoint, keep_latest_k),
        FIELD(checkpoint, resume),
        FIELD(checkpoint, move_old_run_aside),
        FIELD(checkpoint, resume_with_new_optimizer),
        FIELD(checkpoint, save_initial),
        FIELD(checkpoint, save_final),
        FIELD(checkpoint, async_mode),
        FIELD(checkpoint, initial_load_path),
        FIELD(checkpoint, initial_load_in_hf),
        FIELD(checkpoint, initial_load_model_only),
        FIELD(checkpoint, exclude_from_loading),
        FIELD(checkpoint, last_save_in_hf),
        FIELD(metrics, log_freq),
        FIELD(metrics, enable_jsonl),
        FIELD(metrics, progress_bar),
        FIELD(metrics, pipeline_timing),
        FIELD(metrics, profile_step),
        FIELD(metrics, profile_host_ops),
        FIELD(metrics, loss_spike_factor),
        FIELD(activation_checkpoint, mode),
        FIELD(activation_checkpoint, selective_ac_option),
        FIELD(model, family),
        FIELD(model, flavor),
        FIELD(model, cuda_kernels),
        FIELD(model, swiglu_recompute),
        FIELD(model, moe_capacity_factor),
        FIELD(model, attn_mask_type),
        FIELD(model, reset_position_ids),
        FIELD(data, path),
        FIELD(data, paths),
        FIELD(data, weights),
        FIELD(data, val_path),
        FIELD(data, format),
        FIELD(data, shuffle),
        FIELD(data, eval_batches),
        FIELD(data, tokenizer),
        FIELD(parallelism, pipeline_parallel_degree),
        FIELD(parallelism, pipeline_parallel_schedule),
        FIELD(parallelism, pipeline_parallel_schedule_csv),
        FIELD(parallelism, pipeline_parallel_layers_per_stage),
        FIELD(parallelism, pipeline_parallel_stages_per_rank),
        FIELD(parallelism, pipeline_parallel_first_stage_less_layers),
        FIELD(parallelism, pipeline_parallel_last_stage_less_layers),
        FIELD(parallelism, pipeline_parallel_balance),
        FIELD(parallelism, module_fqns_per_model_part),
        FIELD(parallelism, pipeline_parallel_microbatches),
        FIELD(parallelism, data_parallel_degree),
        FIELD(parallelism, expert_parallel_degree),
        FIELD(parallelism, expert_gradient_sum),
        FIELD(parallelism, comm_timeout_seconds),
        FIELD(parallelism, dp_bucket_mb),
        FIELD(parallelism, dp_shard_optimizer),
        FIELD(parallelism, attn_res_cache),
        FIELD(parallelism, attn_res_cache_backward),
        FIELD(parallelism, attn_res_cache_offload),
#undef FIELD
    };
    for (const auto& k : config_schema()) {
      if (k.section == "model" && !f.count(k.dotted())) f[k.dotted()] = model_key(k.type, k.dotted());
    }
    return f;
  }();
  return fields;
}

// What the raw getter returns for `k` (monostate: unset).
ConfigValue raw_value(const Config& c, const ConfigKey& k) {
  const auto key = k.dotted();
  switch (k.type) {
    case ConfigType::kInt: return v(c.get_int_opt(key));
    case ConfigType::kFloat: return v(c.get_float_opt(key));
    case ConfigType::kBool: return v(c.get_bool_opt(key));
    default: break;
  }
  // The other types always have a default, but module_fqns_per_model_part.
  if (!c.is_set(key) && std::holds_alternative<std::monostate>(k.default_value)) return {};
  switch (k.type) {
    case ConfigType::kString: return c.get_string(key);
    case ConfigType::kStringList: return c.get_string_list(key);
    case ConfigType::kStringListList: return c.get_string_list_list(key);
    case ConfigType::kFloatList: return c.get_float_list(key);
    default: return {};
  }
}

void expect_fields_match(const Config& c) {
  const auto j = JobConfig::from(c);
  for (const auto& k : config_schema()) {
    const auto it = typed_fields().find(k.dotted());
    ASSERT_NE(it, typed_fields().end()) << k.dotted() << " has no JobConfig field";
    ASSERT_TRUE(it->second) << k.dotted() << " has no JobConfig field of its type";
    EXPECT_TRUE(it->second(j) == raw_value(c, k)) << k.dotted();
  }
}

// A value of its own for the i-th key, never the key's default; bools
// alternate by `round` so that two bool fields read from each other's keys
// differ in one round.
ConfigValue own_value(const ConfigKey& k, size_t i, int round) {
  const auto n = static_cast<int64_t>(i);
  switch (k.type) {
    case ConfigType::kInt: return int64_t{1000 + n};
    case ConfigType::kFloat: return 0.25 + static_cast<double>(n);
    case ConfigType::kBool: {
      const auto* d = std::get_if<bool>(&k.default_value);
      const bool flip = round == 0 || (i % 2 == 0);
      return d ? (flip ? !*d : *d) : ConfigValue{(i + static_cast<size_t>(round)) % 2 == 0};
    }
    case ConfigType::kString: return str("value-", i);
    case ConfigType::kStringList: return StringList{str("a", i), str("b", i)};
    case ConfigType::kStringListList: return StringListList{{str("x", i)}, {str("y", i)}};
    case ConfigType::kFloatList: return FloatList{0.5 + static_cast<double>(n), 2.0};
  }
  return {};
}

}  // namespace

TEST(JobConfig, EverySchemaKeyHasOneField) {
  size_t schema_keys = 0;
  for (const auto& k : config_schema()) {
    ++schema_keys;
    EXPECT_TRUE(typed_fields().count(k.dotted())) << k.dotted();
  }
  // No field for a key the schema does not have.
  EXPECT_EQ(typed_fields().size(), schema_keys);
}

TEST(JobConfig, DefaultsEqualTheRawGetters) { expect_fields_match(Config()); }

TEST(JobConfig, EveryKeySetEqualsTheRawGetters) {
  for (int round = 0; round < 2; ++round) {
    Config c;
    size_t i = 0;
    // Config::set checks the type only: every key at once, even those the
    // cross-field checks would not take together.
    for (const auto& k : config_schema()) c.set(k.dotted(), own_value(k, i++, round));
    SCOPED_TRACE(round);
    expect_fields_match(c);
  }
}

TEST(JobConfig, ParsedConfigKeepsSourcesAndText) {
  const auto c = Config::parse("[lr_scheduler]\nwarmup_steps = 50\n[model]\ndim = 64\n",
                               "job.toml", {"training.steps=10", "model.n_layers=3"});
  const auto j = JobConfig::from(c);
  EXPECT_EQ(j.lr_scheduler.warmup_steps, 10);  // clamped to training.steps at load
  EXPECT_EQ(j.source("training.steps"), "the command line");
  EXPECT_EQ(j.source("model.dim"), "job.toml");
  EXPECT_EQ(j.model.keys.source("model.n_layers"), "the command line");
  EXPECT_EQ(j.model.keys.get_int_opt("model.dim").value_or(0), 64);
  EXPECT_TRUE(j.model.keys.is_set("model.dim"));
  EXPECT_FALSE(j.model.keys.get_int_opt("model.n_heads").has_value());
  EXPECT_EQ(j.origin(), "job.toml");
  EXPECT_EQ(j.to_toml(), c.to_toml());
  // A copy is a value: changing its sections leaves the original alone.
  auto k = j;
  k.activation_checkpoint.mode = "full";
  EXPECT_EQ(j.activation_checkpoint.mode, "none");
  EXPECT_EQ(JobConfig::defaults().training.steps, Config().get_int("training.steps"));
}

TEST(JobConfig, ModelKeysAnswerModelKeysOnly) {
  const auto j = JobConfig::defaults();
  EXPECT_THROW(j.model.keys.get_int("training.seq_len"), Error);
  EXPECT_THROW(j.model.keys.is_set("parallelism.data_parallel_degree"), Error);
  EXPECT_EQ(j.model.keys.get_int("model.rope_scaling_original_max_seq_len"), 8192);
  // A key with no default that the config leaves unset: the flavor decides.
  EXPECT_THROW(j.model.keys.get_int("model.dim"), ConfigError);
  for (const auto& name : ModelKeys::names()) EXPECT_EQ(name.rfind("model.", 0), 0u) << name;
  EXPECT_FALSE(ModelKeys::names().empty());
}
