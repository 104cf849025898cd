// The FLOPs behind MFU, as a run's metrics.jsonl reports them: every
// accumulated batch, every data-parallel replica, and under block_causal
// each document piece (see Note [FLOPs of a step's documents]).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/process_runs.h"
#include "config/config.h"
#include "config/job_config.h"
#include "data/temp_dir.h"
#include "data/token_file.h"
#include "model/model.h"
#include "train/trainer.h"

namespace viaduct {
namespace {

namespace fs = std::filesystem;

std::vector<nlohmann::json> step_lines(const fs::path& file) {
  std::vector<nlohmann::json> out;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(std::move(j));
  }
  return out;
}

// Each step's `flops` counts flops_per_token per target token under causal;
// under block_causal each document piece of L tokens costs the
// outside-attention FLOPs per position plus the per-pair FLOPs times L^2.
// The data are documents of exactly 4 tokens, so every 32-token window (each
// starts on a multiple of 32) holds 8 whole pieces.
TEST(StepFlops, CountEveryBatchReplicaAndDocument) {
  data::testing::TempDir dir;
  const auto docs = (dir.path() / "docs.tok").string();
  {
    data::TokenFileWriter w(docs, 257, "byte", {256, data::DocumentMarker::Kind::kStarts});
    std::vector<int64_t> toks;
    for (int i = 0; i < 20000; ++i) toks.push_back(i % 4 == 0 ? 256 : 32 + (i * 7919) % 90);
    w.append(toks);
    w.finish();
  }
  const int64_t B = 4, accum = 2, T = 32, pieces = T / 4;
  const std::vector<std::string> common = {
      "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
      "training.seq_len=32", "training.local_batch_size=4", "training.steps=2",
      "training.gradient_accumulation_steps=2", "training.num_threads=1",
      "training.eval_interval=0", "metrics.progress_bar=false", "data.path=" + docs};
  auto run = [&](const std::string& mask) {
    auto o = common;
    o.push_back("model.attn_mask_type=" + mask);
    o.push_back("job.dump_folder=" + (dir.path() / mask).string());
    auto cfg = Config::parse("", "test", o);
    Trainer(cfg).run();
    return std::make_pair(describe_model(JobConfig::from(cfg)),
                          step_lines(dir.path() / mask / "metrics.jsonl"));
  };
  const auto [info, causal] = run("causal");
  ASSERT_EQ(causal.size(), 2u);
  for (const auto& j : causal) {
    ASSERT_TRUE(j.contains("flops")) << j.dump();
    EXPECT_EQ(j["tokens"].get<int64_t>(), B * accum * T);
    EXPECT_DOUBLE_EQ(j["flops"].get<double>(), info.flops_per_token * B * accum * T);
  }
  const double per_window = info.flops_per_token_outside_attention * T +
                            info.attention_flops_per_pair * pieces * 4 * 4;
  EXPECT_LT(per_window, info.flops_per_token * T);  // attention within documents only
  const auto block = run("block_causal").second;
  ASSERT_EQ(block.size(), 2u);
  for (const auto& j : block) {
    EXPECT_EQ(j["documents_per_window"].get<double>(), static_cast<double>(pieces));
    EXPECT_DOUBLE_EQ(j["flops"].get<double>(), B * accum * per_window);
  }
  // Two data-parallel replicas over `viaduct launch`: twice the windows,
  // twice the FLOPs.
  std::string args = " train --model.attn_mask_type=block_causal"
                     " --parallelism.data_parallel_degree=2";
  for (const auto& o : common) args += " --" + o;
  const auto dp_out = dir.path() / "dp2";
  viaduct::testing::run_viaduct_ok(2, args + " --job.dump_folder=" + dp_out.string());
  const auto dp = step_lines(dp_out / "metrics.jsonl");
  ASSERT_EQ(dp.size(), 2u);
  for (const auto& j : dp) EXPECT_DOUBLE_EQ(j["flops"].get<double>(), 2 * B * accum * per_window);
}

}  // namespace
}  // namespace viaduct
