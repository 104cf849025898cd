// The folder of checkpoints a job writes (`<checkpoint.folder>/step-<N>/`):
// which checkpoints it holds (discovery), which one a job resumes from, when
// to save, keeping the newest keep_latest_k (pruning), and removing the
// `.tmp-` folders that crashed, replaced or pruned saves leave. The format of
// one checkpoint, its atomic save and its loading are in checkpoint.h.
//
//   CheckpointManager ckpt(folder, policy);
//   if (auto step = ckpt.resume_step()) { auto c = ckpt.open(*step); ... }
//   ...
//   if (ckpt.save_due(step, total)) ckpt.save(meta, parts, group);
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"

namespace viaduct::checkpoint {

// Steps of the complete checkpoints in `folder`, ascending. `.tmp-` folders
// and incomplete `step-<N>` folders are skipped (the latter with a warning).
std::vector<int64_t> list_checkpoints(const std::filesystem::path& folder,
                                      Verify verify = Verify::kSizes);
std::optional<int64_t> find_latest_checkpoint(
    const std::filesystem::path& folder, Verify verify = Verify::kSizes);
// The highest N of any `step-<N>` folder, complete or not (`.tmp-` folders
// are not step folders).
std::optional<int64_t> newest_step_folder(const std::filesystem::path& folder);
// Removes all but the `keep_latest_k` newest complete checkpoints (0 keeps
// all). Each is first renamed to a `.tmp-` name, so a crash mid-removal never
// leaves a half-deleted folder that looks like a checkpoint. Returns the
// removed steps.
std::vector<int64_t> prune_checkpoints(const std::filesystem::path& folder,
                                       int keep_latest_k);
// Removes the `step-<N>.tmp-*` folders with N <= up_to_step: crashed saves,
// replaced or pruned checkpoints. Later steps are left alone.
void remove_stale_tmp_folders(const std::filesystem::path& folder,
                              int64_t up_to_step);

// The checkpoint.* keys.
struct CheckpointPolicy {
  bool enable = false;
  bool resume = true;         // resume from the newest checkpoint at start
  int64_t interval = 0;       // save every `interval` steps
  int keep_latest_k = 0;      // 0 keeps all
  bool save_initial = false;  // step-0: the initial weights
  bool save_final = true;     // the last step, off the interval
};

// The ranks that save one checkpoint together (two phases, see Note [Atomic
// checkpoint save]): every rank with `writes_parts` writes its parts into the
// shared tmp folder, all wait, rank 0 commits and prunes, all wait.
struct SaveGroup {
  int rank = 0;
  bool writes_parts = true;
  // Every rank's part file names: the commit refuses a save without them.
  std::vector<std::string> expected_files;
  // Waits for every rank of the group; `what` names the phase.
  std::function<void(const std::string& what)> barrier;
};

class CheckpointManager {
 public:
  CheckpointManager(std::filesystem::path folder, CheckpointPolicy policy);

  const std::filesystem::path& folder() const { return folder_; }
  const CheckpointPolicy& policy() const { return policy_; }

  // The newest complete checkpoint's step; nullopt when there is none. The
  // newest `step-<N>` folder must be complete: a damaged one is a FileError
  // naming the file rather than a silent restart from an older step (or
  // from scratch).
  std::optional<int64_t> resume_step() const;
  Checkpoint open(int64_t step, Verify verify = Verify::kChecksums) const;

  // After `step` of `total_steps`: on the interval, or the last step with
  // save_final. False when checkpointing is off.
  bool save_due(int64_t step, int64_t total_steps) const;
  // At the start of a job that did not resume: step-0 with save_initial.
  bool initial_save_due() const { return policy_.enable && policy_.save_initial; }

  // Saves `parts` (this process's), commits, and prunes to keep_latest_k.
  // Without a group, one process does it all. Returns the step folder on the
  // rank that committed, an empty path elsewhere.
  std::filesystem::path save(const CheckpointMetadata& meta,
                             const std::vector<CheckpointPart>& parts,
                             const SaveGroup* group = nullptr) const;

 private:
  std::filesystem::path folder_;
  CheckpointPolicy policy_;
};

}  // namespace viaduct::checkpoint
