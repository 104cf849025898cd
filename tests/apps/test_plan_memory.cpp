// `viaduct plan`'s memory accounting against its reference, the memory
// estimate (see Note [Activation memory estimate]) computed here from the same
// config: every family and layout, each pp rank's figures with the config's
// activation checkpointing and with none and full, ZeRO-1's optimizer share,
// and the plan's totals beside the measured peaks in metrics.jsonl.
#include <gtest/gtest.h>

#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/process_runs.h"
#include "common/reference_cache.h"
#include "config/job_config.h"
#include "data/temp_dir.h"
#include "model/family.h"
#include "model/model.h"
#include "train/memory_estimate.h"
#include "train/plan_spec.h"

namespace viaduct {
namespace {

using testing::shell;

// A config file and its overrides ("section.key=value"), as the command
// line gives them. The device and dtype are explicit, so the reference does
// not depend on the machine.
struct PlanCase {
  std::string name;
  std::string config;
  std::vector<std::string> overrides;
};

std::vector<std::string> with(std::vector<std::string> o, const std::vector<std::string>& extra) {
  o.insert(o.end(), extra.begin(), extra.end());
  o.insert(o.end(), {"training.device=cpu", "training.dtype=float32"});
  return o;
}

std::string command_line(const PlanCase& c, const std::string& extra = "") {
  std::string cmd = std::string(VIADUCT_BINARY) + " plan --config " + c.config;
  for (const auto& o : c.overrides) cmd += " --" + o;
  return cmd + extra;
}

// The JSON line (the last: config warnings on stderr come first).
nlohmann::json plan_json(const PlanCase& c) {
  const auto r = shell(command_line(c, " --json"));
  EXPECT_EQ(r.exit_code, 0) << command_line(c, " --json") << "\n" << r.output;
  if (r.exit_code != 0) return nlohmann::json();
  const auto end = r.output.find_last_not_of('\n');
  const auto begin = r.output.rfind('\n', end);
  return nlohmann::json::parse(
      r.output.substr(begin == std::string::npos ? 0 : begin + 1, end + 1));
}

// The reference: every pp rank's estimate for the config plus `extra`, the
// model described and the plan made as the trainer's rank model makes them.
std::vector<MemoryEstimate> reference_estimates(const PlanCase& c,
                                      const std::vector<std::string>& extra = {}) {
  auto o = c.overrides;
  o.insert(o.end(), extra.begin(), extra.end());
  const auto cfg = JobConfig::load(c.config, o);
  const auto info = describe_model(cfg);
  auto spec = plan_spec_from_config(cfg.parallelism, model_module_fqns(cfg));
  spec.module_flops = info.module_flops;
  const auto plan = pipeline::make_pipeline_plan(spec);
  std::vector<MemoryEstimate> out;
  for (int64_t r = 0; r < plan.split.pp; ++r) {
    out.push_back(estimate_rank_memory(cfg, info, plan, r, at::kFloat, /*on_cuda=*/false));
  }
  return out;
}

const char* const kLlama = "configs/llama_debug.toml";
const char* const kGpt2 = "configs/gpt2_debug.toml";
const char* const kKimi = "configs/kimi_k3_debug.toml";

std::vector<PlanCase> plan_cases() {
  const std::vector<std::string> pp2 = {"parallelism.pipeline_parallel_degree=2",
                                        "parallelism.pipeline_parallel_microbatches=4"};
  return {
      {"llama_one_process", kLlama, with({}, {})},
      {"llama_pp2_1F1B_selective", kLlama,
       with(pp2, {"parallelism.pipeline_parallel_schedule=1F1B",
                  "activation_checkpoint.mode=selective"})},
      {"llama_pp2_zero_bubble_full", kLlama,
       with(pp2, {"parallelism.pipeline_parallel_schedule=InterleavedZeroBubble",
                  "parallelism.pipeline_parallel_stages_per_rank=2",
                  "activation_checkpoint.mode=full"})},
      {"gpt2_pp2_GPipe", kGpt2,
       with(pp2, {"parallelism.pipeline_parallel_schedule=GPipe", "model.tie_embeddings=false"})},
      {"kimi_k3_pp2_interleaved", kKimi,
       with(pp2, {"parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                  "parallelism.pipeline_parallel_stages_per_rank=2",
                  "parallelism.data_parallel_degree=2"})},
      {"exact16_pp4", kKimi,
       with({"model.family=exact16", "parallelism.pipeline_parallel_degree=4",
             "parallelism.pipeline_parallel_microbatches=4", "training.seq_len=16"},
            {})},
  };
}

class PlanMemory : public ::testing::TestWithParam<PlanCase> {};

// Each pp rank's figures are the estimate's, for the config's checkpointing
// and for none and full; AttnRes sections only for AttnRes families.
TEST_P(PlanMemory, PerRankFiguresAreTheEstimate) {
  const auto& c = GetParam();
  const auto j = plan_json(c);
  ASSERT_TRUE(j.is_object());
  const auto reference = reference_estimates(c);
  const auto none = reference_estimates(c, {"activation_checkpoint.mode=none"});
  const auto full = reference_estimates(c, {"activation_checkpoint.mode=full"});
  const auto cfg = JobConfig::load(c.config, c.overrides);
  EXPECT_EQ(j["family"].get<std::string>(), cfg.model.family);
  EXPECT_EQ(j["dtype"].get<std::string>(), "float32");
  EXPECT_EQ(j["device"].get<std::string>(), "cpu");
  const bool attn_res = attn_res_layout(cfg).has_value();
  EXPECT_EQ(j["attn_res"].get<bool>(), attn_res);
  EXPECT_EQ(j.contains("hops"), attn_res);
  ASSERT_EQ(j["ranks"].size(), reference.size());
  for (size_t r = 0; r < reference.size(); ++r) {
    SCOPED_TRACE("pp rank " + std::to_string(r));
    const auto& m = j["ranks"][r]["memory"];
    const auto& e = reference[r];
    EXPECT_DOUBLE_EQ(m["weights"].get<double>(), e.weights);
    EXPECT_DOUBLE_EQ(m["gradients"].get<double>(), e.gradients);
    EXPECT_DOUBLE_EQ(m["optimizer"].get<double>(), e.optimizer);
    EXPECT_DOUBLE_EQ(m["activations"].get<double>(), e.activations);
    EXPECT_DOUBLE_EQ(m["loss"].get<double>(), e.loss);
    EXPECT_DOUBLE_EQ(m["backward_working_set"].get<double>(), e.backward_transient);
    EXPECT_EQ(m["gradients_live_in_forward"].get<bool>(), e.gradients_in_forward);
    EXPECT_DOUBLE_EQ(m["total"].get<double>(), e.total());
    EXPECT_EQ(m["microbatches_in_flight"].get<int64_t>(), e.microbatches_in_flight);
    EXPECT_EQ(m["tokens_per_microbatch"].get<int64_t>(), e.tokens_per_microbatch);
    EXPECT_DOUBLE_EQ(m["activations_ac_none"].get<double>(), none[r].activations);
    EXPECT_DOUBLE_EQ(m["activations_ac_full"].get<double>(), full[r].activations);
    EXPECT_DOUBLE_EQ(m["total_ac_none"].get<double>(), none[r].total());
    EXPECT_DOUBLE_EQ(m["total_ac_full"].get<double>(), full[r].total());
    // Full checkpointing never keeps more than none (under a split backward
    // the recomputed layers live from I to W and count in full).
    EXPECT_LE(full[r].activations, none[r].activations);
  }
  // The text form prints the same table without an error.
  const auto text = shell(command_line(c));
  ASSERT_EQ(text.exit_code, 0) << text.output;
  for (const char* reference_text : {"memory per pp rank", "weights", "gradients", "optimizer",
                                "activations", "loss", "bwd work", "peak", "none / full"}) {
    EXPECT_NE(text.output.find(reference_text), std::string::npos) << reference_text << "\n"
                                                              << text.output;
  }
  EXPECT_EQ(text.output.find("AttnRes") != std::string::npos, attn_res) << text.output;
  std::printf("[plan] %s\n%s", c.name.c_str(), text.output.c_str());
}

INSTANTIATE_TEST_SUITE_P(Families, PlanMemory, ::testing::ValuesIn(plan_cases()),
                         [](const ::testing::TestParamInfo<PlanCase>& i) { return i.param.name; });

// ZeRO-1: the optimizer figure is the unsharded one / dp on every rank, the
// rest unchanged, and the text says the state is sharded.
TEST(PlanMemoryOptimizer, ShardedOptimizerIsTheUnshardedOneOverDp) {
  const std::vector<std::string> layout = {"parallelism.pipeline_parallel_degree=2",
                                           "parallelism.pipeline_parallel_microbatches=4",
                                           "parallelism.data_parallel_degree=4"};
  const PlanCase whole{"whole", kLlama, with(layout, {})};
  const PlanCase sharded{"sharded", kLlama, with(layout, {"parallelism.dp_shard_optimizer=true"})};
  const auto u = plan_json(whole), z = plan_json(sharded);
  ASSERT_TRUE(u.is_object() && z.is_object());
  EXPECT_FALSE(u["optimizer_sharded"].get<bool>());
  EXPECT_TRUE(z["optimizer_sharded"].get<bool>());
  EXPECT_EQ(z["optimizer_shards"].get<int64_t>(), 4);
  ASSERT_EQ(u["ranks"].size(), 2u);
  ASSERT_EQ(z["ranks"].size(), 2u);
  for (size_t r = 0; r < 2; ++r) {
    const auto& a = u["ranks"][r]["memory"];
    const auto& b = z["ranks"][r]["memory"];
    EXPECT_GT(a["optimizer"].get<double>(), 0.0);
    EXPECT_DOUBLE_EQ(b["optimizer"].get<double>(), a["optimizer"].get<double>() / 4);
    for (const char* k : {"weights", "gradients", "activations", "loss"}) {
      EXPECT_DOUBLE_EQ(b[k].get<double>(), a[k].get<double>()) << k;
    }
  }
  const auto text = shell(command_line(sharded));
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("sharded over 4 dp ranks"), std::string::npos) << text.output;
  const auto plain = shell(command_line(whole));
  EXPECT_NE(plain.output.find("not sharded"), std::string::npos) << plain.output;
}

// A pipeline run writes each pp rank's plan total beside the measured peaks:
// the figures `viaduct plan` prints for the same config.
TEST(PlanMemoryMetrics, PipelineRunCarriesThePlanTotalsPerRank) {
  data::testing::TempDir dir;
  const auto corpus = testing::cached_corpus(2468);
  const std::vector<std::string> o = {
      "model.n_layers=2",          "model.dim=32",
      "model.n_heads=4",           "model.n_kv_heads=2",
      "training.seq_len=16",       "training.local_batch_size=8",
      "training.steps=2",          "lr_scheduler.warmup_steps=1",
      "training.num_threads=1",
      "training.eval_interval=0",  "metrics.progress_bar=false",
      "checkpoint.enable=false",   "parallelism.pipeline_parallel_degree=2",
      "parallelism.pipeline_parallel_schedule=1F1B",
      "parallelism.pipeline_parallel_microbatches=4",
      "data.path=" + corpus,       "job.dump_folder=" + (dir.path() / "out").string()};
  const PlanCase c{"pp2", kLlama, with(o, {})};
  std::string args = " train --config " + c.config;
  for (const auto& x : c.overrides) args += " --" + x;
  testing::run_viaduct_ok(2, args);
  const auto steps = testing::step_metrics((dir.path() / "out").string());
  ASSERT_EQ(steps.size(), 2u);
  const auto reference = reference_estimates(c);
  const auto plan = plan_json(c);
  ASSERT_EQ(plan["ranks"].size(), 2u);
  for (const auto& j : steps) {
    SCOPED_TRACE(j.dump());
    ASSERT_TRUE(j.contains("plan_memory_bytes_per_rank"));
    ASSERT_EQ(j["plan_memory_bytes_per_rank"].size(), 2u);
    for (size_t r = 0; r < 2; ++r) {
      EXPECT_DOUBLE_EQ(j["plan_memory_bytes_per_rank"][r].get<double>(), reference[r].total());
      EXPECT_DOUBLE_EQ(j["plan_memory_bytes_per_rank"][r].get<double>(),
                       plan["ranks"][r]["memory"]["total"].get<double>());
    }
    // Rank 0 writes the line: its own figure beside its own peak.
    EXPECT_DOUBLE_EQ(j["plan_memory_bytes"].get<double>(), reference[0].total());
    EXPECT_TRUE(j.contains("peak_memory_bytes_per_rank"));
  }
}

}  // namespace
}  // namespace viaduct
