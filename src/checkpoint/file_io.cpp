// Checked POSIX file calls and CRC-32 for the checkpoint layer (see file_io.h).
#include "checkpoint/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <system_error>
#include <vector>

#include "core/check.h"

namespace viaduct::checkpoint {
namespace {

std::string errno_text() { return std::strerror(errno); }

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

File File::open_read(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  VIADUCT_CHECK_T(FileError, fd >= 0, "cannot open ", path.string(),
                  " for reading: ", errno_text());
  return File(fd, path);
}

File File::create(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  VIADUCT_CHECK_T(FileError, fd >= 0, "cannot create ", path.string(), ": ",
                  errno_text());
  return File(fd, path);
}

File::File(File&& other) noexcept
    : fd_(other.fd_), path_(std::move(other.path_)) {
  other.fd_ = -1;
}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

uint64_t File::size() const {
  struct stat st {};
  VIADUCT_CHECK_T(FileError, ::fstat(fd_, &st) == 0, "cannot stat ",
                  path_.string(), ": ", errno_text());
  return static_cast<uint64_t>(st.st_size);
}

void File::read_at(void* dst, size_t n, uint64_t offset) const {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    ssize_t got = ::pread(fd_, p, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    VIADUCT_CHECK_T(FileError, got >= 0, "cannot read ", path_.string(),
                    " at offset ", offset, ": ", errno_text());
    VIADUCT_CHECK_T(FileError, got > 0, "file ", path_.string(),
                    " is truncated: expected ", n, " more bytes at offset ",
                    offset);
    p += got;
    n -= static_cast<size_t>(got);
    offset += static_cast<uint64_t>(got);
  }
}

void File::write_all(const void* src, size_t n) {
  const auto* p = static_cast<const char*>(src);
  while (n > 0) {
    // Linux writes at most ~2 GiB per call.
    size_t chunk = std::min<size_t>(n, size_t{1} << 30);
    ssize_t put = ::write(fd_, p, chunk);
    if (put < 0 && errno == EINTR) continue;
    VIADUCT_CHECK_T(FileError, put > 0, "cannot write ", path_.string(), ": ",
                    put < 0 ? errno_text() : std::string("wrote 0 bytes"));
    p += put;
    n -= static_cast<size_t>(put);
  }
}

void File::write_at(const void* src, size_t n, uint64_t offset) {
  const auto* p = static_cast<const char*>(src);
  while (n > 0) {
    size_t chunk = std::min<size_t>(n, size_t{1} << 30);
    ssize_t put = ::pwrite(fd_, p, chunk, static_cast<off_t>(offset));
    if (put < 0 && errno == EINTR) continue;
    VIADUCT_CHECK_T(FileError, put > 0, "cannot write ", path_.string(),
                    " at offset ", offset, ": ",
                    put < 0 ? errno_text() : std::string("wrote 0 bytes"));
    p += put;
    n -= static_cast<size_t>(put);
    offset += static_cast<uint64_t>(put);
  }
}

void File::sync() {
  VIADUCT_CHECK_T(FileError, ::fsync(fd_) == 0, "cannot fsync ",
                  path_.string(), ": ", errno_text());
}

void File::close() {
  if (fd_ < 0) return;
  int fd = fd_;
  fd_ = -1;
  VIADUCT_CHECK_T(FileError, ::close(fd) == 0, "cannot close ", path_.string(),
                  ": ", errno_text());
}

void fsync_dir(const std::filesystem::path& dir) {
  // open(O_RDONLY) works on a directory; fsync on it persists its entries.
  File handle = File::open_read(dir);
  handle.sync();
  handle.close();
}

void rename_path(const std::filesystem::path& from,
                 const std::filesystem::path& to) {
  VIADUCT_CHECK_T(FileError, ::rename(from.c_str(), to.c_str()) == 0,
                  "cannot rename ", from.string(), " to ", to.string(), ": ",
                  errno_text());
}

void make_dirs(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  VIADUCT_CHECK_T(FileError, !ec, "cannot create directory ", dir.string(),
                  ": ", ec.message());
}

void remove_tree(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  VIADUCT_CHECK_T(FileError, !ec, "cannot remove ", path.string(), ": ",
                  ec.message());
}

std::string read_text_file(const std::filesystem::path& path) {
  File f = File::open_read(path);
  std::string text(f.size(), '\0');
  f.read_at(text.data(), text.size(), 0);
  return text;
}

void write_text_file(const std::filesystem::path& path,
                     const std::string& text) {
  File f = File::create(path);
  f.write_all(text.data(), text.size());
  f.sync();
  f.close();
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
