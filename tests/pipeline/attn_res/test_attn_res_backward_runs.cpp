// parallelism.attn_res_cache_backward through `viaduct train`, ranks as
// processes over Gloo (see Note [AttnRes cache backward] in
// pipeline/attn_res/block_layout.h): the rank cache with the whole-stack
// backward trains debugmodel_deep to exactly the bits of one process (losses
// and every parameter / optimizer-state tensor after three steps) at pp4 x 2
// and pp2 x 2 stages per rank and under the zero-bubble I/W split, the
// default deposit backward stays within rounding of it, and the measured
// forward and backward bytes per hop and the store peaks equal the tables'.
// The one-process reference comes from the build tree's reference cache
// (common/reference_cache.h), trained once per binary.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/process_runs.h"
#include "common/reference_cache.h"
#include "data/temp_dir.h"
#include "pipeline/attn_res/block_layout.h"
#include "pipeline/schedule/plan.h"
#include "k3_plan.h"

namespace fs = std::filesystem;
using namespace viaduct::pipeline;

namespace {

using viaduct::testing::shell;
using viaduct::testing::ShellRun;
using viaduct::testing::k3_plan;

// The three ways a block's gradient can travel.
enum class Mode { kDeposit, kCacheWholeStack, kWholeStack };
const char* mode_name(Mode m) {
  return m == Mode::kDeposit           ? "cache_deposit"
         : m == Mode::kCacheWholeStack ? "cache_whole_stack_backward"
                                       : "whole_stack";
}
std::string mode_args(Mode m) {
  switch (m) {
    case Mode::kDeposit:
      return " --parallelism.attn_res_cache=true --parallelism.attn_res_cache_backward=deposit";
    case Mode::kCacheWholeStack:
      return " --parallelism.attn_res_cache=true"
             " --parallelism.attn_res_cache_backward=whole_stack";
    case Mode::kWholeStack:
      return " --parallelism.attn_res_cache=false";
  }
  return "";
}

class AttnResCacheBackwardRuns : public ::testing::Test {
 protected:
  static constexpr int kMicro = 8;

  static void SetUpTestSuite() {
    dir_ = new viaduct::data::testing::TempDir();
    data_ = viaduct::testing::cached_corpus(24680);
  }
  static void TearDownTestSuite() { delete dir_; }

  static std::string base_args() {
    std::ostringstream os;
    os << " --model.family=kimi_k3 --model.flavor=debugmodel_deep"
       << " --training.seq_len=16 --training.local_batch_size=8 --training.steps=3"
       << " --training.num_threads=1 --training.eval_interval=0"
       << " --metrics.progress_bar=false --optimizer.lr=0.01"
       << " --checkpoint.enable=true --checkpoint.interval=3"
       << " --parallelism.pipeline_parallel_microbatches=" << kMicro
       << " --data.path=" << data_;
    return os.str();
  }

  // Runs once per test process: later tests in it reuse a run of the same
  // name.
  static std::string train(const std::string& name, int nproc, const std::string& args) {
    const auto out = (fs::path(dir_->path()) / name).string();
    if (fs::exists(fs::path(out) / "checkpoint")) return out;
    viaduct::testing::run_viaduct_ok(nproc,
                                     " train" + base_args() + args + " --job.dump_folder=" + out);
    return out;
  }
  static std::string one_process() { return viaduct::testing::cached_reference(base_args()); }
  static std::string pp_run(int pp, int spr, Mode m,
                            const std::string& schedule = "Interleaved1F1B") {
    std::ostringstream args, name;
    args << " --parallelism.pipeline_parallel_degree=" << pp
         << " --parallelism.pipeline_parallel_schedule=" << schedule
         << " --parallelism.pipeline_parallel_stages_per_rank=" << spr << mode_args(m);
    name << schedule << "_pp" << pp << "x" << spr << "_" << mode_name(m);
    return train(name.str(), pp, args.str());
  }

  static std::vector<nlohmann::json> metrics(const std::string& dump) {
    return viaduct::testing::step_metrics(dump);
  }
  static ShellRun compare(const std::string& a, const std::string& b) {
    return viaduct::testing::checkpoint_compare(a, b);
  }
  static void expect_same_bits(const std::string& a, const std::string& b) {
    const auto r = viaduct::testing::expect_same_bits(a, b, 3);
    EXPECT_NE(r.output.find(" 0 differ"), std::string::npos) << r.output;
  }
  // The default deposit backward: losses within rounding of one process.
  static void expect_within_rounding(const std::string& reference, const std::string& run,
                                     const std::string& what) {
    const auto a = metrics(reference), b = metrics(run);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      const double la = a[i]["loss"].get<double>(), lb = b[i]["loss"].get<double>();
      EXPECT_NEAR(la, lb, 1e-5 * std::abs(la)) << what << " step " << i + 1;
    }
    // The summary line of `checkpoint compare`: "N tensors compared, K differ".
    const auto r = compare(reference, run);
    const auto at = r.output.rfind("tensors compared");
    const auto line = at == std::string::npos ? r.output
                                              : r.output.substr(r.output.rfind('\n', at) + 1);
    std::printf("[%s vs one process] %s\n", what.c_str(), line.c_str());
  }

  static viaduct::data::testing::TempDir* dir_;
  static std::string data_;
};
viaduct::data::testing::TempDir* AttnResCacheBackwardRuns::dir_ = nullptr;
std::string AttnResCacheBackwardRuns::data_;

// A debugmodel_deep layout under Interleaved1F1B: pp and stages per rank.
struct BackwardLayout {
  int pp, stages_per_rank;
};
void PrintTo(const BackwardLayout& l, std::ostream* os) {
  *os << "pp" << l.pp << " x " << l.stages_per_rank;
}

class AttnResCacheBackwardLayouts : public AttnResCacheBackwardRuns,
                                    public ::testing::WithParamInterface<BackwardLayout> {};

class AttnResCacheBackwardModes : public AttnResCacheBackwardRuns,
                                  public ::testing::WithParamInterface<Mode> {};

}  // namespace

TEST_P(AttnResCacheBackwardLayouts, WholeStackBackwardIsBitwiseOneProcess) {
  const auto& l = GetParam();
  const auto one = one_process();
  expect_same_bits(one, pp_run(l.pp, l.stages_per_rank, Mode::kCacheWholeStack));
  expect_within_rounding(one, pp_run(l.pp, l.stages_per_rank, Mode::kDeposit),
                         "debugmodel_deep pp" + std::to_string(l.pp) + "x" +
                             std::to_string(l.stages_per_rank) + " deposit");
}

// pp4 x 2: 35 units over 8 stages, layers [0,4) [4,8) ... [28,33); blocks of
// 12, so rank r's second stage reads three or four entries from its store.
// pp2 x 2: 35 units over 4 stages, layers [0,8) [8,17) [17,26) [26,33),
// every boundary inside a block.
INSTANTIATE_TEST_SUITE_P(DebugmodelDeep, AttnResCacheBackwardLayouts,
                         ::testing::Values(BackwardLayout{4, 2}, BackwardLayout{2, 2}),
                         [](const ::testing::TestParamInfo<BackwardLayout>& info) {
                           return "pp" + std::to_string(info.param.pp) + "_v" +
                                  std::to_string(info.param.stages_per_rank);
                         });

// The zero-bubble split sends the gradients at I and accumulates at W.
TEST_F(AttnResCacheBackwardRuns, InterleavedZeroBubbleWholeStackBackwardIsBitwiseOneProcess) {
  expect_same_bits(one_process(),
                   pp_run(2, 2, Mode::kCacheWholeStack, "InterleavedZeroBubble"));
}

// metrics.jsonl: hop_bytes = (hidden + received) and hop_grad_bytes =
// (hidden + returned) x [B/M, T, D] fp32 x M per hop; the store peak as
// predict_store_peak walks the schedule (blocks only with the whole-stack
// backward).
TEST_P(AttnResCacheBackwardModes, MeasuredForwardAndBackwardBytesEqualTheTables) {
  const int64_t M = kMicro, B = 8, T = 16, D = 64;
  const double entry = static_cast<double>(B / M * T * D * 4);
  const auto plan = k3_plan(33, 4, 2, M);
  const Mode m = GetParam();
  const auto t = make_block_layout_tables(
      plan.split, 12,
      m == Mode::kWholeStack ? AttnResTransport::kWholeStack : AttnResTransport::kRankCache,
      m == Mode::kDeposit ? AttnResCacheBackward::kDeposit : AttnResCacheBackward::kWholeStack);
  const auto ms = metrics(pp_run(4, 2, m));
  ASSERT_FALSE(ms.empty());
  for (const auto& j : ms) {
    ASSERT_TRUE(j.contains("hop_bytes") && j.contains("hop_grad_bytes")) << j.dump();
    const auto fwd = j["hop_bytes"].get<std::vector<int64_t>>();
    const auto bwd = j["hop_grad_bytes"].get<std::vector<int64_t>>();
    ASSERT_EQ(fwd.size(), 7u);
    ASSERT_EQ(bwd.size(), 7u);
    for (int64_t s = 0; s < 7; ++s) {
      EXPECT_EQ(fwd[s], static_cast<int64_t>(t.hop_tensors(s) * entry * M)) << "hop " << s;
      EXPECT_EQ(bwd[s], static_cast<int64_t>(t.grad_hop_tensors(s) * entry * M)) << "hop " << s;
    }
    const auto peaks = j["attn_res_store_peak_bytes"].get<std::vector<int64_t>>();
    ASSERT_EQ(peaks.size(), 4u);
    for (int64_t r = 0; r < 4; ++r) {
      EXPECT_EQ(peaks[r],
                static_cast<int64_t>(predict_store_peak(t, plan.compute, r).total * entry))
          << "rank " << r;
    }
  }
  std::printf("[bytes] %s: hop_bytes %s hop_grad_bytes %s store peaks %s\n", mode_name(m),
              ms[0]["hop_bytes"].dump().c_str(), ms[0]["hop_grad_bytes"].dump().c_str(),
              ms[0]["attn_res_store_peak_bytes"].dump().c_str());
}

INSTANTIATE_TEST_SUITE_P(Pp4x2, AttnResCacheBackwardModes,
                         ::testing::Values(Mode::kDeposit, Mode::kCacheWholeStack,
                                           Mode::kWholeStack),
                         [](const ::testing::TestParamInfo<Mode>& info) {
                           return std::string(mode_name(info.param));
                         });

// `viaduct plan --json` predicts both backwards' gradient bytes.
TEST(AttnResCacheBackwardPlan, PlanCommandShowsBothBackwards) {
  const auto r = shell(std::string(VIADUCT_BINARY) +
                       " plan --config configs/kimi_k3_debug.toml --model.flavor=debugmodel_deep"
                       " --parallelism.pipeline_parallel_degree=4"
                       " --parallelism.pipeline_parallel_schedule=Interleaved1F1B"
                       " --parallelism.pipeline_parallel_stages_per_rank=2"
                       " --parallelism.pipeline_parallel_microbatches=8"
                       " --training.seq_len=16 --training.local_batch_size=8"
                       " --training.dtype=float32 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  const auto plan = k3_plan(33, 4, 2, 8);
  const auto c = make_block_layout_tables(plan.split, 12, AttnResTransport::kRankCache);
  const auto cw = make_block_layout_tables(plan.split, 12, AttnResTransport::kRankCache,
                                           AttnResCacheBackward::kWholeStack);
  const auto w = make_block_layout_tables(plan.split, 12, AttnResTransport::kWholeStack);
  ASSERT_EQ(j["hops"].size(), 7u);
  double deposit = 0, whole = 0;
  for (int64_t s = 0; s < 7; ++s) {
    const auto& h = j["hops"][s];
    EXPECT_EQ(h["rank_cache_tensors"].get<int64_t>(), cw.hop_tensors(s));
    EXPECT_EQ(h["rank_cache_deposit_grad_tensors"].get<int64_t>(), c.grad_hop_tensors(s));
    EXPECT_EQ(h["rank_cache_whole_stack_grad_tensors"].get<int64_t>(), w.grad_hop_tensors(s));
    deposit += h["rank_cache_deposit_grad_bytes"].get<double>();
    whole += h["whole_stack_grad_bytes"].get<double>();
  }
  EXPECT_EQ(j["rank_cache_deposit_grad_bytes_per_step"].get<double>(), deposit);
  EXPECT_EQ(j["rank_cache_whole_stack_grad_bytes_per_step"].get<double>(), whole);
  EXPECT_EQ(j["rank_cache_deposit_grad_bytes_per_step"].get<double>(),
            j["rank_cache_bytes_per_step"].get<double>());
  for (const auto& rank : j["ranks"]) {
    EXPECT_LE(rank["store_peak_bytes_whole_stack_backward"].get<double>(),
              rank["store_peak_bytes"].get<double>());
  }
}
