// A fresh run (checkpoint.resume = false) in a folder that already holds one.
//
// Note [A fresh run never mixes with an old one]
// Starting over in a job.dump_folder that holds a run's metrics.jsonl or
// checkpoints would cut the old metrics, replace its checkpoints one save at
// a time, and leave its newer checkpoints beside the new run's, so a later
// plain restart resumes the old run. Rank 0 looks before anything is
// written: an old run is refused naming the folder and the choices, or,
// with checkpoint.move_old_run_aside = true, its files are renamed into
// `old-run-<UTC time>/` inside their folder (nothing is copied or removed).
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/folder_lock.h"

namespace viaduct {

struct JobConfig;

// What the folders of `job` hold of an earlier run ("metrics.jsonl (12
// lines), checkpoints step-5 ... step-10"); empty when nothing.
std::string old_run_in_folders(const JobConfig& job);

// Under checkpoint.resume = false: returns at once when the folders hold no
// run; throws a ConfigError naming the folder and the choices, or moves the
// old run aside (checkpoint.move_old_run_aside) and returns the folder it
// went to. Run by the rank holding the folder lock.
std::filesystem::path make_room_for_fresh_run(const JobConfig& job);

// The locks of a starting job, taken by rank 0, which speaks for the job
// (see Note [One trainer per dump folder], core/folder_lock.h): job.dump_folder
// and, when checkpoints are on and kept outside it, the checkpoint folder;
// then a fresh run makes room (make_room_for_fresh_run). Held while the
// locks live.
std::vector<std::unique_ptr<FolderLock>> lock_run_folders(const JobConfig& job);

}  // namespace viaduct
