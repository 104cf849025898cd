// One process per folder: an advisory flock(2) on the folder itself, with
// `<folder>/viaduct.lock` naming the holder (host, pid, start time).
//
// Note [One trainer per dump folder]
// Two trainers writing one job.dump_folder overwrite each other's
// checkpoints, remove each other's saves as stale and interleave their
// metrics. Rank 0 takes the folder's lock before the trainer reads or writes
// anything there and holds it for the life of the process; a second one is
// refused with the holder named. The lock is on the folder's own descriptor,
// not on the file that names the holder: deleting viaduct.lock under a live
// trainer lets no second one in. The kernel drops a flock when its process
// dies (kill -9 included), so a lock file that still names a holder but is
// free was left by a process that is gone: it is taken over with a warning.
// A folder removed or replaced under its holder (rm -rf) is found by
// check_still_there, which the trainer asks at every step: the run stops
// with an error rather than write into nothing and exit 0.
// The lock belongs to the process: trainers built one after another (or
// side by side, as tests do) in one process share it.
#pragma once

#include <filesystem>
#include <string>

#include "core/file_io.h"

namespace viaduct {

class FolderLock {
 public:
  // Creates the folder if needed and takes its lock; a FileError naming the
  // holder (and `what_for`, e.g. "job.dump_folder") when another process
  // holds it.
  FolderLock(const std::filesystem::path& folder, const std::string& what_for);
  // Empties the lock file (a clean end leaves no holder named) and releases.
  ~FolderLock();
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // A FileError naming the folder (and `what_for`) when it was removed or
  // replaced by another folder since the lock was taken.
  void check_still_there() const;
  static constexpr const char* kFileName = "viaduct.lock";

 private:
  std::filesystem::path folder_;
  std::filesystem::path path_;
  std::string what_for_;
  std::string key_;  // the folder's canonical path
};

}  // namespace viaduct
