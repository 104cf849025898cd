// Checkpoint folders: atomic save (see Note [Atomic checkpoint save] in
// checkpoint.h), discovery, pruning, verification and metadata.
#include "checkpoint/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <mutex>
#include <set>
#include <system_error>

#include "checkpoint/manager.h"
#include "core/check.h"
#include "core/file_io.h"
#include "core/log.h"
#include "core/torch_compat.h"

namespace viaduct::checkpoint {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kStepPrefix = "step-";
constexpr const char* kTmpInfix = ".tmp-";
constexpr const char* kFormatName = "viaduct-checkpoint";

// Parses the digits of `text` as a non-negative step.
std::optional<int64_t> parse_step(std::string_view text) {
  if (text.empty() || text.size() > 18) return std::nullopt;
  int64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size() || v < 0) {
    return std::nullopt;
  }
  return v;
}

std::string pid_text() { return std::to_string(::getpid()); }

template <typename T>
T get_field(const json& j, const char* key, const std::string& source) {
  VIADUCT_CHECK_T(FileError, j.contains(key), source, ": missing field '", key,
                  "'");
  try {
    return j.at(key).get<T>();
  } catch (const json::exception& e) {
    VIADUCT_CHECK_T(FileError, false, source, ": field '", key,
                    "' has the wrong type (", e.what(), ")");
  }
  return T{};
}

void check_file_name(const std::string& name, const fs::path& dir) {
  VIADUCT_CHECK(!name.empty() && name.find('/') == std::string::npos &&
                    name != "." && name != ".." && name != kMetadataFileName,
                "bad checkpoint file name '", name, "' in ", dir.string());
}

}  // namespace

// ---- naming --------------------------------------------------------------

std::optional<int64_t> step_of_folder_name(const std::string& name) {
  if (name.rfind(kStepPrefix, 0) != 0) return std::nullopt;
  return parse_step(std::string_view(name).substr(std::strlen(kStepPrefix)));
}

std::optional<int64_t> step_of_tmp_folder_name(const std::string& name) {
  if (name.rfind(kStepPrefix, 0) != 0) return std::nullopt;
  size_t at = name.find(kTmpInfix);
  if (at == std::string::npos) return std::nullopt;
  size_t start = std::strlen(kStepPrefix);
  return parse_step(std::string_view(name).substr(start, at - start));
}

// ---- metadata ------------------------------------------------------------

json CheckpointMetadata::to_json() const {
  json files_json = json::array();
  for (const auto& f : files) {
    files_json.push_back(
        {{"name", f.name}, {"bytes", f.bytes}, {"crc32", crc32_hex(f.crc32)}});
  }
  return {{"format", kFormatName},
          {"format_version", format_version},
          {"step", step},
          {"tokens_seen", tokens_seen},
          {"data_cursor", data_cursor},
          {"rng_states", rng_states},
          {"config_toml", config_toml},
          {"layout", layout},
          {"extra", extra},
          {"torch_version", torch_version},
          {"files", files_json}};
}

CheckpointMetadata CheckpointMetadata::from_json(const json& j,
                                                 const std::string& source) {
  VIADUCT_CHECK_T(FileError, j.is_object(), source, ": not a JSON object");
  VIADUCT_CHECK_T(FileError,
                  get_field<std::string>(j, "format", source) == kFormatName,
                  source, ": not a viaduct checkpoint metadata file");
  CheckpointMetadata m;
  m.format_version = get_field<int>(j, "format_version", source);
  VIADUCT_CHECK_T(FileError,
                  m.format_version >= 1 &&
                      m.format_version <= kCheckpointFormatVersion,
                  source, ": format version ", m.format_version,
                  " (this build reads 1..", kCheckpointFormatVersion, ")");
  m.step = get_field<int64_t>(j, "step", source);
  m.tokens_seen = get_field<int64_t>(j, "tokens_seen", source);
  m.data_cursor = j.value("data_cursor", json());
  m.rng_states =
      get_field<std::map<std::string, std::string>>(j, "rng_states", source);
  m.config_toml = get_field<std::string>(j, "config_toml", source);
  m.layout = j.value("layout", json());
  m.extra = j.value("extra", json());
  m.torch_version = j.value("torch_version", std::string());
  const json files = j.contains("files") ? j["files"] : json();
  VIADUCT_CHECK_T(FileError, files.is_array(), source,
                  ": missing or non-list field 'files'");
  std::set<std::string> names;
  for (const auto& f : files) {
    const std::string fs_src = source + " (files entry)";
    VIADUCT_CHECK_T(FileError, f.is_object(), fs_src, ": not an object");
    CheckpointFileRecord r;
    r.name = get_field<std::string>(f, "name", fs_src);
    r.bytes = get_field<uint64_t>(f, "bytes", fs_src);
    r.crc32 = parse_crc32_hex(get_field<std::string>(f, "crc32", fs_src),
                              source + " (file '" + r.name + "')");
    VIADUCT_CHECK_T(FileError,
                    !r.name.empty() && r.name.find('/') == std::string::npos &&
                        names.insert(r.name).second,
                    source, ": bad or repeated file name '", r.name, "'");
    m.files.push_back(std::move(r));
  }
  return m;
}

// ---- names ---------------------------------------------------------------

fs::path checkpoint_dir(const fs::path& folder, int64_t step) {
  return folder / (kStepPrefix + std::to_string(step));
}

std::string part_file_name(const std::string& kind, int rank, int world_size) {
  if (world_size <= 1) return kind + ".safetensors";
  return kind + "-rank" + std::to_string(rank) + ".safetensors";
}

std::string part_file_name(const std::string& kind, int rank, int world_size, int dp_rank,
                           int dp_size) {
  if (dp_size <= 1) return part_file_name(kind, rank, world_size);
  std::string base = kind;
  if (world_size > 1) base += "-rank" + std::to_string(rank);
  return base + "-dp" + std::to_string(dp_rank) + ".safetensors";
}

fs::path checkpoint_tmp_dir(const fs::path& folder, int64_t step,
                            const std::string& save_id) {
  VIADUCT_CHECK(!save_id.empty() && save_id.find('/') == std::string::npos,
                "bad checkpoint save id '", save_id, "'");
  return folder / (kStepPrefix + std::to_string(step) + kTmpInfix + save_id);
}

// ---- save ----------------------------------------------------------------

CheckpointFileRecord write_checkpoint_part(const fs::path& tmp_dir,
                                           const CheckpointPart& part) {
  check_file_name(part.file_name, tmp_dir);
  VIADUCT_CHECK(fs::path(part.file_name).extension() == ".safetensors",
                "checkpoint part '", part.file_name,
                "' must end in .safetensors");
  make_dirs(tmp_dir);
  const fs::path path = tmp_dir / part.file_name;
  FileDigest d = write_safetensors(path, part.tensors, part.metadata);
  CheckpointFileRecord r{part.file_name, d.bytes, d.crc32};
  json record = {{"name", r.name}, {"bytes", r.bytes},
                 {"crc32", crc32_hex(r.crc32)}};
  write_text_file(tmp_dir / (part.file_name + kPartRecordSuffix),
                  record.dump());
  fsync_dir(tmp_dir);
  log::debug("checkpoint: wrote ", path.string(), " (", d.bytes, " bytes, ",
             part.tensors.size(), " tensors)");
  return r;
}

fs::path commit_checkpoint(const fs::path& folder, const fs::path& tmp_dir,
                           CheckpointMetadata meta,
                           const std::vector<std::string>& expected_files) {
  const std::string tmp_name = tmp_dir.filename().string();
  VIADUCT_CHECK(step_of_tmp_folder_name(tmp_name) == meta.step, "tmp folder ",
                tmp_dir.string(), " is not one for step ", meta.step);
  std::error_code ec;
  VIADUCT_CHECK_T(FileError, fs::is_directory(tmp_dir, ec), "checkpoint tmp folder ",
                  tmp_dir.string(), " does not exist (did any rank write a part?)");

  // Every part must have finished: a .safetensors with its record sidecar.
  std::vector<CheckpointFileRecord> records;
  for (const auto& de : fs::directory_iterator(tmp_dir, ec)) {
    const std::string name = de.path().filename().string();
    if (de.path().extension() != ".safetensors") continue;
    const fs::path record_path = tmp_dir / (name + kPartRecordSuffix);
    VIADUCT_CHECK_T(FileError, fs::exists(record_path, ec), "checkpoint part ",
                    de.path().string(),
                    " has no record: its writer did not finish");
    json rj;
    try {
      rj = json::parse(read_text_file(record_path));
    } catch (const json::exception& e) {
      VIADUCT_CHECK_T(FileError, false, "record ", record_path.string(),
                      " is not valid JSON (", e.what(), ")");
    }
    CheckpointFileRecord r;
    r.name = get_field<std::string>(rj, "name", record_path.string());
    r.bytes = get_field<uint64_t>(rj, "bytes", record_path.string());
    r.crc32 = parse_crc32_hex(
        get_field<std::string>(rj, "crc32", record_path.string()),
        record_path.string());
    const uint64_t on_disk = fs::file_size(de.path(), ec);
    VIADUCT_CHECK_T(FileError, !ec && r.name == name && on_disk == r.bytes,
                    "checkpoint part ", de.path().string(), " has ", on_disk,
                    " bytes but its record says ", r.bytes);
    records.push_back(std::move(r));
  }
  VIADUCT_CHECK_T(FileError, !ec, "cannot list ", tmp_dir.string(), ": ",
                  ec.message());
  std::sort(records.begin(), records.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  for (const auto& want : expected_files) {
    bool found = std::any_of(records.begin(), records.end(),
                             [&](const auto& r) { return r.name == want; });
    VIADUCT_CHECK_T(FileError, found, "checkpoint part ", want,
                    " is missing from ", tmp_dir.string(),
                    " (a rank did not write it before the commit)");
  }
  for (const auto& r : records) {
    const fs::path sidecar = tmp_dir / (r.name + kPartRecordSuffix);
    VIADUCT_CHECK_T(FileError, fs::remove(sidecar, ec) && !ec, "cannot remove ",
                    sidecar.string(), ": ", ec.message());
  }

  meta.files = records;
  meta.format_version = kCheckpointFormatVersion;
  meta.torch_version = compat::torch_version();
  write_text_file(tmp_dir / kMetadataFileName, meta.to_json().dump(2) + "\n");
  fsync_dir(tmp_dir);

  const fs::path dest = checkpoint_dir(folder, meta.step);
  if (fs::exists(dest, ec)) {
    // rename(2) will not replace a non-empty folder: move the old one aside
    // under a tmp name (removed below with the other stale tmp folders).
    const fs::path aside =
        checkpoint_tmp_dir(folder, meta.step, "replaced-" + pid_text());
    log::warn("checkpoint: replacing existing ", dest.string());
    remove_tree(aside);
    rename_path(dest, aside);
  }
  rename_path(tmp_dir, dest);
  fsync_dir(folder);
  // The checkpoint folder's own entry, for the first save into a new one.
  fsync_dir(fs::absolute(folder).parent_path());

  remove_stale_tmp_folders(folder, meta.step);
  log::info("checkpoint: saved step ", meta.step, " to ", dest.string(), " (",
            records.size(), " tensor files)");
  return dest;
}

fs::path save_checkpoint(const fs::path& folder, const CheckpointMetadata& meta,
                         const std::vector<CheckpointPart>& parts) {
  make_dirs(folder);
  const fs::path tmp = checkpoint_tmp_dir(folder, meta.step, pid_text());
  remove_tree(tmp);  // left by an earlier process with our pid
  std::vector<std::string> expected;
  try {
    for (const auto& part : parts) {
      write_checkpoint_part(tmp, part);
      expected.push_back(part.file_name);
    }
    make_dirs(tmp);  // a save with no parts still commits metadata
    return commit_checkpoint(folder, tmp, meta, expected);
  } catch (const FileError& e) {
    throw save_failure(folder, tmp, meta.step, parts, e.what());
  }
}

FileError save_failure(const fs::path& folder, const fs::path& tmp_dir, int64_t step,
                       const std::vector<CheckpointPart>& parts, const std::string& cause) {
  // The tmp folder goes first: a full disk must not stay full because of a
  // save that cannot finish.
  const std::string why = remove_tree_noexcept(tmp_dir);
  const std::string removed =
      !why.empty() ? str("; its temporary folder ", tmp_dir.string(), " could not be removed: ",
                         why)
                   : str("; its temporary folder ", tmp_dir.string(), " was removed");
  std::error_code ec;
  uint64_t needed = 0;
  for (const auto& part : parts) {
    for (const auto& [name, t] : part.tensors) {
      needed += static_cast<uint64_t>(t.numel()) * t.element_size() + name.size() + 64;
    }
  }
  const auto space = fs::space(folder, ec);
  const auto mib = [](uint64_t b) { return str(b / (1024 * 1024), " MiB"); };
  return FileError(str("checkpoint step ", step, " could not be saved: ", cause,
                       removed, ". This rank's part of the save needs about ", mib(needed),
                       ec ? std::string("") : str("; ", folder.string(), " has ",
                                                  mib(space.available), " free")));
}

// ---- load ----------------------------------------------------------------

CheckpointMetadata load_checkpoint_metadata(const fs::path& step_dir) {
  const fs::path path = step_dir / kMetadataFileName;
  std::error_code ec;
  VIADUCT_CHECK_T(FileError, fs::exists(path, ec), "checkpoint ",
                  step_dir.string(), " has no ", kMetadataFileName,
                  " (incomplete save?)");
  json j;
  try {
    j = json::parse(read_text_file(path));
  } catch (const json::exception& e) {
    VIADUCT_CHECK_T(FileError, false, path.string(), " is not valid JSON (",
                    e.what(), ")");
  }
  return CheckpointMetadata::from_json(j, path.string());
}

void verify_checkpoint(const fs::path& step_dir, Verify verify) {
  CheckpointMetadata meta = load_checkpoint_metadata(step_dir);
  for (const auto& rec : meta.files) {
    const fs::path path = step_dir / rec.name;
    const std::string where = "file " + path.string();
    std::error_code ec;
    const uint64_t size = fs::file_size(path, ec);
    VIADUCT_CHECK_T(FileError, !ec, where, " listed in ", kMetadataFileName,
                    " is missing or unreadable: ", ec.message());
    if (size != rec.bytes) {
      // Name the tensors the damage reaches where the header still parses.
      std::string detail;
      try {
        SafetensorsFile f(path);
      } catch (const FileError& e) {
        detail = std::string("; ") + e.what();
      }
      VIADUCT_CHECK_T(FileError, false, where, " has ", size, " bytes but ",
                      kMetadataFileName, " records ", rec.bytes,
                      " (truncated or replaced)", detail);
    }
    if (verify == Verify::kChecksums) {
      FileDigest d = digest_file(path);
      if (d.crc32 != rec.crc32) {
        std::string detail;
        try {
          SafetensorsFile f(path);
          auto damaged = f.damaged_tensors();
          if (damaged.empty()) {
            detail = "; the damage is in the header";
          } else {
            detail = "; damaged tensor(s):";
            for (const auto& n : damaged) detail += " '" + n + "'";
          }
        } catch (const FileError& e) {
          detail = std::string("; ") + e.what();
        }
        VIADUCT_CHECK_T(FileError, false, where, ": checksum mismatch (",
                        kMetadataFileName, " records crc32 ",
                        crc32_hex(rec.crc32), ", the file has ",
                        crc32_hex(d.crc32), ")", detail);
      }
    }
  }
}

Checkpoint open_checkpoint(const fs::path& step_dir, Verify verify) {
  verify_checkpoint(step_dir, verify);
  CheckpointMetadata meta = load_checkpoint_metadata(step_dir);
  std::vector<fs::path> paths;
  for (const auto& rec : meta.files) {
    if (fs::path(rec.name).extension() == ".safetensors") {
      paths.push_back(step_dir / rec.name);
    }
  }
  return Checkpoint{step_dir, std::move(meta), TensorFileIndex(paths, step_dir)};
}

// ---- opaque bytes --------------------------------------------------------

std::string bytes_to_hex(const void* data, size_t n) {
  static const char kDigits[] = "0123456789abcdef";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = kDigits[p[i] >> 4];
    s[2 * i + 1] = kDigits[p[i] & 15];
  }
  return s;
}

std::vector<uint8_t> hex_to_bytes(const std::string& hex, const std::string& what) {
  auto nibble = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  VIADUCT_CHECK_T(FileError, hex.size() % 2 == 0, what,
                  ": hex text of odd length");
  std::vector<uint8_t> out(hex.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    int hi = nibble(hex[2 * i]);
    int lo = nibble(hex[2 * i + 1]);
    VIADUCT_CHECK_T(FileError, hi >= 0 && lo >= 0, what,
                    ": not hex at character ", 2 * i);
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return out;
}

std::string generator_state_hex(const at::Generator& gen) {
  at::Generator g = gen;  // a handle to the same generator
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(g.mutex());
    state = g.get_state();
  }
  state = state.contiguous();
  return bytes_to_hex(state.data_ptr(), static_cast<size_t>(state.nbytes()));
}

void set_generator_state(at::Generator& gen, const std::string& hex) {
  std::vector<uint8_t> bytes = hex_to_bytes(hex, "generator state");
  at::Tensor state =
      at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(state.data_ptr(), bytes.data(), bytes.size());
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace viaduct::checkpoint
