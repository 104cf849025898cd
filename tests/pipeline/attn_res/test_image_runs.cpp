// Kimi-K3 with its vision tower on image-text data (see Note [Image-text rows],
// data/sampler.h), ranks as processes over Gloo: under every pipeline
// layout, with the tower on the first stage, three steps train to exactly
// the bits of one process (losses, every parameter and optimizer-state
// tensor). The one-process reference comes from the reference cache.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <sstream>

#include "common/process_runs.h"
#include "common/reference_cache.h"
#include "core/file_io.h"
#include "data/image_text_file.h"
#include "data/temp_dir.h"

namespace fs = std::filesystem;

namespace {

// 96 records of 3 x 16 x 16 random pixels, each with 3..7 random byte
// tokens and the end of text: the same file in every test process.
std::string cached_images() {
  const auto dir = viaduct::testing::cached("images", "k3-16px-96", [](const fs::path& tmp) {
    viaduct::data::ImageTextWriter w((tmp / "d.img").string(), 3, 16, 257, "byte");
    std::mt19937 rng(4321);
    std::vector<uint8_t> img(3 * 16 * 16);
    for (int r = 0; r < 96; ++r) {
      for (auto& p : img) p = static_cast<uint8_t>(rng() % 256);
      std::vector<int64_t> caption;
      for (unsigned j = 0; j < 3 + rng() % 5; ++j) caption.push_back(97 + rng() % 26);
      caption.push_back(256);
      w.append(img.data(), caption);
    }
    w.finish();
    return true;
  });
  return (dir / "d.img").string();
}

struct ImageLayout {
  int pp, stages_per_rank, micro;
  std::string schedule;
};

std::string image_layout_name(const ::testing::TestParamInfo<ImageLayout>& info) {
  const auto& l = info.param;
  return "pp" + std::to_string(l.pp) + "_" + l.schedule + "_v" +
         std::to_string(l.stages_per_rank) + "_m" + std::to_string(l.micro);
}

class ImageRuns : public ::testing::TestWithParam<ImageLayout> {
 protected:
  static void SetUpTestSuite() { dir_ = new viaduct::data::testing::TempDir(); }
  static void TearDownTestSuite() { delete dir_; }

  // P = (16 / 8)^2 = 4 placeholders, captions of at most 8 tokens.
  static std::string base_args(int micro, int steps = 3) {
    std::ostringstream os;
    os << " --model.family=kimi_k3 --model.flavor=debugmodel --model.vision=true"
       << " --training.seq_len=12 --training.local_batch_size=8 --training.steps=" << steps
       << " --training.num_threads=1 --training.eval_interval=0 --data.shuffle=true"
       << " --metrics.progress_bar=false --optimizer.lr=0.01"
       << " --checkpoint.enable=true --checkpoint.interval=" << steps
       << " --parallelism.pipeline_parallel_microbatches=" << micro
       << " --data.path=" << cached_images();
    return os.str();
  }
  static std::string train(const std::string& name, int nproc, const std::string& args) {
    const auto out = (fs::path(dir_->path()) / name).string();
    viaduct::remove_tree(out);
    viaduct::testing::run_viaduct_ok(nproc, " train" + args + " --job.dump_folder=" + out);
    return out;
  }
  static viaduct::data::testing::TempDir* dir_;
};
viaduct::data::testing::TempDir* ImageRuns::dir_ = nullptr;

}  // namespace

TEST_P(ImageRuns, IsBitwiseOneProcess) {
  const auto& l = GetParam();
  const auto reference = viaduct::testing::cached_reference(base_args(l.micro));
  std::ostringstream args;
  args << base_args(l.micro) << " --parallelism.pipeline_parallel_degree=" << l.pp
       << " --parallelism.pipeline_parallel_schedule=" << l.schedule
       << " --parallelism.pipeline_parallel_stages_per_rank=" << l.stages_per_rank
       // The whole-stack transport: the rank cache, where a rank holds two
       // stages, stays within rounding of one process, not its bits
       // (test_attn_res_runs.cpp).
       << " --parallelism.attn_res_cache=false";
  const auto run = train(image_layout_name({l, 0}), l.pp, args.str());
  viaduct::testing::expect_same_bits(reference, run, 3);
  // Not vacuous: the images reach the loss (each step trains on new ones,
  // and the losses are of caption tokens only, so they differ from step to
  // step).
  const auto losses = viaduct::testing::step_losses(run);
  ASSERT_EQ(losses.size(), 3u);
  EXPECT_NE(losses[0], losses[1]);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ImageRuns,
                         ::testing::Values(ImageLayout{2, 1, 2, "1F1B"},
                                           ImageLayout{2, 2, 4, "Interleaved1F1B"},
                                           ImageLayout{4, 1, 4, "GPipe"}),
                         image_layout_name);
