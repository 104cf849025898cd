// Checked POSIX file calls (see file_io.h).
#include "core/file_io.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <system_error>

#include "core/check.h"

namespace viaduct {
namespace fs = std::filesystem;

namespace {
// Linux moves at most ~2 GiB per write(2); larger requests go in chunks.
constexpr size_t kMaxWrite = size_t{1} << 30;
}  // namespace

std::string errno_text() { return std::strerror(errno); }

// ---- UniqueFd --------------------------------------------------------------

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.release();
  }
  return *this;
}

int UniqueFd::release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void UniqueFd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void UniqueFd::close_checked(const std::string& path) {
  if (fd_ < 0) return;
  int fd = release();
  VIADUCT_CHECK_T(FileError, ::close(fd) == 0, "cannot close ", path, ": ",
                  errno_text());
}

bool write_fully(int fd, const void* src, size_t n) {
  const auto* p = static_cast<const char*>(src);
  while (n > 0) {
    ssize_t put = ::write(fd, p, std::min(n, kMaxWrite));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    p += put;
    n -= static_cast<size_t>(put);
  }
  return true;
}

bool pwrite_fully(int fd, const void* src, size_t n, uint64_t offset) {
  const auto* p = static_cast<const char*>(src);
  while (n > 0) {
    ssize_t put = ::pwrite(fd, p, std::min(n, kMaxWrite), static_cast<off_t>(offset));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    p += put;
    n -= static_cast<size_t>(put);
    offset += static_cast<uint64_t>(put);
  }
  return true;
}

// ---- File ------------------------------------------------------------------

File File::open_read(const fs::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  VIADUCT_CHECK_T(FileError, fd >= 0, "cannot open ", path.string(),
                  " for reading: ", errno_text());
  return File(fd, path);
}

File File::create(const fs::path& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  VIADUCT_CHECK_T(FileError, fd >= 0, "cannot create ", path.string(), ": ",
                  errno_text());
  return File(fd, path);
}

File File::open_append(const fs::path& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  VIADUCT_CHECK_T(FileError, fd >= 0, "cannot open ", path.string(),
                  " for appending: ", errno_text());
  return File(fd, path);
}

File File::open_read_write(const fs::path& path) {
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  VIADUCT_CHECK_T(FileError, fd >= 0, "cannot open ", path.string(),
                  " for writing: ", errno_text());
  return File(fd, path);
}

uint64_t File::size() const {
  struct stat st {};
  VIADUCT_CHECK_T(FileError, ::fstat(fd_.get(), &st) == 0, "cannot stat ",
                  path_.string(), ": ", errno_text());
  return static_cast<uint64_t>(st.st_size);
}

void File::read_at(void* dst, size_t n, uint64_t offset) const {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    ssize_t got = ::pread(fd_.get(), p, n, static_cast<off_t>(offset));
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
  errno = 0;
  VIADUCT_CHECK_T(FileError, write_fully(fd_.get(), src, n), "cannot write ",
                  path_.string(), ": ",
                  errno != 0 ? errno_text() : std::string("wrote 0 bytes"));
}

void File::write_at(const void* src, size_t n, uint64_t offset) {
  errno = 0;
  VIADUCT_CHECK_T(FileError, pwrite_fully(fd_.get(), src, n, offset),
                  "cannot write ", path_.string(), " at offset ", offset, ": ",
                  errno != 0 ? errno_text() : std::string("wrote 0 bytes"));
}

void File::truncate(uint64_t size) {
  int rc = 0;
  do {
    rc = ::ftruncate(fd_.get(), static_cast<off_t>(size));
  } while (rc != 0 && errno == EINTR);
  VIADUCT_CHECK_T(FileError, rc == 0, "cannot truncate ", path_.string(),
                  " to ", size, " bytes: ", errno_text());
}

void File::sync() {
  VIADUCT_CHECK_T(FileError, ::fsync(fd_.get()) == 0, "cannot fsync ",
                  path_.string(), ": ", errno_text());
}

void File::close() { fd_.close_checked(path_.string()); }

bool File::removed() const {
  struct stat st {};
  return fd_.valid() && ::fstat(fd_.get(), &st) == 0 && st.st_nlink == 0;
}

// ---- folders ---------------------------------------------------------------

void fsync_dir(const fs::path& dir) {
  // open(O_RDONLY) works on a folder; fsync on it persists its entries.
  File handle = File::open_read(dir);
  handle.sync();
  handle.close();
}

void rename_path(const fs::path& from, const fs::path& to) {
  VIADUCT_CHECK_T(FileError, ::rename(from.c_str(), to.c_str()) == 0,
                  "cannot rename ", from.string(), " to ", to.string(), ": ",
                  errno_text());
}

void make_dirs(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  VIADUCT_CHECK_T(FileError, !ec, "cannot create directory ", dir.string(),
                  ": ", ec.message());
}

namespace {
// nftw's callback: folders after their contents (FTW_DEPTH). A non-zero
// return (the errno) stops the walk and is nftw's result.
int remove_entry(const char* path, const struct stat*, int type, struct FTW*) {
  const int rc = type == FTW_DP ? ::rmdir(path) : ::unlink(path);
  return rc == 0 ? 0 : errno;
}
}  // namespace

// The walk is nftw(3), not std::filesystem::remove_all: built with g++ 13
// against the PyTorch wheel's LibTorch, remove_all of a non-empty folder
// dies of SIGSEGV inside libstdc++'s filesystem code (listing folders works);
// nftw does not go through that code.
std::string remove_tree_noexcept(const fs::path& path) noexcept {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? std::string() : errno_text();
  }
  if (!S_ISDIR(st.st_mode)) return ::unlink(path.c_str()) == 0 ? std::string() : errno_text();
  const int rc = ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  if (rc == 0) return "";
  return rc > 0 ? std::string(std::strerror(rc)) : errno_text();
}

void remove_tree(const fs::path& path) {
  const std::string why = remove_tree_noexcept(path);
  VIADUCT_CHECK_T(FileError, why.empty(), "cannot remove ", path.string(), ": ", why);
}

// ---- whole files -----------------------------------------------------------

std::string read_text_file(const fs::path& path) {
  File f = File::open_read(path);
  std::string text(f.size(), '\0');
  f.read_at(text.data(), text.size(), 0);
  return text;
}

void write_text_file(const fs::path& path, const std::string& text) {
  File f = File::create(path);
  f.write_all(text.data(), text.size());
  f.sync();
  f.close();
}

AtomicFile::AtomicFile(const fs::path& path)
    : path_(path),
      tmp_path_(path.string() + ".tmp"),
      file_(File::create(tmp_path_)) {}

AtomicFile::~AtomicFile() {
  // The descriptor closes with file_; the name goes now.
  if (!committed_) ::unlink(tmp_path_.c_str());
}

void AtomicFile::commit() {
  VIADUCT_CHECK(!committed_, "file ", path_.string(), " is already committed");
  file_.sync();
  file_.close();
  rename_path(tmp_path_, path_);
  committed_ = true;
  // The folder's entry: the rename itself persists.
  fs::path dir = path_.parent_path();
  fsync_dir(dir.empty() ? fs::path(".") : dir);
}

void atomic_write_file(const fs::path& path, const std::string& text) {
  AtomicFile out(path);
  out.file().write_all(text.data(), text.size());
  out.commit();
}

}  // namespace viaduct
