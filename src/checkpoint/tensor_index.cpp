// The union-of-files tensor index and layout-independent loading
// (Note [Checkpoints load under any layout] in tensor_index.h).
#include "checkpoint/tensor_index.h"

#include <algorithm>
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
  for (const auto& [name, e] : files_.back()->entries()) {
    auto [it, fresh] = index_.emplace(name, slot);
    VIADUCT_CHECK_T(FileError, fresh, "tensor '", name, "' is stored twice: in ",
                    files_[it->second]->path().string(), " and in ",
                    path.string());
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
  out.reserve(index_.size());
  for (const auto& [name, slot] : index_) out.push_back(name);
  return out;
}

const SafetensorsFile& TensorFileIndex::file_of(const std::string& fqn) const {
  auto it = index_.find(fqn);
  VIADUCT_CHECK_T(FileError, it != index_.end(), "tensor '", fqn,
                  "' not found in checkpoint ", searched());
  return *files_[it->second];
}

const TensorEntry& TensorFileIndex::entry(const std::string& fqn) const {
  return file_of(fqn).entry(fqn);
}

at::Tensor TensorFileIndex::load(const std::string& fqn,
                                 bool verify_checksum) const {
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
      // cache, Note [Low-precision weight cache], trusts it).
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
