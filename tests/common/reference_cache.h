// A cache of single-process reference runs (and the corpora they read) in the
// build tree, shared by every test process of a ctest run: a reference is
// trained once per binary, not once per test. Entries live in
// <VIADUCT_TEST_CACHE>/<binary identity>/<name>-<hash of the key>/, where
// the key is the whole command line and the identity is the viaduct binary's
// size and modification time, so a rebuilt binary never reuses an old entry
// (the folders of other binaries are removed). ctest -j runs test processes
// side by side: an flock on the entry's lock file makes one process build it
// while the others wait, and it is built in a temporary folder renamed into
// place, so no reader sees half an entry.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <string>
#include <system_error>

#include "common/process_runs.h"
#include "core/file_io.h"

#if defined(VIADUCT_BINARY) && defined(VIADUCT_TEST_CACHE)

namespace viaduct::testing {

namespace cache_detail {

// FNV-1a, 64 bits, as 16 hex digits.
inline std::string hash_hex(const std::string& s) {
  uint64_t h = 14695981039346656037ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

// An exclusive flock held for the object's lifetime.
class FileLock {
 public:
  explicit FileLock(const std::filesystem::path& path) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "open " + path.string());
    while (::flock(fd_, LOCK_EX) != 0) {
      if (errno != EINTR) {
        const int err = errno;
        ::close(fd_);
        throw std::system_error(err, std::generic_category(), "flock " + path.string());
      }
    }
  }
  ~FileLock() { ::close(fd_); }  // closing the descriptor releases the lock
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace cache_detail

// The viaduct binary's size and modification time (nanoseconds).
inline std::string binary_identity() {
  struct stat st{};
  if (::stat(VIADUCT_BINARY, &st) != 0) return "missing";
  return std::to_string(static_cast<long long>(st.st_size)) + "-" +
         std::to_string(static_cast<long long>(st.st_mtim.tv_sec)) +
         std::to_string(1000000000LL + st.st_mtim.tv_nsec).substr(1);
}

// This binary's cache folder; the first call in a process removes the
// folders of other binaries.
inline std::filesystem::path cache_root() {
  namespace fs = std::filesystem;
  static const fs::path root = [] {
    const fs::path base = VIADUCT_TEST_CACHE;
    fs::create_directories(base);
    const fs::path mine = base / binary_identity();
    cache_detail::FileLock lock(base / ".lock");
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(base, ec)) {
      if (e.is_directory() && e.path() != mine) (void)viaduct::remove_tree_noexcept(e.path());
    }
    fs::create_directories(mine);
    return mine;
  }();
  return root;
}

// <root>/<name>-<hash of key>, made by `make` (into an empty temporary
// folder it is given; true on success) when absent. A failed make leaves no
// entry, and the returned folder does not exist.
inline std::filesystem::path cached(const std::string& name, const std::string& key,
                                    const std::function<bool(const std::filesystem::path&)>& make) {
  namespace fs = std::filesystem;
  const fs::path root = cache_root();
  const fs::path entry = root / (name + "-" + cache_detail::hash_hex(key));
  cache_detail::FileLock lock(fs::path(entry.string() + ".lock"));
  if (fs::exists(entry)) return entry;
  const fs::path tmp = fs::path(entry.string() + ".tmp" + std::to_string(::getpid()));
  viaduct::remove_tree(tmp);
  fs::create_directories(tmp);
  if (!make(tmp)) {
    viaduct::remove_tree(tmp);
    return entry;
  }
  fs::rename(tmp, entry);
  return entry;
}

// The path of a token file holding write_random_corpus's tokens for
// (seed, n), the same path in every test process; with val_n > 0, a
// validation file of (val_seed, val_n) beside it (data.val_path's default).
inline std::string cached_corpus(uint64_t seed, int n = 20000, uint64_t val_seed = 0,
                                 int val_n = 0) {
  std::ostringstream key;
  key << seed << " " << n << " " << val_seed << " " << val_n;
  const auto dir = cached("corpus", key.str(), [&](const std::filesystem::path& tmp) {
    write_random_corpus((tmp / "d.tok").string(), seed, n);
    if (val_n > 0) write_random_corpus((tmp / "d.val.tok").string(), val_seed, val_n);
    return true;
  });
  return (dir / "d.tok").string();
}

// The path of a token file holding write_random_documents's tokens for
// (seed, n), with a validation file of (val_seed, val_n) beside it.
inline std::string cached_documents(uint64_t seed, int n, uint64_t val_seed, int val_n) {
  std::ostringstream key;
  key << "documents " << seed << " " << n << " " << val_seed << " " << val_n;
  const auto dir = cached("corpus", key.str(), [&](const std::filesystem::path& tmp) {
    write_random_documents((tmp / "d.tok").string(), seed, n);
    write_random_documents((tmp / "d.val.tok").string(), val_seed, val_n);
    return true;
  });
  return (dir / "d.tok").string();
}

// The dump folder of `viaduct train<args>` on one process (metrics.jsonl and
// the checkpoint), trained at most once per binary. The args must not name a
// dump folder, and the data they read must not change under the same path
// (use cached_corpus); a --config file is keyed by its contents.
inline std::string cached_reference(const std::string& args) {
  // A config file named by --config is part of the key by its contents.
  std::string key = args;
  std::istringstream words(args);
  for (std::string w, file; words >> w;) {
    if (w == "--config" && words >> file) {
      std::ifstream in(file);
      key += "\n" + std::string(std::istreambuf_iterator<char>(in), {});
    }
  }
  const auto dir = cached("ref", key, [&](const std::filesystem::path& tmp) {
    const std::string cmd =
        std::string(VIADUCT_BINARY) + " train" + args + " --job.dump_folder=" + tmp.string();
    const auto r = shell(cmd);
    EXPECT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
    return r.exit_code == 0;
  });
  return dir.string();
}

}  // namespace viaduct::testing

#endif  // VIADUCT_BINARY && VIADUCT_TEST_CACHE
