// CRC-32 (the zlib / IEEE 802.3 polynomial, computed by zlib), which
// detects corrupt checkpoint files and tensors. The checked file calls themselves are
// core/file_io.h's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace viaduct::checkpoint {

// CRC-32 as zlib's crc32(): start from 0, feed chunks in order.
uint32_t crc32_update(uint32_t crc, const void* data, size_t n);
inline uint32_t crc32(const void* data, size_t n) {
  return crc32_update(0, data, n);
}
// The CRC-32 of A followed by B, from crc32(A), crc32(B) and B's length
// (zlib's crc32_combine).
uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
// Eight lowercase hex digits, and back (FileError naming `what`).
std::string crc32_hex(uint32_t crc);
uint32_t parse_crc32_hex(const std::string& hex, const std::string& what);

struct FileDigest {
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};
// Streams the whole file.
FileDigest digest_file(const std::filesystem::path& path);

}  // namespace viaduct::checkpoint
