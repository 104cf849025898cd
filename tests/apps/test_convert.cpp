// `viaduct convert` and `viaduct tokenize` as a user runs them: checkpoints
// written by a two-stage pipeline run (llama) and by one process (gpt2) go to
// an HF folder and back, bitwise; bad input exits non-zero naming the
// problem.
#include <gtest/gtest.h>

#include <filesystem>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf.h"
#include "common/process_runs.h"
#include "data/temp_dir.h"
#include "model/hf_adapter.h"

namespace viaduct::checkpoint {
namespace {

namespace fs = std::filesystem;
using testing::run_viaduct_ok;
using testing::shell;

// Every model tensor of a step folder, by FQN.
TensorMap model_tensors(const fs::path& step_dir) {
  Checkpoint c = open_checkpoint(step_dir);
  TensorMap out;
  for (const auto& name : c.tensors.names()) {
    if (name.rfind("optim.", 0) != 0) out[name] = c.tensors.load(name);
  }
  return out;
}

std::string args(const std::string& config, const std::string& data) {
  return " --config " + std::string(VIADUCT_SOURCE_DIR) + "/configs/" + config +
         " --model.n_layers=4 --training.seq_len=16 --training.local_batch_size=4"
         " --training.steps=1 --training.num_threads=1 --training.eval_interval=0"
         " --metrics.progress_bar=false --checkpoint.enable=true --checkpoint.interval=1"
         " --training.dtype=float32 --data.path=" + data;
}

class ConvertApp : public ::testing::Test {
 protected:
  void SetUp() override {
    data_ = dir_.file("corpus.tok");
    testing::write_random_corpus(data_, 7);
  }
  void round_trip(const std::string& config, int nproc, const std::string& extra,
                  const std::string& convert_extra = "") {
    const std::string run = dir_.file("run"), hf = dir_.file("hf"), back = dir_.file("back");
    run_viaduct_ok(nproc, " train" + args(config, data_) + extra + " --job.dump_folder=" + run);
    const fs::path step = fs::path(run) / "checkpoint" / "step-1";
    run_viaduct_ok(1, " convert --to hf --input " + run + "/checkpoint --output " + hf +
                          " --max-shard-mb 1" + convert_extra);
    EXPECT_TRUE(fs::exists(fs::path(hf) / "config.json"));
    run_viaduct_ok(1, " convert --to viaduct --input " + hf + " --output " + back +
                          " --config " + VIADUCT_SOURCE_DIR + "/configs/" + config +
                          " --model.n_layers=4");
    TensorMap reference = model_tensors(step), got = model_tensors(fs::path(back) / "step-0");
    ASSERT_EQ(reference.size(), got.size());
    for (const auto& [name, t] : reference) {
      ASSERT_TRUE(got.count(name)) << name;
      EXPECT_TRUE(at::equal(t, got.at(name))) << name << " differs after the round trip";
    }
  }
  data::testing::TempDir dir_;
  std::string data_;
};

TEST_F(ConvertApp, LlamaFromATwoStagePipelineRunRoundTripsBitwise) {
  round_trip("llama_debug.toml", 2,
             " --parallelism.pipeline_parallel_degree=2"
             " --parallelism.pipeline_parallel_microbatches=2");
}

TEST_F(ConvertApp, Gpt2RoundTripsBitwiseAndCarriesTheTokenizer) {
  const std::string tok = dir_.file("tokenizer.json");
  data::testing::write_text(tok, "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"\\u0120\": 1}}}\n");
  round_trip("gpt2_debug.toml", 1, "", " --tokenizer " + tok);
  EXPECT_EQ(data::testing::read_bytes(dir_.file("hf/tokenizer.json")),
            data::testing::read_bytes(tok));
}

TEST_F(ConvertApp, BadInputExitsNonZeroNamingTheProblem) {
  const std::string bin = VIADUCT_BINARY;
  auto r = shell(bin + " convert --to hf --input " + dir_.file("nothing") + " --output " +
                 dir_.file("o"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no complete checkpoint"), std::string::npos) << r.output;
  r = shell(bin + " convert --to viaduct --input " + dir_.path().string() + " --output " +
            dir_.file("o") + " --config " + VIADUCT_SOURCE_DIR + "/configs/llama_debug.toml");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no config.json"), std::string::npos) << r.output;

  // An HF llama folder whose shape differs from the job's.
  ChainSpec s;
  s.family = "llama";
  s.n_layers = 1;
  s.dim = 16;
  s.n_heads = 2;
  s.n_kv_heads = 2;
  s.vocab_size = 300;
  s.ffn_hidden = 32;
  s.max_seq_len = 64;
  TensorMap v = {{"tok_embeddings.weight", at::zeros({300, 16})},
                 {"norm.weight", at::ones({16})},
                 {"lm_head.weight", at::zeros({300, 16})},
                 {"layers.0.attention.wq.weight", at::zeros({16, 16})},
                 {"layers.0.attention.wk.weight", at::zeros({16, 16})},
                 {"layers.0.attention.wv.weight", at::zeros({16, 16})},
                 {"layers.0.attention.wo.weight", at::zeros({16, 16})},
                 {"layers.0.feed_forward.w1.weight", at::zeros({32, 16})},
                 {"layers.0.feed_forward.w2.weight", at::zeros({16, 32})},
                 {"layers.0.feed_forward.w3.weight", at::zeros({32, 16})},
                 {"layers.0.attention_norm.weight", at::ones({16})},
                 {"layers.0.ffn_norm.weight", at::ones({16})}};
  write_hf_folder(dir_.file("small"), v, *llama_hf_adapter(s), {});
  r = shell(bin + " convert --to viaduct --input " + dir_.file("small") + " --output " +
            dir_.file("o") + " --config " + VIADUCT_SOURCE_DIR + "/configs/llama_debug.toml");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("num_hidden_layers = 1 but the viaduct config has model.n_layers = 8"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir_.file("o")));

  // A missing --tokenizer: named, and nothing written.
  r = shell(bin + " convert --to hf --input " + dir_.file("nothing") + " --output " +
            dir_.file("o") + " --tokenizer " + dir_.file("missing.json"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("convert --tokenizer: the tokenizer '" + dir_.file("missing.json") +
                          "' does not exist"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir_.file("o")));

  r = shell(bin + " tokenize --tokenizer " + dir_.file("missing.json") + " hi");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("missing.json' does not exist"), std::string::npos) << r.output;
  r = shell(bin + " tokenize --tokenizer byte hi");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.output, "104 105\n");
}

}  // namespace
}  // namespace viaduct::checkpoint
