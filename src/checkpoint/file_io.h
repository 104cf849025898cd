// Checked POSIX file calls for the checkpoint layer: an RAII file handle whose
// every open/read/write/fsync/close reports failures as viaduct::FileError
// with the path and strerror(errno), directory fsync and rename, and CRC-32
// (the zlib / IEEE 802.3 polynomial) used to detect corrupt checkpoint files.
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

// An open file descriptor. Destruction closes without checking; call close()
// where the result matters (after writing).
class File {
 public:
  static File open_read(const std::filesystem::path& path);
  // Creates or truncates, mode 0644.
  static File create(const std::filesystem::path& path);

  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  uint64_t size() const;
  // Reads exactly n bytes at offset; a short read is a FileError ("truncated").
  void read_at(void* dst, size_t n, uint64_t offset) const;
  void write_all(const void* src, size_t n);
  // pwrite of exactly n bytes at offset (the file position is unchanged).
  void write_at(const void* src, size_t n, uint64_t offset);
  void sync();
  void close();
  const std::filesystem::path& path() const { return path_; }

 private:
  File(int fd, std::filesystem::path path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::filesystem::path path_;
};

// fsync a directory so that the entries created or renamed in it persist.
void fsync_dir(const std::filesystem::path& dir);
// rename(2), checked.
void rename_path(const std::filesystem::path& from,
                 const std::filesystem::path& to);
// Creates the directory (and parents) if missing, checked.
void make_dirs(const std::filesystem::path& dir);
// Removes a file or tree, checked; a missing path is not an error.
void remove_tree(const std::filesystem::path& path);

std::string read_text_file(const std::filesystem::path& path);
// Writes, fsyncs and closes (no rename: callers write into a tmp folder).
void write_text_file(const std::filesystem::path& path, const std::string& text);

struct FileDigest {
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};
// Streams the whole file.
FileDigest digest_file(const std::filesystem::path& path);

}  // namespace viaduct::checkpoint
