// Every schedule, at pp 2 and 4 with 1-4 stages per rank and uneven splits,
// trains three AdamW steps to exactly the bits of one process running the
// same micro-batches: the losses and every parameter and optimizer-state
// tensor (which differ whenever any gradient bit differs). Ranks are
// processes started by `viaduct launch`, talking Gloo over loopback. The
// one-process references come from the build tree's reference cache
// (common/reference_cache.h), trained once per binary.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
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

class PipelineRuns : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new viaduct::data::testing::TempDir();
    data_ = viaduct::testing::cached_corpus(12345, 20000, 777, 4000);
  }
  static void TearDownTestSuite() { delete dir_; }

  static std::string base_args(const std::string& family, int layers, int micro) {
    std::ostringstream os;
    os << " --model.family=" << family << " --model.n_layers=" << layers
       << " --model.dim=32 --model.n_heads=4 --model.tie_embeddings=false"
       << (family == "llama" ? " --model.n_kv_heads=2" : "")
       << " --training.seq_len=16 --training.local_batch_size=8 --training.steps=3"
       << " --training.num_threads=1 --training.eval_interval=0"
       << " --metrics.progress_bar=false --optimizer.lr=0.01"
       << " --checkpoint.enable=true --checkpoint.interval=3"
       << " --parallelism.pipeline_parallel_microbatches=" << micro
       << " --data.path=" << data_;
    return os.str();
  }

  // Runs one job; returns its dump folder.
  static std::string train(const std::string& name, int nproc, const std::string& args,
                           const std::string& env = "") {
    const auto out = (fs::path(dir_->path()) / name).string();
    viaduct::remove_tree(out);
    last_ = viaduct::testing::run_viaduct_ok(nproc, " train" + args + " --job.dump_folder=" + out,
                                             env);
    return out;
  }

  static std::vector<std::string> losses(const std::string& dump) {
    return viaduct::testing::step_losses(dump);
  }
  static void expect_same_bits(const std::string& a, const std::string& b) {
    viaduct::testing::expect_same_bits(a, b, 3);
  }

  // The single-process reference for (family, layers, micro-batches).
  static std::string reference_run(const std::string& family, int layers, int micro) {
    return viaduct::testing::cached_reference(base_args(family, layers, micro));
  }

  static viaduct::data::testing::TempDir* dir_;
  static std::string data_;
  static ShellRun last_;
};
viaduct::data::testing::TempDir* PipelineRuns::dir_ = nullptr;
std::string PipelineRuns::data_;
ShellRun PipelineRuns::last_;

// One pipeline layout of a small llama or gpt2.
struct Layout {
  std::string family;
  int layers, micro, pp;
  std::string schedule;
  int stages_per_rank;  // 0: the schedule's own
  int last_stage_less_layers = 0;
};

// e.g. pp2_Interleaved1F1B_v2_llama_L6_m4
std::string describe(const Layout& l) {
  std::ostringstream os;
  os << "pp" << l.pp << "_" << l.schedule;
  if (l.stages_per_rank > 0) os << "_v" << l.stages_per_rank;
  os << "_" << l.family << "_L" << l.layers << "_m" << l.micro;
  if (l.last_stage_less_layers > 0) os << "_last_less" << l.last_stage_less_layers;
  return os.str();
}
std::string layout_name(const ::testing::TestParamInfo<Layout>& info) {
  return describe(info.param);
}
void PrintTo(const Layout& l, std::ostream* os) { *os << describe(l); }

// The layout's pipeline flags, appended to a run's arguments.
std::string pipeline_flags(const Layout& l) {
  std::ostringstream args;
  args << " --parallelism.pipeline_parallel_degree=" << l.pp
       << " --parallelism.pipeline_parallel_schedule=" << l.schedule;
  if (l.stages_per_rank > 0) {
    args << " --parallelism.pipeline_parallel_stages_per_rank=" << l.stages_per_rank;
  }
  if (l.last_stage_less_layers > 0) {
    args << " --parallelism.pipeline_parallel_last_stage_less_layers="
         << l.last_stage_less_layers;
  }
  return args.str();
}

class PipelineLayouts : public PipelineRuns, public ::testing::WithParamInterface<Layout> {};

}  // namespace

TEST_P(PipelineLayouts, TrainsToTheBitsOfOneProcess) {
  const Layout& l = GetParam();
  const auto reference = reference_run(l.family, l.layers, l.micro);
  const auto args = base_args(l.family, l.layers, l.micro) + pipeline_flags(l);
  expect_same_bits(reference, train("run", l.pp, args));
}

INSTANTIATE_TEST_SUITE_P(GPipeAnd1F1B, PipelineLayouts,
                         ::testing::Values(Layout{"llama", 6, 4, 2, "GPipe", 1},
                                           Layout{"llama", 6, 4, 2, "1F1B", 1},
                                           Layout{"gpt2", 6, 4, 2, "1F1B", 1},
                                           Layout{"llama", 6, 8, 4, "1F1B", 1},
                                           Layout{"gpt2", 6, 8, 4, "GPipe", 1}),
                         layout_name);

INSTANTIATE_TEST_SUITE_P(InterleavedAndLooped, PipelineLayouts,
                         ::testing::Values(Layout{"llama", 6, 4, 2, "Interleaved1F1B", 2},
                                           Layout{"gpt2", 6, 4, 2, "Interleaved1F1B", 2},
                                           Layout{"llama", 6, 4, 2, "LoopedBFS", 2},
                                           Layout{"llama", 14, 8, 2, "Interleaved1F1B", 4},
                                           Layout{"llama", 14, 8, 4, "Interleaved1F1B", 2}),
                         layout_name);

INSTANTIATE_TEST_SUITE_P(ZeroBubbleFamily, PipelineLayouts,
                         ::testing::Values(Layout{"llama", 6, 4, 2, "InterleavedZeroBubble", 2},
                                           Layout{"gpt2", 6, 4, 2, "ZBVZeroBubble", 0},
                                           Layout{"llama", 6, 8, 4, "ZBVZeroBubble", 0},
                                           Layout{"llama", 6, 4, 2, "DualPipeV", 0},
                                           Layout{"gpt2", 14, 8, 4, "DualPipeV", 0},
                                           Layout{"llama", 14, 8, 4, "InterleavedZeroBubble", 2}),
                         layout_name);

// 7 layers + 2 units over 4 stages: 3, 2, 2, 2 units; 5 layers + 2 over 4
// stages with a heavier head; pp = 1 with 4 stages on one rank, where every
// hand-over is local.
INSTANTIATE_TEST_SUITE_P(UnevenSplitsAndLocalStages, PipelineLayouts,
                         ::testing::Values(Layout{"llama", 7, 4, 2, "Interleaved1F1B", 2},
                                           Layout{"llama", 5, 4, 2, "Interleaved1F1B", 2, 2},
                                           Layout{"llama", 6, 4, 1, "Interleaved1F1B", 4}),
                         layout_name);

// See Note [Document boundaries] (ops/documents.h): under block_causal every
// rank finds the documents of each micro-batch itself; the layouts keep the
// bits of one process, with eval, and with checkpointed layers, whose
// recompute runs after later micro-batches' forwards.
class BlockCausalLayouts : public PipelineRuns, public ::testing::WithParamInterface<Layout> {
 protected:
  static std::string block_args(const std::string& family, int layers, int micro) {
    const auto documents = viaduct::testing::cached_documents(424242, 20000, 4343, 4000);
    auto args = base_args(family, layers, micro);
    args.replace(args.find(data_), data_.size(), documents);
    return args + " --model.attn_mask_type=block_causal --training.eval_interval=3"
           " --activation_checkpoint.mode=selective --activation_checkpoint.selective_ac_option=2";
  }
};

TEST_P(BlockCausalLayouts, TrainsToTheBitsOfOneProcess) {
  const Layout& l = GetParam();
  const auto reference = viaduct::testing::cached_reference(block_args(l.family, l.layers, l.micro));
  const auto args = block_args(l.family, l.layers, l.micro) + pipeline_flags(l);
  const auto run = train("block_causal", l.pp, args);
  expect_same_bits(reference, run);
  const auto eval = [](const std::string& dump) {
    std::vector<double> out;
    std::ifstream in(fs::path(dump) / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.contains("eval_loss")) out.push_back(j["eval_loss"].get<double>());
    }
    return out;
  };
  EXPECT_EQ(eval(reference), eval(run));
  EXPECT_FALSE(eval(run).empty());
  const auto ref_steps = viaduct::testing::step_metrics(reference);
  const auto run_steps = viaduct::testing::step_metrics(run);
  ASSERT_EQ(ref_steps.size(), run_steps.size());
  for (size_t i = 0; i < run_steps.size(); ++i) {
    const auto& j = run_steps[i];
    // Documents of 1 to 12 tokens: several in each 16-token window.
    EXPECT_GT(j.value("documents_per_window", 0.0), 1.5) << j.dump();
    EXPECT_GT(j.value("mean_document_tokens", 0.0), 1.0) << j.dump();
    // Every layout counts the FLOPs of the same documents.
    EXPECT_EQ(j.value("flops", -1.0), ref_steps[i].value("flops", -2.0)) << j.dump();
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, BlockCausalLayouts,
                         ::testing::Values(Layout{"llama", 6, 4, 2, "1F1B", 1},
                                           Layout{"gpt2", 6, 4, 2, "Interleaved1F1B", 2},
                                           Layout{"llama", 6, 4, 2, "ZBVZeroBubble", 0}),
                         layout_name);

TEST_F(PipelineRuns, BlockCausalRefusesDataWithoutDocumentMarker) {
  // The plain random corpus is a viaduct file without a recorded marker.
  const auto out = (fs::path(dir_->path()) / "no_marker").string();
  const auto r = viaduct::testing::shell(std::string(VIADUCT_BINARY) + " train" +
                                         base_args("llama", 2, 1) +
                                         " --model.attn_mask_type=block_causal"
                                         " --job.dump_folder=" + out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("model.attn_mask_type"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(data_), std::string::npos) << r.output;
}

TEST_F(PipelineRuns, PipelineTimesDataParallelMatchesDataParallel) {
  const auto dp = train("dp2", 2, base_args("llama", 6, 4) +
                                      " --parallelism.data_parallel_degree=2");
  const auto ppdp = train("pp2dp2", 4, base_args("llama", 6, 4) +
                                           " --parallelism.data_parallel_degree=2"
                                           " --parallelism.pipeline_parallel_degree=2");
  const auto a = losses(dp), b = losses(ppdp);
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = std::stod(a[i]), y = std::stod(b[i]);
    EXPECT_NEAR(x, y, 1e-6 * std::abs(x)) << "step " << i + 1;
  }
}

// See Note [Overlapped data-parallel reduction]: with two stages per rank, the
// later stage's buckets start summing while the rank still runs the earlier
// stage's backward (B, W under zero bubble, deferred under LoopedBFS; with
// gradient accumulation, in the last batch only), and the run keeps the
// bits of the data-parallel run without a pipeline, whose buckets are
// summed after the step.
TEST_F(PipelineRuns, OverlappedGradientSumKeepsTheBitsOfTheSumAfterTheStep) {
  const std::string common = base_args("llama", 6, 4) +
                             " --model.vocab_size=16384 --parallelism.dp_bucket_mb=1"
                             " --parallelism.data_parallel_degree=2";
  auto overlapped = [](const std::string& dump) {
    std::vector<int64_t> out;
    for (const auto& j : viaduct::testing::step_metrics(dump)) {
      EXPECT_GT(j.value("dp_buckets", 0), 0) << j.dump();
      out.push_back(j.value("dp_buckets_overlapped", -1));
    }
    return out;
  };
  const auto after = train("dp2_after_step", 2, common);
  EXPECT_EQ(overlapped(after), (std::vector<int64_t>{0, 0, 0}));
  for (const std::string schedule : {"Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS"}) {
    SCOPED_TRACE(schedule);
    const auto run = train("dp2_pp2_" + schedule, 4,
                           common + " --parallelism.pipeline_parallel_degree=2"
                                    " --parallelism.pipeline_parallel_stages_per_rank=2"
                                    " --parallelism.pipeline_parallel_schedule=" + schedule);
    viaduct::testing::expect_same_bits(after, run, 3);
    // Rank 0 holds stages 0 and 2; stage 2's one bucket is summing while
    // stage 0 runs its last backwards.
    EXPECT_EQ(overlapped(run), (std::vector<int64_t>{1, 1, 1}));
  }
  // With two accumulated batches per step, only the second batch's
  // schedule may start the sums.
  const std::string accumulate = " --training.gradient_accumulation_steps=2";
  const auto after2 = train("dp2_after_step_accum2", 2, common + accumulate);
  const auto run2 = train("dp2_pp2_accum2", 4,
                          common + accumulate +
                              " --parallelism.pipeline_parallel_degree=2"
                              " --parallelism.pipeline_parallel_stages_per_rank=2"
                              " --parallelism.pipeline_parallel_schedule=Interleaved1F1B");
  viaduct::testing::expect_same_bits(after2, run2, 3);
  EXPECT_EQ(overlapped(run2), (std::vector<int64_t>{1, 1, 1}));
}

TEST_F(PipelineRuns, CheckpointMovesBetweenLayoutsBitwise) {
  // Reference: 4 steps on one process, checkpoints every 2.
  auto args = [&](const std::string& extra) {
    auto a = base_args("llama", 6, 4) + " --training.steps=4 --checkpoint.interval=2"
             " --checkpoint.keep_latest_k=0" + extra;
    return a;
  };
  const auto reference = viaduct::testing::cached_reference(args(""));
  // Written under pp2 x 2 stages per rank; the step-4 checkpoint is dropped,
  // then the run resumes from step 2 under one process and under pp4.
  const auto src = train("move_src", 2, args(" --parallelism.pipeline_parallel_degree=2"
                                             " --parallelism.pipeline_parallel_schedule=Interleaved1F1B"
                                             " --parallelism.pipeline_parallel_stages_per_rank=2"));
  for (const auto& [name, nproc, layout] :
       std::vector<std::tuple<std::string, int, std::string>>{
           {"move_pp1", 1, ""},
           {"move_pp4", 4, " --parallelism.pipeline_parallel_degree=4"
                           " --parallelism.pipeline_parallel_schedule=1F1B"}}) {
    const auto dst = (fs::path(dir_->path()) / name).string();
    viaduct::remove_tree(dst);
    fs::create_directories(dst);
    fs::copy(src + "/checkpoint", dst + "/checkpoint", fs::copy_options::recursive);
    viaduct::remove_tree(dst + "/checkpoint/step-4");
    std::ostringstream cmd;
    cmd << VIADUCT_BINARY;
    if (nproc > 1) {
      cmd << " launch --nproc-per-node " << nproc
          << " -- " << VIADUCT_BINARY;
    }
    cmd << " train" << args(layout) << " --job.dump_folder=" << dst;
    auto r = shell(cmd.str());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
    auto c = shell(std::string(VIADUCT_BINARY) + " checkpoint compare " + reference +
                   "/checkpoint " + dst + "/checkpoint");
    EXPECT_EQ(c.exit_code, 0) << name << "\n" << c.output;
    const auto lr = losses(reference), ld = losses(dst);
    ASSERT_EQ(ld.size(), 2u) << name;  // steps 3 and 4
    EXPECT_EQ(ld[0], lr[2]);
    EXPECT_EQ(ld[1], lr[3]);
  }
}

// See Note [ZeRO-1]: the optimizer sharded over dp 2 x pp 2 trains to the bits
// of the same run unsharded (losses, weights, every optimizer moment) at
// the same data-parallel traffic, each
// replica keeps and writes about half of its pp rank's optimizer state, and
// the sharded checkpoint resumes under other layouts, sharded or not,
// continuing with the bits of a resume from the unsharded run's checkpoint.
TEST_F(PipelineRuns, ShardedOptimizerKeepsTheBitsOfDataParallel) {
  // A 16384-token vocabulary makes each embedding a 2 MiB bucket of its own,
  // so the first and last stages shard two buckets each.
  auto args = [&](const std::string& extra) {
    return base_args("llama", 6, 4) +
           " --model.vocab_size=16384 --parallelism.dp_bucket_mb=1 --training.steps=4"
           " --checkpoint.interval=2 --checkpoint.keep_latest_k=0" + extra;
  };
  const std::string dp2pp2 =
      " --parallelism.data_parallel_degree=2 --parallelism.pipeline_parallel_degree=2";
  const auto plain = train("zero_plain", 4, args(dp2pp2));
  const auto plain_log = last_.output;
  const auto sharded = train("zero_sharded", 4, args(dp2pp2 + " --parallelism.dp_shard_optimizer=true"));
  viaduct::testing::expect_same_bits(plain, sharded, 4);
  // The same traffic: a reduce-scatter, then an all-gather of the summed
  // gradients or of the updated weights.
  auto dp_bytes = [](const std::string& dump) {
    std::vector<int64_t> out;
    for (const auto& j : viaduct::testing::step_metrics(dump)) out.push_back(j.value("dp_bytes", -1));
    return out;
  };
  ASSERT_EQ(dp_bytes(plain).size(), 4u);
  EXPECT_GT(dp_bytes(plain)[0], 0);
  EXPECT_EQ(dp_bytes(plain), dp_bytes(sharded));

  // Rank 0's optimizer bytes (logged) and the files each replica wrote.
  auto logged_bytes = [](const std::string& log) -> int64_t {
    const std::string key = "rank 0: optimizer state ";
    const auto at = log.find(key);
    if (at == std::string::npos) return -1;
    return std::stoll(log.substr(at + key.size()));
  };
  const int64_t whole = logged_bytes(plain_log), half = logged_bytes(last_.output);
  ASSERT_GT(whole, 0) << plain_log;
  ASSERT_GT(half, 0) << last_.output;
  EXPECT_NE(last_.output.find("ZeRO-1 over dp 2"), std::string::npos) << last_.output;
  // Two buckets on the first stage; each boundary moves down by fewer than
  // kShardAlign elements of each of the two moments.
  EXPECT_LE(half, whole / 2);
  EXPECT_GE(half, whole / 2 - 2 * 64 * 2 * 4);
  const auto step4 = fs::path(sharded) / "checkpoint" / "step-4";
  for (int r = 0; r < 2; ++r) {
    const auto one = fs::file_size(fs::path(plain) / "checkpoint" / "step-4" /
                                   ("optim-rank" + std::to_string(r) + ".safetensors"));
    uintmax_t pieces = 0;
    for (int d = 0; d < 2; ++d) {
      const auto f = step4 / ("optim-rank" + std::to_string(r) + "-dp" + std::to_string(d) +
                              ".safetensors");
      ASSERT_TRUE(fs::exists(f)) << f;
      EXPECT_LT(fs::file_size(f), one * 6 / 10) << f;
      pieces += fs::file_size(f);
    }
    EXPECT_GT(pieces, one) << "both halves hold every element (plus their headers)";
  }
  EXPECT_FALSE(fs::exists(step4 / "optim-rank0.safetensors"));

  // Resume from step 2 under other layouts: from the sharded checkpoint and
  // from the plain one, each continuing to step 4 with the same bits.
  auto resume = [&](const std::string& name, const std::string& from, int nproc,
                    const std::string& layout) {
    const auto dst = (fs::path(dir_->path()) / name).string();
    viaduct::remove_tree(dst);
    fs::create_directories(dst);
    fs::copy(from + "/checkpoint", dst + "/checkpoint", fs::copy_options::recursive);
    viaduct::remove_tree(dst + "/checkpoint/step-4");
    last_ = viaduct::testing::run_viaduct_ok(nproc, " train" + args(layout) +
                                                        " --job.dump_folder=" + dst);
    EXPECT_NE(last_.output.find("resumed from"), std::string::npos) << last_.output;
    return dst;
  };
  for (const auto& [name, nproc, from_sharded, from_plain] :
       std::vector<std::tuple<std::string, int, std::string, std::string>>{
           {"pp2", 2, " --parallelism.pipeline_parallel_degree=2",
            " --parallelism.pipeline_parallel_degree=2"},
           {"pp4", 4, " --parallelism.pipeline_parallel_degree=4 --parallelism.pipeline_parallel_schedule=1F1B",
            " --parallelism.pipeline_parallel_degree=4 --parallelism.pipeline_parallel_schedule=1F1B"},
           // Sharded dp 4 against plain dp 4: the same bits again.
           {"zero_dp4", 4, " --parallelism.data_parallel_degree=4 --parallelism.dp_shard_optimizer=true",
            " --parallelism.data_parallel_degree=4"}}) {
    const auto a = resume("resume_" + name + "_from_sharded", sharded, nproc, from_sharded);
    const auto b = resume("resume_" + name + "_from_plain", plain, nproc, from_plain);
    SCOPED_TRACE(name);
    viaduct::testing::expect_same_bits(a, b, 2);
  }
}

TEST_F(PipelineRuns, KilledRankEndsTheJobNamingTheRank) {
  const auto start = std::chrono::steady_clock::now();
  const auto out = (fs::path(dir_->path()) / "killed").string();
  std::ostringstream cmd;
  cmd << "VIADUCT_FAULT_KILL=1:2 " << VIADUCT_BINARY << " launch --nproc-per-node 2 -- " << VIADUCT_BINARY << " train"
      << base_args("llama", 6, 4) << " --parallelism.pipeline_parallel_degree=2"
      << " --parallelism.comm_timeout_seconds=20 --job.dump_folder=" << out;
  auto r = shell(cmd.str());
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1"), std::string::npos) << r.output;
  EXPECT_LT(secs, 60.0) << r.output;
}

TEST_F(PipelineRuns, ImpossibleLayoutsAreRefusedUpFront) {
  auto r = shell(std::string(VIADUCT_BINARY) + " train" + base_args("llama", 6, 4) +
                 " --parallelism.pipeline_parallel_degree=2 --job.dump_folder=" +
                 dir_->path().string() + "/refused");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("viaduct launch --nproc-per-node 2"), std::string::npos) << r.output;
  r = shell(std::string(VIADUCT_BINARY) + " train" + base_args("gpt2", 6, 4) +
            " --model.tie_embeddings=true --parallelism.pipeline_parallel_degree=1"
            " --parallelism.pipeline_parallel_stages_per_rank=2"
            " --parallelism.pipeline_parallel_schedule=Interleaved1F1B --job.dump_folder=" +
            dir_->path().string() + "/tied");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("tie_embeddings"), std::string::npos) << r.output;
}

TEST_F(PipelineRuns, EvalBeforeTrainingAndAfterMatchesOneProcess) {
  // Forward-only eval runs through the pipeline at step 0 (before any
  // training step) and at the end, and gives one process's bits.
  auto eval_losses = [](const std::string& dump) {
    std::vector<std::string> out;
    std::ifstream in(fs::path(dump) / "metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line);
      if (j.contains("eval_loss")) out.push_back(j["eval_loss"].dump());
    }
    return out;
  };
  const std::string ev = " --training.eval_interval=3 --data.eval_batches=2";
  const auto reference = viaduct::testing::cached_reference(base_args("llama", 6, 4) + ev);
  const auto run = train("eval_pp2", 2, base_args("llama", 6, 4) + ev +
                                            " --parallelism.pipeline_parallel_degree=2"
                                            " --parallelism.pipeline_parallel_stages_per_rank=2"
                                            " --parallelism.pipeline_parallel_schedule=Interleaved1F1B");
  const auto a = eval_losses(reference), b = eval_losses(run);
  ASSERT_EQ(a.size(), 2u);  // step 0 and step 3
  EXPECT_EQ(a, b);
}

// See Note [Measured bubble] (pipeline/runtime/executor.h): every step line of a
// pipeline run carries this rank's span, compute and P2P wait seconds and the
// measured bubble per pp rank. On CPU the intervals are disjoint host times
// inside the span, so the bounds hold exactly. The simulated bubble of 1F1B
// is (p-1)/(m+p-1): 1/3 at m = 2, 1/9 at m = 8. The measured bubbles are
// wall-clock figures, so their ordering is not asserted.
TEST_F(PipelineRuns, MeasuredBubbleIsBoundedAndSimulatedBubbleFallsWithMoreMicrobatches) {
  auto run = [&](int micro, const std::string& extra) {
    std::ostringstream os;
    os << " --model.family=llama --model.n_layers=4 --model.dim=128 --model.n_heads=4"
       << " --model.n_kv_heads=2 --training.seq_len=64 --training.local_batch_size=16"
       << " --training.steps=3 --training.num_threads=1 --training.eval_interval=0"
       << " --metrics.progress_bar=false --checkpoint.enable=false"
       << " --parallelism.pipeline_parallel_degree=2"
       << " --parallelism.pipeline_parallel_schedule=1F1B"
       << " --parallelism.pipeline_parallel_microbatches=" << micro
       << " --data.path=" << data_ << extra;
    return viaduct::testing::step_metrics(
        train("bubble_m" + std::to_string(micro) + (extra.empty() ? "" : "_off"), 2, os.str()));
  };
  const auto few = run(2, ""), many = run(8, "");
  ASSERT_EQ(few.size(), 3u) << last_.output;
  ASSERT_EQ(many.size(), 3u) << last_.output;
  for (const auto* steps : {&few, &many}) {
    for (const auto& j : *steps) {
      SCOPED_TRACE(j.dump());
      for (const char* k : {"pipeline_seconds", "pipeline_compute_seconds",
                            "pipeline_p2p_wait_seconds", "bubble_measured",
                            "bubble_measured_per_rank", "bubble_measured_mean",
                            "bubble_simulated"}) {
        ASSERT_TRUE(j.contains(k)) << k;
      }
      const double span = j["pipeline_seconds"], compute = j["pipeline_compute_seconds"],
                   wait = j["pipeline_p2p_wait_seconds"], bubble = j["bubble_measured"];
      EXPECT_GT(compute, 0.0);
      EXPECT_GE(wait, 0.0);
      EXPECT_LE(compute + wait, span);
      EXPECT_LE(span, j["step_seconds"].get<double>());
      EXPECT_GE(bubble, 0.0);
      EXPECT_LT(bubble, 1.0);
      EXPECT_DOUBLE_EQ(bubble, 1.0 - compute / span);  // rank 0 writes the line
      ASSERT_EQ(j["bubble_measured_per_rank"].size(), 2u);
      EXPECT_DOUBLE_EQ(j["bubble_measured_per_rank"][0].get<double>(), bubble);
      for (const auto& b : j["bubble_measured_per_rank"]) {
        EXPECT_GE(b.get<double>(), 0.0);
        EXPECT_LT(b.get<double>(), 1.0);
      }
      // Each pp rank's memory peak, read before the optimizer: rank 0's
      // is at most its peak at the step's end (the line's own figure), up
      // to the kernel's lazily synced RSS counters behind VmHWM on CPU.
      ASSERT_EQ(j["peak_memory_bytes_per_rank"].size(), 2u);
      for (const auto& b : j["peak_memory_bytes_per_rank"]) EXPECT_GT(b.get<double>(), 0.0);
      EXPECT_LE(j["peak_memory_bytes_per_rank"][0].get<double>(),
                1.01 * j["peak_memory_bytes"].get<double>());
    }
  }
  const double sim_few = few[0]["bubble_simulated"], sim_many = many[0]["bubble_simulated"];
  EXPECT_NEAR(sim_few, 1.0 / 3, 1e-12);
  EXPECT_NEAR(sim_many, 1.0 / 9, 1e-12);
  for (const auto* steps : {&few, &many}) {
    for (const auto& j : *steps) {
      EXPECT_EQ(j["bubble_simulated"].get<double>(), (*steps)[0]["bubble_simulated"].get<double>());
    }
  }
  // Off: no timing fields.
  const auto off = run(2, " --metrics.pipeline_timing=false");
  ASSERT_FALSE(off.empty());
  EXPECT_FALSE(off[0].contains("bubble_measured"));
  EXPECT_FALSE(off[0].contains("pipeline_compute_seconds"));
}

// Activation checkpointing (see Note [Activation checkpointing], ops/recompute.h)
// with two stages per rank, under zero-bubble's I/W split and plain 1F1B
// backward, every layer, every 2nd and per op: the bits of the one process
// without it.
TEST_F(PipelineRuns, ActivationCheckpointingTrainsToTheBitsOfOneProcess) {
  const auto reference = reference_run("llama", 6, 4);
  const auto layout = base_args("llama", 6, 4) +
                      " --parallelism.pipeline_parallel_degree=2"
                      " --parallelism.pipeline_parallel_stages_per_rank=2";
  expect_same_bits(reference, train("ac_full_zb", 2,
                              layout +
                                  " --parallelism.pipeline_parallel_schedule=InterleavedZeroBubble"
                                  " --activation_checkpoint.mode=full"));
  expect_same_bits(reference, train("ac_every2_1f1b", 2,
                              layout +
                                  " --parallelism.pipeline_parallel_schedule=Interleaved1F1B"
                                  " --activation_checkpoint.mode=selective"
                                  " --activation_checkpoint.selective_ac_option=2"));
  // Per op (see Note [Per-op activation checkpointing]): the recompute takes
  // the projections' outputs back from the forward.
  expect_same_bits(reference, train("ac_op_zb", 2,
                              layout +
                                  " --parallelism.pipeline_parallel_schedule=InterleavedZeroBubble"
                                  " --activation_checkpoint.mode=selective"
                                  " --activation_checkpoint.selective_ac_option=op"));
}
