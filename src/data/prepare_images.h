// Image-text pairs -> an image-text file (image_text_file.h), the work of
// `viaduct prepare-images`. Three kinds of input, read in the order given:
//
//   WebDataset shards (`.tar`): the files of one sample share a key (the
//     path up to the first dot of the file name); KEY.jpg / .jpeg / .png /
//     .webp is the image and KEY.txt (the text) or KEY.json (its
//     `json_field`, "caption" by default) the caption.
//   JSON Lines (`.jsonl`): one {"image": path, "text": caption} per line,
//     the path relative to the JSONL file's folder.
//   IDX files (MNIST's format, gzipped or not): an image file (magic 2051,
//     uint8 [N, H, W]) with its label file (magic 2049, uint8 [N]); the
//     caption of label k is `caption_template` with "{label}" replaced by
//     labels[k].
//
// Each image is decoded (image_decode.h), fitted to image_size x image_size
// RGB, and stored with its caption's tokens (the text's, then the end of
// text token). Samples are read in order and decoded on `threads` threads;
// the output is the same for any thread count. A bad sample (an image that
// is cut short, of zero size or no image at all, a caption missing or
// empty, a label with no name) is reported with its file and key and
// skipped, or, with `strict`, stops the run; either way the output is
// written atomically (nothing half-written), and a manifest
// `<output>.json` records the counts, the sizes, the skipped samples and
// each source file's size and CRC-32.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/image_decode.h"

namespace viaduct::data {

struct ImageInput {
  enum class Kind { kTar, kJsonl, kIdx };
  Kind kind = Kind::kTar;
  std::string path;         // the shard, the JSONL file, or the IDX images
  std::string labels_path;  // IDX only: the label file
};

struct PrepareImagesOptions {
  int64_t image_size = 16;  // model.vision_image_size
  ImageFit fit = ImageFit::kCrop;
  std::string tokenizer = "byte";       // load_tokenizer's spec
  std::string json_field = "caption";   // the caption field of a shard's KEY.json
  std::string caption_template = "{label}";  // IDX
  std::vector<std::string> labels;      // IDX: the name of each label
  bool strict = false;
  int threads = 0;  // 0: every core
};

// One skipped sample.
struct ImageProblem {
  std::string file;
  std::string key;
  std::string reason;
};

struct PrepareImagesStats {
  int64_t records = 0;
  int64_t skipped = 0;
  std::vector<ImageProblem> problems;  // the skipped samples, in input order
  int64_t caption_tokens = 0;
  int64_t bytes_read = 0;     // source files
  int64_t bytes_written = 0;  // the image-text file
  double seconds = 0;
  std::string manifest_path;
};

// Writes `output` and `<output>.json`. Throws FileError for an input that
// cannot be read at all (missing, not a tar / JSONL / IDX file), and, with
// `strict`, for the first bad sample; no output is left behind then.
PrepareImagesStats prepare_images(const std::vector<ImageInput>& inputs,
                                  const std::string& output,
                                  const PrepareImagesOptions& options);

// The samples of a WebDataset shard held in memory, for the readers' tests:
// (key, image bytes, caption text) in shard order, with the problems of the
// keys that have no image or no caption. Throws FileError for a shard whose
// headers are not tar.
struct RawSample {
  std::string file;
  std::string key;
  std::string image;    // the encoded image bytes
  std::string image_path;  // JSONL: the image file, read when it is decoded
  std::string caption;  // the caption text
  std::string problem;  // set: the sample is bad, the rest may be empty
  // IDX: the pixels, already decoded ([H, W] grey), instead of `image`.
  int64_t grey_width = 0, grey_height = 0;
};
std::vector<RawSample> read_tar_samples(const std::string& path, const std::string& json_field);
std::vector<RawSample> read_jsonl_samples(const std::string& path);
std::vector<RawSample> read_idx_samples(const std::string& images, const std::string& labels,
                                        const std::string& caption_template,
                                        const std::vector<std::string>& names);

}  // namespace viaduct::data
