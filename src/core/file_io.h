// Checked POSIX file calls, in one place for every layer that writes files
// (data, checkpoint, launcher): an owned descriptor, a file whose every
// open/read/write/fsync/close reports failures as viaduct::FileError with the
// path and strerror(errno), EINTR-safe writes, folder fsync and rename, and
// the atomic replace of a file.
//
// Note [Atomic replace]
// A file that must never be seen half-written is written to `<path>.tmp` in
// the same folder (rename(2) is atomic only within one file system), fsynced,
// renamed onto `path`, and the folder is fsynced so that the rename itself
// persists. A crash leaves either the old file or the new one, and at worst a
// stray `.tmp` that the next write truncates. A folder is published the same
// way (checkpoint/checkpoint.h, see Note [Atomic checkpoint save]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

namespace viaduct {

// A host-order integer from bytes at any alignment (the token and
// image-text file headers; both formats are little-endian, and their
// readers refuse big-endian hosts).
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// strerror(errno), read before anything else can change errno.
std::string errno_text();

// An owned file descriptor; closes it (unchecked) on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  void reset();
  // Closes, reporting a failure as FileError naming `path`.
  void close_checked(const std::string& path);

 private:
  int fd_ = -1;
};

// Writes all n bytes to fd, retrying short writes and EINTR. Returns false
// when the descriptor fails (a closed pipe, a full disk); errno tells why.
bool write_fully(int fd, const void* src, size_t n);
// pwrite of all n bytes at offset, retrying short writes and EINTR; false as
// above.
bool pwrite_fully(int fd, const void* src, size_t n, uint64_t offset);

// An open file: every call is checked and a failure is a FileError naming
// the path. Destruction closes without checking; call close() where the
// result matters (after writing).
class File {
 public:
  static File open_read(const std::filesystem::path& path);
  // Creates or truncates, mode 0644.
  static File create(const std::filesystem::path& path);
  // Creates if missing, mode 0644; every write goes to the end (O_APPEND).
  static File open_append(const std::filesystem::path& path);
  // Opens an existing file for reading and writing (no truncation).
  static File open_read_write(const std::filesystem::path& path);

  File(File&& other) noexcept = default;
  File& operator=(File&& other) noexcept = default;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() = default;

  uint64_t size() const;
  // Reads exactly n bytes at offset; a short read is a FileError ("truncated").
  void read_at(void* dst, size_t n, uint64_t offset) const;
  void write_all(const void* src, size_t n);
  // pwrite of exactly n bytes at offset (the file position is unchanged).
  void write_at(const void* src, size_t n, uint64_t offset);
  // ftruncate(2): the file ends at `size` bytes (no new space is needed to
  // shorten a file).
  void truncate(uint64_t size);
  void sync();
  void close();
  bool is_open() const { return fd_.valid(); }
  // True when the file has no name left (unlinked under its open
  // descriptor): what is written to it can no longer be read by anyone.
  bool removed() const;
  const std::filesystem::path& path() const { return path_; }

 private:
  File(int fd, std::filesystem::path path) : fd_(fd), path_(std::move(path)) {}
  UniqueFd fd_;
  std::filesystem::path path_;
};

// fsync a folder so that the entries created or renamed in it persist.
void fsync_dir(const std::filesystem::path& dir);
// rename(2), checked.
void rename_path(const std::filesystem::path& from,
                 const std::filesystem::path& to);
// Creates the folder (and parents) if missing, checked.
void make_dirs(const std::filesystem::path& dir);
// Removes a file or tree, checked; a missing path is not an error.
void remove_tree(const std::filesystem::path& path);
// The same, for cleanup paths that must not throw: "" when the path is gone,
// else why it is not.
std::string remove_tree_noexcept(const std::filesystem::path& path) noexcept;

std::string read_text_file(const std::filesystem::path& path);
// Writes, fsyncs and closes (no rename: for files inside a folder that is
// published as a whole).
void write_text_file(const std::filesystem::path& path, const std::string& text);

// A file written under see Note [Atomic replace]: the writes go to `<path>.tmp`;
// commit() fsyncs, closes, renames onto `path` and fsyncs the folder.
// Dropped without commit(), it removes the temporary file.
class AtomicFile {
 public:
  explicit AtomicFile(const std::filesystem::path& path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // The temporary file, open for writing until commit().
  File& file() { return file_; }
  bool committed() const { return committed_; }
  void commit();
  const std::filesystem::path& path() const { return path_; }
  const std::filesystem::path& tmp_path() const { return tmp_path_; }

 private:
  std::filesystem::path path_;
  std::filesystem::path tmp_path_;
  File file_;
  bool committed_ = false;
};

// Replaces `path` with `text` under see Note [Atomic replace].
void atomic_write_file(const std::filesystem::path& path, const std::string& text);

}  // namespace viaduct
