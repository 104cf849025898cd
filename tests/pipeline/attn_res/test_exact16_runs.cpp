// The exact16 family through the `viaduct` command, ranks as processes over
// Gloo: `viaduct train --config configs/kimi_k3_debug.toml
// --model.family=exact16` at pp4 x 2 stages per rank, rank cache and whole
// stack, trains to the bits of one process (losses and every parameter and
// optimizer-state tensor after three steps) -- the rank cache included,
// because exact16's gradients are integers (see Note [exact16: integer
// gradients]) -- and the command refuses a job that would break them.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/process_runs.h"
#include "common/reference_cache.h"
#include "data/temp_dir.h"

namespace fs = std::filesystem;

namespace {

using viaduct::testing::shell;

// The arguments of `viaduct train` (without the command word): 8 sequences
// of 16 tokens, 128 tokens a step, a power of two.
std::string exact16_args(const std::string& corpus, const std::string& extra) {
  std::ostringstream os;
  os << " --config configs/kimi_k3_debug.toml --model.family=exact16"
     << " --training.seq_len=16 --training.local_batch_size=8 --training.steps=3"
     << " --training.num_threads=1 --training.eval_interval=0 --training.dtype=float32"
     << " --metrics.progress_bar=false --checkpoint.interval=3"
     << " --parallelism.pipeline_parallel_microbatches=4 --data.path=" << corpus << extra;
  return os.str();
}

// The transports: the rank cache (true) and the whole stack (false).
class Exact16Transports : public ::testing::TestWithParam<bool> {
 protected:
  viaduct::data::testing::TempDir dir_;
};

TEST_P(Exact16Transports, TrainCommandPp4x2IsBitwiseOneProcess) {
  const bool cache = GetParam();
  const auto corpus = viaduct::testing::cached_corpus(4242);
  const auto one = viaduct::testing::cached_reference(exact16_args(corpus, ""));
  const auto reference = viaduct::testing::step_losses(one);
  ASSERT_EQ(reference.size(), 3u);
  const auto pp = (fs::path(dir_.path()) / "pp4x2").string();
  viaduct::testing::run_viaduct_ok(
      4, " train" + exact16_args(corpus, std::string(" --parallelism.pipeline_parallel_degree=4"
                                          " --parallelism.pipeline_parallel_schedule=Interleaved1F1B"
                                          " --parallelism.pipeline_parallel_stages_per_rank=2"
                                          " --parallelism.attn_res_cache=") +
                                  (cache ? "true" : "false")) +
             " --job.dump_folder=" + pp);
  const auto r = viaduct::testing::expect_same_bits(one, pp, reference.size());
  // 33 parameters (the embedding, two biases a layer) and AdamW's two
  // moments of each.
  EXPECT_NE(r.output.find("99 tensors compared, 0 differ"), std::string::npos) << r.output;
  std::printf("[exact16] losses %s %s %s\n", reference[0].c_str(), reference[1].c_str(), reference[2].c_str());
}

INSTANTIATE_TEST_SUITE_P(Transports, Exact16Transports, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return std::string(i.param ? "rank_cache" : "whole_stack");
                         });

TEST(Exact16Runs, TrainCommandRefusesANonPowerOfTwoTokenCount) {
  viaduct::data::testing::TempDir dir;
  const auto corpus = viaduct::testing::cached_corpus(4242);
  const auto r = shell(std::string(VIADUCT_BINARY) + " train" + exact16_args(corpus, " --training.seq_len=12") +
                       " --job.dump_folder=" + (fs::path(dir.path()) / "bad").string());
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("power-of-two token count"), std::string::npos) << r.output;
}

}  // namespace
