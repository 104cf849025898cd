// `viaduct eval-captions` as a user runs it, against a second computation
// here: the checkpoint's model loaded in this process scores each image
// alone (one row per caption, no batching) with the summed loss of every
// label's caption; the guess is the lowest, the truth the image's own
// caption. The command's accuracy must equal it exactly and its class-name
// losses agree to rounding, with the real images and with blank ones; a
// caption no label gives is refused naming the record.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "checkpoint/checkpoint.h"
#include "checkpoint/manager.h"
#include "common/process_runs.h"
#include "config/config.h"
#include "config/job_config.h"
#include "data/image_text_file.h"
#include "data/temp_dir.h"
#include "model/family.h"
#include "model/model.h"
#include "train/expert_parallel.h"

namespace viaduct {
namespace {

namespace fs = std::filesystem;
namespace ck = checkpoint;

const std::vector<std::string> kLabels{"cat", "dog", "bird"};

std::vector<int64_t> caption_of(size_t label) {
  std::vector<int64_t> c;
  for (unsigned char ch : "a " + kLabels[label]) c.push_back(ch);
  c.push_back(256);
  return c;
}

// n records, label r % 3, images whose brightness says the label (so a
// few steps learn something) plus noise.
void write_labelled(const std::string& path, int n, uint32_t seed) {
  data::ImageTextWriter w(path, 3, 16, 257, "byte");
  std::mt19937 rng(seed);
  std::vector<uint8_t> img(3 * 16 * 16);
  for (int r = 0; r < n; ++r) {
    for (auto& p : img) p = static_cast<uint8_t>(80 * (r % 3) + rng() % 60);
    w.append(img.data(), caption_of(static_cast<size_t>(r % 3)));
  }
  w.finish();
}

TEST(EvalCaptions, MatchesImageByImageScoringOfTheCheckpoint) {
  data::testing::TempDir dir;
  const auto train = dir.file("train.img"), test = dir.file("test.img");
  write_labelled(train, 48, 1);
  write_labelled(test, 21, 2);
  const auto out = dir.file("run");
  testing::run_viaduct_ok(
      1, " train --model.family=kimi_k3 --model.flavor=debugmodel --model.n_layers=4"
         " --model.attn_res_block_size=2 --model.vision=true --training.seq_len=12"
         " --training.local_batch_size=8 --training.steps=6 --training.num_threads=1"
         " --training.eval_interval=0 --metrics.progress_bar=false --checkpoint.enable=true"
         " --checkpoint.interval=6 --data.path=" + train + " --job.dump_folder=" + out);
  const auto result_path = dir.file("r.json");
  testing::run_viaduct_ok(1, " eval-captions --checkpoint " + out + "/checkpoint --data " + test +
                                 " --labels cat,dog,bird --caption 'a {label}' --batch 4"
                                 " --device cpu --output " + result_path);
  std::ifstream in(result_path);
  const auto result = nlohmann::json::parse(in);

  // The reference: the checkpoint's model, one image and one caption a row.
  const fs::path step = ck::checkpoint_dir(out + "/checkpoint",
                                           *ck::find_latest_checkpoint(out + "/checkpoint"));
  ck::Checkpoint c = ck::open_checkpoint(step);
  const auto job = JobConfig::from(Config::parse(c.metadata.config_toml, "metadata.json"));
  auto model = build_model_part(job);
  load_part_tensors(c.tensors, *model);
  c.tensors.load_into(model->extra_state());
  model->eval();
  torch::NoGradGuard no_grad;
  const auto image = *image_input(job);
  const int64_t P = image.patches;
  data::ImageTextFile file(test);
  auto score = [&](const at::Tensor& img, size_t k, double& name_loss) {
    const auto cap = caption_of(k);
    const auto L = static_cast<int64_t>(cap.size());
    auto tokens = at::full({1, P + L - 1}, image.image_token_id, at::kLong);
    for (int64_t j = 0; j + 1 < L; ++j) tokens[0][P + j] = cap[j];
    auto logp = at::log_softmax(model->forward({tokens, img})[0].to(at::kDouble), -1);
    double total = 0;
    name_loss = 0;
    for (int64_t j = 0; j < L; ++j) {
      const double nll = -logp[0][P - 1 + j][cap[j]].item<double>();
      total += nll;
      if (j >= 2 && j + 1 < L) name_loss += nll;  // after "a ", before the end
    }
    return total;
  };
  auto evaluate = [&](bool blank) {
    int64_t correct = 0;
    double name_sum = 0;
    for (int64_t i = 0; i < file.size(); ++i) {
      auto img = at::zeros({1, 1, 3, 16, 16}, at::kByte);
      if (!blank) std::memcpy(img.data_ptr<uint8_t>(), file.image(i), 3 * 16 * 16);
      const size_t truth = static_cast<size_t>(i % 3);
      size_t best = 0;
      double best_loss = 0, truth_name = 0;
      for (size_t k = 0; k < kLabels.size(); ++k) {
        double name = 0;
        const double loss = score(img, k, name);
        if (k == 0 || loss < best_loss) {
          best = k;
          best_loss = loss;
        }
        if (k == truth) truth_name = name;
      }
      correct += best == truth;
      name_sum += truth_name;
    }
    return std::make_pair(static_cast<double>(correct) / file.size(), name_sum / file.size());
  };
  const auto real = evaluate(false), blank = evaluate(true);
  EXPECT_EQ(result["images"], 21);
  EXPECT_EQ(result["labels"], 3);
  EXPECT_DOUBLE_EQ(result["accuracy"].get<double>(), real.first);
  EXPECT_DOUBLE_EQ(result["blank_accuracy"].get<double>(), blank.first);
  EXPECT_NEAR(result["class_name_loss"].get<double>(), real.second, 1e-4 * (1 + real.second));
  EXPECT_NEAR(result["blank_class_name_loss"].get<double>(), blank.second,
              1e-4 * (1 + blank.second));
  // Not vacuous: the losses with and without the images differ.
  EXPECT_GT(std::abs(real.second - blank.second), 1e-3);

  // A caption that no label gives: refused, naming the record.
  const auto r = testing::shell(std::string(VIADUCT_BINARY) + " eval-captions --checkpoint " +
                                out + "/checkpoint --data " + test +
                                " --labels cat,dog,fish --caption 'a {label}' 2>&1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("record 2"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace viaduct
