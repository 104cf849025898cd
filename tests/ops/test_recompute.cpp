// Activation checkpointing (see Note [Activation checkpointing], ops/recompute.h)
// against the run without it: llama, gpt2 and kimi_k3 debug models train a
// few steps in one process and as a chain of pipeline stages under plain
// backward and zero-bubble's I/W split, with mode none, full, selective
// every N-th layer and selective per op ("op": see Note [Per-op activation
// checkpointing]); losses, every gradient, the MoE load counters and every
// parameter must be the same bits. Also: checkpointing keeps fewer bytes
// after the forward ("op" between none and full), "op" recomputes none of
// the expensive ops, the memory estimate follows the mode, and the config
// refuses what it does not support.
#include <gtest/gtest.h>
#include <malloc.h>

#include <iostream>
#include <string>
#include <vector>

#include "config/job_config.h"
#include "core/check.h"
#include "model/model.h"
#include "ops/recompute.h"
#include "pipeline/runtime/stage.h"
#include "train/memory_estimate.h"
#include "train/plan_spec.h"

namespace viaduct {
namespace {

constexpr int64_t kBatch = 4, kSeq = 16, kSteps = 3, kMicro = 2;

std::vector<std::string> family_args(const std::string& family) {
  if (family == "kimi_k3") {
    // 6 layers in blocks of 2 (reads of several blocks), MLA at layers 2
    // and 5, MoE after the first (bias updates on).
    return {"model.family=kimi_k3", "model.flavor=debugmodel", "model.n_layers=6",
            "model.attn_res_block_size=2", "model.mla_interval=3", "model.dim=32",
            "model.n_heads=2", "model.kda_head_dim=16", "model.moe_hidden_dim=32",
            "model.ffn_hidden_dim=64", "model.moe_bias_update_rate=0.01"};
  }
  std::vector<std::string> a = {"model.family=" + family, "model.flavor=debugmodel",
                                "model.n_layers=4", "model.dim=32", "model.n_heads=4",
                                "model.tie_embeddings=false"};
  if (family == "llama") a.push_back("model.n_kv_heads=2");
  return a;
}

JobConfig make_config(const std::string& family, const std::vector<std::string>& extra) {
  auto o = family_args(family);
  auto set = [&](const std::string& key) {
    for (const auto& e : extra) {
      if (e.rfind(key + "=", 0) == 0) return true;
    }
    return false;
  };
  if (!set("training.seq_len")) o.push_back("training.seq_len=" + std::to_string(kSeq));
  if (!set("training.local_batch_size")) {
    o.push_back("training.local_batch_size=" + std::to_string(kBatch));
  }
  o.insert(o.end(), extra.begin(), extra.end());
  return JobConfig::parse("", "test", o);
}

// What a run leaves to compare: per step the loss, every gradient and the
// replica statistics (MoE tokens per expert); at the end every parameter.
struct Run {
  std::vector<at::Tensor> losses;
  std::vector<std::vector<at::Tensor>> grads, stats;
  std::vector<at::Tensor> params;
};

void expect_same_bits(const Run& a, const Run& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  for (size_t s = 0; s < a.losses.size(); ++s) {
    EXPECT_TRUE(at::equal(a.losses[s], b.losses[s]))
        << what << ": step " << s << " loss " << a.losses[s].item<double>() << " vs "
        << b.losses[s].item<double>();
    ASSERT_EQ(a.grads[s].size(), b.grads[s].size()) << what;
    for (size_t i = 0; i < a.grads[s].size(); ++i) {
      ASSERT_EQ(a.grads[s][i].defined(), b.grads[s][i].defined()) << what << ": grad " << i;
      if (a.grads[s][i].defined()) {
        EXPECT_TRUE(at::equal(a.grads[s][i], b.grads[s][i]))
            << what << ": step " << s << " gradient " << i;
      }
    }
    ASSERT_EQ(a.stats[s].size(), b.stats[s].size()) << what;
    for (size_t i = 0; i < a.stats[s].size(); ++i) {
      EXPECT_TRUE(at::equal(a.stats[s][i], b.stats[s][i]))
          << what << ": step " << s << " MoE counter " << i;
    }
  }
  ASSERT_EQ(a.params.size(), b.params.size()) << what;
  for (size_t i = 0; i < a.params.size(); ++i) {
    EXPECT_TRUE(at::equal(a.params[i], b.params[i])) << what << ": parameter " << i;
  }
}

// Byte-tokenizer ids: (tokens, targets), each [B, T].
std::pair<at::Tensor, at::Tensor> batch(int64_t step, int64_t B = kBatch, int64_t T = kSeq) {
  torch::manual_seed(1000 + static_cast<uint64_t>(step));
  auto seq = at::randint(0, 256, {B, T + 1}, at::kLong);
  return {seq.narrow(1, 0, T).contiguous(), seq.narrow(1, 1, T).contiguous()};
}

// An SGD step and the after-step hook (MoE bias updates), the same in
// every run.
void sgd_step(const std::vector<std::shared_ptr<ModelPart>>& parts) {
  torch::NoGradGuard no_grad;
  for (auto& part : parts) {
    for (auto& p : part->parameters()) {
      if (p.grad().defined()) p.sub_(p.grad() * 0.05);
    }
    part->after_optimizer_step();
  }
}

void record_step(const std::vector<std::shared_ptr<ModelPart>>& parts, Run& run) {
  std::vector<at::Tensor> grads, stats;
  for (auto& part : parts) {
    for (auto& p : part->parameters()) {
      grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
      p.mutable_grad() = at::Tensor();
    }
    for (auto& s : part->replica_statistics()) stats.push_back(s.clone());
  }
  run.grads.push_back(grads);
  run.stats.push_back(stats);
}

void record_params(const std::vector<std::shared_ptr<ModelPart>>& parts, Run& run) {
  for (auto& part : parts) {
    for (auto& p : part->parameters()) run.params.push_back(p.detach().clone());
  }
}

// The whole model in one process, micro-batches one after another; on
// `device` with activations in `dtype` when given (the weights stay fp32).
Run train_one_process(const JobConfig& cfg, const at::Device& device = at::kCPU,
                      at::ScalarType dtype = at::kFloat) {
  auto part = build_model_part(cfg);
  part->init_weights(7);
  part->to(device);
  part->set_compute_dtype(dtype);
  Run run;
  const double scale = 1.0 / static_cast<double>(kBatch * kSeq);
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [tokens, targets] = batch(step);
    tokens = tokens.to(device);
    targets = targets.to(device);
    at::Tensor loss = at::zeros({}, at::kDouble);
    for (int64_t mb = 0; mb < kMicro; ++mb) {
      const auto rows = kBatch / kMicro;
      auto l = part->forward_loss({tokens.narrow(0, mb * rows, rows)},
                                  targets.narrow(0, mb * rows, rows));
      loss += l.detach().to(at::kCPU, at::kDouble);
      (l * scale).backward();
    }
    run.losses.push_back(loss.cpu());
    record_step({part}, run);
    sgd_step({part});
  }
  record_params({part}, run);
  return run;
}

enum class Backward { kPlain, kZeroBubble };

// The model as a chain of pipeline stages in one process (as one rank
// holding every stage): forwards of every micro-batch, then backward --
// plain B per stage, or zero-bubble's I for each micro-batch and stage and
// the W of each afterwards.
Run train_stages(const JobConfig& cfg, int64_t n_stages, Backward how) {
  const auto fqns = model_module_fqns(cfg);
  // Cut the layers evenly; pinned modules ride with the ends.
  std::vector<std::string> layers;
  for (const auto& m : fqns) {
    if (m.rfind("layers.", 0) == 0) layers.push_back(m);
  }
  const auto per = static_cast<int64_t>(layers.size()) / n_stages;
  std::vector<std::vector<std::string>> stage_fqns(static_cast<size_t>(n_stages));
  bool seen_layer = false;
  for (const auto& m : fqns) {
    if (m.rfind("layers.", 0) == 0) {
      seen_layer = true;
      const int64_t id = std::stoll(m.substr(7));
      stage_fqns[static_cast<size_t>(std::min(n_stages - 1, id / per))].push_back(m);
    } else {
      stage_fqns[seen_layer ? static_cast<size_t>(n_stages - 1) : 0].push_back(m);
    }
  }
  std::vector<std::shared_ptr<ModelPart>> parts;
  std::vector<std::unique_ptr<pipeline::PipelineStage>> stages;
  for (int64_t s = 0; s < n_stages; ++s) {
    parts.push_back(build_model_part(cfg, stage_fqns[static_cast<size_t>(s)]));
    parts.back()->init_weights(7);
    stages.push_back(std::make_unique<pipeline::PipelineStage>(s, n_stages, parts.back()));
  }
  Run run;
  const double scale = 1.0 / static_cast<double>(kBatch * kSeq);
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [tokens, targets] = batch(step);
    const auto rows = kBatch / kMicro;
    for (int64_t mb = 0; mb < kMicro; ++mb) {
      Activations x{tokens.narrow(0, mb * rows, rows)};
      for (auto& st : stages) {
        x = st->forward(mb, x, targets.narrow(0, mb * rows, rows), scale);
      }
    }
    at::Tensor loss = at::zeros({}, at::kDouble);
    for (int64_t mb = 0; mb < kMicro; ++mb) {
      loss += stages.back()->loss_sum(mb);
      Activations g;
      for (auto it = stages.rbegin(); it != stages.rend(); ++it) {
        g = how == Backward::kPlain ? (*it)->backward(mb, g) : (*it)->backward_input(mb, g);
      }
    }
    if (how == Backward::kZeroBubble) {
      for (int64_t mb = 0; mb < kMicro; ++mb) {
        for (auto it = stages.rbegin(); it != stages.rend(); ++it) (*it)->backward_weight(mb);
      }
    }
    for (auto& st : stages) EXPECT_EQ(st->live_microbatches(), 0u);
    run.losses.push_back(loss);
    record_step(parts, run);
    sgd_step(parts);
  }
  record_params(parts, run);
  return run;
}

const std::vector<std::vector<std::string>> kModes = {
    {"activation_checkpoint.mode=full"},
    {"activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=2"},
    {"activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=3"},
    {"activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=op"}};
const std::vector<std::string>& kOp = kModes[3];

std::string mode_name(const std::vector<std::string>& m) {
  if (m.empty()) return "none";
  return m.size() == 1 ? m[0] : m[0] + " " + m[1];
}

class ActivationCheckpointFamilies : public ::testing::TestWithParam<std::string> {};

TEST_P(ActivationCheckpointFamilies, OneProcessTrainsToTheBitsOfNoCheckpointing) {
  const auto reference = train_one_process(make_config(GetParam(), {}));
  for (const auto& mode : kModes) {
    expect_same_bits(reference, train_one_process(make_config(GetParam(), mode)), mode_name(mode));
  }
}

TEST_P(ActivationCheckpointFamilies, StagesUnderPlainAndZeroBubbleBackwardMatchBitwise) {
  // Three stages: layers split 2 / 2 / 2 (k3: each stage opens a block) or
  // 1 / 1 / 2; the references are the same stages without checkpointing.
  for (auto how : {Backward::kPlain, Backward::kZeroBubble}) {
    const auto reference = train_stages(make_config(GetParam(), {}), 3, how);
    for (const auto& mode : kModes) {
      expect_same_bits(reference, train_stages(make_config(GetParam(), mode), 3, how),
                       mode_name(mode) + (how == Backward::kPlain ? " plain" : " I/W"));
    }
  }
  // And the zero-bubble split with checkpointing equals one process,
  // recomputing each layer once per micro-batch: I keeps the recomputed
  // graph for W.
  const auto one = train_one_process(make_config(GetParam(), {}));
  const auto cfg = make_config(GetParam(), kModes[0]);
  const auto before = ops::recomputes();
  expect_same_bits(one, train_stages(cfg, 3, Backward::kZeroBubble), "full I/W vs one process");
  EXPECT_EQ(ops::recomputes() - before,
            describe_model(cfg).n_layers * kMicro * kSteps);
}

// "op" under zero-bubble's I/W split against one process without
// checkpointing, counting the expensive ops: "op" computes each once (the
// recompute takes every one back from the forward), "full" twice.
TEST_P(ActivationCheckpointFamilies, OpRecomputesNoExpensiveOp) {
  const auto one = train_one_process(make_config(GetParam(), {}));
  auto count = [&](const std::vector<std::string>& mode) {
    const auto cfg = make_config(GetParam(), mode);
    const auto computes = ops::saved_op_computes(), replays = ops::saved_op_replays();
    const auto recomputes = ops::recomputes();
    expect_same_bits(one, train_stages(cfg, 3, Backward::kZeroBubble),
                     mode_name(mode) + " I/W vs one process");
    EXPECT_EQ(ops::recomputes() - recomputes,
              mode.empty() ? 0 : describe_model(cfg).n_layers * kMicro * kSteps);
    return std::make_pair(ops::saved_op_computes() - computes,
                          ops::saved_op_replays() - replays);
  };
  const auto [none_computes, none_replays] = count({});
  const auto [full_computes, full_replays] = count(kModes[0]);
  const auto [op_computes, op_replays] = count(kOp);
  EXPECT_GT(none_computes, 0);
  EXPECT_GT(op_replays, 0);
  EXPECT_EQ(none_replays, 0);
  EXPECT_EQ(full_replays, 0);
  EXPECT_EQ(op_computes, none_computes) << GetParam();
  EXPECT_EQ(op_replays, full_computes - none_computes) << GetParam();
  EXPECT_LT(op_computes, full_computes) << GetParam();
}

// On a GPU in bf16, where the projections are the mixed-precision linear
// (see Note [Linear with an fp32 weight gradient]) and the MoE experts grouped
// GEMMs: "op" against none, after checking that none repeats its own bits
// there.
TEST_P(ActivationCheckpointFamilies, OpOnCudaInBf16HasTheBitsOfNone) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  const at::Device cuda(at::kCUDA);
  const auto reference = train_one_process(make_config(GetParam(), {}), cuda, at::kBFloat16);
  const auto again = train_one_process(make_config(GetParam(), {}), cuda, at::kBFloat16);
  bool repeats = true;
  for (size_t s = 0; s < reference.losses.size(); ++s) {
    repeats = repeats && at::equal(reference.losses[s], again.losses[s]);
  }
  if (!repeats) GTEST_SKIP() << "a run without checkpointing does not repeat its bits here";
  const auto replays = ops::saved_op_replays();
  expect_same_bits(reference, train_one_process(make_config(GetParam(), kOp), cuda, at::kBFloat16),
                   "op on CUDA");
  const auto cfg = make_config(GetParam(), kOp);
  const auto per_layer = static_cast<double>(ops::saved_op_replays() - replays) /
                         static_cast<double>(describe_model(cfg).n_layers * kMicro * kSteps);
  std::cout << GetParam() << " on CUDA: ops replayed per layer and micro-batch " << per_layer
            << "\n";
  EXPECT_GT(per_layer, 0);
  expect_same_bits(reference, train_one_process(make_config(GetParam(), kModes[0]), cuda, at::kBFloat16),
                   "full on CUDA");
}

INSTANTIATE_TEST_SUITE_P(Families, ActivationCheckpointFamilies,
                         ::testing::Values("llama", "gpt2", "kimi_k3"));

// Bytes malloc holds (the CPU allocator's tensors among them).
double heap_bytes() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const auto m = mallinfo2();
#else
  const auto m = mallinfo();  // int fields: enough for these few MiB
#endif
  return static_cast<double>(m.uordblks) + static_cast<double>(m.hblkhd);
}

// The bytes a forward leaves alive for its backward.
double kept_after_forward(const JobConfig& cfg) {
  auto part = build_model_part(cfg);
  part->init_weights(7);
  auto [tokens, targets] = batch(0, 8, 64);
  // A first step, so that what the first one allocates or frees for good
  // (the engine's threads, lazily built tables) stays out of the count.
  part->forward_loss({tokens}, targets).backward();
  const double before = heap_bytes();
  auto loss = part->forward_loss({tokens}, targets);
  const double kept = heap_bytes() - before;
  loss.backward();  // and the recompute works
  return kept;
}

TEST(ActivationCheckpoint, KeepsFewerBytesAfterTheForward) {
  for (const std::string family : {"llama", "gpt2", "kimi_k3"}) {
    const std::vector<std::string> big = {"training.seq_len=64", "training.local_batch_size=8"};
    auto with = [&](std::vector<std::string> mode) {
      mode.insert(mode.end(), big.begin(), big.end());
      return kept_after_forward(make_config(family, mode));
    };
    const double none = with({});
    const double full = with(kModes[0]);
    const double every2 = with(kModes[1]);
    const double op = with(kOp);
    std::cout << family << " bytes kept after the forward: none " << none << ", op " << op
              << ", every 2nd " << every2 << ", full " << full << "\n";
    EXPECT_LT(full, 0.5 * none) << family << ": none " << none << " full " << full;
    EXPECT_LT(every2, none) << family << ": none " << none << " every 2nd " << every2;
    EXPECT_LT(full, every2) << family;
    // "op": the layer inputs and the expensive ops' outputs, not the norms'
    // and activations' values nor attention's.
    EXPECT_LT(op, none) << family << ": none " << none << " op " << op;
    EXPECT_GT(op, full) << family << ": full " << full << " op " << op;
  }
}

TEST(ActivationCheckpoint, MemoryEstimateKeepsInputsAndOneRecompute) {
  const std::vector<std::string> base = {"training.seq_len=32", "training.local_batch_size=8"};
  auto cfg_of = [&](std::vector<std::string> mode) {
    mode.insert(mode.end(), base.begin(), base.end());
    return make_config("llama", mode);
  };
  auto estimate = [](const JobConfig& cfg) {
    const auto plan = pipeline::make_pipeline_plan(
        plan_spec_from_config(cfg.parallelism, model_module_fqns(cfg)));
    return estimate_rank_memory(cfg, describe_model(cfg), plan, 0, at::kFloat, false);
  };
  const auto none_cfg = cfg_of({});
  const auto none = estimate(none_cfg);
  const auto info = describe_model(none_cfg);
  const double layer = info.layers.at(0).saved_values_per_token;  // each llama layer alike
  const double D = static_cast<double>(info.dim), L = 4, tokens = 8 * 32;
  EXPECT_DOUBLE_EQ(none.activations, L * layer * tokens * 4);
  // full: every layer keeps its input (D), plus one layer recomputed.
  const auto full = estimate(cfg_of(kModes[0]));
  EXPECT_DOUBLE_EQ(full.activations, (L * D + layer) * tokens * 4);
  for (const auto& l : describe_model(cfg_of(kModes[0])).layers) {
    EXPECT_EQ(l.saved_values_per_token, D);
    EXPECT_EQ(l.recompute_values_per_token, layer);
  }
  // every 2nd: layers 1 and 3 checkpointed.
  const auto every2 = estimate(cfg_of(kModes[1]));
  EXPECT_DOUBLE_EQ(every2.activations, (2 * layer + 2 * D + layer) * tokens * 4);
  EXPECT_LT(full.activations, every2.activations);
  EXPECT_LT(every2.activations, none.activations);
  // op: every layer keeps its input and its expensive ops' outputs -- q,
  // attention's and wo's (D each), k and v (kv each), w1 and w3 (H each),
  // w2's (D) -- plus what one layer's recompute adds beside them: the
  // layer in full less what it kept beyond its input.
  const auto op_cfg = cfg_of(kOp);
  const auto shapes = build_model_part(none_cfg)->named_parameters();
  const double kv = static_cast<double>(shapes["layers.0.attention.wk.weight"].size(0));
  const double H = static_cast<double>(shapes["layers.0.feed_forward.w1.weight"].size(0));
  EXPECT_EQ(kv, D / 2);  // 2 of 4 heads
  const double op_layer = D + 4 * D + 2 * kv + 2 * H;
  for (const auto& l : describe_model(op_cfg).layers) {
    EXPECT_EQ(l.saved_values_per_token, op_layer);
    EXPECT_EQ(l.recompute_values_per_token, layer);
  }
  const auto op = estimate(op_cfg);
  EXPECT_DOUBLE_EQ(op.activations, (L * op_layer + layer - op_layer + D) * tokens * 4);
  EXPECT_LT(full.activations, op.activations);
  EXPECT_LT(op.activations, none.activations);
}

TEST(ActivationCheckpoint, ConfigTakesOpAndRefusesBadValues) {
  auto parse = [](std::vector<std::string> o) { return JobConfig::parse("", "test", o); };
  EXPECT_NO_THROW(parse({"activation_checkpoint.mode=full"}));
  EXPECT_NO_THROW(parse({"activation_checkpoint.mode=selective",
                         "activation_checkpoint.selective_ac_option=4"}));
  EXPECT_NO_THROW(
      parse({"activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=op"}));
  for (const char* bad : {"0", "-1", "two", "ops"}) {
    EXPECT_THROW(parse({"activation_checkpoint.mode=selective",
                        std::string("activation_checkpoint.selective_ac_option=") + bad}),
                 ConfigError)
        << bad;
  }
  EXPECT_THROW(parse({"activation_checkpoint.mode=some"}), ConfigError);
}

}  // namespace
}  // namespace viaduct
