// Warm start (checkpoint.initial_load_path) from a viaduct checkpoint and
// from a Hugging Face folder written by `viaduct convert --to hf`, under one
// stage and a two-stage pipeline in one process; the full-state variant
// against an uninterrupted run; a restart that resumes instead; bad inputs;
// and checkpoint.last_save_in_hf's folder against the final weights.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>

#include "checkpoint/hf.h"
#include "common/process_runs.h"
#include "config/config.h"
#include "config/job_config.h"
#include "core/check.h"
#include "data/fixtures.h"
#include "data/temp_dir.h"
#include "data/token_file.h"
#include "model/family.h"
#include "train/trainer.h"
#include "train/warm_start.h"

using namespace viaduct;
namespace fs = std::filesystem;

namespace {

using data::testing::write_phrase_corpus;

const std::vector<std::string> kTwoStages = {
    "parallelism.pipeline_parallel_stages_per_rank=2",
    "parallelism.pipeline_parallel_schedule=Interleaved1F1B",
    "parallelism.pipeline_parallel_microbatches=2"};

struct WarmStartJob {
  data::testing::TempDir dir;
  std::string data_path;
  WarmStartJob() : data_path((fs::path(dir.path()) / "train.tok").string()) {
    write_phrase_corpus(data_path, 20000);
  }
  std::string path(const std::string& name) const { return (fs::path(dir.path()) / name).string(); }
  Config config(const std::string& dump, std::vector<std::string> extra = {}) const {
    std::vector<std::string> o = {
        "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
        "training.seq_len=32", "training.local_batch_size=4", "training.steps=3",
        "training.num_threads=1", "training.eval_interval=0",
        "metrics.progress_bar=false", "optimizer.lr=0.003", "lr_scheduler.warmup_steps=2",
        "data.path=" + data_path, "checkpoint.enable=true", "checkpoint.interval=3",
        "job.dump_folder=" + path(dump)};
    o.insert(o.end(), extra.begin(), extra.end());
    return Config::parse("", "test", o);
  }
};

std::map<std::string, at::Tensor> weights(const Trainer& t) {
  std::map<std::string, at::Tensor> out;
  for (const auto& np : t.optimizer().params()) out[np.fqn] = np.param.detach().clone();
  return out;
}

void expect_same_bits(const std::map<std::string, at::Tensor>& a,
                      const std::map<std::string, at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
  }
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(WarmStart, ModelOnlyLoadsTheWeightsAtStepZeroWithAFreshOptimizer) {
  WarmStartJob job;
  Trainer src(job.config("src"));
  src.run();
  const auto reference = weights(src);
  const std::string ckpt = src.checkpoint_folder();
  // The checkpoint folder (its latest step) and the step folder alike.
  for (const std::string& path : {ckpt, ckpt + "/step-3"}) {
    Trainer t(job.config("dst", {"checkpoint.initial_load_path=" + path,
                                 "checkpoint.enable=false"}));
    ASSERT_TRUE(t.warm_start());
    EXPECT_EQ(t.step(), 0);
    expect_same_bits(reference, weights(t));
    EXPECT_EQ(t.optimizer().steps_taken(), 0);
    for (const auto& [name, s] : t.optimizer().state()) {
      EXPECT_EQ(s.abs().sum().item<double>(), 0.0) << name;
    }
    const auto m = t.train_step();
    EXPECT_TRUE(std::isfinite(m.loss));
    EXPECT_EQ(t.step(), 1);
  }
  // The same first step as a run whose weights are put in by hand: a fresh
  // data cursor and optimizer.
  Trainer warm(job.config("warm", {"checkpoint.initial_load_path=" + ckpt}));
  ASSERT_TRUE(warm.warm_start());
  Trainer by_hand(job.config("by_hand"));
  {
    torch::NoGradGuard g;
    for (const auto& np : by_hand.optimizer().params()) np.param.copy_(reference.at(np.fqn));
  }
  EXPECT_EQ(warm.train_step().loss, by_hand.train_step().loss);
  expect_same_bits(weights(by_hand), weights(warm));
}

TEST(WarmStart, FullStateContinuesAsTheUninterruptedRun) {
  WarmStartJob job;
  Trainer whole(job.config("whole", {"training.steps=6", "checkpoint.enable=false"}));
  std::vector<double> losses;
  for (int i = 0; i < 6; ++i) losses.push_back(whole.train_step().loss);
  // Three of the six steps (the LR schedule spans six), then a checkpoint.
  Trainer src(job.config("src", {"training.steps=6"}));
  for (int i = 0; i < 3; ++i) src.train_step();
  src.save_checkpoint();
  Trainer t(job.config("dst", {"training.steps=6", "checkpoint.initial_load_path=" +
                                                       src.checkpoint_folder(),
                               "checkpoint.initial_load_model_only=false"}));
  ASSERT_TRUE(t.warm_start());
  EXPECT_EQ(t.step(), 3);
  for (int i = 3; i < 6; ++i) EXPECT_EQ(t.train_step().loss, losses[i]) << "step " << i + 1;
  expect_same_bits(weights(whole), weights(t));
  // Excluded: the step and the optimizer start fresh, the data cursor does not.
  Trainer ex(job.config("ex", {"training.steps=6", "checkpoint.initial_load_path=" +
                                                       src.checkpoint_folder(),
                               "checkpoint.initial_load_model_only=false",
                               "checkpoint.exclude_from_loading=[\"optimizer\", \"step\"]"}));
  ASSERT_TRUE(ex.warm_start());
  EXPECT_EQ(ex.step(), 0);
  EXPECT_EQ(ex.optimizer().steps_taken(), 0);
  for (const auto& [name, s] : ex.optimizer().state()) {
    EXPECT_EQ(s.abs().sum().item<double>(), 0.0) << name;
  }
}

TEST(WarmStart, LoadsAcrossPipelineLayouts) {
  WarmStartJob job;
  // One stage -> two stages in one process, and back.
  Trainer one(job.config("one"));
  one.run();
  Trainer two_dst(job.config("two_dst", [&] {
    auto o = kTwoStages;
    o.push_back("checkpoint.initial_load_path=" + one.checkpoint_folder());
    return o;
  }()));
  ASSERT_TRUE(two_dst.warm_start());
  EXPECT_EQ(two_dst.parts().size(), 2u);
  expect_same_bits(weights(one), weights(two_dst));
  Trainer two(job.config("two", kTwoStages));
  two.run();
  Trainer one_dst(job.config("one_dst", {"checkpoint.initial_load_path=" +
                                         two.checkpoint_folder()}));
  ASSERT_TRUE(one_dst.warm_start());
  expect_same_bits(weights(two), weights(one_dst));
  EXPECT_TRUE(std::isfinite(one_dst.train_step().loss));
}

TEST(WarmStart, HuggingFaceFolderFromConvertGivesTheSameWeights) {
  WarmStartJob job;
  Trainer src(job.config("src"));
  src.run();
  const std::string hf = job.path("hf");
  viaduct::testing::shell(std::string(VIADUCT_BINARY) + " convert --to hf --input " +
                 src.checkpoint_folder() + " --output " + hf);
  ASSERT_TRUE(fs::exists(fs::path(hf) / "config.json"));
  // Found by its config.json, and forced; one stage and two.
  for (const auto& extra : std::vector<std::vector<std::string>>{
           {}, {"checkpoint.initial_load_in_hf=true"}, kTwoStages}) {
    auto o = extra;
    o.push_back("checkpoint.initial_load_path=" + hf);
    Trainer t(job.config("dst", o));
    ASSERT_TRUE(t.warm_start());
    EXPECT_EQ(t.step(), 0);
    expect_same_bits(weights(src), weights(t));
  }
  // An HF folder holds no training state.
  Trainer full(job.config("full", {"checkpoint.initial_load_path=" + hf,
                                   "checkpoint.initial_load_model_only=false"}));
  EXPECT_NE(error_of([&] { full.warm_start(); }).find("initial_load_model_only"),
            std::string::npos);
}

TEST(WarmStart, ARestartResumesFromItsOwnCheckpoint) {
  WarmStartJob job;
  Trainer src(job.config("src"));
  src.run();
  Trainer first(job.config("dst", {"checkpoint.initial_load_path=" + src.checkpoint_folder()}));
  first.run();
  EXPECT_EQ(first.step(), 3);
  // Continued with a path that would fail if it were read.
  Trainer again(job.config("dst", {"training.steps=5",
                                   "checkpoint.initial_load_path=" + job.path("nowhere")}));
  again.run();
  EXPECT_EQ(again.step(), 5);
  // The same as continuing the first run by hand.
  Trainer reference(job.config("dst", {"training.steps=5"}));
  ASSERT_TRUE(reference.resume());
  EXPECT_EQ(reference.step(), 5);
  expect_same_bits(weights(again), weights(reference));
}

TEST(WarmStart, BadInputsAreNamed) {
  WarmStartJob job;
  const auto start = [&](std::vector<std::string> o) {
    return error_of([&] {
      Trainer t(job.config("dst", o));
      t.run();
    });
  };
  auto e = start({"checkpoint.initial_load_path=" + job.path("nowhere")});
  EXPECT_NE(e.find("nowhere"), std::string::npos) << e;
  EXPECT_NE(e.find("is not a folder"), std::string::npos) << e;
  fs::create_directories(job.path("empty"));
  e = start({"checkpoint.initial_load_path=" + job.path("empty")});
  EXPECT_NE(e.find("no viaduct checkpoint"), std::string::npos) << e;

  Trainer src(job.config("src"));
  src.run();
  // Another width: the tensor and both shapes.
  e = start({"checkpoint.initial_load_path=" + src.checkpoint_folder(), "model.dim=32",
             "model.n_heads=2", "model.n_kv_heads=1"});
  EXPECT_NE(e.find("tok_embeddings.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("64"), std::string::npos) << e;
  EXPECT_NE(e.find("32"), std::string::npos) << e;
  // Fewer layers: the tensors without a place.
  e = start({"checkpoint.initial_load_path=" + src.checkpoint_folder(), "model.n_layers=1"});
  EXPECT_NE(e.find("layers.1."), std::string::npos) << e;
  // A corrupt file.
  const auto file = fs::path(src.checkpoint_folder()) / "step-3" / "model.safetensors";
  fs::resize_file(file, fs::file_size(file) / 2);
  e = start({"checkpoint.initial_load_path=" + src.checkpoint_folder() + "/step-3"});
  EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
  EXPECT_THROW(job.config("dst", {"checkpoint.exclude_from_loading=[\"model\"]"}), ConfigError);
}

TEST(LastSaveInHf, TheFolderHoldsTheFinalWeights) {
  WarmStartJob job;
  for (const auto& layout : std::vector<std::vector<std::string>>{{}, kTwoStages}) {
    const std::string dump = layout.empty() ? "one" : "two";
    auto o = layout;
    o.push_back("checkpoint.last_save_in_hf=true");
    const auto cfg = job.config(dump, o);
    Trainer t(cfg);
    t.run();
    const auto job_config = JobConfig::from(cfg);
    const auto folder = hf_export_folder(job_config, 3);
    EXPECT_EQ(folder, fs::path(t.checkpoint_folder()) / "hf-step-3");
    const auto back = checkpoint::read_hf_model(folder, *state_dict_adapter(job_config));
    expect_same_bits(weights(t), std::map<std::string, at::Tensor>(back.begin(), back.end()));
    // And a run started from it has those weights.
    Trainer w(job.config(dump + "_warm", {"checkpoint.initial_load_path=" + folder.string()}));
    ASSERT_TRUE(w.warm_start());
    expect_same_bits(weights(t), weights(w));
  }
}

TEST(LastSaveInHf, TheFolderCarriesTheTokenizerOfDataTokenizer) {
  WarmStartJob job;
  const fs::path tok = job.path("tokenizer");
  fs::create_directories(tok);
  const std::string json = "{\"version\": \"1.0\", \"model\": {\"type\": \"BPE\"}}\n";
  data::testing::write_text((tok / "tokenizer.json").string(), json);
  data::testing::write_text((tok / "tokenizer_config.json").string(), "{}\n");
  const auto cfg = job.config("run", {"checkpoint.last_save_in_hf=true",
                                      "data.tokenizer=" + (tok / "tokenizer.json").string()});
  Trainer(cfg).run();
  const auto folder = hf_export_folder(JobConfig::from(cfg), 3);
  EXPECT_EQ(data::testing::read_bytes((folder / "tokenizer.json").string()),
            data::testing::read_bytes((tok / "tokenizer.json").string()));
  EXPECT_TRUE(fs::exists(folder / "tokenizer_config.json"));
  EXPECT_FALSE(fs::exists(folder / "special_tokens_map.json"));
  EXPECT_TRUE(fs::exists(folder / "config.json"));
  // A missing tokenizer stops the run before it writes anything.
  const auto e = error_of([&] {
    job.config("bad", {"checkpoint.last_save_in_hf=true",
                       "data.tokenizer=" + job.path("missing.json")});
  });
  EXPECT_NE(e.find("data.tokenizer (from the command line): the tokenizer '" + job.path("missing.json") +
                   "' does not exist"),
            std::string::npos)
      << e;
  EXPECT_FALSE(fs::exists(job.path("bad")));
}

namespace {

checkpoint::TensorMap model_tensors(const fs::path& step_dir) {
  const auto c = checkpoint::open_checkpoint(step_dir);
  checkpoint::TensorMap out;
  for (const auto& name : c.tensors.names()) {
    if (name.rfind("optim.", 0) != 0) out[name] = c.tensors.load(name);
  }
  return out;
}

}  // namespace

TEST(WarmStart, TwoPipelineRanksLoadAndExportUnderALauncher) {
  WarmStartJob job;
  const std::string common =
      " train --model.n_layers=2 --model.dim=64 --model.n_heads=4 --model.n_kv_heads=2"
      " --training.seq_len=32 --training.local_batch_size=4 --training.steps=2"
      " --training.num_threads=1 --training.eval_interval=0 --metrics.progress_bar=false"
      " --checkpoint.enable=true --data.path=" + job.data_path;
  viaduct::testing::run_viaduct_ok(1, common + " --job.dump_folder=" + job.path("src"));
  // pp2: each rank loads its own FQNs; step-0 holds what they loaded, and
  // hf-step-2 is read back from the final checkpoint.
  viaduct::testing::run_viaduct_ok(
      2, common + " --parallelism.pipeline_parallel_degree=2"
                  " --parallelism.pipeline_parallel_microbatches=2"
                  " --checkpoint.save_initial=true --checkpoint.last_save_in_hf=true"
                  " --checkpoint.initial_load_path=" + job.path("src") + "/checkpoint"
                  " --job.dump_folder=" + job.path("dst"));
  const auto loaded = model_tensors(job.path("dst") + "/checkpoint/step-0");
  const auto reference = model_tensors(job.path("src") + "/checkpoint/step-2");
  expect_same_bits(std::map<std::string, at::Tensor>(reference.begin(), reference.end()),
                   std::map<std::string, at::Tensor>(loaded.begin(), loaded.end()));
  const auto final_weights = model_tensors(job.path("dst") + "/checkpoint/step-2");
  const fs::path hf_dir = job.path("dst") + "/checkpoint/hf-step-2";
  // Read as the model its config.json describes (llama's reading of it).
  const auto hf = checkpoint::read_hf_folder(hf_dir);
  const auto overrides =
      state_dict_adapter(JobConfig::parse("", "test"))->from_hf_config(hf.config, hf_dir.string());
  const auto back =
      checkpoint::read_hf_model(hf_dir, *state_dict_adapter(JobConfig::parse("", "test", overrides)));
  expect_same_bits(std::map<std::string, at::Tensor>(final_weights.begin(), final_weights.end()),
                   std::map<std::string, at::Tensor>(back.begin(), back.end()));
}
