// Bad input that must neither lose data nor be silently accepted: each case
// a user met, against `viaduct` processes, with its message, its exit code,
// and (where a refusal could have written) the folder unchanged.
#include <gtest/gtest.h>
#include <signal.h>
#include <zlib.h>

#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/process_runs.h"
#include "core/file_io.h"
#include "data/temp_dir.h"
#include "survive_util.h"

namespace viaduct::testing {
namespace {
namespace fs = std::filesystem;
using data::testing::TempDir;

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override { write_random_corpus(dir_.file("corpus.tok"), 7, 6000); }
  // A small job with checkpoints every `interval` steps.
  std::string ckpt_job(const std::string& dump, int steps, int interval = 2) const {
    return job(dir_, dump, steps) + " --checkpoint.enable=true --checkpoint.interval=" +
           std::to_string(interval);
  }
  TempDir dir_;
};

// (step, kind) of every line of a metrics.jsonl: "step" or "eval".
std::vector<std::pair<int64_t, std::string>> metric_lines(const fs::path& file) {
  std::vector<std::pair<int64_t, std::string>> out;
  for (const auto& line : lines_of(file)) {
    const auto j = nlohmann::json::parse(line);
    out.emplace_back(j.at("step").get<int64_t>(), j.contains("loss") ? "step" : "eval");
  }
  return out;
}

// ---- lost or corrupted data ----------------------------------------------------

TEST_F(BadInput, AFreshRunOnAFolderWithARunIsRefusedOrMovesItAsideWhenAsked) {
  auto r = shell(kBin + ckpt_job("run", 4));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto before = snapshot(dir_.file("run"));
  r = shell(kBin + ckpt_job("run", 2) + " --checkpoint.resume=false");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "job.dump_folder " + dir_.file("run") + " holds a run");
  expect_has(r.output, "checkpoints step-2 ... step-4");
  expect_has(r.output, "checkpoint.move_old_run_aside = true");
  EXPECT_EQ(snapshot(dir_.file("run")), before);

  // Asked to, the old run goes aside whole and the new one starts at step 1.
  r = shell(kBin + ckpt_job("run", 2) +
            " --checkpoint.resume=false --checkpoint.move_old_run_aside=true");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  fs::path aside;
  for (const auto& de : fs::directory_iterator(dir_.file("run"))) {
    if (de.path().filename().string().rfind("old-run-", 0) == 0) aside = de.path();
  }
  ASSERT_FALSE(aside.empty()) << r.output;
  for (const auto& [rel, text] : before) {
    if (rel == "viaduct.lock") continue;
    ASSERT_TRUE(fs::exists(aside / rel)) << rel;
    if (text != "<dir>") EXPECT_EQ(read_file(aside / rel), text) << rel;
  }
  // A plain restart now resumes the new run, never the old one.
  r = shell(kBin + ckpt_job("run", 3));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_has(r.output, "at step 2");
  std::vector<int64_t> steps;
  for (const auto& [step, kind] : metric_lines(dir_.file("run/metrics.jsonl"))) steps.push_back(step);
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3}));
}

void write_gzip(const std::string& path, const std::string& text) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, text.data(), static_cast<unsigned>(text.size())),
            static_cast<int>(text.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
}

TEST_F(BadInput, ATruncatedOrCorruptGzipIsRefusedNamingTheFile) {
  std::string text;
  for (int i = 0; i < 3000; ++i) text += "{\"text\": \"document number " + std::to_string(i) + "\"}\n";
  const std::string good = dir_.file("good.jsonl.gz");
  write_gzip(good, text);
  auto r = shell(kBin + " prepare-data --input " + good + " --output " + dir_.file("good.tok"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_has(r.output, "3000");
  const std::string bytes = read_file(good);
  // Cut short (the trailer and the stream's end gone) and a flipped CRC.
  const std::string cut = dir_.file("cut.jsonl.gz"), crc = dir_.file("crc.jsonl.gz");
  data::testing::write_text(cut, bytes.substr(0, bytes.size() * 2 / 3));
  std::string flipped = bytes;
  flipped[flipped.size() - 8] ^= 0x5a;  // the CRC-32 of the trailer
  data::testing::write_text(crc, flipped);
  for (const auto& [input, says] : std::vector<std::pair<std::string, std::string>>{
           {cut, "is a truncated or corrupt gzip file"}, {crc, "is not a readable gzip file"}}) {
    r = shell(kBin + " prepare-data --input " + input + " --output " + dir_.file("out.tok"));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    expect_has(r.output, "'" + input + "' " + says);
    EXPECT_FALSE(fs::exists(dir_.file("out.tok"))) << r.output;
  }
}

TEST_F(BadInput, PrepareDataRefusesAnOutputThatIsAnInput) {
  const std::string text = dir_.file("corpus.txt");
  data::testing::write_text(text, "one document\n");
  fs::create_symlink(text, dir_.file("link.tok"));
  for (const std::string& out : {text, dir_.file("link.tok")}) {
    const auto r = shell(kBin + " prepare-data --input " + text + " --output " + out);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    expect_has(r.output, "the output '" + out + "' is the input '" + text + "'");
    EXPECT_EQ(read_file(text), "one document\n");
  }
}

TEST_F(BadInput, TheFolderLockHoldsWhenItsFileIsDeletedAndARemovedFolderStopsTheRun) {
  Background first(job(dir_, "run", 1000000), dir_.file("first.log"));
  const fs::path lock = dir_.file("run/viaduct.lock");
  ASSERT_TRUE(wait_until([&] { return !read_file(lock).empty(); })) << first.output();
  ASSERT_TRUE(wait_until([&] { return !read_file(dir_.file("run/metrics.jsonl")).empty(); }));
  fs::remove(lock);
  auto r = shell(kBin + job(dir_, "run", 2));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  expect_has(r.output, "is in use by another viaduct process");
  // The dump folder removed under the live trainer ends it with an error.
  viaduct::remove_tree(dir_.file("run"));
  EXPECT_EQ(first.wait(), 1) << first.output();
  expect_has(first.output(), "was removed");
}

TEST_F(BadInput, ARestartFromScratchLeavesOneLinePerStep) {
  write_random_corpus(dir_.file("corpus.val.tok"), 8, 2000);
  // Checkpoints on, none written yet (killed before the first save), and
  // checkpoints off: each restart starts from step 0 again.
  for (const std::string& extra :
       {std::string(" --checkpoint.enable=true --checkpoint.interval=1000 "
                    "--checkpoint.save_final=false"),
        std::string(" --checkpoint.enable=false")}) {
    const std::string dump = extra.find("false") != std::string::npos &&
                                     extra.find("save_final") == std::string::npos
                                 ? "off"
                                 : "none";
    const std::string run = job(dir_, dump, 3) + " --training.eval_interval=2" + extra;
    for (int attempt = 0; attempt < 2; ++attempt) {
      const auto r = shell(kBin + run);
      ASSERT_EQ(r.exit_code, 0) << r.output;
    }
    const auto lines = metric_lines(dir_.file(dump + "/metrics.jsonl"));
    const std::vector<std::pair<int64_t, std::string>> reference{
        {0, "eval"}, {1, "step"}, {2, "step"}, {2, "eval"}, {3, "step"}, {3, "eval"}};
    EXPECT_EQ(lines, reference) << dump;
  }
}

TEST_F(BadInput, ConvertRefusesAnOutputThatHoldsACheckpointEitherWay) {
  auto r = shell(kBin + ckpt_job("run", 2));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string hf = dir_.file("hf");
  r = shell(kBin + " convert --to hf --input " + dir_.file("run/checkpoint") + " --output " + hf);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto before = snapshot(dir_.file("run"));
  r = shell(kBin + " convert --to viaduct --input " + hf + " --output " +
            dir_.file("run/checkpoint") + " --model.n_layers=2");
  EXPECT_NE(r.exit_code, 0) << r.output;  // --config is required first
  r = shell(kBin + " convert --to viaduct --input " + hf + " --output " +
            dir_.file("run/checkpoint") + " --config " + VIADUCT_SOURCE_DIR +
            "/configs/llama_debug.toml --model.n_layers=2");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  expect_has(r.output, "--output '" + dir_.file("run/checkpoint") +
                           "' already holds checkpoints (step-2)");
  r = shell(kBin + " convert --to hf --input " + dir_.file("run/checkpoint") + " --output " + hf);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(snapshot(dir_.file("run")), before);
}

// ---- settings silently ignored or accepted -------------------------------------

TEST_F(BadInput, NanAndInfinityAreRefusedWhereverANumberIsRead) {
  const std::string toml = dir_.file("nan.toml");
  data::testing::write_text(toml, "[training]\nmax_norm = nan\n");
  for (const std::string& args : std::vector<std::string>{
           " train --training.max_norm=nan --print-config",
           " train --training.max_norm=inf --print-config",
           " train --optimizer.lr=-inf --print-config", " train --config " + toml + " --print-config",
           " train --data.paths=a,b --data.weights=1,nan --print-config"}) {
    const auto r = shell(kBin + args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    expect_has(r.output, "must be a finite number");
  }
  auto r = shell(kBin + " plan --device-gib inf");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "--device-gib must be a finite number");
  r = shell(kBin + " launch --nproc-per-node 1 --timeout inf -- true");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "--timeout expects seconds (a finite number >= 0), got 'inf'");
  r = shell(kBin + " prepare-data --input " + dir_.file("corpus.tok") + " --output " +
            dir_.file("o.tok") + " --val-fraction nan");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "is not a finite number");
}

TEST_F(BadInput, ASecondConfigFileIsRefused) {
  const std::string a = dir_.file("a.toml"), b = dir_.file("b.toml");
  data::testing::write_text(a, "[training]\nsteps = 3\n");
  data::testing::write_text(b, "[training]\nsteps = 5\n");
  const auto r = shell(kBin + " train --config " + a + " --config=" + b + " --print-config");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "--config given twice ('" + a + "' and '" + b + "')");
}

TEST_F(BadInput, EveryFamilyRefusesTheKeysOfAnother) {
  const std::vector<std::pair<std::string, std::string>> cases{
      {"--model.image_token_id=300", "model.image_token_id (from the command line) does not apply "
                                     "to model.family = llama"},
      {"--model.vision=true", "model.vision (from the command line) does not apply to "
                              "model.family = llama"},
      {"--model.n_routed_experts=8", "does not apply to model.family = llama"},
      {"--model.attn_res=false", "model.attn_res (from the command line) does not apply to "
                                 "model.family = llama"},
      {"--model.cuda_kernels=false --model.family=exact16", "model.cuda_kernels"},
      {"--model.family=gpt2 --model.rope_theta=10000", "model.rope_theta (from the command line) "
                                                       "does not apply to model.family = gpt2"},
      {"--model.family=kimi_k3 --model.n_kv_heads=2", "model.n_kv_heads (from the command line) "
                                                      "does not apply to model.family = kimi_k3"},
  };
  for (const auto& [arg, says] : cases) {
    for (const std::string& command : {"train", "plan", "describe"}) {
      const auto r = shell(kBin + " " + command + " " + arg +
                           (command == "train" ? " --print-config" : ""));
      EXPECT_EQ(r.exit_code, 2) << command << " " << arg << "\n" << r.output;
      expect_has(r.output, says);
    }
  }
  // What a family does read is still taken.
  EXPECT_EQ(shell(kBin + " describe --model.family=kimi_k3 --model.n_routed_experts=4").exit_code, 0);
  EXPECT_EQ(shell(kBin + " describe --model.family=gpt2 --model.n_kv_heads=4").exit_code, 0);
}

TEST_F(BadInput, BlendWeightsWhoseSumOverflowsAreRefused) {
  const auto r = shell(kBin + " train --data.paths=a,b --data.weights=[1e308,1e308] --print-config");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "data.weights = [1e+308, 1e+308] (from the command line) sum past the "
                       "largest number");
}

TEST_F(BadInput, AMissingTokenizerStopsEveryCommandAtLoad) {
  const std::string missing = dir_.file("missing.json");
  for (const std::string& command : {" train" + job(dir_, "run", 2).substr(6), std::string(" plan"),
                                     std::string(" split")}) {
    const auto r = shell(kBin + command + " --data.tokenizer=" + missing);
    EXPECT_EQ(r.exit_code, 2) << command << "\n" << r.output;
    expect_has(r.output, "data.tokenizer (from the command line): the tokenizer '" + missing +
                             "' does not exist");
  }
  EXPECT_FALSE(fs::exists(dir_.file("run")));
}

TEST_F(BadInput, PlanAndSplitRefuseWhatTrainRefuses) {
  const std::string gpt2_pp2 = " --config " + std::string(VIADUCT_SOURCE_DIR) +
                               "/configs/gpt2_debug.toml --parallelism.pipeline_parallel_degree=2";
  for (const std::string& command : {"plan", "split", "schedule", "train"}) {
    const auto r = shell(kBin + " " + command + gpt2_pp2 +
                         (command == std::string("train") ? " --print-config" : ""));
    EXPECT_EQ(r.exit_code, 2) << command << "\n" << r.output;
    expect_has(r.output, "model.tie_embeddings = true needs tok_embeddings and lm_head in the "
                         "same part");
  }
  EXPECT_EQ(shell(kBin + " plan" + gpt2_pp2 + " --model.tie_embeddings=false").exit_code, 0);
}

TEST_F(BadInput, ResumingUnderAnotherOptimizerIsRefusedUnlessAsked) {
  auto r = shell(kBin + ckpt_job("run", 2));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto before = snapshot(dir_.file("run"));
  r = shell(kBin + ckpt_job("run", 4) + " --optimizer.name=SGD");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "it was saved with optimizer.name = AdamW, this config has SGD");
  expect_has(r.output, "checkpoint.resume_with_new_optimizer = true");
  EXPECT_EQ(snapshot(dir_.file("run")), before);
  r = shell(kBin + ckpt_job("run", 4) +
            " --optimizer.name=SGD --checkpoint.resume_with_new_optimizer=true");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  expect_has(r.output, "its AdamW state (");
  expect_has(r.output, "is dropped and SGD starts fresh");
  expect_has(r.output, "at step 2");
}

// ---- misleading errors ---------------------------------------------------------

TEST_F(BadInput, AHeldOutTokenPastTheVocabIsNamedWithItsFile) {
  {
    data::TokenFileWriter w(dir_.file("corpus.val.tok"), 70000, "big");
    w.append({5, 6, 60000, 7});
    w.finish();
  }
  const auto r = shell(kBin + job(dir_, "run", 2) + " --training.eval_interval=1");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "the held-out data '" + dir_.file("corpus.val.tok") + "'");
  expect_has(r.output, "holds token id 60000");
}

TEST_F(BadInput, LaunchReportsTheRankThatFailedFirstWithItsOwnError) {
  // Only pp rank 0 holds the embedding, so only it checks the token ids;
  // rank 1 fails after it, on the closed connection.
  {
    data::TokenFileWriter w(dir_.file("big.tok"), 70000, "big");
    std::vector<int64_t> toks(4000, 65);
    toks[10] = 60000;
    w.append(toks);
    w.finish();
  }
  const auto r = shell(kBin + " launch --nproc-per-node 2 -- " + kBin + " train --data.path=" +
                       dir_.file("big.tok") + " --job.dump_folder=" + dir_.file("run") +
                       " --training.steps=2 --training.eval_interval=0 "
                       "--training.local_batch_size=2 --training.seq_len=32 --model.n_layers=2 "
                       "--parallelism.pipeline_parallel_degree=2 --metrics.progress_bar=false");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "viaduct launch: rank 0 exited with status 2: viaduct train: config "
                       "error: the data '" + dir_.file("big.tok") + "' holds token id 60000");
  expect_has(r.output, "viaduct launch: failed: rank 0 exited with status 2");
}

TEST_F(BadInput, CommandLineMistakesAreNamed) {
  auto r = shell(kBin + " checkpoint frobnicate " + dir_.path().string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "unknown subcommand 'frobnicate'");
  r = shell(kBin + " checkpoint compare " + dir_.path().string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "compare takes two folders, got 1 argument");
  r = shell(kBin + " convert --to onnx --input a --output b");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "--to must be hf or viaduct, got 'onnx'");
  // The launcher's own shape is config too: exit 2, as docs/troubleshooting.md says.
  r = shell(kBin + " launch --nproc-per-node 0 -- true");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "--nproc-per-node must be in [1, 4096], got 0");
  // The standalone commands' options of one value: an unknown one named
  // with the usage, exit 2; a missing value named, exit 2; both spellings
  // of a value read alike (the next check fails past the parsing).
  for (const std::string& command : {"prepare-data", "prepare-images", "eval-captions"}) {
    r = shell(kBin + " " + command + " --frobnicate=1");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    expect_has(r.output, "viaduct " + command + ": unknown argument '--frobnicate=1'");
    expect_has(r.output, "usage:");
    r = shell(kBin + " " + command + " --output");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    expect_has(r.output, "--output needs a value");
  }
  r = shell(kBin + " prepare-data --threads=zero --input x --output y");
  EXPECT_NE(r.exit_code, 0) << r.output;
  const auto spelled_apart = shell(kBin + " prepare-data --threads zero --input x --output y");
  EXPECT_EQ(spelled_apart.exit_code, r.exit_code);
  EXPECT_EQ(spelled_apart.output, r.output);
  // Help goes to stdout (a pipe), and names the SentencePiece files.
  r = shell(kBin + " --help 2>/dev/null");
  EXPECT_EQ(r.exit_code, 0);
  expect_has(r.output, "commands:");
  for (const std::string& command : {"prepare-data", "tokenize"}) {
    r = shell(kBin + " " + command + " --help 2>/dev/null");
    EXPECT_EQ(r.exit_code, 0);
    expect_has(r.output, "SentencePiece model");
    expect_has(r.output, ".model");
  }
}

TEST_F(BadInput, ASignalWithoutCheckpointsSaysItSavesNothing) {
  Background run(job(dir_, "run", 1000000), dir_.file("run.log"));
  ASSERT_TRUE(wait_until([&] { return !read_file(dir_.file("run/metrics.jsonl")).empty(); }))
      << run.output();
  run.signal(SIGTERM);
  EXPECT_EQ(run.wait(), 128 + SIGTERM);
  expect_has(run.output(), "got SIGTERM: finishing this step and exiting without saving");
  EXPECT_EQ(run.output().find("saving a checkpoint"), std::string::npos) << run.output();
}

}  // namespace
}  // namespace viaduct::testing
