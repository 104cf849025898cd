// `viaduct eval-captions`: zero-shot classification by caption likelihood.
// Each image of an image-text file is scored with the caption of every
// class (the template with the class's name); the class whose caption the
// model gives the lowest loss is its guess, and the class the image's own
// caption names is the truth. The same checkpoint is scored again with blank
// (all-zero) images: what the model knows without looking. Prints and
// optionally writes (atomically) the accuracy and the loss on the class
// name's tokens, with the real images and with blank ones.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/command.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/manager.h"
#include "config/config.h"
#include "config/job_config.h"
#include "core/check.h"
#include "core/file_io.h"
#include "core/log.h"
#include "core/strings.h"
#include "data/image_text_file.h"
#include "data/text_tokenizer.h"
#include "model/family.h"
#include "model/model.h"
#include "train/expert_parallel.h"

namespace viaduct::apps {
namespace {
namespace fs = std::filesystem;
namespace ck = checkpoint;

constexpr const char* kUsage =
    "usage: viaduct eval-captions --checkpoint DIR --data FILE --labels NAMES\n"
    "         [--caption TEMPLATE] [--tokenizer FILE] [--limit N] [--batch N]\n"
    "         [--threads N] [--device auto|cpu|cuda] [--output FILE.json]\n"
    "\n"
    "Zero-shot classification by caption likelihood: every image of FILE (an\n"
    "image-text file from prepare-images) is scored with the caption of each\n"
    "label; the lowest loss is the guess, the image's own caption the truth.\n"
    "  --checkpoint DIR   a run's checkpoint folder (its newest step) or a\n"
    "                     step folder; the model is the one its config builds\n"
    "  --labels NAMES     comma-separated names, as prepare-images got them\n"
    "  --caption TEMPLATE as prepare-images got it; default \"{label}\"\n"
    "  --tokenizer FILE   as prepare-images got it; default byte\n"
    "  --limit N          the first N images only; default all\n"
    "  --batch N          images per forward (each with every caption);\n"
    "                     default 32\n"
    "  --threads N        intra-op threads; default the config's\n"
    "                     training.num_threads\n"
    "  --device D         where the model runs; default auto (cuda when there\n"
    "                     is one)\n"
    "  --output FILE      also write the results as JSON\n";

int64_t parse_count(const std::string& name, const std::string& value) {
  char* end = nullptr;
  const long long v = std::strtoll(value.c_str(), &end, 10);
  VIADUCT_CHECK_T(ConfigError, !value.empty() && *end == '\0' && v >= 1, name, ": '", value,
                  "' is not a count >= 1");
  return v;
}

struct Scores {
  int64_t correct = 0;
  double name_loss = 0;  // summed over images: the true caption's name tokens
  std::vector<int64_t> per_class_correct, per_class_total;
};

int eval_captions_main(int argc, char** argv) {
  std::string checkpoint_dir, data_path, labels, caption = "{label}", tokenizer_spec = "byte",
                                                 output;
  std::string device_name = "auto";
  int64_t limit = -1, batch = 32, threads = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    static const std::vector<std::string> kValued{"--checkpoint", "--data",  "--labels",
                                                  "--caption",    "--tokenizer", "--limit",
                                                  "--batch",      "--threads", "--output",
                                                  "--device"};
    const auto opt = valued_option(argc, argv, i, kValued, "eval-captions", kUsage);
    if (!opt) return 2;
    const std::string &name = opt->name, &value = opt->value;
    if (name == "--checkpoint") checkpoint_dir = value;
    else if (name == "--data") data_path = value;
    else if (name == "--labels") labels = value;
    else if (name == "--caption") caption = value;
    else if (name == "--tokenizer") tokenizer_spec = value;
    else if (name == "--limit") limit = parse_count(name, value);
    else if (name == "--batch") batch = parse_count(name, value);
    else if (name == "--threads") threads = parse_count(name, value);
    else if (name == "--output") output = value;
    else if (name == "--device") device_name = value;
  }
  if (checkpoint_dir.empty() || data_path.empty() || labels.empty()) {
    std::fprintf(stderr, "viaduct eval-captions: --checkpoint, --data and --labels are "
                         "required\n\n%s", kUsage);
    return 2;
  }
  VIADUCT_CHECK_T(ConfigError, caption.find("{label}") != std::string::npos, "--caption '",
                  caption, "' has no {label}");
  const auto t0 = std::chrono::steady_clock::now();

  // The model of the checkpoint.
  fs::path dir(checkpoint_dir);
  if (!fs::exists(dir / ck::kMetadataFileName)) {
    const auto latest = ck::find_latest_checkpoint(dir);
    VIADUCT_CHECK_T(FileError, latest.has_value(), "eval-captions: no complete checkpoint in '",
                    checkpoint_dir, "'");
    dir = ck::checkpoint_dir(dir, *latest);
  }
  ck::Checkpoint ckpt = ck::open_checkpoint(dir);
  const auto job = JobConfig::from(
      Config::parse(ckpt.metadata.config_toml, (dir / ck::kMetadataFileName).string()));
  at::set_num_threads(static_cast<int>(threads > 0 ? threads : job.training.num_threads));
  const auto image = image_input(job);
  VIADUCT_CHECK_T(ConfigError, image.has_value(), "eval-captions: the checkpoint's model (",
                  dir.string(), ") has no vision tower (model.vision = true)");
  VIADUCT_CHECK_T(ConfigError, device_name == "auto" || device_name == "cpu" ||
                                   device_name == "cuda",
                  "--device: '", device_name, "' (expected auto, cpu or cuda)");
  const bool cuda = device_name == "cuda" || (device_name == "auto" && torch::cuda::is_available());
  VIADUCT_CHECK_T(ConfigError, !cuda || torch::cuda::is_available(),
                  "--device cuda, but no CUDA device is available");
  const at::Device device = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  auto model = build_model_part(job);
  load_part_tensors(ckpt.tensors, *model);
  ckpt.tensors.load_into(model->extra_state());
  model->to(device);
  model->eval();
  torch::NoGradGuard no_grad;

  // The data and the candidate captions.
  const data::ImageTextFile file(data_path);
  VIADUCT_CHECK_T(ConfigError,
                  file.channels() == image->channels && file.image_size() == image->image_size,
                  "'", data_path, "' holds ", file.channels(), "x", file.image_size(), "x",
                  file.image_size(), " images, but the model takes ", image->channels, "x",
                  image->image_size, "x", image->image_size);
  const auto names = split_on(labels, ',');
  const auto tokenizer = data::load_tokenizer(tokenizer_spec);
  const int64_t end_token = tokenizer->document_marker().token;
  std::vector<std::vector<int64_t>> captions;
  for (const auto& n : names) {
    std::string text = caption;
    text.replace(text.find("{label}"), 7, n);
    auto ids = tokenizer->encode(text, false);
    VIADUCT_CHECK_T(ConfigError,
                    std::find(ids.begin(), ids.end(), image->image_token_id) == ids.end(),
                    "eval-captions: the caption of label '", n, "' holds the image placeholder "
                    "id ", image->image_token_id, " (model.image_token_id)");
    ids.push_back(end_token);
    captions.push_back(std::move(ids));
  }
  // The name's tokens: after what every caption shares, before the end.
  size_t shared = 0;
  while (std::all_of(captions.begin(), captions.end(), [&](const auto& c) {
    return shared + 1 < c.size() && c[shared] == captions[0][shared];
  })) {
    ++shared;
  }
  const int64_t K = static_cast<int64_t>(names.size()), P = image->patches;
  int64_t longest = 0;
  for (const auto& c : captions) longest = std::max<int64_t>(longest, static_cast<int64_t>(c.size()));
  const int64_t T = P + longest - 1;  // inputs; the last caption token is a target only
  const int64_t N = limit > 0 ? std::min(limit, file.size()) : file.size();
  std::vector<int64_t> truth(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) {
    const auto c = file.caption(i);
    const auto it = std::find(captions.begin(), captions.end(), c);
    VIADUCT_CHECK_T(FileError, it != captions.end(), "eval-captions: record ", i, " of '",
                    data_path, "' has a caption that no label's gives (\"",
                    tokenizer->decode(c), "\"); give the --labels, --caption and --tokenizer "
                    "that prepare-images got");
    truth[static_cast<size_t>(i)] = it - captions.begin();
  }
  // Rows: image b with caption k at row b K + k; targets only at the
  // caption's tokens, a mask picks the name's.
  auto tokens = at::full({K, T}, 0, at::kLong);
  auto targets = at::full({K, T}, -100, at::kLong);
  auto name_mask = at::zeros({K, T}, at::kFloat);
  for (int64_t k = 0; k < K; ++k) {
    const auto& c = captions[static_cast<size_t>(k)];
    const auto L = static_cast<int64_t>(c.size());
    for (int64_t t = 0; t < P; ++t) tokens[k][t] = image->image_token_id;
    for (int64_t j = 0; j + 1 < L; ++j) tokens[k][P + j] = c[static_cast<size_t>(j)];
    for (int64_t j = 0; j < L; ++j) {
      targets[k][P - 1 + j] = c[static_cast<size_t>(j)];
      if (j >= static_cast<int64_t>(shared) && j + 1 < L) name_mask[k][P - 1 + j] = 1.0f;
    }
  }
  // caption_loss, name_loss: [nb, K] for images [nb, 1, C, S, S].
  auto losses = [&](const at::Tensor& images) {
    const int64_t nb = images.size(0);
    // [nb K, ...]: every image with every caption.
    auto imgs = images.repeat_interleave(K, 0).to(device);
    auto tok = tokens.repeat({nb, 1}).to(device);
    auto tgt = targets.repeat({nb, 1}).to(device);
    auto logits = model->forward({tok, imgs}).at(0).to(at::kFloat);  // [nb K, T, V]
    auto logp = at::log_softmax(logits, -1);
    auto nll = -logp.gather(-1, tgt.clamp_min(0).unsqueeze(-1)).squeeze(-1) * (tgt >= 0);
    return std::make_pair(nll.sum(-1).view({nb, K}).cpu(),
                          (nll * name_mask.repeat({nb, 1}).to(device)).sum(-1).view({nb, K}).cpu());
  };
  auto tally = [&](Scores& s, const at::Tensor& caption_loss, const at::Tensor& name_loss,
                   int64_t image) {
    const int64_t t = truth[static_cast<size_t>(image)];
    const bool ok = caption_loss.argmin().item<int64_t>() == t;
    s.correct += ok;
    s.per_class_correct[static_cast<size_t>(t)] += ok;
    s.per_class_total[static_cast<size_t>(t)] += 1;
    s.name_loss += name_loss[t].item<double>();
  };
  auto fresh = [&] {
    Scores s;
    s.per_class_correct.assign(static_cast<size_t>(K), 0);
    s.per_class_total.assign(static_cast<size_t>(K), 0);
    return s;
  };
  Scores real = fresh(), blank = fresh();
  // Blank images are all the same image: one forward scores them all.
  const auto blank_losses =
      losses(at::zeros({1, 1, file.channels(), file.image_size(), file.image_size()}, at::kByte));
  for (int64_t b0 = 0; b0 < N; b0 += batch) {
    const int64_t nb = std::min(batch, N - b0);
    auto images =
        at::empty({nb, 1, file.channels(), file.image_size(), file.image_size()}, at::kByte);
    for (int64_t b = 0; b < nb; ++b) {
      std::memcpy(images.data_ptr<uint8_t>() + b * file.image_bytes(), file.image(b0 + b),
                  static_cast<size_t>(file.image_bytes()));
    }
    const auto [caption_loss, name_loss] = losses(images);
    for (int64_t b = 0; b < nb; ++b) {
      tally(real, caption_loss[b], name_loss[b], b0 + b);
      tally(blank, blank_losses.first[0], blank_losses.second[0], b0 + b);
    }
    if ((b0 / batch) % 50 == 49) log::info("eval-captions: ", b0 + nb, " of ", N, " images");
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto acc = [&](const Scores& s) { return static_cast<double>(s.correct) / N; };
  const auto loss = [&](const Scores& s) { return s.name_loss / N; };
  nlohmann::json per_class = nlohmann::json::object();
  for (int64_t k = 0; k < K; ++k) {
    const auto total = real.per_class_total[static_cast<size_t>(k)];
    per_class[names[static_cast<size_t>(k)]] =
        total ? static_cast<double>(real.per_class_correct[static_cast<size_t>(k)]) / total : 0.0;
  }
  const nlohmann::json result = {
      {"checkpoint", dir.string()},
      {"step", ckpt.metadata.step},
      {"data", data_path},
      {"images", N},
      {"labels", K},
      {"accuracy", acc(real)},
      {"class_name_loss", loss(real)},
      {"blank_accuracy", acc(blank)},
      {"blank_class_name_loss", loss(blank)},
      {"accuracy_per_label", per_class},
      {"device", cuda ? "cuda" : "cpu"},
      {"seconds", seconds}};
  log::info("eval-captions: ", dir.string(), " on ", N, " images of '", data_path, "', ", K,
            " labels: accuracy ", acc(real), " (blank images: ", acc(blank),
            "); class-name loss ", loss(real), " nats (blank images: ", loss(blank), ") in ",
            seconds, " s");
  std::printf("%s\n", result.dump().c_str());
  if (!output.empty()) atomic_write_file(output, result.dump(2) + "\n");
  return 0;
}

}  // namespace

VIADUCT_COMMAND("eval-captions",
                "zero-shot classification of an image-text file by caption likelihood",
                eval_captions_main);

}  // namespace viaduct::apps
