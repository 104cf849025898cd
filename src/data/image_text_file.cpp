// Image-text files: the header's validation, the mapped reader and the
// atomic writer (format in image_text_file.h).
#include "data/image_text_file.h"

#include <algorithm>
#include <cstring>
#include <fstream>

#include "core/file_io.h"
#include "core/check.h"

namespace viaduct::data {
namespace {

constexpr char kMagic[8] = {'V', 'I', 'A', 'D', 'I', 'M', 'G', '\0'};
constexpr uint32_t kVersion = 1;
constexpr int64_t kHeaderBytes = 128;
constexpr size_t kTokenizerField = 64;
constexpr size_t kWriteChunk = 1 << 22;


}  // namespace

bool is_image_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char head[sizeof(kMagic)] = {};
  if (!in.read(head, sizeof(head))) return false;
  return std::memcmp(head, kMagic, sizeof(kMagic)) == 0;
}

ImageTextFile::ImageTextFile(const std::string& path) : file_(path) {
  const uint8_t* d = file_.data();
  const auto size = static_cast<uint64_t>(file_.size());
  VIADUCT_CHECK_T(FileError, size >= kHeaderBytes && std::memcmp(d, kMagic, sizeof(kMagic)) == 0,
                  "image-text file '", path, "' has no VIADIMG header (not written by "
                  "viaduct prepare-images?)");
  const uint32_t version = load_u32(d + 8);
  VIADUCT_CHECK_T(FileError, version == kVersion, "image-text file '", path, "' has version ",
                  version, "; this viaduct reads version ", kVersion);
  channels_ = load_u32(d + 12);
  image_size_ = load_u32(d + 16);
  VIADUCT_CHECK_T(FileError, channels_ >= 1 && channels_ <= 4 && image_size_ >= 1 &&
                                 image_size_ <= 65536,
                  "image-text file '", path, "': bad image shape ", channels_, " x ",
                  image_size_, " x ", image_size_);
  const uint64_t count = load_u64(d + 24), tokens = load_u64(d + 32);
  vocab_size_ = static_cast<int64_t>(load_u64(d + 40));
  const char* name = reinterpret_cast<const char*>(d + 48);
  tokenizer_.assign(name, strnlen(name, kTokenizerField));
  VIADUCT_CHECK_T(FileError, count < (uint64_t{1} << 40) && tokens < (uint64_t{1} << 40),
                  "image-text file '", path, "': implausible counts ", count, " records, ",
                  tokens, " tokens");
  const uint64_t image_bytes = static_cast<uint64_t>(this->image_bytes());
  const uint64_t expected =
      kHeaderBytes + count * image_bytes + tokens * 4 + (count + 1) * 8;
  VIADUCT_CHECK_T(FileError, size == expected, "image-text file '", path, "' is ", size,
                  " bytes but its header (", count, " images of ", channels_, "x",
                  image_size_, "x", image_size_, ", ", tokens, " caption tokens) needs ",
                  expected, " (truncated or corrupt)");
  count_ = static_cast<int64_t>(count);
  token_count_ = static_cast<int64_t>(tokens);
  images_ = d + kHeaderBytes;
  tokens_ = images_ + count * image_bytes;
  offsets_ = tokens_ + tokens * 4;
  // The offsets must rise from 0 to M, each caption non-empty.
  VIADUCT_CHECK_T(FileError, load_u64(offsets_) == 0 &&
                                 load_u64(offsets_ + count * 8) == tokens,
                  "image-text file '", path, "': caption offsets do not span the ", tokens,
                  " tokens");
  for (uint64_t i = 0; i < count; ++i) {
    VIADUCT_CHECK_T(FileError, load_u64(offsets_ + (i + 1) * 8) > load_u64(offsets_ + i * 8),
                    "image-text file '", path, "': record ", i,
                    " has an empty caption or offsets out of order");
  }
}

const uint8_t* ImageTextFile::image(int64_t i) const {
  VIADUCT_ASSERT(i >= 0 && i < count_, "image ", i, " of ", count_);
  return images_ + i * image_bytes();
}

int64_t ImageTextFile::caption_length(int64_t i) const {
  VIADUCT_ASSERT(i >= 0 && i < count_, "caption ", i, " of ", count_);
  return static_cast<int64_t>(load_u64(offsets_ + (i + 1) * 8) - load_u64(offsets_ + i * 8));
}

int64_t ImageTextFile::read_caption(int64_t i, int64_t* out, int64_t max) const {
  const int64_t n = std::min(caption_length(i), max);
  const uint8_t* p = tokens_ + load_u64(offsets_ + i * 8) * 4;
  for (int64_t k = 0; k < n; ++k) out[k] = load_u32(p + k * 4);
  return n;
}

std::vector<int64_t> ImageTextFile::caption(int64_t i) const {
  std::vector<int64_t> out(static_cast<size_t>(caption_length(i)));
  read_caption(i, out.data(), static_cast<int64_t>(out.size()));
  return out;
}

int64_t ImageTextFile::max_token() const {
  uint32_t m = 0;
  for (int64_t k = 0; k < token_count_; ++k) m = std::max(m, load_u32(tokens_ + k * 4));
  return m;
}

int64_t ImageTextFile::max_caption_length() const {
  int64_t m = 0;
  for (int64_t i = 0; i < count_; ++i) m = std::max(m, caption_length(i));
  return m;
}

// ------------------------------------------------------------------ writer

ImageTextWriter::ImageTextWriter(const std::string& path, int64_t channels,
                                 int64_t image_size, int64_t vocab_size,
                                 const std::string& tokenizer)
    : path_(path),
      channels_(channels),
      image_size_(image_size),
      vocab_size_(vocab_size),
      tokenizer_(tokenizer) {
  VIADUCT_CHECK(channels >= 1 && channels <= 4 && image_size >= 1, "image-text file '", path,
                "': bad image shape ", channels, " x ", image_size);
  VIADUCT_CHECK(vocab_size > 0 && vocab_size <= (int64_t{1} << 32), "image-text file '",
                path, "': vocab size ", vocab_size, " does not fit 32-bit tokens");
  VIADUCT_CHECK(tokenizer.size() < kTokenizerField, "image-text file '", path,
                "': tokenizer name '", tokenizer, "' is longer than ", kTokenizerField - 1,
                " characters");
  out_ = std::make_unique<AtomicFile>(path);
  // Room for the header, written last (finish) once the counts are known.
  const uint8_t zeros[kHeaderBytes] = {};
  out_->file().write_all(zeros, sizeof(zeros));
}

ImageTextWriter::~ImageTextWriter() = default;

void ImageTextWriter::append(const uint8_t* image, const std::vector<int64_t>& caption) {
  VIADUCT_CHECK(out_ != nullptr, "image-text file '", path_, "' is already finished");
  VIADUCT_CHECK(!caption.empty(), "image-text file '", path_, "': record ", count_,
                " has an empty caption");
  for (int64_t t : caption) {
    VIADUCT_CHECK(t >= 0 && t < vocab_size_, "image-text file '", path_, "': token ", t,
                  " is outside the vocab [0, ", vocab_size_, ")");
    tokens_.push_back(static_cast<uint32_t>(t));
  }
  offsets_.push_back(tokens_.size());
  const auto bytes = static_cast<size_t>(channels_ * image_size_ * image_size_);
  buffer_.insert(buffer_.end(), image, image + bytes);
  ++count_;
  if (buffer_.size() >= kWriteChunk) {
    out_->file().write_all(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
}

int64_t ImageTextWriter::finish() {
  VIADUCT_CHECK(out_ != nullptr, "image-text file '", path_, "' is already finished");
  File& f = out_->file();
  if (!buffer_.empty()) f.write_all(buffer_.data(), buffer_.size());
  buffer_.clear();
  f.write_all(tokens_.data(), tokens_.size() * 4);
  f.write_all(offsets_.data(), offsets_.size() * 8);
  uint8_t header[kHeaderBytes] = {};
  std::memcpy(header, kMagic, sizeof(kMagic));
  const uint32_t version = kVersion, c = static_cast<uint32_t>(channels_),
                 s = static_cast<uint32_t>(image_size_);
  const uint64_t n = static_cast<uint64_t>(count_), m = tokens_.size(),
                 v = static_cast<uint64_t>(vocab_size_);
  std::memcpy(header + 8, &version, 4);
  std::memcpy(header + 12, &c, 4);
  std::memcpy(header + 16, &s, 4);
  std::memcpy(header + 24, &n, 8);
  std::memcpy(header + 32, &m, 8);
  std::memcpy(header + 40, &v, 8);
  std::memcpy(header + 48, tokenizer_.data(), tokenizer_.size());
  f.write_at(header, sizeof(header), 0);
  const int64_t bytes = kHeaderBytes + count_ * channels_ * image_size_ * image_size_ +
                        static_cast<int64_t>(m) * 4 + (count_ + 1) * 8;
  out_->commit();
  out_.reset();
  return bytes;
}

}  // namespace viaduct::data
