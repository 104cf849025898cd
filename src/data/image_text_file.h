// Image-text files: images already decoded and resized to the vision tower's
// size, each with its caption's tokens, memory-mapped by the trainer. No
// image decoder is needed to read one (`viaduct prepare-images` writes them:
// data/prepare_images.h).
//
//   [0, 8)     magic "VIADIMG\0"
//   [8, 12)    uint32 version (1)
//   [12, 16)   uint32 channels C (3: RGB)
//   [16, 20)   uint32 image size S (square S x S)
//   [20, 24)   reserved, zero
//   [24, 32)   uint64 record count N
//   [32, 40)   uint64 caption token count M (all records)
//   [40, 48)   uint64 vocab size
//   [48, 112)  tokenizer name, NUL-padded (at most 63 chars)
//   [112, 128) reserved, zero
//   then uint8 images [N, C, S, S] (channel-major, row-major),
//   then uint32 caption tokens [M],
//   then uint64 offsets [N + 1]: record i's caption is tokens
//   [offsets[i], offsets[i + 1]).
//
// A caption holds the tokenizer's tokens of the text and then the end of
// text token, so that a model learns where a caption ends; it never holds
// the image placeholders, which the sampler puts before it (the model
// decides how many). Every field is validated on open and the size must
// match exactly; anything else is a FileError naming the file.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/file_io.h"
#include "data/token_file.h"

namespace viaduct::data {

// Whether `path` starts with the image-text magic (false for a file that
// cannot be read: opening it reports why).
bool is_image_text_file(const std::string& path);

class ImageTextFile {
 public:
  explicit ImageTextFile(const std::string& path);

  const std::string& path() const { return file_.path(); }
  int64_t size() const { return count_; }  // records
  int64_t channels() const { return channels_; }
  int64_t image_size() const { return image_size_; }
  int64_t image_bytes() const { return channels_ * image_size_ * image_size_; }
  int64_t vocab_size() const { return vocab_size_; }
  const std::string& tokenizer() const { return tokenizer_; }
  int64_t caption_tokens() const { return token_count_; }

  // Record i's image: image_bytes() bytes, [C, S, S].
  const uint8_t* image(int64_t i) const;
  int64_t caption_length(int64_t i) const;
  // Copies at most `max` of record i's caption tokens into out; returns how
  // many it copied.
  int64_t read_caption(int64_t i, int64_t* out, int64_t max) const;
  std::vector<int64_t> caption(int64_t i) const;
  // The largest token id and the longest caption (scan every caption).
  int64_t max_token() const;
  int64_t max_caption_length() const;

 private:
  MappedFile file_;
  int64_t count_ = 0;
  int64_t channels_ = 0;
  int64_t image_size_ = 0;
  int64_t token_count_ = 0;
  int64_t vocab_size_ = 0;
  std::string tokenizer_;
  const uint8_t* images_ = nullptr;
  const uint8_t* tokens_ = nullptr;   // uint32 [M]
  const uint8_t* offsets_ = nullptr;  // uint64 [N + 1]
};

// Writes an image-text file atomically (see Note [Atomic replace],
// core/file_io.h): images stream to `<path>.tmp`, the captions are kept in
// memory (a small share of the bytes) and written by finish(), which then
// fills the header, fsyncs and renames. Dropped without finish(), it
// removes the temporary file.
class ImageTextWriter {
 public:
  ImageTextWriter(const std::string& path, int64_t channels, int64_t image_size,
                  int64_t vocab_size, const std::string& tokenizer);
  ~ImageTextWriter();
  ImageTextWriter(const ImageTextWriter&) = delete;
  ImageTextWriter& operator=(const ImageTextWriter&) = delete;

  // image: [C, S, S] uint8; caption: tokens in [0, vocab_size), at least one.
  void append(const uint8_t* image, const std::vector<int64_t>& caption);
  // Returns the file's size in bytes.
  int64_t finish();
  int64_t records() const { return count_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::unique_ptr<AtomicFile> out_;  // null once finished
  int64_t channels_, image_size_, vocab_size_;
  std::string tokenizer_;
  int64_t count_ = 0;
  std::vector<uint32_t> tokens_;
  std::vector<uint64_t> offsets_{0};
  std::vector<uint8_t> buffer_;  // images not yet written
};

}  // namespace viaduct::data
