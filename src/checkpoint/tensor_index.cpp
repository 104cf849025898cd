// The union-of-files tensor index and layout-independent loading
// (see Note [Checkpoints load under any layout] in tensor_index.h).
#include "checkpoint/tensor_index.h"

#include <c10/util/accumulate.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>

#include "core/check.h"

namespace viaduct::checkpoint {
namespace {

std::string sizes_text(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(sizes[i]);
  }
  return s + "]";
}

}  // namespace

std::string optim_state_fqn(const std::string& state,
                            const std::string& param_fqn) {
  return "optim." + state + "." + param_fqn;
}

std::pair<NamedTensors, StringMap> piece_entries(const std::vector<TensorPiece>& pieces) {
  NamedTensors tensors;
  nlohmann::json table = nlohmann::json::object();
  for (const auto& p : pieces) {
    VIADUCT_CHECK(p.values.dim() == 1, "piece of '", p.fqn, "' must be 1-D");
    const std::string name = p.fqn + "@" + std::to_string(p.offset);
    tensors.emplace_back(name, p.values);
    table[name] = {{"fqn", p.fqn}, {"shape", p.shape}, {"offset", p.offset}};
  }
  StringMap meta;
  if (!pieces.empty()) meta[kTensorPiecesKey] = table.dump();
  return {std::move(tensors), std::move(meta)};
}

TensorFileIndex::TensorFileIndex(const std::filesystem::path& folder)
    : location_(folder) {
  std::error_code ec;
  if (std::filesystem::is_regular_file(folder, ec)) {
    add_file(folder);
    return;
  }
  VIADUCT_CHECK_T(FileError, std::filesystem::is_directory(folder, ec),
                  "checkpoint folder ", folder.string(), " does not exist");
  std::vector<std::filesystem::path> paths;
  for (const auto& de : std::filesystem::directory_iterator(folder, ec)) {
    if (de.path().extension() == ".safetensors" && de.is_regular_file()) {
      paths.push_back(de.path());
    }
  }
  VIADUCT_CHECK_T(FileError, !ec, "cannot list ", folder.string(), ": ",
                  ec.message());
  std::sort(paths.begin(), paths.end());
  for (const auto& p : paths) add_file(p);
}

TensorFileIndex::TensorFileIndex(const std::vector<std::filesystem::path>& files,
                                 std::filesystem::path location)
    : location_(std::move(location)) {
  for (const auto& p : files) add_file(p);
}

void TensorFileIndex::add_file(const std::filesystem::path& path) {
  files_.push_back(std::make_unique<SafetensorsFile>(path));
  const size_t slot = files_.size() - 1;
  const SafetensorsFile& file = *files_.back();
  // See Note [Tensors stored in pieces]: entries the pieces table names are
  // indexed under their tensor's FQN.
  std::set<std::string> piece_names;
  auto meta = file.metadata().find(kTensorPiecesKey);
  if (meta != file.metadata().end()) {
    nlohmann::json table;
    try {
      table = nlohmann::json::parse(meta->second);
    } catch (const nlohmann::json::exception& e) {
      throw FileError(str(path.string(), ": metadata ", kTensorPiecesKey,
                          " is not valid JSON (", e.what(), ")"));
    }
    VIADUCT_CHECK_T(FileError, table.is_object(), path.string(), ": metadata ",
                    kTensorPiecesKey, " is not a JSON object");
    for (const auto& [name, d] : table.items()) {
      const std::string where = str("piece '", name, "' in ", path.string());
      VIADUCT_CHECK_T(FileError, file.contains(name), where, " is listed but not stored");
      PieceRef ref{slot, name, {}, 0};
      std::string fqn;
      try {
        fqn = d.at("fqn").get<std::string>();
        ref.shape = d.at("shape").get<std::vector<int64_t>>();
        ref.offset = d.at("offset").get<int64_t>();
      } catch (const nlohmann::json::exception& e) {
        throw FileError(str(where, ": bad description (", e.what(), ")"));
      }
      const auto& e = file.entry(name);
      int64_t numel = 1;
      for (auto n : ref.shape) numel *= n;
      VIADUCT_CHECK_T(FileError,
                      e.shape.size() == 1 && ref.offset >= 0 &&
                          ref.offset + e.shape[0] <= numel,
                      where, ": elements [", ref.offset, ", ", ref.offset + (e.shape.empty() ? 0 : e.shape[0]),
                      ") do not fit tensor '", fqn, "' of shape ", sizes_text(ref.shape));
      auto& list = pieces_[fqn];
      for (const auto& other : list) {
        VIADUCT_CHECK_T(FileError, other.offset != ref.offset, "tensor '", fqn,
                        "' has two pieces at element ", ref.offset, ": in ",
                        files_[other.slot]->path().string(), " and in ", path.string());
      }
      list.push_back(std::move(ref));
      std::sort(list.begin(), list.end(),
                [](const PieceRef& a, const PieceRef& b) { return a.offset < b.offset; });
      piece_names.insert(name);
    }
  }
  for (const auto& [name, e] : file.entries()) {
    if (piece_names.count(name) != 0) continue;
    auto [it, fresh] = index_.emplace(name, slot);
    VIADUCT_CHECK_T(FileError, fresh, "tensor '", name, "' is stored twice: in ",
                    files_[it->second]->path().string(), " and in ",
                    path.string());
  }
  for (const auto& [fqn, list] : pieces_) {
    VIADUCT_CHECK_T(FileError, index_.count(fqn) == 0, "tensor '", fqn,
                    "' is stored both whole and in pieces in ", searched());
  }
}

std::string TensorFileIndex::searched() const {
  std::string names;
  for (const auto& f : files_) {
    names += ' ';
    names += f->path().filename().string();
  }
  return str(location_.string(), " (searched ", files_.size(), " file(s):",
             names, ")");
}

std::vector<std::string> TensorFileIndex::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size() + pieces_.size());
  for (const auto& [name, slot] : index_) out.push_back(name);
  for (const auto& [name, list] : pieces_) out.push_back(name);
  std::sort(out.begin(), out.end());
  return out;
}

const SafetensorsFile& TensorFileIndex::file_of(const std::string& fqn) const {
  auto it = index_.find(fqn);
  VIADUCT_CHECK_T(FileError, it != index_.end(), "tensor '", fqn,
                  pieces_.count(fqn) ? "' is stored in pieces, not whole, in checkpoint "
                                     : "' not found in checkpoint ",
                  searched());
  return *files_[it->second];
}

const TensorEntry& TensorFileIndex::entry(const std::string& fqn) const {
  return file_of(fqn).entry(fqn);
}

TensorInfo TensorFileIndex::info(const std::string& fqn) const {
  auto p = pieces_.find(fqn);
  if (p == pieces_.end()) {
    const auto& e = entry(fqn);
    return {e.dtype, e.shape, 0};
  }
  const auto& first = p->second.front();
  return {files_[first.slot]->entry(first.entry).dtype, first.shape, p->second.size()};
}

at::Tensor TensorFileIndex::assemble(const std::string& fqn, bool verify_checksum) const {
  const auto& shape = pieces_.at(fqn).front().shape;
  return assemble_range(fqn, 0, c10::multiply_integers(shape), verify_checksum).view(shape);
}

at::Tensor TensorFileIndex::assemble_range(const std::string& fqn, int64_t begin, int64_t end,
                                           bool verify_checksum) const {
  const auto& list = pieces_.at(fqn);
  const auto& shape = list.front().shape;
  const auto dtype = files_[list.front().slot]->entry(list.front().entry).dtype;
  const auto esize = static_cast<uint64_t>(c10::elementSize(dtype));
  const int64_t numel = c10::multiply_integers(shape);
  auto out = at::empty({end - begin}, at::TensorOptions().dtype(dtype));
  auto* dst = static_cast<char*>(out.data_ptr());
  // Every piece's place is checked; only those overlapping [begin, end) are
  // read.
  int64_t covered = 0;
  for (const auto& ref : list) {
    const SafetensorsFile& file = *files_[ref.slot];
    const auto& e = file.entry(ref.entry);
    const std::string where = str("tensor '", fqn, "' (piece '", ref.entry, "' in ",
                                  file.path().string(), ")");
    VIADUCT_CHECK_T(FileError, ref.shape == shape && e.dtype == dtype, where,
                    ": its pieces disagree on the shape or dtype");
    VIADUCT_CHECK_T(FileError, ref.offset == covered, where, ": elements [", covered, ", ",
                    ref.offset, ") are in no piece", ref.offset < covered ? " (pieces overlap)" : "",
                    " of ", searched());
    const int64_t lo = std::max(begin, ref.offset), hi = std::min(end, ref.offset + e.shape[0]);
    if (lo < hi) {
      file.read_range_into(e, static_cast<uint64_t>(lo - ref.offset) * esize,
                           static_cast<uint64_t>(hi - ref.offset) * esize,
                           dst + static_cast<uint64_t>(lo - begin) * esize, verify_checksum);
    }
    covered = ref.offset + e.shape[0];
  }
  VIADUCT_CHECK_T(FileError, covered == numel, "tensor '", fqn, "': elements [", covered, ", ",
                  numel, ") are in no piece of ", searched());
  return out;
}

at::Tensor TensorFileIndex::load_range(const std::string& fqn, int64_t begin, int64_t end,
                                       bool verify_checksum) const {
  const auto inf = info(fqn);
  const int64_t numel = c10::multiply_integers(inf.shape);
  VIADUCT_CHECK(0 <= begin && begin <= end && end <= numel, "tensor '", fqn, "': elements [",
                begin, ", ", end, ") are outside its ", numel);
  if (pieces_.count(fqn) != 0) return assemble_range(fqn, begin, end, verify_checksum);
  const SafetensorsFile& file = file_of(fqn);
  const auto esize = static_cast<uint64_t>(c10::elementSize(inf.dtype));
  auto out = at::empty({end - begin}, at::TensorOptions().dtype(inf.dtype));
  file.read_range_into(file.entry(fqn), static_cast<uint64_t>(begin) * esize,
                       static_cast<uint64_t>(end) * esize, out.data_ptr(), verify_checksum);
  return out;
}

at::Tensor TensorFileIndex::load_rows(const std::string& fqn, int64_t first_row, int64_t rows,
                                      bool verify_checksum) const {
  auto shape = info(fqn).shape;
  VIADUCT_CHECK(!shape.empty() && 0 <= first_row && 0 <= rows && first_row + rows <= shape[0],
                "tensor '", fqn, "': rows [", first_row, ", ", first_row + rows,
                ") are outside its shape ", c10::IntArrayRef(shape));
  const int64_t row = c10::multiply_integers(shape.begin() + 1, shape.end());
  shape[0] = rows;
  return load_range(fqn, first_row * row, (first_row + rows) * row, verify_checksum).view(shape);
}

at::Tensor TensorFileIndex::load(const std::string& fqn,
                                 bool verify_checksum) const {
  if (pieces_.count(fqn) != 0) return assemble(fqn, verify_checksum);
  return file_of(fqn).read(fqn, verify_checksum);
}

std::map<std::string, at::Tensor> TensorFileIndex::load_many(
    const std::vector<std::string>& fqns, bool verify_checksum) const {
  std::map<std::string, at::Tensor> out;
  for (const auto& fqn : fqns) out[fqn] = load(fqn, verify_checksum);
  return out;
}

LoadReport TensorFileIndex::load_into(const NamedTensors& destinations,
                                      const LoadOptions& options) const {
  torch::NoGradGuard no_grad;
  LoadReport report;
  for (const auto& [fqn, dst] : destinations) {
    if (!contains(fqn)) {
      VIADUCT_CHECK_T(FileError, !options.strict, "tensor '", fqn,
                      "' not found in checkpoint ", searched());
      report.missing.push_back(fqn);
      continue;
    }
    if (pieces_.count(fqn) != 0) {
      const auto inf = info(fqn);
      const std::string where = "tensor '" + fqn + "' (in pieces)";
      VIADUCT_CHECK(dst.defined(), "the destination of ", where, " is an undefined tensor");
      VIADUCT_CHECK_T(FileError, dst.sizes() == at::IntArrayRef(inf.shape), where, ": shape ",
                      sizes_text(inf.shape), " in the checkpoint, but the destination has shape ",
                      sizes_text(dst.sizes()));
      VIADUCT_CHECK_T(FileError, dst.scalar_type() == inf.dtype || options.allow_dtype_cast,
                      where, ": dtype ", dtype_name(inf.dtype), " in the checkpoint, but the ",
                      "destination is ", c10::toString(dst.scalar_type()),
                      " (set LoadOptions::allow_dtype_cast to convert)");
      at::Tensor target = dst;
      target.copy_(assemble(fqn, options.verify_checksums));
      report.loaded.push_back(fqn);
      continue;
    }
    const SafetensorsFile& file = file_of(fqn);
    const TensorEntry& e = file.entry(fqn);
    const std::string where = "tensor '" + fqn + "' in file " +
                              file.path().string();
    VIADUCT_CHECK(dst.defined(), "the destination of ", where,
                  " is an undefined tensor");
    VIADUCT_CHECK_T(FileError, dst.sizes() == at::IntArrayRef(e.shape), where,
                    ": shape ", sizes_text(e.shape),
                    " in the file, but the destination has shape ",
                    sizes_text(dst.sizes()));
    const bool same_dtype = dst.scalar_type() == e.dtype;
    VIADUCT_CHECK_T(FileError, same_dtype || options.allow_dtype_cast, where,
                    ": dtype ", dtype_name(e.dtype),
                    " in the file, but the destination is ",
                    c10::toString(dst.scalar_type()),
                    " (set LoadOptions::allow_dtype_cast to convert)");
    if (same_dtype && dst.device().is_cpu() && dst.is_contiguous()) {
      // Straight into the destination's memory, no staging copy.
      file.read_into(e, dst.data_ptr(), options.verify_checksums);
      // A raw write: move the version counter as copy_ would (the weight
      // cache, see Note [Low-precision weight cache], trusts it).
      torch::autograd::impl::bump_version(dst);
    } else {
      at::Tensor staged = file.read(fqn, options.verify_checksums);
      at::Tensor target = dst;  // a handle: copy_ writes the caller's storage
      target.copy_(staged);
    }
    report.loaded.push_back(fqn);
  }
  return report;
}

LoadReport TensorFileIndex::load_into(const torch::nn::Module& module,
                                      const LoadOptions& options) const {
  NamedTensors dsts;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    dsts.emplace_back(item.key(), item.value());
  }
  return load_into(dsts, options);
}

std::map<std::string, at::Tensor> load_tensors(
    const std::filesystem::path& folder, const std::vector<std::string>& fqns) {
  return TensorFileIndex(folder).load_many(fqns);
}

}  // namespace viaduct::checkpoint
