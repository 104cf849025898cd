// CRC-32 for the checkpoint layer (see crc32.h).
#include "checkpoint/crc32.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <vector>

#include "core/check.h"
#include "core/file_io.h"

namespace viaduct::checkpoint {
namespace {

// Slicing-by-8 tables for the reflected polynomial 0xEDB88320.
struct Crc32Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Crc32Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) {
        t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
      }
    }
  }
};

const Crc32Tables& crc_tables() {
  static const Crc32Tables tables;
  return tables;
}

}  // namespace

uint32_t crc32_update(uint32_t crc, const void* data, size_t n) {
  const auto& t = crc_tables().t;
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  while (n >= 8) {
    uint32_t lo = c ^ (uint32_t(p[0]) | uint32_t(p[1]) << 8 |
                       uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24);
    uint32_t hi = uint32_t(p[4]) | uint32_t(p[5]) << 8 | uint32_t(p[6]) << 16 |
                  uint32_t(p[7]) << 24;
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^
        t[4][lo >> 24] ^ t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^
        t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = t[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
  return ~c;
}

namespace {

// Polynomial arithmetic modulo the CRC polynomial, as zlib 1.2.12 does it.
uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = uint32_t{1} << 31;
  uint32_t p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ 0xEDB88320u : b >> 1;
  }
  return p;
}

// x^(n * 2^k) modulo the polynomial.
uint32_t x2nmodp(uint64_t n, unsigned k) {
  static const std::array<uint32_t, 32> kX2n = [] {
    std::array<uint32_t, 32> t{};
    uint32_t p = uint32_t{1} << 30;  // x^1
    t[0] = p;
    for (size_t i = 1; i < t.size(); ++i) t[i] = p = multmodp(p, p);
    return t;
  }();
  uint32_t p = uint32_t{1} << 31;  // x^0
  while (n) {
    if (n & 1) p = multmodp(kX2n[k & 31], p);
    n >>= 1;
    ++k;
  }
  return p;
}

}  // namespace

uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return multmodp(x2nmodp(len_b, 3), crc_a) ^ crc_b;
}

uint32_t parse_crc32_hex(const std::string& hex, const std::string& what) {
  VIADUCT_CHECK_T(FileError,
                  hex.size() == 8 && hex.find_first_not_of(
                                         "0123456789abcdef") == std::string::npos,
                  what, ": bad crc32 '", hex, "' (want 8 lowercase hex digits)");
  return static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
}

std::string crc32_hex(uint32_t crc) {
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", crc);
  return buf;
}

FileDigest digest_file(const std::filesystem::path& path) {
  File f = File::open_read(path);
  FileDigest d;
  d.bytes = f.size();
  std::vector<char> buf(size_t{8} << 20);
  for (uint64_t off = 0; off < d.bytes;) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), d.bytes - off));
    f.read_at(buf.data(), n, off);
    d.crc32 = crc32_update(d.crc32, buf.data(), n);
    off += n;
  }
  return d;
}

}  // namespace viaduct::checkpoint
