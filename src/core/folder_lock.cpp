// The folder lock (see folder_lock.h).
#include "core/folder_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>

#include "core/check.h"
#include "core/log.h"

namespace viaduct {
namespace fs = std::filesystem;

namespace {

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// The holder's text on one line: "host H, pid P, started T".
std::string holder_text(int fd) {
  std::string text;
  char buf[512];
  ssize_t n = 0;
  off_t off = 0;
  while ((n = ::pread(fd, buf, sizeof(buf), off)) > 0) {
    text.append(buf, static_cast<size_t>(n));
    off += n;
    if (text.size() > 4096) break;
  }
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text;
}

// The locks this process holds: canonical folder path -> the folder's
// descriptor (which holds the flock), the lock file's, and the FolderLocks
// sharing them.
struct HeldLock {
  UniqueFd dir;
  UniqueFd file;
  int users = 0;
};
std::mutex g_held_mutex;
std::map<std::string, HeldLock>& held_locks() {
  static std::map<std::string, HeldLock> held;
  return held;
}

// The holder named by the lock file, read without creating it.
std::string holder_of(const fs::path& lock_file) {
  UniqueFd fd(::open(lock_file.c_str(), O_RDONLY | O_CLOEXEC));
  return fd.valid() ? holder_text(fd.get()) : std::string();
}

}  // namespace

FolderLock::FolderLock(const fs::path& folder, const std::string& what_for)
    : folder_(folder), path_(folder / kFileName), what_for_(what_for) {
  make_dirs(folder);
  std::error_code ec;
  key_ = fs::weakly_canonical(folder, ec).string();
  if (ec) key_ = fs::absolute(folder).lexically_normal().string();
  std::lock_guard<std::mutex> guard(g_held_mutex);
  auto it = held_locks().find(key_);
  if (it != held_locks().end()) {
    ++it->second.users;
    return;
  }
  UniqueFd dir(::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  VIADUCT_CHECK_T(FileError, dir.valid(), "cannot open the folder ", folder.string(),
                  " to lock it: ", errno_text());
  auto try_lock = [](int fd) {
    int rc = 0;
    do {
      rc = ::flock(fd, LOCK_EX | LOCK_NB);
    } while (rc != 0 && errno == EINTR);
    return rc == 0 ? 0 : errno;
  };
  int err = try_lock(dir.get());
  UniqueFd fd;
  if (err != 0 && err != EWOULDBLOCK) {
    // A file system that locks files but not folders (NFS emulates flock
    // with write locks, which a folder opened for reading cannot take):
    // the lock file's own flock, as good while the file stays.
    log::warn("cannot lock the folder ", folder.string(), " itself (", std::strerror(err),
              "); locking ", path_.string(), " instead: deleting that file under a run would "
              "let a second run in");
    fd = UniqueFd(::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
    VIADUCT_CHECK_T(FileError, fd.valid(), "cannot open the lock file ", path_.string(), ": ",
                    errno_text());
    err = try_lock(fd.get());
  }
  if (err != 0) {
    VIADUCT_CHECK_T(FileError, err == EWOULDBLOCK, "cannot lock ", folder.string(), ": ",
                    std::strerror(err));
    const std::string holder = holder_of(path_);
    throw FileError(str(what_for, " ", folder.string(), " is in use by another viaduct process (",
                        holder.empty() ? std::string("holder not named: its ") + kFileName +
                                             " is gone or not yet written"
                                       : holder,
                        "; lock file ", path_.string(),
                        "): wait for it to end, or give this run another ", what_for));
  }
  if (!fd.valid()) fd = UniqueFd(::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  VIADUCT_CHECK_T(FileError, fd.valid(), "cannot open the lock file ", path_.string(), ": ",
                  errno_text());
  const std::string previous = holder_text(fd.get());
  if (!previous.empty()) {
    log::warn("taking over ", path_.string(), ": its holder (", previous,
              ") is gone without releasing it");
  }
  const std::string me =
      str("host ", host_name(), ", pid ", ::getpid(), ", started ", utc_now(), "\n");
  // The lock is the flock; the text only names the holder. A full disk
  // must not stop a run that could still resume and report, so a failed
  // write is a warning.
  if (::ftruncate(fd.get(), 0) != 0 || !pwrite_fully(fd.get(), me.data(), me.size(), 0) ||
      ::fsync(fd.get()) != 0) {
    log::warn("cannot write the holder into ", path_.string(), ": ", errno_text(),
              " (the lock is held all the same)");
  }
  HeldLock& held = held_locks()[key_];
  held.dir = std::move(dir);
  held.file = std::move(fd);
  held.users = 1;
}

void FolderLock::check_still_there() const {
  int dir_fd = -1;
  {
    std::lock_guard<std::mutex> guard(g_held_mutex);
    auto it = held_locks().find(key_);
    if (it == held_locks().end()) return;
    dir_fd = it->second.dir.get();
  }
  struct stat held {}, now {};
  const bool held_ok = ::fstat(dir_fd, &held) == 0;
  const bool gone = held_ok && held.st_nlink == 0;
  const bool replaced = held_ok && !gone &&
                        (::stat(folder_.c_str(), &now) != 0 || now.st_ino != held.st_ino ||
                         now.st_dev != held.st_dev);
  VIADUCT_CHECK_T(FileError, !gone && !replaced, what_for_, " ", folder_.string(), " was ",
                  gone ? "removed" : "moved or replaced",
                  " while this run held it (by another process): its metrics and checkpoints "
                  "are not where this run writes them; stopping");
}

FolderLock::~FolderLock() {
  std::lock_guard<std::mutex> guard(g_held_mutex);
  auto it = held_locks().find(key_);
  if (it == held_locks().end() || --it->second.users > 0) return;
  // Unchecked: a destructor cannot report, and a holder left named only
  // costs the next run a warning.
  (void)!::ftruncate(it->second.file.get(), 0);
  (void)!::flock(it->second.dir.get(), LOCK_UN);
  (void)!::flock(it->second.file.get(), LOCK_UN);
  held_locks().erase(it);
}

}  // namespace viaduct
