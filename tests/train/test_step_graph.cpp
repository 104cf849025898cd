// training.cuda_graphs (see Note [The step as one CUDA graph],
// train/step_graph.h): true is refused where it cannot run, with the key
// named and nothing written; unset takes the graph where the run allows it
// and runs eager steps elsewhere; on a GPU, steps replayed from the graph
// have the bits of eager steps.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "common/cuda_test.h"
#include "config/config.h"
#include "core/check.h"
#include "data/fixtures.h"
#include "data/temp_dir.h"
#include "train/step_graph.h"
#include "train/trainer.h"

using namespace viaduct;
namespace fs = std::filesystem;

namespace {

struct GraphJob {
  data::testing::TempDir dir;
  std::string data_path;
  GraphJob() : data_path((fs::path(dir.path()) / "train.tok").string()) {
    data::testing::write_phrase_corpus(data_path, 20000);
  }
  fs::path dump() const { return fs::path(dir.path()) / "out"; }
  Config config(std::vector<std::string> extra) const {
    std::vector<std::string> o = {
        "model.n_layers=2", "model.dim=128", "model.n_heads=4",
        "training.seq_len=64", "training.local_batch_size=4", "training.steps=6",
        "training.num_threads=1", "training.eval_interval=0", "metrics.progress_bar=false",
        "optimizer.lr=0.003", "lr_scheduler.warmup_steps=2", "data.path=" + data_path,
        "job.dump_folder=" + dump().string()};
    o.insert(o.end(), extra.begin(), extra.end());
    return Config::parse("", "test", o);
  }
};

// The message of the ConfigError `f` throws ("" when it throws none).
template <typename F>
std::string config_error(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(StepGraph, RefusedWhereItCannotRunNamingTheKey) {
  GraphJob job;
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"training.device=cpu"}, "needs a CUDA device"},
      {{"parallelism.pipeline_parallel_degree=2"}, "pipeline_parallel_degree must be 1"},
      {{"parallelism.data_parallel_degree=2"}, "data_parallel_degree must be 1"},
      {{"model.attn_mask_type=block_causal"}, "block_causal"},
  };
  for (const auto& [extra, says] : refused) {
    auto keys = extra;
    keys.push_back("training.cuda_graphs=true");
    const auto msg = config_error([&] { job.config(keys); });
    EXPECT_NE(msg.find("training.cuda_graphs = true"), std::string::npos) << extra[0] << ": " << msg;
    EXPECT_NE(msg.find(says), std::string::npos) << extra[0] << ": " << msg;
  }
  // Off, the same keys load.
  EXPECT_NO_THROW(job.config({"training.device=cpu", "training.cuda_graphs=false"}));
}

TEST(StepGraph, RefusedOnTheCpuBeforeAnythingIsWritten) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "training.device = auto picks the GPU here";
  GraphJob job;
  const auto msg = config_error([&] { Trainer t(job.config({"training.cuda_graphs=true"})); });
  EXPECT_NE(msg.find("training.cuda_graphs = true needs a CUDA device"), std::string::npos)
      << msg;
  EXPECT_FALSE(fs::exists(job.dump() / "metrics.jsonl"));
}

TEST(StepGraph, SgdIsRefused) {
  REQUIRE_GPU();
  GraphJob job;
  const auto msg = config_error([&] {
    Trainer t(job.config({"training.cuda_graphs=true", "training.device=cuda",
                          "optimizer.name=SGD"}));
  });
  EXPECT_NE(msg.find("the clip and the update on the device"), std::string::npos) << msg;
}

TEST(StepGraph, OtherShapesThanTheCapturedOnesAreAnError) {
  REQUIRE_GPU();
  StepGraph g(at::Device(at::kCUDA, 0));
  auto batch = [](int64_t rows, int64_t T) {
    data::TokenBatch b;
    b.inputs = at::zeros({rows, T}, at::kLong);
    b.targets = at::zeros({rows, T}, at::kLong);
    return b;
  };
  auto scope = g.stream_scope();
  g.load({batch(2, 16), batch(2, 16)}, 0.5);
  EXPECT_EQ(g.microbatches().size(), 2u);
  EXPECT_TRUE(g.microbatches()[0].inputs.is_cuda());
  EXPECT_EQ(g.loss_scale().item<float>(), 0.5f);
  EXPECT_THROW(g.load({batch(2, 16), batch(2, 32)}, 0.5), Error);
  EXPECT_THROW(g.load({batch(2, 16)}, 0.5), Error);
}

namespace {

// Every step's loss and gradient norm, the weights and the optimizer's
// moments after `steps` steps, and the number of replayed steps.
struct Run {
  std::vector<double> loss, norm;
  std::vector<double> wait, seconds;  // device_wait_seconds, the step's seconds
  std::vector<at::Tensor> state;
  int64_t replays = 0;
};

Run train(const Config& cfg, int steps) {
  Trainer t(cfg);
  Run r;
  for (int i = 0; i < steps; ++i) {
    const auto m = t.train_step();
    r.loss.push_back(m.loss);
    r.norm.push_back(m.grad_norm);
    r.wait.push_back(m.device_wait_seconds);
    r.seconds.push_back(m.seconds);
  }
  for (const auto& np : t.optimizer().params()) r.state.push_back(np.param.detach().cpu());
  for (const auto& [name, s] : t.optimizer().state()) r.state.push_back(s.cpu());
  r.replays = t.graph_replays();
  return r;
}

void expect_same_bits(const std::vector<std::string>& keys) {
  REQUIRE_GPU();
  constexpr int kSteps = 6;
  GraphJob a, b;
  auto with = [&](bool graphs) {
    auto k = keys;
    k.push_back("training.device=cuda");
    k.push_back("training.dtype=bfloat16");
    k.push_back(std::string("training.cuda_graphs=") + (graphs ? "true" : "false"));
    return k;
  };
  const auto eager = train(a.config(with(false)), kSteps);
  const auto graph = train(b.config(with(true)), kSteps);
  EXPECT_EQ(eager.replays, 0);
  EXPECT_EQ(graph.replays, kSteps - StepGraph::kWarmupSteps);
  for (int i = 0; i < kSteps; ++i) {
    EXPECT_EQ(graph.loss[i], eager.loss[i]) << "step " << i + 1;
    EXPECT_EQ(graph.norm[i], eager.norm[i]) << "step " << i + 1;
  }
  ASSERT_EQ(graph.state.size(), eager.state.size());
  for (size_t i = 0; i < eager.state.size(); ++i) {
    EXPECT_TRUE(at::equal(graph.state[i], eager.state[i])) << "state tensor " << i;
  }
}

}  // namespace

TEST(StepGraph, UnsetRunsEagerOnTheCpu) {
  GraphJob job;
  const auto r = train(job.config({"training.device=cpu"}), 3);
  EXPECT_EQ(r.replays, 0);
  EXPECT_EQ(r.loss.size(), 3u);
  // The clip ran on the host: no device wait to report.
  for (double w : r.wait) EXPECT_EQ(w, -1.0);
}

TEST(StepGraph, UnsetTakesTheGraphWhereTheRunAllowsIt) {
  REQUIRE_GPU();
  constexpr int kSteps = 4;
  const std::vector<std::string> gpu = {"training.device=cuda", "training.dtype=bfloat16"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), gpu.begin(), gpu.end());
    return extra;
  };
  GraphJob a, b, c, d, e;
  const auto unset = train(a.config(with({})), kSteps);
  EXPECT_EQ(unset.replays, kSteps - StepGraph::kWarmupSteps);
  const auto eager = train(b.config(with({"training.cuda_graphs=false"})), kSteps);
  EXPECT_EQ(eager.replays, 0);
  EXPECT_EQ(unset.loss, eager.loss);
  EXPECT_EQ(unset.norm, eager.norm);
  // The clip ran on the device: the wait for its values is part of the step.
  for (const auto* r : {&unset, &eager}) {
    for (size_t i = 0; i < r->wait.size(); ++i) {
      EXPECT_GE(r->wait[i], 0.0) << "step " << i + 1;
      EXPECT_LE(r->wait[i], r->seconds[i]) << "step " << i + 1;
    }
  }
  // Where the run does not allow it: eager steps, no error.
  EXPECT_EQ(train(c.config(with({"optimizer.name=SGD"})), kSteps).replays, 0);
  EXPECT_EQ(train(d.config(with({"model.cuda_kernels=false"})), kSteps).replays, 0);
  EXPECT_EQ(train(e.config(with({"metrics.profile_step=3"})), kSteps).replays, 0);
}

TEST(StepGraph, SameBitsAsEagerStepsLlama) {
  // Two accumulated batches of two micro-batches: four forwards and
  // backwards in one graph, the gradients written by the first and added
  // to by the rest.
  expect_same_bits({"model.n_kv_heads=2", "training.gradient_accumulation_steps=2",
                    "parallelism.pipeline_parallel_microbatches=2"});
}

TEST(StepGraph, SameBitsAsEagerStepsKimiK3) {
  // KDA, MLA, MoE (its counters and the selection bias moved after each
  // update) and the AttnRes reads, with full activation checkpointing.
  expect_same_bits({"model.family=kimi_k3", "model.flavor=debugmodel", "model.n_layers=4",
                    "model.attn_res_block_size=2", "model.first_k_dense=1",
                    "activation_checkpoint.mode=full"});
}
