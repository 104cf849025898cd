// The trainer on image-text data (see Note [Image-text rows], data/sampler.h):
// a step counts the caption's tokens alone, a resumed run continues the
// uninterrupted one bitwise (the data cursor over records included), the
// images reach the loss, and eval reads the held-out image-text file.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include "config/config.h"
#include "core/check.h"
#include "data/image_text_file.h"
#include "data/temp_dir.h"
#include "train/trainer.h"

using namespace viaduct;
namespace fs = std::filesystem;

namespace {

// n records of 3 x 16 x 16 pixels (all `blank` when set), each with 2..5
// byte tokens and the end of text; returns the caption tokens written.
int64_t write_image_file(const std::string& path, int n, uint32_t seed, bool blank = false) {
  data::ImageTextWriter w(path, 3, 16, 257, "byte");
  std::mt19937 rng(seed);
  std::vector<uint8_t> img(3 * 16 * 16);
  int64_t tokens = 0;
  for (int r = 0; r < n; ++r) {
    for (auto& p : img) p = blank ? 0 : static_cast<uint8_t>(rng() % 256);
    std::vector<int64_t> caption;
    for (unsigned j = 0; j < 2 + rng() % 4; ++j) caption.push_back(97 + rng() % 26);
    caption.push_back(256);
    tokens += static_cast<int64_t>(caption.size());
    w.append(img.data(), caption);
  }
  w.finish();
  return tokens;
}

struct ImageJob {
  data::testing::TempDir dir;
  std::string data_path = (fs::path(dir.path()) / "train.img").string();
  int64_t caption_tokens = write_image_file(data_path, 16, 11);
  ImageJob() { write_image_file((fs::path(dir.path()) / "train.val.img").string(), 8, 12); }
  Config config(std::vector<std::string> extra = {}) const {
    std::vector<std::string> o = {
        "model.family=kimi_k3", "model.flavor=debugmodel", "model.n_layers=4",
        "model.attn_res_block_size=2", "model.vision=true",
        "training.seq_len=10", "training.local_batch_size=4", "training.steps=6",
        "training.num_threads=1", "training.eval_interval=0", "data.shuffle=true",
        "metrics.progress_bar=false", "lr_scheduler.warmup_steps=1",
        "data.path=" + data_path, "data.eval_batches=2",
        "job.dump_folder=" + (fs::path(dir.path()) / "out").string()};
    o.insert(o.end(), extra.begin(), extra.end());
    return Config::parse("", "test", o);
  }
};

}  // namespace

TEST(ImageTraining, StepsCountCaptionTokensAndAnEpochSeesEveryOne) {
  ImageJob job;
  Trainer t(job.config());
  int64_t tokens = 0;
  for (int i = 0; i < 4; ++i) tokens += t.train_step().tokens;  // 16 records, 4 a step
  EXPECT_EQ(tokens, job.caption_tokens);
}

TEST(ImageTraining, ResumeContinuesBitwise) {
  ImageJob a, b;
  Trainer ta(a.config());
  std::vector<double> reference;
  for (int i = 0; i < 6; ++i) reference.push_back(ta.train_step().loss);
  const std::vector<std::string> ck = {"checkpoint.enable=true", "checkpoint.interval=3"};
  {
    Trainer tb(b.config(ck));
    for (int i = 0; i < 3; ++i) EXPECT_EQ(tb.train_step().loss, reference[i]);
    tb.save_checkpoint();
  }
  Trainer tc(b.config(ck));
  ASSERT_TRUE(tc.resume());
  for (int i = 3; i < 6; ++i) EXPECT_EQ(tc.train_step().loss, reference[i]) << "step " << i + 1;
  const auto& pa = ta.optimizer().params();
  const auto& pc = tc.optimizer().params();
  ASSERT_EQ(pa.size(), pc.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(torch::equal(pa[i].param, pc[i].param)) << pa[i].fqn;
  }
}

TEST(ImageTraining, TheImagesReachTheLossAndEvalReadsTheHeldOutFile) {
  ImageJob job;
  Trainer real(job.config());
  const double with_images = real.train_step().loss;
  // The same captions with blank images.
  data::testing::TempDir other;
  const auto blank = (fs::path(other.path()) / "blank.img").string();
  write_image_file(blank, 16, 11, true);
  Trainer t(job.config({"data.path=" + blank}));
  EXPECT_NE(t.train_step().loss, with_images);
  EXPECT_TRUE(std::isfinite(real.evaluate()));
  // The tower's size must be the data's.
  EXPECT_THROW(Trainer(job.config({"model.vision_image_size=32"})), ConfigError);
  // A model without a tower refuses image-text data.
  EXPECT_THROW(Trainer(job.config({"model.vision=false"})), ConfigError);
}
