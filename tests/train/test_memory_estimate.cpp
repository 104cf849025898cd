// The per-rank memory estimate (see Note [Activation memory estimate]) against
// a closed-form count of a small llama's shapes, taken from the built model.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "config/job_config.h"
#include "core/check.h"
#include "model/model.h"
#include "train/memory_estimate.h"
#include "train/plan_spec.h"

namespace viaduct {
namespace {

JobConfig llama_config(std::vector<std::string> extra = {}) {
  std::vector<std::string> o = {"model.family=llama", "model.flavor=debugmodel",
                                "model.n_layers=2", "model.dim=64", "model.n_heads=4",
                                "model.n_kv_heads=2", "training.seq_len=32",
                                "training.local_batch_size=8"};
  o.insert(o.end(), extra.begin(), extra.end());
  return JobConfig::parse("", "test", o);
}

pipeline::PipelinePlan plan_of(const JobConfig& cfg) {
  return pipeline::make_pipeline_plan(
      plan_spec_from_config(cfg.parallelism, model_module_fqns(cfg)));
}

// The shapes the closed form needs, read off the built model.
struct Shapes {
  double params = 0, dim = 0, kv = 0, hidden = 0, vocab = 0;
};

Shapes shapes_of(const JobConfig& cfg) {
  Shapes s;
  auto part = build_model_part(cfg);
  for (const auto& p : part->named_parameters()) {
    s.params += static_cast<double>(p.value().numel());
    if (p.key() == "tok_embeddings.weight") {
      s.vocab = static_cast<double>(p.value().size(0));
      s.dim = static_cast<double>(p.value().size(1));
    }
    if (p.key() == "layers.0.attention.wk.weight") s.kv = static_cast<double>(p.value().size(0));
    if (p.key() == "layers.0.feed_forward.w1.weight") {
      s.hidden = static_cast<double>(p.value().size(0));
    }
  }
  return s;
}

// Per layer and token: both norms' inputs and outputs, q, attention out, k,
// v, and SwiGLU's w1 x, w3 x and their product.
double llama_layer_values(const Shapes& s) { return 6 * s.dim + 2 * s.kv + 3 * s.hidden; }

TEST(MemoryEstimate, OneProcessLlamaMatchesClosedForm) {
  const auto cfg = llama_config({"parallelism.pipeline_parallel_microbatches=2"});
  const auto s = shapes_of(cfg);
  ASSERT_GT(s.kv, 0);
  ASSERT_GT(s.hidden, 0);
  const auto e =
      estimate_rank_memory(cfg, describe_model(cfg), plan_of(cfg), 0, at::kFloat, false);
  const double tokens = 8.0 / 2.0 * 32.0;  // one micro-batch at a time
  EXPECT_EQ(e.microbatches_in_flight, 1);
  EXPECT_DOUBLE_EQ(e.weights, 4 * s.params);
  EXPECT_DOUBLE_EQ(e.gradients, 4 * s.params);
  EXPECT_DOUBLE_EQ(e.optimizer, 8 * s.params);
  EXPECT_DOUBLE_EQ(e.activations, 2 * llama_layer_values(s) * tokens * 4);
  EXPECT_DOUBLE_EQ(e.loss, tokens * s.vocab * 8);  // plain loss on CPU
  // The backward's working set: one layer's values in full and the head's
  // fp32 weight gradient.
  EXPECT_DOUBLE_EQ(e.backward_transient,
                   llama_layer_values(s) * tokens * 4 + s.vocab * s.dim * 4);
  // bf16 halves the kept activations and adds the weight cache's bf16 copy
  // of every weight but the embedding.
  const auto b =
      estimate_rank_memory(cfg, describe_model(cfg), plan_of(cfg), 0, at::kBFloat16, false);
  EXPECT_DOUBLE_EQ(b.activations, e.activations / 2);
  EXPECT_DOUBLE_EQ(b.weights, 4 * s.params + 2 * (s.params - s.vocab * s.dim));
}

// Which parts are live together: gradients are freed after each step, so
// in one process with one micro-batch they peak after the activations are
// gone; with two micro-batches (or accumulated batches) the first one's
// gradients are live while the second one's activations are kept.
TEST(MemoryEstimate, PeakCountsThePartsLiveTogether) {
  auto estimate = [](const JobConfig& cfg) {
    return estimate_rank_memory(cfg, describe_model(cfg), plan_of(cfg), 0, at::kFloat, false);
  };
  const auto one = estimate(llama_config());
  EXPECT_FALSE(one.gradients_in_forward);
  const double forward = one.activations + std::max(one.loss, one.backward_transient);
  EXPECT_DOUBLE_EQ(one.total(), one.weights + one.optimizer + std::max(forward, one.gradients));
  EXPECT_LT(one.total(), one.weights + one.optimizer + one.gradients + forward);
  // Tiny activations: the gradients set the peak.
  const auto tiny = estimate(llama_config({"training.local_batch_size=1", "training.seq_len=2"}));
  EXPECT_DOUBLE_EQ(tiny.total(), tiny.weights + tiny.optimizer + tiny.gradients);
  for (const auto& extra : std::vector<std::vector<std::string>>{
           {"parallelism.pipeline_parallel_microbatches=2"},
           {"training.gradient_accumulation_steps=2"}}) {
    SCOPED_TRACE(extra[0]);
    const auto e = estimate(llama_config(extra));
    EXPECT_TRUE(e.gradients_in_forward);
    EXPECT_DOUBLE_EQ(e.total(), e.weights + e.optimizer + e.gradients + e.activations +
                                    std::max(e.loss, e.backward_transient));
  }
}

TEST(MemoryEstimate, OneF1BHoldsPpMinusRankMicrobatches) {
  // 2 layers on 2 ranks: stage 0 = embedding + layers.0, stage 1 = layers.1
  // + head. 1F1B with 4 micro-batches holds 2 on rank 0, 1 on rank 1.
  const auto cfg = llama_config({"parallelism.pipeline_parallel_degree=2",
                                 "parallelism.pipeline_parallel_schedule=1F1B",
                                 "parallelism.pipeline_parallel_microbatches=4"});
  const auto s = shapes_of(cfg);
  const auto info = describe_model(cfg);
  const auto plan = plan_of(cfg);
  const double tokens = 8.0 / 4.0 * 32.0;
  const auto r0 = estimate_rank_memory(cfg, info, plan, 0, at::kFloat, false);
  const auto r1 = estimate_rank_memory(cfg, info, plan, 1, at::kFloat, false);
  EXPECT_EQ(r0.microbatches_in_flight, 2);
  EXPECT_EQ(r1.microbatches_in_flight, 1);
  EXPECT_DOUBLE_EQ(r0.activations, 2 * llama_layer_values(s) * tokens * 4);
  EXPECT_DOUBLE_EQ(r1.activations, 1 * llama_layer_values(s) * tokens * 4);
  EXPECT_DOUBLE_EQ(r0.loss, 0);
  EXPECT_DOUBLE_EQ(r1.loss, tokens * s.vocab * 8);
  EXPECT_DOUBLE_EQ(r0.weights, 4 * s.params / 2);
}

TEST(MemoryEstimate, ChunkedLossHoldsOneChunk) {
  const auto cfg = llama_config({"model.loss_chunk_tokens=64"});
  const auto s = shapes_of(cfg);
  const auto e =
      estimate_rank_memory(cfg, describe_model(cfg), plan_of(cfg), 0, at::kFloat, false);
  EXPECT_DOUBLE_EQ(e.loss, 64 * s.vocab * 8);
}

// ZeRO-1 divides AdamW's moments over the dp ranks and nothing else.
TEST(MemoryEstimate, ShardedOptimizerIsTheUnshardedOneOverDp) {
  const auto whole = llama_config({"parallelism.data_parallel_degree=4"});
  const auto sharded = llama_config(
      {"parallelism.data_parallel_degree=4", "parallelism.dp_shard_optimizer=true"});
  const auto s = shapes_of(whole);
  const auto u = estimate_rank_memory(whole, describe_model(whole), plan_of(whole), 0,
                                      at::kFloat, false);
  const auto z = estimate_rank_memory(sharded, describe_model(sharded), plan_of(sharded), 0,
                                      at::kFloat, false);
  EXPECT_EQ(u.optimizer_shards, 1);
  EXPECT_EQ(z.optimizer_shards, 4);
  EXPECT_DOUBLE_EQ(u.optimizer, 8 * s.params);
  EXPECT_DOUBLE_EQ(z.optimizer, u.optimizer / 4);
  EXPECT_DOUBLE_EQ(z.weights, u.weights);
  EXPECT_DOUBLE_EQ(z.gradients, u.gradients);
  EXPECT_DOUBLE_EQ(z.activations, u.activations);
  EXPECT_DOUBLE_EQ(z.total(), u.total() - u.optimizer * 3 / 4);
  EXPECT_NE(describe_memory_estimate(z).find("sharded over 4 dp ranks"), std::string::npos);
  // SGD keeps no state to shard.
  const auto sgd = llama_config({"parallelism.data_parallel_degree=4",
                                 "parallelism.dp_shard_optimizer=true", "optimizer.name=SGD"});
  const auto g =
      estimate_rank_memory(sgd, describe_model(sgd), plan_of(sgd), 0, at::kFloat, false);
  EXPECT_DOUBLE_EQ(g.optimizer, 0);
  EXPECT_EQ(g.optimizer_shards, 1);
}

// A run that fits with less than a tenth to spare starts with a warning
// naming the share; one with room starts without it.
TEST(MemoryEstimate, WarnsNearTheLimit) {
  const auto cfg = llama_config();
  const auto e =
      estimate_rank_memory(cfg, describe_model(cfg), plan_of(cfg), 0, at::kFloat, false);
  testing::internal::CaptureStderr();
  EXPECT_NO_THROW(check_rank_memory_fits(cfg, 0, at::kFloat, false, e.total() / 0.95, "cpu"));
  const auto near = testing::internal::GetCapturedStderr();
  EXPECT_NE(near.find("is 95% of what cpu has"), std::string::npos) << near;
  EXPECT_NE(near.find("may still run out of memory"), std::string::npos) << near;
  testing::internal::CaptureStderr();
  EXPECT_NO_THROW(check_rank_memory_fits(cfg, 0, at::kFloat, false, e.total() / 0.8, "cpu"));
  const auto room = testing::internal::GetCapturedStderr();
  EXPECT_EQ(room.find("may still run out of memory"), std::string::npos) << room;
}

TEST(MemoryEstimate, RefusesWithFiguresAndKnobs) {
  const auto cfg = llama_config();
  const auto e = check_rank_memory_fits(cfg, 0, at::kFloat, false, 1e15, "cpu");
  // Exactly enough fits; a byte less does not.
  EXPECT_NO_THROW(check_rank_memory_fits(cfg, 0, at::kFloat, false, e.total(), "cpu"));
  try {
    check_rank_memory_fits(cfg, 0, at::kFloat, false, e.total() - 1, "cpu");
    FAIL() << "a run one byte over was accepted";
  } catch (const ConfigError& err) {
    const std::string m = err.what();
    for (const char* reference : {"cannot fit", "weights", "gradients", "optimizer", "activations",
                             "loss", "training.local_batch_size",
                             "parallelism.pipeline_parallel_degree", "model.flavor"}) {
      EXPECT_NE(m.find(reference), std::string::npos) << reference << " missing from: " << m;
    }
    EXPECT_EQ(m.find("dp_shard_optimizer"), std::string::npos) << "dp = 1: " << m;
  }
  // With dp > 1 and the moments whole, sharding them is one of the knobs.
  const auto dp2 = llama_config({"parallelism.data_parallel_degree=2"});
  try {
    check_rank_memory_fits(dp2, 0, at::kFloat, false, 1, "cpu");
    FAIL() << "a run over was accepted";
  } catch (const ConfigError& err) {
    const std::string m = err.what();
    EXPECT_NE(m.find("parallelism.dp_shard_optimizer = true"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace viaduct
