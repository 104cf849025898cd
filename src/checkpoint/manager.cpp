// The folder of checkpoints: discovery, the resume choice, the save policy,
// pruning and stale tmp folders (see manager.h).
#include "checkpoint/manager.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <system_error>

#include "core/check.h"
#include "core/file_io.h"
#include "core/log.h"

namespace viaduct::checkpoint {
namespace fs = std::filesystem;

namespace {

// Why `dir` is not a complete checkpoint, or "" when it is.
std::string incomplete_reason(const fs::path& dir, int64_t step, Verify verify) {
  try {
    CheckpointMetadata meta = load_checkpoint_metadata(dir);
    if (meta.step != step) {
      return str("metadata.json says step ", meta.step);
    }
    verify_checkpoint(dir, verify);
  } catch (const FileError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// ---- discovery -----------------------------------------------------------

std::vector<int64_t> list_checkpoints(const fs::path& folder, Verify verify) {
  std::vector<int64_t> steps;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return steps;
  for (const auto& de : fs::directory_iterator(folder, ec)) {
    auto step = step_of_folder_name(de.path().filename().string());
    if (!step || !de.is_directory(ec)) continue;
    std::string why = incomplete_reason(de.path(), *step, verify);
    if (why.empty()) {
      steps.push_back(*step);
    } else {
      log::warn("checkpoint: ignoring incomplete ", de.path().string(), ": ",
                why);
    }
  }
  VIADUCT_CHECK_T(FileError, !ec, "cannot list ", folder.string(), ": ",
                  ec.message());
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::optional<int64_t> find_latest_checkpoint(const fs::path& folder,
                                              Verify verify) {
  auto steps = list_checkpoints(folder, verify);
  if (steps.empty()) return std::nullopt;
  return steps.back();
}

std::optional<int64_t> newest_step_folder(const fs::path& folder) {
  std::optional<int64_t> newest;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return newest;
  for (const auto& de : fs::directory_iterator(folder, ec)) {
    auto step = step_of_folder_name(de.path().filename().string());
    if (step && de.is_directory(ec) && (!newest || *step > *newest)) newest = step;
  }
  VIADUCT_CHECK_T(FileError, !ec, "cannot list ", folder.string(), ": ",
                  ec.message());
  return newest;
}

// ---- pruning and stale folders -------------------------------------------

std::vector<int64_t> prune_checkpoints(const fs::path& folder,
                                       int keep_latest_k) {
  VIADUCT_CHECK(keep_latest_k >= 0, "checkpoint.keep_latest_k must be >= 0, got ",
                keep_latest_k);
  std::vector<int64_t> removed;
  if (keep_latest_k == 0) return removed;
  auto steps = list_checkpoints(folder, Verify::kSizes);
  if (steps.size() <= static_cast<size_t>(keep_latest_k)) return removed;
  steps.resize(steps.size() - static_cast<size_t>(keep_latest_k));
  for (int64_t step : steps) {
    const fs::path aside =
        checkpoint_tmp_dir(folder, step, "pruned-" + std::to_string(::getpid()));
    remove_tree(aside);
    rename_path(checkpoint_dir(folder, step), aside);
    fsync_dir(folder);
    remove_tree(aside);
    removed.push_back(step);
    log::info("checkpoint: pruned step ", step, " in ", folder.string());
  }
  return removed;
}

void remove_stale_tmp_folders(const fs::path& folder, int64_t up_to_step) {
  std::error_code ec;
  std::vector<fs::path> stale;
  for (const auto& de : fs::directory_iterator(folder, ec)) {
    auto s = step_of_tmp_folder_name(de.path().filename().string());
    if (s && *s <= up_to_step && de.is_directory(ec)) stale.push_back(de.path());
  }
  for (const auto& path : stale) {
    log::info("checkpoint: removing stale ", path.string());
    remove_tree(path);
  }
}

// ---- CheckpointManager ---------------------------------------------------

CheckpointManager::CheckpointManager(fs::path folder, CheckpointPolicy policy)
    : folder_(std::move(folder)), policy_(policy) {}

std::optional<int64_t> CheckpointManager::resume_step() const {
  const auto newest = newest_step_folder(folder_);
  const auto latest = find_latest_checkpoint(folder_);
  if (newest && (!latest || *latest != *newest)) {
    verify_checkpoint(checkpoint_dir(folder_, *newest),
                      Verify::kSizes);  // throws, naming the file
    throw FileError(str("checkpoint ", checkpoint_dir(folder_, *newest).string(),
                        " is incomplete; remove it to resume from an older one"));
  }
  return latest;
}

Checkpoint CheckpointManager::open(int64_t step, Verify verify) const {
  return open_checkpoint(checkpoint_dir(folder_, step), verify);
}

bool CheckpointManager::save_due(int64_t step, int64_t total_steps) const {
  if (!policy_.enable) return false;
  return (policy_.interval > 0 && step % policy_.interval == 0) ||
         (step == total_steps && policy_.save_final);
}

fs::path CheckpointManager::save(const CheckpointMetadata& meta,
                                 const std::vector<CheckpointPart>& parts,
                                 const SaveGroup* group) const {
  const int rank = group ? group->rank : 0;
  const auto t0 = std::chrono::steady_clock::now();
  fs::path dir;
  if (!group) {
    dir = save_checkpoint(folder_, meta, parts);
  } else {
    // The tmp folder's name is the same on every rank.
    const auto tmp = checkpoint_tmp_dir(folder_, meta.step, str("s", meta.step));
    if (group->writes_parts) {
      try {
        for (const auto& part : parts) write_checkpoint_part(tmp, part);
      } catch (const FileError& e) {
        throw save_failure(folder_, tmp, meta.step, parts, e.what());
      }
    }
    group->barrier(str("checkpoint step ", meta.step, " (write)"));
    if (rank == 0) {
      try {
        dir = commit_checkpoint(folder_, tmp, meta, group->expected_files);
      } catch (const FileError& e) {
        throw save_failure(folder_, tmp, meta.step, parts, e.what());
      }
    }
    group->barrier(str("checkpoint step ", meta.step, " (commit)"));
  }
  if (rank == 0) {
    const auto removed = prune_checkpoints(folder_, policy_.keep_latest_k);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    log::info("saved checkpoint ", dir.string(), " in ", std::round(seconds * 10) / 10, " s",
              removed.empty() ? "" : str(" (pruned ", removed.size(), " older)"));
  }
  if (group) group->barrier("checkpoint prune");
  return dir;
}

}  // namespace viaduct::checkpoint
