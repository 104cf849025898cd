// The exact16 family through the `viaduct` command, ranks as processes over
// Gloo: `viaduct train --config configs/kimi_k3_debug.toml
// --model.family=exact16` at pp4 x 2 stages per rank, rank cache and whole
// stack, trains to the bits of one process (losses and every parameter and
// optimizer-state tensor after three steps) -- the rank cache included,
// because exact16's gradients are integers (Note [exact16: integer
// gradients]) -- and the command refuses a job that would break them.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/process_runs.h"
#include "data/temp_dir.h"

namespace fs = std::filesystem;

namespace {

using viaduct::testing::shell;

class Exact16Runs : public ::testing::Test {
 protected:
  void SetUp() override {
    corpus_ = (fs::path(dir_.path()) / "d.tok").string();
    viaduct::testing::write_random_corpus(corpus_, 4242);
  }

  // 8 sequences of 16 tokens: 128 tokens a step, a power of two.
  std::string args(const std::string& extra) const {
    std::ostringstream os;
    os << " train --config configs/kimi_k3_debug.toml --model.family=exact16"
       << " --training.seq_len=16 --training.local_batch_size=8 --training.steps=3"
       << " --training.num_threads=1 --training.eval_interval=0 --training.dtype=float32"
       << " --metrics.progress_bar=false --checkpoint.interval=3"
       << " --parallelism.pipeline_parallel_microbatches=4 --data.path=" << corpus_ << extra;
    return os.str();
  }

  std::string train(const std::string& name, int nproc, const std::string& extra) {
    const auto out = (fs::path(dir_.path()) / name).string();
    viaduct::testing::run_viaduct_ok(nproc, args(extra) + " --job.dump_folder=" + out);
    return out;
  }

  viaduct::data::testing::TempDir dir_;
  std::string corpus_;
};

TEST_F(Exact16Runs, TrainCommandPp4x2BothTransportsIsBitwiseOneProcess) {
  const auto one = train("one", 1, "");
  const auto want = viaduct::testing::step_losses(one);
  ASSERT_EQ(want.size(), 3u);
  for (bool cache : {true, false}) {
    SCOPED_TRACE(cache ? "rank cache" : "whole stack");
    const auto pp = train(cache ? "pp4x2_cache" : "pp4x2_whole", 4,
                          std::string(" --parallelism.pipeline_parallel_degree=4"
                                      " --parallelism.pipeline_parallel_schedule=Interleaved1F1B"
                                      " --parallelism.pipeline_parallel_stages_per_rank=2"
                                      " --parallelism.attn_res_cache=") +
                              (cache ? "true" : "false"));
    const auto r = viaduct::testing::expect_same_bits(one, pp, want.size());
    // 33 parameters (the embedding, two biases a layer) and AdamW's two
    // moments of each.
    EXPECT_NE(r.output.find("99 tensors compared, 0 differ"), std::string::npos) << r.output;
  }
  std::printf("[exact16] losses %s %s %s\n", want[0].c_str(), want[1].c_str(), want[2].c_str());
}

TEST_F(Exact16Runs, TrainCommandRefusesANonPowerOfTwoTokenCount) {
  const auto r = shell(std::string(VIADUCT_BINARY) + args(" --training.seq_len=12") +
                       " --job.dump_folder=" + (fs::path(dir_.path()) / "bad").string());
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("power-of-two token count"), std::string::npos) << r.output;
}

}  // namespace
