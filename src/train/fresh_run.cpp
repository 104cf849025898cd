// A fresh run in a folder that holds an old one (see fresh_run.h).
#include "train/fresh_run.h"

#include <ctime>
#include <fstream>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "config/job_config.h"
#include "core/check.h"
#include "core/folder_lock.h"
#include "core/log.h"
#include "train/train_state.h"

namespace viaduct {
namespace fs = std::filesystem;

namespace {

constexpr const char* kAsidePrefix = "old-run-";

bool is_under(const fs::path& inner, const fs::path& outer) {
  const auto rel = fs::absolute(inner).lexically_normal().lexically_relative(
      fs::absolute(outer).lexically_normal());
  return !rel.empty() && *rel.begin() != "..";
}

// The `step-<N>` folders of a checkpoint folder, complete or not (a crashed
// save is the old run's too).
std::vector<std::string> step_folders(const fs::path& folder) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(folder, ec)) {
    const auto name = de.path().filename().string();
    if (name.rfind("step-", 0) == 0 && de.is_directory(ec)) out.push_back(name);
  }
  std::sort(out.begin(), out.end(), [](const std::string& a, const std::string& b) {
    return std::strtoll(a.c_str() + 5, nullptr, 10) < std::strtoll(b.c_str() + 5, nullptr, 10);
  });
  return out;
}

int64_t line_count(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  int64_t n = 0;
  for (std::string line; std::getline(in, line);) n += !line.empty();
  return n;
}

std::string utc_stamp() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

// Renames every entry of `folder` but the lock and earlier asides into
// `folder/<aside>`.
void move_entries(const fs::path& folder, const std::string& aside) {
  const fs::path to = folder / aside;
  fs::create_directory(to);
  std::vector<fs::path> entries;
  for (const auto& de : fs::directory_iterator(folder)) {
    const auto name = de.path().filename().string();
    if (name == FolderLock::kFileName || name.rfind(kAsidePrefix, 0) == 0) continue;
    entries.push_back(de.path());
  }
  for (const auto& e : entries) {
    std::error_code ec;
    fs::rename(e, to / e.filename(), ec);
    VIADUCT_CHECK_T(FileError, !ec, "cannot move ", e.string(), " aside into ", to.string(), ": ",
                    ec.message());
  }
}

}  // namespace

std::string old_run_in_folders(const JobConfig& job) {
  const fs::path dump = job.job.dump_folder;
  std::string found;
  std::error_code ec;
  const fs::path metrics = dump / "metrics.jsonl";
  if (fs::is_regular_file(metrics, ec)) {
    if (const int64_t lines = line_count(metrics); lines > 0) {
      found = str(metrics.string(), " (", lines, " lines)");
    }
  }
  const fs::path ckpt = checkpoint_folder_from_config(job);
  const auto steps = step_folders(ckpt);
  if (!steps.empty()) {
    found += str(found.empty() ? "" : " and ", "checkpoints ", steps.front(),
                 steps.size() > 1 ? str(" ... ", steps.back()) : std::string(), " in ",
                 ckpt.string());
  }
  return found;
}

fs::path make_room_for_fresh_run(const JobConfig& job) {
  if (job.checkpoint.resume) return {};
  const std::string found = old_run_in_folders(job);
  if (found.empty()) return {};
  const fs::path dump = job.job.dump_folder;
  VIADUCT_CHECK_T(ConfigError, job.checkpoint.move_old_run_aside,
                  "checkpoint.resume = false (from ", job.source("checkpoint.resume"),
                  "), but job.dump_folder ", dump.string(), " holds a run: ", found,
                  ". A fresh run there would mix with it or destroy it. Give this run another "
                  "job.dump_folder, resume the old run (checkpoint.resume = true), or set "
                  "checkpoint.move_old_run_aside = true to move it into ", (dump / kAsidePrefix).string(),
                  "<UTC time>/ first");
  const std::string aside = kAsidePrefix + utc_stamp();
  const fs::path ckpt = checkpoint_folder_from_config(job);
  move_entries(dump, aside);
  if (!is_under(ckpt, dump) && fs::exists(ckpt)) move_entries(ckpt, aside);
  log::warn("checkpoint.move_old_run_aside: the old run (", found, ") is now in ",
            (dump / aside).string(),
            !is_under(ckpt, dump) ? str(" and ", (ckpt / aside).string()) : std::string(),
            "; this run starts fresh");
  return dump / aside;
}

std::vector<std::unique_ptr<FolderLock>> lock_run_folders(const JobConfig& job) {
  // See Note [One trainer per dump folder]: a checkpoint folder outside the
  // dump folder is locked too.
  std::vector<std::unique_ptr<FolderLock>> locks;
  const fs::path dump = job.job.dump_folder;
  locks.push_back(std::make_unique<FolderLock>(dump, "job.dump_folder"));
  if (!job.checkpoint.enable) return locks;
  const fs::path ckpt = fs::absolute(checkpoint_folder_from_config(job)).lexically_normal();
  const auto rel = ckpt.lexically_relative(fs::absolute(dump).lexically_normal());
  if (rel.empty() || *rel.begin() == "..") {
    locks.push_back(std::make_unique<FolderLock>(ckpt, "checkpoint.folder"));
  }
  make_room_for_fresh_run(job);  // See Note [A fresh run never mixes with an old one]
  return locks;
}

}  // namespace viaduct
