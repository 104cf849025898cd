// `viaduct prepare-images`: image-text pairs (WebDataset tar shards, a JSONL
// of {"image", "text"}, IDX image and label files with a caption template)
// -> an image-text file the trainer memory-maps (data/prepare_images.h).
// Each image format needs its library at build time (src/data/CMakeLists.txt);
// IDX input needs none.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "apps/command.h"
#include "core/check.h"
#include "core/log.h"
#include "core/strings.h"
#include "data/prepare_images.h"

namespace viaduct::apps {
namespace {

constexpr const char* kUsage =
    "usage: viaduct prepare-images --output FILE --image-size S\n"
    "         [--input SHARD.tar|LIST.jsonl ...]\n"
    "         [--idx-images FILE --idx-labels FILE --labels NAMES "
    "[--caption TEMPLATE]]\n"
    "         [--fit crop|pad] [--tokenizer FILE] [--json-field NAME] "
    "[--strict] [--threads N]\n"
    "\n"
    "Decodes images (PNG, JPEG, WebP), fits them to S x S RGB and writes them\n"
    "with their captions' tokens into an image-text file for training with a\n"
    "vision tower (model.vision_image_size = S), and FILE.json, its manifest.\n"
    "  --input PATH       a WebDataset shard (.tar, or gzipped .tar.gz / .tgz:\n"
    "                     KEY.jpg|png|webp with KEY.txt or KEY.json) or a\n"
    "                     JSON Lines file (.jsonl:\n"
    "                     {\"image\": path, \"text\": caption} per line, paths\n"
    "                     relative to its folder); repeatable, read in order\n"
    "  --idx-images FILE  IDX image file (MNIST's format, .gz or not) ...\n"
    "  --idx-labels FILE  ... and its labels; repeatable as pairs\n"
    "  --labels NAMES     IDX: comma-separated name of each label, 0 first\n"
    "  --caption TEMPLATE IDX: the caption, {label} replaced by the name;\n"
    "                     default \"{label}\"\n"
    "  --image-size S     the square side (model.vision_image_size)\n"
    "  --fit MODE         crop (default: the middle of the image scaled to\n"
    "                     cover the square) or pad (all of it, on black)\n"
    "  --tokenizer FILE   as prepare-data's; default byte\n"
    "  --json-field NAME  the caption field of a shard's KEY.json; default\n"
    "                     caption\n"
    "  --strict           stop at the first bad sample (default: report it\n"
    "                     with its file and key, skip it, count it)\n"
    "  --threads N        decoding threads; default every core\n";

int64_t parse_count(const std::string& name, const std::string& value, int64_t max) {
  char* end = nullptr;
  const long long v = std::strtoll(value.c_str(), &end, 10);
  VIADUCT_CHECK_T(ConfigError, !value.empty() && *end == '\0' && v >= 1 && v <= max, name,
                  ": '", value, "' is not a count in [1, ", max, "]");
  return v;
}

int prepare_images_main(int argc, char** argv) {
  std::vector<data::ImageInput> inputs;
  std::vector<std::string> idx_images, idx_labels;
  std::string output;
  bool have_size = false;
  data::PrepareImagesOptions options;
  static const std::vector<std::string> kValued{
      "--input", "--output", "--idx-images", "--idx-labels", "--labels", "--caption",
      "--image-size", "--fit", "--tokenizer", "--json-field", "--threads"};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (arg == "--strict") {
      options.strict = true;
      continue;
    }
    const auto opt = valued_option(argc, argv, i, kValued, "prepare-images", kUsage);
    if (!opt) return 2;
    const std::string &name = opt->name, &value = opt->value;
    if (name == "--input") {
      data::ImageInput in;
      in.path = value;
      if (value.ends_with(".tar") || value.ends_with(".tar.gz") || value.ends_with(".tgz")) {
        in.kind = data::ImageInput::Kind::kTar;
      } else if (value.ends_with(".jsonl")) {
        in.kind = data::ImageInput::Kind::kJsonl;
      } else {
        throw ConfigError(str("--input '", value,
                              "': expected a WebDataset shard (.tar, .tar.gz or .tgz) or a JSON Lines file "
                              "(.jsonl); IDX files go with --idx-images and --idx-labels"));
      }
      inputs.push_back(in);
    } else if (name == "--output") {
      output = value;
    } else if (name == "--idx-images") {
      idx_images.push_back(value);
    } else if (name == "--idx-labels") {
      idx_labels.push_back(value);
    } else if (name == "--labels") {
      options.labels = split_on(value, ',');
    } else if (name == "--caption") {
      options.caption_template = value;
    } else if (name == "--image-size") {
      options.image_size = parse_count(name, value, 4096);
      have_size = true;
    } else if (name == "--fit") {
      VIADUCT_CHECK_T(ConfigError, value == "crop" || value == "pad", "--fit: '", value,
                      "' (expected crop or pad)");
      options.fit = value == "crop" ? data::ImageFit::kCrop : data::ImageFit::kPad;
    } else if (name == "--tokenizer") {
      options.tokenizer = value;
    } else if (name == "--json-field") {
      options.json_field = value;
    } else if (name == "--threads") {
      options.threads = static_cast<int>(parse_count(name, value, 4096));
    }
  }
  VIADUCT_CHECK_T(ConfigError, idx_images.size() == idx_labels.size(), "--idx-images (",
                  idx_images.size(), ") and --idx-labels (", idx_labels.size(),
                  ") must come in pairs");
  for (size_t k = 0; k < idx_images.size(); ++k) {
    inputs.push_back({data::ImageInput::Kind::kIdx, idx_images[k], idx_labels[k]});
  }
  VIADUCT_CHECK_T(ConfigError, idx_images.empty() || !options.labels.empty(),
                  "IDX input needs --labels (the name of each label, comma-separated)");
  if (inputs.empty() || output.empty() || !have_size) {
    std::fprintf(stderr,
                 "viaduct prepare-images: an input, --output and --image-size are "
                 "required\n\n%s",
                 kUsage);
    return 2;
  }
  log::info("prepare-images: ", inputs.size(), " input(s) -> ", output, " (",
            options.image_size, " x ", options.image_size, ")");
  const auto s = data::prepare_images(inputs, output, options);
  const double seconds = std::max(s.seconds, 1e-9);
  log::info("prepare-images: ", s.records, " images, ", s.skipped, " skipped, ",
            s.caption_tokens, " caption tokens; ", s.bytes_read, " bytes read, ",
            s.bytes_written, " written in ", seconds, " s (",
            static_cast<int64_t>(static_cast<double>(s.records + s.skipped) / seconds),
            " images/s)");
  log::info("prepare-images: manifest ", s.manifest_path);
  return 0;
}

}  // namespace

VIADUCT_COMMAND("prepare-images",
                "image-text pairs (tar, JSONL, IDX) -> image-text file for the vision tower",
                prepare_images_main);

}  // namespace viaduct::apps
