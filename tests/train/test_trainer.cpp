// The single-process trainer: loss falls, metrics.jsonl, bitwise resume,
// corrupt checkpoints refused, micro-batches add up.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "checkpoint/manager.h"
#include "config/config.h"
#include "config/job_config.h"
#include "core/check.h"
#include "data/fixtures.h"
#include "data/temp_dir.h"
#include "data/token_file.h"
#include "model/model.h"
#include "train/memory_estimate.h"
#include "train/trainer.h"

using namespace viaduct;
namespace fs = std::filesystem;

namespace {

using data::testing::write_phrase_corpus;

struct Job {
  data::testing::TempDir dir;
  std::string data_path;
  Job() : data_path((fs::path(dir.path()) / "train.tok").string()) {
    write_phrase_corpus(data_path, 20000);
    write_phrase_corpus((fs::path(dir.path()) / "train.val.tok").string(), 4000);
  }
  Config config(std::vector<std::string> extra = {}) const {
    return Config::parse("", "test", overrides(std::move(extra)));
  }
  // data.paths and data.weights in `extra` instead of data.path.
  Config blend_config(std::vector<std::string> extra) const {
    auto o = overrides(std::move(extra));
    o.erase(std::find(o.begin(), o.end(), "data.path=" + data_path));
    return Config::parse("", "test", o);
  }
  std::vector<std::string> overrides(std::vector<std::string> extra) const {
    std::vector<std::string> o = {
        "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
        "training.seq_len=32", "training.local_batch_size=4", "training.steps=6",
        "training.num_threads=1", "training.eval_interval=3",
        "metrics.progress_bar=false", "optimizer.lr=0.003",
        "lr_scheduler.warmup_steps=2",
        "data.path=" + data_path, "data.eval_batches=2",
        "job.dump_folder=" + (fs::path(dir.path()) / "out").string()};
    o.insert(o.end(), extra.begin(), extra.end());
    // kimi_k3's attention takes no KV-head count (the family refuses it).
    if (std::find(o.begin(), o.end(), "model.family=kimi_k3") != o.end()) {
      o.erase(std::find(o.begin(), o.end(), "model.n_kv_heads=2"));
    }
    return o;
  }
};

std::vector<nlohmann::json> read_metrics(const fs::path& file) {
  std::vector<nlohmann::json> out;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

std::vector<at::Tensor> params(const Trainer& t) {
  std::vector<at::Tensor> out;
  for (const auto& np : t.optimizer().params()) out.push_back(np.param.detach().clone());
  return out;
}

}  // namespace

TEST(Trainer, LossFallsAndMetricsAreWritten) {
  Job job;
  auto cfg = job.config({"training.steps=30", "training.eval_interval=10"});
  Trainer t(cfg);
  const auto last = t.run();
  auto lines = read_metrics(fs::path(cfg.get_string("job.dump_folder")) / "metrics.jsonl");
  std::vector<double> losses, evals;
  for (const auto& j : lines) {
    if (j.contains("loss")) {
      for (const char* k : {"step", "loss", "grad_norm", "lr", "tokens_per_sec"})
        EXPECT_TRUE(j.contains(k)) << k;
      losses.push_back(j["loss"].get<double>());
    }
    if (j.contains("eval_loss")) evals.push_back(j["eval_loss"].get<double>());
  }
  ASSERT_EQ(losses.size(), 30u);
  EXPECT_EQ(evals.size(), 4u);  // steps 0, 10, 20, 30
  EXPECT_LT(losses.back(), 0.6 * losses.front());
  EXPECT_LT(evals.back(), evals.front());
  // The loss is written with enough digits to round-trip a float32.
  EXPECT_EQ(static_cast<float>(losses.back()), static_cast<float>(last.loss));
}

// Every step line carries the plan's estimated total (see Note [Activation
// memory estimate]) beside the measured peak; one process has no per-rank
// list.
TEST(Trainer, MetricsCarryThePlanMemoryEstimate) {
  Job job;
  auto cfg = job.config({"training.steps=2", "training.eval_interval=0", "training.device=cpu",
                         "parallelism.pipeline_parallel_microbatches=2"});
  Trainer t(cfg);
  t.run();
  const auto job_config = JobConfig::from(cfg);
  const double reference = estimate_rank_memory(job_config, describe_model(job_config), t.plan(),
                                                0, at::kFloat, false)
                               .total();
  auto lines = read_metrics(fs::path(cfg.get_string("job.dump_folder")) / "metrics.jsonl");
  int steps = 0;
  for (const auto& j : lines) {
    if (!j.contains("loss")) continue;
    ++steps;
    ASSERT_TRUE(j.contains("plan_memory_bytes")) << j.dump();
    EXPECT_DOUBLE_EQ(j["plan_memory_bytes"].get<double>(), reference);
    EXPECT_GT(j["peak_memory_bytes"].get<double>(), 0.0);
    EXPECT_FALSE(j.contains("plan_memory_bytes_per_rank"));
  }
  EXPECT_EQ(steps, 2);
}

TEST(Trainer, ResumeContinuesBitwise) {
  Job a, b;
  // A: six uninterrupted steps.
  Trainer ta(a.config());
  std::vector<double> reference;
  for (int i = 0; i < 6; ++i) reference.push_back(ta.train_step().loss);
  // B: three steps, a checkpoint, a "crash", and a new process resumes.
  const std::vector<std::string> ck = {"checkpoint.enable=true", "checkpoint.interval=3"};
  {
    Trainer tb(b.config(ck));
    for (int i = 0; i < 3; ++i) EXPECT_EQ(tb.train_step().loss, reference[i]);
    tb.save_checkpoint();
  }
  Trainer tc(b.config(ck));
  ASSERT_TRUE(tc.resume());
  EXPECT_EQ(tc.step(), 3);
  for (int i = 3; i < 6; ++i) EXPECT_EQ(tc.train_step().loss, reference[i]) << "step " << i + 1;
  const auto pa = params(ta), pc = params(tc);
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pc[i]));
}

TEST(Trainer, BlendResumesBitwiseAndEvalsOnTheValFilesOfItsSources) {
  // Two sources: train.tok (with train.val.tok beside it) and a small other
  // corpus of 7 windows that starts a new epoch every few steps.
  Job a, b;
  const auto blend = [](const Job& job) {
    const auto other = (fs::path(job.dir.path()) / "other.tok").string();
    if (!fs::exists(other)) {
      data::TokenFileWriter w(other, 257, "byte");
      std::vector<int64_t> toks;
      for (int64_t i = 0; i < 250; ++i) toks.push_back(97 + (i * 7) % 26);
      w.append(toks);
      w.finish();
    }
    return std::vector<std::string>{"data.paths=[\"" + job.data_path + "\", \"" + other + "\"]",
                                    "data.weights=[0.6, 0.4]", "data.shuffle=true",
                                    "training.steps=8", "checkpoint.enable=true",
                                    "checkpoint.interval=5"};
  };
  // A: eight uninterrupted steps, eval at 3 and 6 from train.val.tok alone.
  Trainer ta(a.blend_config(blend(a)));
  std::vector<double> reference, reference_eval;
  for (int i = 0; i < 8; ++i) {
    reference.push_back(ta.train_step().loss);
    if (i == 2 || i == 5) reference_eval.push_back(ta.evaluate());
  }
  EXPECT_FALSE(std::isnan(reference_eval[0]));
  // B: five steps, a checkpoint mid-epoch of both sources, a new process.
  std::string folder;
  {
    Trainer tb(b.blend_config(blend(b)));
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(tb.train_step().loss, reference[i]) << "step " << i + 1;
      if (i == 2) EXPECT_EQ(tb.evaluate(), reference_eval[0]);
    }
    tb.save_checkpoint();
    folder = tb.checkpoint_folder();
  }
  const auto cursor =
      checkpoint::open_checkpoint(checkpoint::checkpoint_dir(folder, 5)).metadata.data_cursor;
  ASSERT_EQ(cursor["sources"].size(), 2u) << cursor.dump();
  EXPECT_EQ(cursor["sources"][1]["epoch"].get<int64_t>(), 1) << cursor.dump();
  {
    Trainer tc(b.blend_config(blend(b)));
    ASSERT_TRUE(tc.resume());
    EXPECT_EQ(tc.step(), 5);
    for (int i = 5; i < 8; ++i) {
      EXPECT_EQ(tc.train_step().loss, reference[i]) << "step " << i + 1;
      if (i == 5) EXPECT_EQ(tc.evaluate(), reference_eval[1]);
    }
    const auto pa = params(ta), pc = params(tc);
    for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pc[i]));
  }
  // The checkpoint refuses a blend with other weights.
  try {
    Trainer td(b.blend_config([&] {
      auto o = blend(b);
      o[1] = "data.weights=[0.5, 0.5]";
      return o;
    }()));
    td.resume();
    FAIL() << "a blend with other weights resumed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("data.weights give it 0.5"), std::string::npos)
        << e.what();
  }
  // A source that matches no file is named with its key.
  try {
    Trainer t(b.blend_config({"data.paths=[\"" + b.data_path + "\", \"/nonexistent/*.tok\"]",
                              "data.weights=[1, 1]"}));
    FAIL();
  } catch (const FileError& e) {
    EXPECT_NE(std::string(e.what()).find("data.paths[1]: no token file matches "
                                         "'/nonexistent/*.tok'"),
              std::string::npos)
        << e.what();
  }
}

TEST(Trainer, RunResumesFromTheDumpFolderAndKeepsLatestK) {
  Job job;
  const std::vector<std::string> ck = {"checkpoint.enable=true", "checkpoint.interval=2",
                                       "checkpoint.keep_latest_k=2"};
  Trainer(job.config(ck)).run();
  auto cfg = job.config(ck);
  Trainer t(cfg);
  EXPECT_EQ(checkpoint::list_checkpoints(t.checkpoint_folder()),
            (std::vector<int64_t>{4, 6}));
  // Longer run from the same folder: resumes at 6 and continues.
  auto longer = job.config([&] { auto o = ck; o.push_back("training.steps=8"); return o; }());
  Trainer t2(longer);
  t2.run();
  EXPECT_EQ(t2.step(), 8);
  auto lines = read_metrics(fs::path(cfg.get_string("job.dump_folder")) / "metrics.jsonl");
  int64_t prev = -1;
  for (const auto& j : lines) {
    if (!j.contains("loss")) continue;
    EXPECT_EQ(j["step"].get<int64_t>(), prev + 1 == 0 ? 1 : prev + 1);
    prev = j["step"].get<int64_t>();
  }
  EXPECT_EQ(prev, 8);
}

TEST(Trainer, CorruptCheckpointIsRefusedNamingTheFile) {
  Job job;
  const std::vector<std::string> ck = {"checkpoint.enable=true"};
  {
    Trainer t(job.config(ck));
    t.train_step();
    t.save_checkpoint();
  }
  Trainer probe(job.config(ck));
  const auto file = fs::path(probe.checkpoint_folder()) / "step-1" / "model.safetensors";
  ASSERT_TRUE(fs::exists(file));
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x7f');
  }
  try {
    Trainer t(job.config(ck));
    t.resume();
    FAIL() << "corrupt checkpoint accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.safetensors"), std::string::npos) << e.what();
  }
  // Truncated: also refused.
  fs::resize_file(file, fs::file_size(file) / 2);
  EXPECT_THROW({ Trainer t(job.config(ck)); t.resume(); }, Error);
}

TEST(Trainer, MissingDataNamesTheFile) {
  Job job;
  try {
    Trainer t(job.config({"data.path=/nonexistent/x.tok"}));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/x.tok"), std::string::npos) << e.what();
  }
}

TEST(Trainer, MicrobatchesAndAccumulationMatchOneBatchClosely) {
  // Splitting a step into micro-batches or accumulation steps reorders the
  // gradient sums only: the losses agree to float32 rounding.
  Job a, b, c;
  Trainer ta(a.config({"training.local_batch_size=4"}));
  Trainer tb(b.config({"training.local_batch_size=4",
                       "parallelism.pipeline_parallel_microbatches=4"}));
  Trainer tc(c.config({"training.local_batch_size=2",
                       "training.gradient_accumulation_steps=2"}));
  for (int i = 0; i < 3; ++i) {
    const double la = ta.train_step().loss, lb = tb.train_step().loss,
                 lc = tc.train_step().loss;
    EXPECT_NEAR(la, lb, 1e-4 * la);
    EXPECT_NEAR(la, lc, 1e-4 * la);
  }
}

TEST(Trainer, MoeSelectionBiasIsCheckpointedAndResumesBitwise) {
  // kimi_k3 keeps its MoE selection bias in a buffer that after_optimizer_step
  // moves: a resume that lost it would route tokens differently.
  Job a, b;
  const std::vector<std::string> k3 = {"model.family=kimi_k3", "model.flavor=debugmodel",
                                       "model.n_layers=4", "model.attn_res_block_size=2",
                                       "model.first_k_dense=1"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), k3.begin(), k3.end());
    return extra;
  };
  Trainer ta(a.config(with({})));
  std::vector<double> reference;
  for (int i = 0; i < 4; ++i) reference.push_back(ta.train_step().loss);
  const auto ck = with({"checkpoint.enable=true"});
  {
    Trainer tb(b.config(ck));
    for (int i = 0; i < 2; ++i) tb.train_step();
    tb.save_checkpoint();
  }
  Trainer tc(b.config(ck));
  ASSERT_TRUE(tc.resume());
  bool has_bias = false;
  for (const auto& [k, t] : tc.parts().front()->extra_state()) {
    has_bias = true;
    EXPECT_GT(t.abs().sum().item<double>(), 0.0) << k << " was not restored";
  }
  EXPECT_TRUE(has_bias);
  for (int i = 2; i < 4; ++i) EXPECT_EQ(tc.train_step().loss, reference[i]) << "step " << i + 1;
}

TEST(Trainer, ProfileStepWritesATraceOfThatStepOnly) {
  // metrics.profile_step = 2: a Chrome trace of step 2's host ops, with the
  // trainer's phase scopes, and the same losses as an unprofiled run.
  Job job;
  auto cfg = job.config({"training.steps=3", "training.eval_interval=0",
                         "metrics.profile_step=2"});
  const auto profiled = Trainer(cfg).run();
  const auto trace = fs::path(cfg.get_string("job.dump_folder")) / "profile" /
                     "step-2-rank-0.trace.json";
  ASSERT_TRUE(fs::exists(trace)) << trace;
  EXPECT_FALSE(fs::exists(trace.string() + ".tmp"));
  std::ifstream in(trace);
  const auto j = nlohmann::json::parse(in);
  ASSERT_TRUE(j.contains("traceEvents"));
  std::set<std::string> names;
  for (const auto& e : j["traceEvents"]) {
    if (e.contains("name")) names.insert(e["name"].get<std::string>());
  }
  for (const char* reference : {"viaduct::forward_backward", "viaduct::grad_norm",
                           "viaduct::optimizer", "aten::mm"}) {
    EXPECT_TRUE(names.count(reference)) << reference << " missing from the trace";
  }
  // Only step 2 was profiled.
  EXPECT_EQ(std::distance(fs::directory_iterator(trace.parent_path()), fs::directory_iterator()), 1);
  Job plain_job;
  const auto plain = Trainer(plain_job.config({"training.steps=3", "training.eval_interval=0"})).run();
  EXPECT_EQ(profiled.loss, plain.loss);

  // Device kernels only on a CPU device would record nothing: refused
  // before the first step, naming the key.
  Job cpu_job;
  std::string what;
  try {
    Trainer(cpu_job.config({"training.steps=1", "training.eval_interval=0",
                            "metrics.profile_step=1", "metrics.profile_host_ops=false"}))
        .run();
  } catch (const ConfigError& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("metrics.profile_host_ops = false"), std::string::npos) << what;
}

TEST(Trainer, AutoLossChunkIsThePlainLossWithoutKernels) {
  // model.loss_chunk_tokens = -1 (auto) takes the plain loss where the fused
  // kernels do not run (here: the CPU), bit for bit; a set chunk size takes
  // the chunked path, equal to rounding.
  std::vector<double> losses;
  for (const char* chunk : {"-1", "0", "40"}) {
    Job job;
    auto last = Trainer(job.config({"training.steps=2", "training.eval_interval=0",
                                    std::string("model.loss_chunk_tokens=") + chunk}))
                    .run();
    losses.push_back(last.loss);
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_NEAR(losses[2], losses[1], 1e-5 * std::abs(losses[1]));
}
