// Expert parallelism in whole training runs (ranks as processes started by
// `viaduct launch`, Gloo over loopback): a small kimi_k3 with MoE layers
// trains at dp x ep to the bits of the same dp without ep -- the losses,
// the gradient norms (clipping active, so they reach the weights), every
// weight and optimizer moment -- also under pipeline schedules, and its
// checkpoints resume under another ep with the bits of an uninterrupted
// run. Bad expert-parallel configs stop with a message naming the cause.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/process_runs.h"
#include "common/reference_cache.h"
#include "core/file_io.h"
#include "data/temp_dir.h"

namespace fs = std::filesystem;

namespace {

using viaduct::testing::shell;
using viaduct::testing::ShellRun;

class ExpertParallelRuns : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new viaduct::data::testing::TempDir();
    data_ = viaduct::testing::cached_corpus(13579, 20000, 2468, 4000);
  }
  static void TearDownTestSuite() { delete dir_; }

  // Six layers (five of them MoE, 8 experts top-2) in AttnRes blocks of 3;
  // a small max_norm keeps the clip coefficient below 1 in every step.
  static std::string base_args(int steps = 5) {
    std::ostringstream os;
    os << " --model.family=kimi_k3 --model.flavor=debugmodel --model.n_layers=6"
       << " --model.attn_res_block_size=3 --model.dim=32 --model.n_heads=2"
       << " --model.moe_hidden_dim=32 --model.vocab_size=257"
       << " --training.seq_len=16 --training.local_batch_size=4 --training.steps=" << steps
       << " --training.max_norm=0.05 --training.num_threads=1 --training.eval_interval=0"
       << " --metrics.progress_bar=false --optimizer.lr=0.01"
       << " --checkpoint.enable=true --checkpoint.interval=2 --checkpoint.keep_latest_k=0"
       << " --data.path=" << data_;
    return os.str();
  }
  static std::string layout(int pp, int dp, int ep, const std::string& extra = "") {
    std::ostringstream os;
    os << " --parallelism.pipeline_parallel_degree=" << pp
       << " --parallelism.data_parallel_degree=" << dp
       << " --parallelism.expert_parallel_degree=" << ep << extra;
    return os.str();
  }

  // Runs once per test process: a later test reuses a run of the same name.
  static std::string train(const std::string& name, int nproc, const std::string& args) {
    const auto out = (fs::path(dir_->path()) / name).string();
    if (fs::exists(fs::path(out) / "metrics.jsonl")) return out;
    last_ = viaduct::testing::run_viaduct_ok(nproc, " train" + args + " --job.dump_folder=" + out);
    return out;
  }

  static std::vector<std::string> norms(const std::string& dump) {
    std::vector<std::string> out;
    for (const auto& j : viaduct::testing::step_metrics(dump)) out.push_back(j["grad_norm"].dump());
    return out;
  }
  static void expect_same_bits(const std::string& a, const std::string& b, size_t steps) {
    viaduct::testing::expect_same_bits(a, b, steps);
    EXPECT_EQ(norms(a), norms(b));
  }

  static viaduct::data::testing::TempDir* dir_;
  static std::string data_;
  static ShellRun last_;
};
viaduct::data::testing::TempDir* ExpertParallelRuns::dir_ = nullptr;
std::string ExpertParallelRuns::data_;
ShellRun ExpertParallelRuns::last_;

TEST_F(ExpertParallelRuns, DataParallelTimesExpertParallelHasTheBitsOfDataParallel) {
  const auto plain = train("dp2_ep1", 2, base_args() + layout(1, 2, 1));
  const auto ep = train("dp2_ep2", 2, base_args() + layout(1, 2, 2));
  expect_same_bits(plain, ep, 5);
  // Eval runs the exchanges without a graph, on every replica alike.
  auto evals = [](const std::string& dump) {
    std::vector<std::string> out;
    std::ifstream in(fs::path(dump) / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("eval_loss")) out.push_back(j["eval_loss"].dump());
    }
    return out;
  };
  const std::string eval = " --training.eval_interval=2 --data.eval_batches=2";
  const auto plain_e = evals(train("dp2_ep1_eval", 2, base_args() + layout(1, 2, 1) + eval));
  const auto ep_e = evals(train("dp2_ep2_eval", 2, base_args() + layout(1, 2, 2) + eval));
  EXPECT_GE(plain_e.size(), 2u);
  EXPECT_EQ(plain_e, ep_e);
  // The clip coefficient was below 1: the norms reached the weights.
  for (const auto& j : viaduct::testing::step_metrics(ep)) {
    EXPECT_GT(j["grad_norm"].get<double>(), 0.05);
  }
  // Each ep rank wrote its experts as pieces of the whole tensors.
  EXPECT_TRUE(fs::exists(fs::path(ep) / "checkpoint/step-5/model-dp1.safetensors"));
  // The run report draws the load imbalance over the steps.
  EXPECT_NE(viaduct::testing::shell("cat " + ep + "/report.html").output.find("MoE load"),
            std::string::npos);
  // Every step line carries each layer's load imbalance (layer 0 is dense).
  for (const auto& j : viaduct::testing::step_metrics(ep)) {
    ASSERT_TRUE(j.contains("moe_load_max_over_mean")) << j.dump();
    EXPECT_EQ(j["moe_load_max_over_mean"].size(), 6u);
    EXPECT_EQ(j["moe_load_max_over_mean"][0].get<double>(), 0.0);
    EXPECT_GE(j["moe_load_max_over_mean"][1].get<double>(), 1.0);
    EXPECT_EQ(j["ep_tokens_received_per_rank"].size(), 2u);
    EXPECT_GT(j["ep_alltoall_bytes"].get<double>(), 0.0);
  }
  // See Note [Expert capacity]: the same copies dropped under either layout.
  const std::string capacity = " --model.moe_capacity_factor=0.5";
  const auto plain_c = train("dp2_ep1_capacity", 2, base_args() + layout(1, 2, 1) + capacity);
  const auto ep_c = train("dp2_ep2_capacity", 2, base_args() + layout(1, 2, 2) + capacity);
  expect_same_bits(plain_c, ep_c, 5);
  const auto a = viaduct::testing::step_metrics(plain_c), b = viaduct::testing::step_metrics(ep_c);
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    EXPECT_GT(a[k]["moe_dropped_tokens"].get<double>(), 0.0);
    EXPECT_EQ(a[k]["moe_dropped_tokens"], b[k]["moe_dropped_tokens"]);
  }
}

TEST_F(ExpertParallelRuns, PipelineSchedulesWithExpertParallelHaveTheBitsOfDataParallel) {
  const auto plain = train("dp2_ep1", 2, base_args() + layout(1, 2, 1));
  for (const auto& [name, schedule] : std::vector<std::pair<std::string, std::string>>{
           {"pp2_dp2_ep2_1f1b", " --parallelism.pipeline_parallel_schedule=1F1B"
                                " --parallelism.pipeline_parallel_microbatches=2"},
           {"pp2_dp2_ep2_interleaved", " --parallelism.pipeline_parallel_schedule=Interleaved1F1B"
                                       " --parallelism.pipeline_parallel_stages_per_rank=2"
                                       " --parallelism.pipeline_parallel_microbatches=2"},
           // The I and W passes each run the exchanges' backward.
           {"pp2_dp2_ep2_zero_bubble",
            " --parallelism.pipeline_parallel_schedule=InterleavedZeroBubble"
            " --parallelism.pipeline_parallel_stages_per_rank=2"
            " --parallelism.pipeline_parallel_microbatches=2"},
           // A recomputed layer runs its exchanges again in the backward.
           {"pp2_dp2_ep2_1f1b_recompute", " --parallelism.pipeline_parallel_schedule=1F1B"
                                          " --parallelism.pipeline_parallel_microbatches=2"
                                          " --activation_checkpoint.mode=full"}}) {
    SCOPED_TRACE(name);
    // One process and pipelines share bits with the same micro-batches
    // (the AttnRes rank cache with the whole-stack backward: see Note [AttnRes
    // cache backward]).
    const auto with_micro = train("dp2_ep1_m2", 2,
                                  base_args() + layout(1, 2, 1) +
                                      " --parallelism.pipeline_parallel_microbatches=2");
    const auto run = train(name, 4,
                           base_args() + layout(2, 2, 2, schedule) +
                               " --parallelism.attn_res_cache_backward=whole_stack");
    expect_same_bits(with_micro, run, 5);
  }
  (void)plain;
  // A pipeline rank without MoE layers (layers 0-2 dense: the first stage)
  // still joins the step's MoE metric sums.
  const std::string dense = " --model.first_k_dense=3 --parallelism.pipeline_parallel_microbatches=2";
  const auto one = train("dp2_ep1_m2_dense3", 2, base_args() + layout(1, 2, 1) + dense);
  const auto pp = train("pp2_dp2_ep2_dense3", 4,
                        base_args() + layout(2, 2, 2, dense) +
                            " --parallelism.attn_res_cache_backward=whole_stack");
  expect_same_bits(one, pp, 5);
  const auto m = viaduct::testing::step_metrics(pp);
  ASSERT_FALSE(m.empty());
  EXPECT_EQ(m.back()["moe_load_max_over_mean"][0].get<double>(), 0.0);
  EXPECT_GE(m.back()["moe_load_max_over_mean"][5].get<double>(), 1.0);
}

TEST_F(ExpertParallelRuns, CheckpointsResumeUnderAnotherExpertParallelDegree) {
  // dp 4: the reference without ep, 4 steps; written at ep 1, 2 and 4, cut
  // back to step 2 and resumed at ep 2, 4, 1 and 2.
  const auto args = base_args(4);
  const auto reference = train("dp4_ep1", 4, args + layout(1, 4, 1));
  for (const auto& [from, to] :
       std::vector<std::pair<int, int>>{{1, 2}, {2, 4}, {2, 1}, {4, 2}}) {
    const auto src = train("dp4_ep" + std::to_string(from), 4, args + layout(1, 4, from));
    const auto dst =
        (fs::path(dir_->path()) / ("resume_ep" + std::to_string(from) + "_to_ep" +
                                   std::to_string(to)))
            .string();
    SCOPED_TRACE(dst);
    viaduct::remove_tree(dst);
    fs::create_directories(dst);
    fs::copy(src + "/checkpoint", dst + "/checkpoint", fs::copy_options::recursive);
    viaduct::remove_tree(dst + "/checkpoint/step-4");
    auto r = viaduct::testing::run_viaduct_ok(
        4, " train" + args + layout(1, 4, to) + " --job.dump_folder=" + dst);
    EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
    auto c = shell(std::string(VIADUCT_BINARY) + " checkpoint compare " + reference + "/checkpoint " +
                   dst + "/checkpoint");
    EXPECT_EQ(c.exit_code, 0) << c.output;
    const auto lr = viaduct::testing::step_losses(reference);
    const auto ld = viaduct::testing::step_losses(dst);
    ASSERT_EQ(lr.size(), 4u);
    ASSERT_EQ(ld.size(), 2u);  // steps 3 and 4
    EXPECT_EQ(ld[0], lr[2]);
    EXPECT_EQ(ld[1], lr[3]);
  }
}

// ZeRO-1 with expert parallelism: the dense moments sharded over dp, the
// experts' over their dp / ep replicas; the bits of plain data parallelism,
// and its pieces resume under another ep unsharded.
TEST_F(ExpertParallelRuns, ZeroOneWithExpertParallelHasTheBitsOfDataParallel) {
  const std::string zero = " --parallelism.dp_shard_optimizer=true";
  expect_same_bits(train("dp2_ep1", 2, base_args() + layout(1, 2, 1)),
                   train("dp2_ep2_zero", 2, base_args() + layout(1, 2, 2, zero)), 5);
  const auto args = base_args(4);
  const auto reference = train("dp4_ep1", 4, args + layout(1, 4, 1));
  const auto src = train("dp4_ep2_zero", 4, args + layout(1, 4, 2, zero));
  expect_same_bits(reference, src, 4);
  const auto dst = (fs::path(dir_->path()) / "resume_ep2_zero_to_ep4").string();
  viaduct::remove_tree(dst);
  fs::create_directories(dst);
  fs::copy(src + "/checkpoint", dst + "/checkpoint", fs::copy_options::recursive);
  viaduct::remove_tree(dst + "/checkpoint/step-4");
  viaduct::testing::run_viaduct_ok(4, " train" + args + layout(1, 4, 4) +
                                          " --job.dump_folder=" + dst);
  auto c = shell(std::string(VIADUCT_BINARY) + " checkpoint compare " + reference + "/checkpoint " +
                 dst + "/checkpoint");
  EXPECT_EQ(c.exit_code, 0) << c.output;
}

// parallelism.expert_gradient_sum = local: one gradient of the local
// experts, the sources added as the backward meets them -- the same bits run
// to run, and close to ep 1's (with two micro-batches the two add in other
// orders, so their bits need not agree).
TEST_F(ExpertParallelRuns, LocalGradientSumRepeatsItsBitsAndStaysCloseToDataParallel) {
  const std::string m2 = " --parallelism.pipeline_parallel_microbatches=2";
  const std::string local = " --parallelism.expert_gradient_sum=local";
  const auto reference = train("dp2_ep1_m2", 2, base_args() + layout(1, 2, 1) + m2);
  const auto a = train("dp2_ep2_local_a", 2, base_args() + layout(1, 2, 2) + m2 + local);
  const auto b = train("dp2_ep2_local_b", 2, base_args() + layout(1, 2, 2) + m2 + local);
  expect_same_bits(a, b, 5);
  const auto lr = viaduct::testing::step_metrics(reference), la = viaduct::testing::step_metrics(a);
  ASSERT_EQ(lr.size(), la.size());
  for (size_t k = 0; k < lr.size(); ++k) {
    const double x = lr[k]["loss"].get<double>(), y = la[k]["loss"].get<double>();
    EXPECT_LT(std::abs(x - y), 1e-5 * std::abs(x)) << "step " << k + 1;
  }
}

// The plan counts the copy of the experts' gradients per source rank that
// replica_order holds: (ep - 1) x the rank's expert parameters x 4 bytes
// more than local.
TEST(ExpertParallelPlan, GradientsPerSourceAreCounted) {
  auto plan = [](const std::string& sum) {
    const auto r = shell(std::string(VIADUCT_BINARY) +
                         " plan --json --model.family=kimi_k3 --model.flavor=debugmodel"
                         " --parallelism.data_parallel_degree=4"
                         " --parallelism.expert_parallel_degree=4"
                         " --parallelism.expert_gradient_sum=" + sum);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return nlohmann::json::parse(r.output.substr(r.output.find('{')));
  };
  const auto ordered = plan("replica_order"), local = plan("local");
  const auto& mo = ordered["ranks"][0]["memory"];
  const auto& ml = local["ranks"][0]["memory"];
  const double experts = ml["expert_params"].get<double>();
  ASSERT_GT(experts, 0.0);
  EXPECT_DOUBLE_EQ(mo["gradients"].get<double>() - ml["gradients"].get<double>(),
                   3.0 * experts * 4.0);
  EXPECT_DOUBLE_EQ(mo["weights"].get<double>(), ml["weights"].get<double>());
}

// A rank killed as a step starts leaves its peer in the step's first expert
// all-to-all: the job ends within the timeout, naming the rank.
TEST_F(ExpertParallelRuns, KilledRankEndsTheJobInsteadOfHangingInAnAllToAll) {
  const auto start = std::chrono::steady_clock::now();
  const auto out = (fs::path(dir_->path()) / "killed").string();
  const auto r = shell("VIADUCT_FAULT_KILL=1:2 " + std::string(VIADUCT_BINARY) +
                       " launch --nproc-per-node 2 -- " + VIADUCT_BINARY + " train" +
                       base_args() + layout(1, 2, 2) +
                       " --parallelism.comm_timeout_seconds=20 --job.dump_folder=" + out);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1"), std::string::npos) << r.output;
  EXPECT_LT(secs, 60.0) << r.output;
}

// A bad expert-parallel config stops before any rank starts, naming the key.
TEST(ExpertParallelConfig, BadDegreesAreRefusedNamingTheCause) {
  const std::string k3 = " --model.family=kimi_k3 --model.flavor=debugmodel";
  struct Case {
    std::string args, message;
  };
  for (const auto& c : std::vector<Case>{
           {k3 + " --parallelism.data_parallel_degree=2 --parallelism.expert_parallel_degree=4",
            "parallelism.expert_parallel_degree (4) must divide "
            "parallelism.data_parallel_degree (2)"},
           {k3 + " --parallelism.data_parallel_degree=3 --parallelism.expert_parallel_degree=3",
            "parallelism.expert_parallel_degree (3) must divide model.n_routed_experts (8)"},
           {" --model.family=llama --parallelism.data_parallel_degree=2"
            " --parallelism.expert_parallel_degree=2",
            "needs a model with MoE layers, but llama has none"},
           {k3 + " --model.moe_ffn=false --parallelism.data_parallel_degree=2"
                 " --parallelism.expert_parallel_degree=2",
            "needs a model with MoE layers, but kimi_k3 with this config has none"},
           {k3 + " --parallelism.expert_parallel_degree=0", "expert_parallel_degree"},
           {" --model.family=llama --model.moe_capacity_factor=1.25",
            "model.moe_capacity_factor (from the command line) does not apply to model.family = "
            "llama"},
           {k3 + " --model.moe_ffn=false --model.moe_capacity_factor=1.25",
            "model.moe_capacity_factor = 1.25 needs a model with MoE layers, but kimi_k3 with this "
            "config has none"},

       }) {
    SCOPED_TRACE(c.args);
    const auto r = shell(std::string(VIADUCT_BINARY) + " plan" + c.args);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << r.output;
  }
}

}  // namespace
