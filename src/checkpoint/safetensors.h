// The safetensors file format (https://github.com/huggingface/safetensors),
// written and read by our own code:
//
//   [8 bytes]  N, the header length, unsigned little-endian
//   [N bytes]  JSON header, UTF-8, starting with '{', padded with spaces
//              {"<name>": {"dtype": "F32", "shape": [2, 3],
//                          "data_offsets": [begin, end]}, ...,
//               "__metadata__": {"key": "value", ...}}     (optional)
//   [rest]     the byte buffer; offsets are relative to its start
//
// The reader validates what the spec requires: the header length fits the
// file, the header is a JSON object, every entry has exactly dtype, shape and
// data_offsets, a known dtype, shape × dtype size == end − begin, ranges inside
// the buffer, no overlaps and no holes. Any violation is a viaduct::FileError
// naming the file and, where there is one, the tensor.
//
// Our writer also records a CRC-32 of every tensor's bytes in the metadata
// key `viaduct.tensor_crc32` (a JSON object name → 8 hex digits, stored as a
// string as the format requires); the reader checks it when it reads a tensor,
// so corrupt data is refused with the tensor's name. Other readers ignore it.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/crc32.h"
#include "core/file_io.h"

namespace viaduct::checkpoint {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
using StringMap = std::map<std::string, std::string>;

// The header metadata key holding per-tensor CRC-32s (see the top comment).
inline constexpr const char* kTensorCrcKey = "viaduct.tensor_crc32";
// The spec's cap on the header size (100 MB).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// "F32", "BF16", ... for a LibTorch dtype; Error for one with no name here.
std::string dtype_name(at::ScalarType dtype);
// The inverse; nullopt for an unknown or unsupported name.
std::optional<at::ScalarType> dtype_from_name(const std::string& name);

// Writes `tensors` (any device, any layout: saved from CPU contiguous copies)
// and `metadata` to `path` and fsyncs it. Names must be unique, non-empty and
// not "__metadata__". Tensors are laid out by decreasing element size, then
// name, so every tensor is aligned to its element size. Not atomic on its
// own: save into a tmp folder (checkpoint.h) for that.
FileDigest write_safetensors(const std::filesystem::path& path,
                             const NamedTensors& tensors,
                             const StringMap& metadata = {});

struct TensorEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // relative to the byte buffer
  uint64_t end = 0;
  std::optional<uint32_t> crc32;  // when written by viaduct
  uint64_t nbytes() const { return end - begin; }
};

// One opened and validated safetensors file. Reads use pread on a descriptor
// held open for the object's lifetime.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return file_.path(); }
  const std::map<std::string, TensorEntry>& entries() const { return entries_; }
  // The header's __metadata__ without viaduct's own keys.
  const StringMap& metadata() const { return metadata_; }
  bool contains(const std::string& name) const {
    return entries_.count(name) != 0;
  }
  const TensorEntry& entry(const std::string& name) const;

  // A CPU tensor with the stored dtype and shape.
  at::Tensor read(const std::string& name, bool verify_checksum = true) const;
  // Reads the entry's bytes into `dst` (entry.nbytes() bytes).
  void read_into(const TensorEntry& entry, void* dst,
                 bool verify_checksum = true) const;
  // Reads bytes [lo, hi) of the entry into `dst`. A checksum covers the whole
  // entry, so verifying streams all of it (a few MiB at a time) and keeps
  // only the range: memory is the range's, not the entry's.
  void read_range_into(const TensorEntry& entry, uint64_t lo, uint64_t hi, void* dst,
                       bool verify_checksum = true) const;
  // The names whose stored CRC-32 does not match their bytes.
  std::vector<std::string> damaged_tensors() const;

 private:
  File file_;
  uint64_t data_start_ = 0;
  std::map<std::string, TensorEntry> entries_;
  StringMap metadata_;
};

}  // namespace viaduct::checkpoint
