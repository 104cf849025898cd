// One checkpoint: a folder `<checkpoint.folder>/step-<N>/` holding FQN-keyed
// safetensors files and `metadata.json`, saved atomically, verified and
// opened for loading under any pipeline layout. The folder of checkpoints
// (discovery, resume, pruning) is the CheckpointManager's (manager.h).
//
// Note [Atomic checkpoint save]
// Every file is written into `step-<N>.tmp-<save id>/` and fsynced; then
// metadata.json (which lists every file with its size and CRC-32) is written
// and fsynced, the folder is fsynced and renamed to `step-<N>/`, and the
// parent folder is fsynced. rename(2) is atomic, so a crash leaves either a
// `.tmp-` folder (never considered, removed by the next save:
// remove_stale_tmp_folders in manager.h) or a complete `step-<N>/`. Discovery also requires metadata.json to parse and every listed
// file to exist with its recorded size; opening for load checks the CRC-32s.
//
// Single process:
//   CheckpointMetadata meta;  meta.step = step;  meta.tokens_seen = ...;
//   save_checkpoint(folder, meta, {{"model.safetensors", model_tensors},
//                                  {"optim.safetensors", optim_tensors}});
//   prune_checkpoints(folder, keep_latest_k);      // manager.h
//
// Several ranks sharing one folder (two phases around a barrier):
//   auto tmp = checkpoint_tmp_dir(folder, step, save_id);  // same on all ranks
//   write_checkpoint_part(tmp, {part_file_name("model", rank, world), ...});
//   write_checkpoint_part(tmp, {part_file_name("optim", rank, world), ...});
//   barrier();
//   if (rank == 0) { commit_checkpoint(folder, tmp, meta, expected_files);
//                    prune_checkpoints(folder, keep_latest_k); }
//   barrier();   // optional: lets other ranks see the committed folder
// `save_id` must be identical on every rank and unique per save attempt of a
// job run, e.g. rank 0's pid and start time broadcast once at start-up.
//
// Load (any layout; each rank asks for the FQNs it owns):
//   if (auto step = find_latest_checkpoint(folder)) {  // manager.h
//     Checkpoint ckpt = open_checkpoint(checkpoint_dir(folder, *step));
//     ckpt.tensors.load_into(my_named_params);       // model
//     ckpt.tensors.load_into(my_named_optim_state);  // optim.<state>.<fqn>
//     ... ckpt.metadata.data_cursor, rng_states, tokens_seen ...
//   }
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_index.h"
#include "core/check.h"

namespace viaduct::checkpoint {

inline constexpr int kCheckpointFormatVersion = 1;
inline constexpr const char* kMetadataFileName = "metadata.json";
// Sidecar a rank writes next to each finished part; commit folds them in.
inline constexpr const char* kPartRecordSuffix = ".record.json";

struct CheckpointFileRecord {
  std::string name;  // relative to the step folder
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};

struct CheckpointMetadata {
  int format_version = kCheckpointFormatVersion;
  int64_t step = 0;
  int64_t tokens_seen = 0;
  nlohmann::json data_cursor;  // opaque: the data layer's resumable cursor
  // Generator name → hex of Generator::get_state() (generator_state_hex).
  std::map<std::string, std::string> rng_states;
  std::string config_toml;  // the effective job config
  // The world layout at save time, e.g. {"pp": 4, "dp": 1, "stages": 8}.
  // Informational: tensors load under any layout.
  nlohmann::json layout;
  // Anything else the trainer wants back (scheduler state, ...).
  nlohmann::json extra;
  // Filled by commit_checkpoint.
  std::vector<CheckpointFileRecord> files;
  std::string torch_version;

  nlohmann::json to_json() const;
  // FileError naming `source` on a missing or mistyped field, or a format
  // version newer than this build reads.
  static CheckpointMetadata from_json(const nlohmann::json& j,
                                      const std::string& source);
};

// One tensor file of a save.
struct CheckpointPart {
  std::string file_name;  // e.g. "model.safetensors"; no folders
  NamedTensors tensors;
  StringMap metadata;  // into the file's __metadata__
};

// <folder>/step-<step>
std::filesystem::path checkpoint_dir(const std::filesystem::path& folder,
                                     int64_t step);
// "<kind>.safetensors" when world_size == 1, else "<kind>-rank<r>.safetensors".
std::string part_file_name(const std::string& kind, int rank, int world_size);
// The same name with "-dp<dp_rank>" before the extension when dp_size > 1:
// a file every data-parallel replica writes (ZeRO-1's optimizer slices).
std::string part_file_name(const std::string& kind, int rank, int world_size, int dp_rank,
                           int dp_size);
// <folder>/step-<step>.tmp-<save_id>
std::filesystem::path checkpoint_tmp_dir(const std::filesystem::path& folder,
                                         int64_t step,
                                         const std::string& save_id);
// "step-<N>" → N; anything else (including "step-<N>.tmp-…") → nullopt.
std::optional<int64_t> step_of_folder_name(const std::string& name);
// "step-<N>.tmp-<id>" → N; anything else → nullopt.
std::optional<int64_t> step_of_tmp_folder_name(const std::string& name);

// Single process: writes every part and commits. `meta.files` is filled in.
// Returns the step folder. A save that fails (a full disk) removes its tmp
// folder and says how much space it needed (save_failure).
std::filesystem::path save_checkpoint(const std::filesystem::path& folder,
                                      const CheckpointMetadata& meta,
                                      const std::vector<CheckpointPart>& parts);

// Phase 1, any rank: writes one part into the tmp folder (creating it), fsyncs
// it and records its size and CRC-32 in a sidecar for the commit.
CheckpointFileRecord write_checkpoint_part(const std::filesystem::path& tmp_dir,
                                           const CheckpointPart& part);
// The FileError of a failed save: `cause`, the bytes the parts needed and
// what the file system of `folder` has free, after `tmp_dir` is removed.
FileError save_failure(const std::filesystem::path& folder,
                       const std::filesystem::path& tmp_dir, int64_t step,
                       const std::vector<CheckpointPart>& parts, const std::string& cause);

// Phase 2, one rank after every rank's phase 1: checks every part finished
// (and each of `expected_files` is there), writes metadata.json, renames the
// tmp folder to step-<meta.step>/ (replacing an existing one) and removes
// stale tmp folders of this or earlier steps. Returns the step folder.
std::filesystem::path commit_checkpoint(
    const std::filesystem::path& folder, const std::filesystem::path& tmp_dir,
    CheckpointMetadata meta, const std::vector<std::string>& expected_files = {});

enum class Verify {
  kSizes,      // metadata.json parses, every listed file has its size
  kChecksums,  // and every file's CRC-32 matches (reads everything)
};

// Reads and validates step_dir/metadata.json (not the tensor files).
CheckpointMetadata load_checkpoint_metadata(const std::filesystem::path& step_dir);
// FileError naming the file (and, for corrupt data, the damaged tensors) when
// a listed file is missing, has the wrong size or (kChecksums) wrong CRC-32.
void verify_checkpoint(const std::filesystem::path& step_dir,
                       Verify verify = Verify::kChecksums);

struct Checkpoint {
  std::filesystem::path dir;
  CheckpointMetadata metadata;
  TensorFileIndex tensors;  // over exactly the files metadata.json lists
};
// Verifies, then indexes the files. Under pipeline parallelism a rank may pass
// Verify::kSizes: the per-tensor CRC-32s still check every tensor it reads.
Checkpoint open_checkpoint(const std::filesystem::path& step_dir,
                           Verify verify = Verify::kChecksums);

// Opaque bytes as lowercase hex, and back (FileError naming `what`).
std::string bytes_to_hex(const void* data, size_t n);
std::vector<uint8_t> hex_to_bytes(const std::string& hex, const std::string& what);
// at::Generator state (CPU or CUDA) as hex, and back.
std::string generator_state_hex(const at::Generator& gen);
void set_generator_state(at::Generator& gen, const std::string& hex);

}  // namespace viaduct::checkpoint
