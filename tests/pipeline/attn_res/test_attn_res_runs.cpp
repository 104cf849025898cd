// Kimi-K3 over pipeline stages with AttnResStage, ranks as processes over
// Gloo: the whole-stack transport trains to exactly the bits of one process
// (losses and every parameter / optimizer-state tensor after three steps),
// offload changes no bit, the rank cache stays within rounding of it, the
// measured per-hop bytes and store peaks equal the layout tables' prediction,
// and without AttnRes (model.attn_res = false) the stages are a plain chain.
// The one-process references come from the build tree's reference cache
// (common/reference_cache.h), trained once per binary.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/check.h"
#include "common/process_runs.h"
#include "common/reference_cache.h"
#include "core/file_io.h"
#include "data/temp_dir.h"
#include "pipeline/attn_res/block_store.h"
#include "data/token_file.h"
#include "pipeline/attn_res/block_layout.h"
#include "pipeline/schedule/plan.h"
#include "k3_plan.h"

namespace fs = std::filesystem;
using namespace viaduct::pipeline;

namespace {

using viaduct::testing::shell;
using viaduct::testing::ShellRun;
using viaduct::testing::k3_plan;

class AttnResRuns : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new viaduct::data::testing::TempDir();
    data_ = viaduct::testing::cached_corpus(987654);
  }
  static void TearDownTestSuite() { delete dir_; }

  static std::string base_args(const std::string& flavor, int micro, int steps = 3) {
    std::ostringstream os;
    os << " --model.family=kimi_k3 --model.flavor=" << flavor
       << " --training.seq_len=16 --training.local_batch_size=8 --training.steps=" << steps
       << " --training.num_threads=1 --training.eval_interval=0"
       << " --metrics.progress_bar=false --optimizer.lr=0.01"
       << " --checkpoint.enable=true --checkpoint.interval=" << steps
       << " --parallelism.pipeline_parallel_microbatches=" << micro
       << " --data.path=" << data_;
    return os.str();
  }

  static std::string train(const std::string& name, int nproc, const std::string& args) {
    const auto out = (fs::path(dir_->path()) / name).string();
    viaduct::remove_tree(out);
    viaduct::testing::run_viaduct_ok(nproc, " train" + args + " --job.dump_folder=" + out);
    return out;
  }

  static std::vector<nlohmann::json> metrics(const std::string& dump) {
    return viaduct::testing::step_metrics(dump);
  }
  static ShellRun compare(const std::string& a, const std::string& b) {
    return viaduct::testing::checkpoint_compare(a, b);
  }
  static void expect_same_bits(const std::string& a, const std::string& b, size_t steps = 3) {
    viaduct::testing::expect_same_bits(a, b, steps);
  }

  static std::string reference_run(const std::string& flavor, int micro, int steps = 3) {
    return viaduct::testing::cached_reference(base_args(flavor, micro, steps));
  }

  static std::string pp_run(const std::string& flavor, int micro, int pp, int spr, bool cache,
                            bool offload = false, int steps = 3) {
    std::ostringstream args, name;
    args << base_args(flavor, micro, steps) << " --parallelism.pipeline_parallel_degree=" << pp
         << " --parallelism.pipeline_parallel_schedule=Interleaved1F1B"
         << " --parallelism.pipeline_parallel_stages_per_rank=" << spr
         << " --parallelism.attn_res_cache=" << (cache ? "true" : "false")
         << " --parallelism.attn_res_cache_offload=" << (offload ? "true" : "false");
    name << flavor << "_pp" << pp << "x" << spr << (cache ? "_cache" : "_whole")
         << (offload ? "_offload" : "") << "_" << steps;
    return train(name.str(), pp, args.str());
  }

  static viaduct::data::testing::TempDir* dir_;
  static std::string data_;
};
viaduct::data::testing::TempDir* AttnResRuns::dir_ = nullptr;
std::string AttnResRuns::data_;

// The whole-stack transport at one layout, with or without offload.
struct WholeStackLayout {
  std::string flavor;
  int micro, pp, stages_per_rank;
  bool offload;
};

std::string describe(const WholeStackLayout& l) {
  return l.flavor + "_pp" + std::to_string(l.pp) + "_v" + std::to_string(l.stages_per_rank) +
         "_m" + std::to_string(l.micro) + (l.offload ? "_offload" : "");
}
std::string whole_stack_name(const ::testing::TestParamInfo<WholeStackLayout>& info) {
  return describe(info.param);
}
void PrintTo(const WholeStackLayout& l, std::ostream* os) { *os << describe(l); }

class AttnResWholeStack : public AttnResRuns,
                          public ::testing::WithParamInterface<WholeStackLayout> {};

// The transport under test: the rank cache (true) or the whole stack.
class AttnResTransports : public AttnResRuns, public ::testing::WithParamInterface<bool> {};

std::string transport_case_name(const ::testing::TestParamInfo<bool>& info) {
  return info.param ? "rank_cache" : "whole_stack";
}

}  // namespace

TEST_P(AttnResWholeStack, IsBitwiseOneProcess) {
  const auto& l = GetParam();
  expect_same_bits(reference_run(l.flavor, l.micro),
                   pp_run(l.flavor, l.micro, l.pp, l.stages_per_rank, false, l.offload));
}

// debugmodel: 26 units over 4 stages, a boundary inside a block, and rank 0
// receives entry 0 again at stage 2 in the whole stack; offload changes no
// bit. debugmodel_deep: 35 units over 8 stages, and over 16 stages (4 per
// rank) with one or two layers per stage.
INSTANTIATE_TEST_SUITE_P(Layouts, AttnResWholeStack,
                         ::testing::Values(WholeStackLayout{"debugmodel", 4, 2, 2, false},
                                           WholeStackLayout{"debugmodel", 4, 2, 2, true},
                                           WholeStackLayout{"debugmodel_deep", 8, 4, 2, false},
                                           WholeStackLayout{"debugmodel_deep", 8, 4, 4, false}),
                         whole_stack_name);

// The rank cache adds a block's gradient contributions grouped by rank, so
// its bits may differ from the whole stack's in the last places; offload
// changes none of them.
// See Note [Document boundaries] (ops/documents.h): under block_causal each
// rank finds every micro-batch's documents itself; the whole-stack
// transport over 4 stages keeps the bits of one process.
TEST_F(AttnResRuns, BlockCausalIsBitwiseOneProcess) {
  auto args = base_args("debugmodel", 4);
  args.replace(args.find(data_), data_.size(),
               viaduct::testing::cached_documents(424242, 20000, 4343, 4000));
  args += " --model.attn_mask_type=block_causal --model.mla_rope=true";
  const auto reference = viaduct::testing::cached_reference(args);
  const auto run = train("block_causal_pp2x2", 2,
                         args + " --parallelism.pipeline_parallel_degree=2"
                                " --parallelism.pipeline_parallel_schedule=Interleaved1F1B"
                                " --parallelism.pipeline_parallel_stages_per_rank=2"
                                " --parallelism.attn_res_cache=false");
  expect_same_bits(reference, run);
  for (const auto& j : metrics(run)) EXPECT_GT(j.value("documents_per_window", 0.0), 1.5);
}

TEST_F(AttnResRuns, RankCacheStaysWithinRoundingAndOffloadChangesNoBit) {
  const auto reference = reference_run("debugmodel", 4);
  const auto cache = pp_run("debugmodel", 4, 2, 2, true);
  const auto a = metrics(reference), b = metrics(cache);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const double la = a[i]["loss"].get<double>(), lb = b[i]["loss"].get<double>();
    EXPECT_NEAR(la, lb, 1e-5 * std::abs(la)) << "step " << i + 1;
    std::printf("[cache vs one process] debugmodel pp2x2 step %zu loss %.17g vs %.17g (diff %.3g)\n",
                i + 1, la, lb, lb - la);
  }
  auto r = compare(reference, cache);
  std::printf("[cache vs one process] checkpoint compare (exit %d):\n%s\n", r.exit_code,
              r.output.c_str());
  expect_same_bits(cache, pp_run("debugmodel", 4, 2, 2, true, true));
}

// metrics.jsonl's hop_bytes and attn_res_store_peak_bytes equal the tables:
// (hidden + received entries) x [B/M, T, D] fp32 x M per hop; the store peak
// as predict_store_peak walks the schedule.
TEST_P(AttnResTransports, MeasuredBytesEqualTheTables) {
  const int64_t M = 4, B = 8, T = 16, D = 64;
  const double entry = static_cast<double>(B / M * T * D * 4);
  const auto plan = k3_plan(24, 2, 2, M);
  const bool cache = GetParam();
  const auto t = make_block_layout_tables(
      plan.split, 12, cache ? AttnResTransport::kRankCache : AttnResTransport::kWholeStack);
  const auto run = pp_run("debugmodel", static_cast<int>(M), 2, 2, cache);
  const auto m = metrics(run);
  ASSERT_FALSE(m.empty());
  for (const auto& j : m) {
    ASSERT_TRUE(j.contains("hop_bytes")) << j.dump();
    const auto hops = j["hop_bytes"].get<std::vector<int64_t>>();
    ASSERT_EQ(hops.size(), 3u);
    for (int64_t s = 0; s < 3; ++s) {
      EXPECT_EQ(hops[s], static_cast<int64_t>(t.hop_tensors(s) * entry * M)) << "hop " << s;
    }
    const auto peaks = j["attn_res_store_peak_bytes"].get<std::vector<int64_t>>();
    ASSERT_EQ(peaks.size(), 2u);
    for (int64_t r = 0; r < 2; ++r) {
      EXPECT_EQ(peaks[r],
                static_cast<int64_t>(predict_store_peak(t, plan.compute, r).total * entry))
          << "rank " << r;
    }
  }
  std::printf("[bytes] %s: %s\n", cache ? "rank cache" : "whole stack", m[0].dump().c_str());
}

// `viaduct plan --json` predicts the same hop sizes without running.
TEST(AttnResPlan, PlanCommandMatchesTheTables) {
  const auto r = shell(std::string(VIADUCT_BINARY) +
                       " plan --config configs/kimi_k3_debug.toml --model.flavor=debugmodel"
                       " --parallelism.pipeline_parallel_degree=2"
                       " --parallelism.pipeline_parallel_schedule=Interleaved1F1B"
                       " --parallelism.pipeline_parallel_stages_per_rank=2"
                       " --parallelism.pipeline_parallel_microbatches=4"
                       " --training.seq_len=16 --training.local_batch_size=8"
                       " --training.dtype=float32 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  const auto plan = k3_plan(24, 2, 2, 4);
  const auto c = make_block_layout_tables(plan.split, 12, AttnResTransport::kRankCache);
  const auto w = make_block_layout_tables(plan.split, 12, AttnResTransport::kWholeStack);
  ASSERT_EQ(j["hops"].size(), 3u);
  for (int64_t s = 0; s < 3; ++s) {
    EXPECT_EQ(j["hops"][s]["rank_cache_tensors"].get<int64_t>(), c.hop_tensors(s));
    EXPECT_EQ(j["hops"][s]["whole_stack_tensors"].get<int64_t>(), w.hop_tensors(s));
  }
  EXPECT_EQ(j["entry_bytes"].get<double>(), 2.0 * 16 * 64 * 4);
}

// The store: deposits are counted against the tables, a missing or extra one
// is an Error naming rank, stage, micro-batch and block; release and the
// step-end sweep.
TEST(RankBlockStore, CountsDepositsAndSweeps) {
  const auto plan = k3_plan(24, 2, 2, 4);
  const auto t = make_block_layout_tables(plan.split, 12, AttnResTransport::kRankCache);
  RankBlockStore store(1, t, /*offload=*/true);  // CPU: offload keeps tensors as they are
  auto block = at::ones({2, 4, 8});
  store.put(1, 0, 0, block);
  store.put(1, 0, 1, block * 2);
  EXPECT_TRUE(store.get(3, 0, 1, at::kCPU).equal(block * 2));
  EXPECT_EQ(store.peak_bytes(), 2 * 64 * 4);
  store.release(0);
  EXPECT_EQ(store.bytes(), 0);
  EXPECT_THROW(store.get(3, 0, 1, at::kCPU), viaduct::Error);
  store.deposit(3, 0, 0, block);
  EXPECT_THROW(store.deposit(3, 0, 0, block), viaduct::Error);  // one expected
  EXPECT_TRUE(store.collect(1, 0, 0).equal(block));
  try {
    store.collect(1, 0, 1);
    FAIL() << "a missing deposit was not reported";
  } catch (const viaduct::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("stage 1"), std::string::npos) << m;
    EXPECT_NE(m.find("micro-batch 0"), std::string::npos) << m;
    EXPECT_NE(m.find("block 1"), std::string::npos) << m;
  }
  store.put(1, 2, 0, block);
  store.deposit(3, 1, 1, block);
  try {
    store.sweep("step end");
    FAIL() << "leftovers were not reported";
  } catch (const viaduct::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("block 0 of micro-batch 2"), std::string::npos) << m;
    EXPECT_NE(m.find("uncollected deposits for block 1 of micro-batch 1"), std::string::npos) << m;
  }
  EXPECT_EQ(store.bytes(), 0);
  EXPECT_NO_THROW(store.sweep("step end"));
}

// The zero-bubble split (I then W) collects deposits at I; both transports
// against one process.
TEST_P(AttnResTransports, InterleavedZeroBubbleMatchesOneProcess) {
  const auto reference = reference_run("debugmodel", 4);
  const bool cache = GetParam();
  std::ostringstream args;
  args << base_args("debugmodel", 4) << " --parallelism.pipeline_parallel_degree=2"
       << " --parallelism.pipeline_parallel_schedule=InterleavedZeroBubble"
       << " --parallelism.pipeline_parallel_stages_per_rank=2"
       << " --parallelism.attn_res_cache=" << (cache ? "true" : "false");
  const auto run = train(std::string("zb_") + (cache ? "cache" : "whole"), 2, args.str());
  if (!cache) {
    expect_same_bits(reference, run);
  } else {
    const auto a = metrics(reference), b = metrics(run);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_NEAR(a[i]["loss"].get<double>(), b[i]["loss"].get<double>(),
                  1e-5 * std::abs(a[i]["loss"].get<double>()));
    }
  }
}

// Activation checkpointing (see Note [Activation checkpointing],
// ops/recompute.h) through the whole-stack transport: zero-bubble's I/W
// split with every layer recomputed (in full and per op), and 1F1B with
// every 3rd, have the bits of the one process without it.
TEST_F(AttnResRuns, ActivationCheckpointingIsBitwiseOneProcess) {
  const auto reference = reference_run("debugmodel", 4);
  const auto layout = base_args("debugmodel", 4) +
                      " --parallelism.pipeline_parallel_degree=2"
                      " --parallelism.pipeline_parallel_stages_per_rank=2"
                      " --parallelism.attn_res_cache=false";
  expect_same_bits(reference, train("ac_full_zb", 2,
                              layout +
                                  " --parallelism.pipeline_parallel_schedule=InterleavedZeroBubble"
                                  " --activation_checkpoint.mode=full"));
  expect_same_bits(reference, train("ac_every3_1f1b", 2,
                              layout +
                                  " --parallelism.pipeline_parallel_schedule=Interleaved1F1B"
                                  " --activation_checkpoint.mode=selective"
                                  " --activation_checkpoint.selective_ac_option=3"));
  expect_same_bits(reference, train("ac_op_zb", 2,
                              layout +
                                  " --parallelism.pipeline_parallel_schedule=InterleavedZeroBubble"
                                  " --activation_checkpoint.mode=selective"
                                  " --activation_checkpoint.selective_ac_option=op"));
}

// model.attn_res = false makes kimi_k3 a chain: plain stages hand on
// {hidden} (no AttnRes transport, so no hop_bytes in the metrics), with the
// bits of one process, and a loss unlike the AttnRes model's.
TEST_F(AttnResRuns, PlainResidualsPp2x2IsBitwiseOneProcessWithoutTheTransport) {
  const auto base = base_args("debugmodel", 4) + " --model.attn_res=false";
  const auto reference = viaduct::testing::cached_reference(base);
  const auto pp = train("plain_pp2x2", 2,
                        base + " --parallelism.pipeline_parallel_degree=2"
                               " --parallelism.pipeline_parallel_schedule=Interleaved1F1B"
                               " --parallelism.pipeline_parallel_stages_per_rank=2");
  expect_same_bits(reference, pp);
  for (const auto& j : metrics(pp)) EXPECT_FALSE(j.contains("hop_bytes")) << j.dump();
  EXPECT_NE(viaduct::testing::step_losses(reference),
            viaduct::testing::step_losses(reference_run("debugmodel", 4)));
}

INSTANTIATE_TEST_SUITE_P(Transports, AttnResTransports, ::testing::Values(false, true),
                         transport_case_name);
