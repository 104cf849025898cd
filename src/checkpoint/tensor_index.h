// FQN → (file, entry) over the union of a checkpoint's tensor files.
//
// Note [Checkpoints load under any layout]
// Tensors are keyed by their global FQN (DESIGN.md, "Names that cross
// files"), never by rank or stage. Each rank of a save writes the tensors of
// the parts it holds into its own files (model-rank<r>.safetensors, ...); the
// loader indexes every file of the folder and each rank of the load asks for
// just the FQNs it owns, wherever they were written. So a checkpoint saved
// with pp=4 loads under pp=2, under stages_per_rank=2, or on one process.
//
// Optimizer state uses the same FQNs behind a prefix (optim_state_fqn):
//   optim.<state>.<param fqn>   e.g. optim.exp_avg.layers.3.attention.wq.weight
//                                    optim.exp_avg_sq.layers.3.attention.wq.weight
//                                    optim.step.layers.3.attention.wq.weight
//
// Note [Tensors stored in pieces]
// A tensor may also be stored as pieces: 1-D entries each holding a
// contiguous range of its row-major elements, possibly in different files
// (each ZeRO-1 rank writes its own slice of every optimizer moment, no
// gather to one rank). The file's metadata key `viaduct.tensor_pieces` (a
// JSON object, stored as a string) maps each piece's entry name
// ("<fqn>@<offset>") to {"fqn", "shape", "offset"}. The index lists such a
// tensor under its FQN like any other; load() and load_into() assemble it
// from pieces that must tile it exactly, so a sharded save loads under any
// layout, sharded or not.
#pragma once

#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"

namespace viaduct::checkpoint {

// "optim.<state>.<param_fqn>".
std::string optim_state_fqn(const std::string& state,
                            const std::string& param_fqn);

// The metadata key of see Note [Tensors stored in pieces].
inline constexpr const char* kTensorPiecesKey = "viaduct.tensor_pieces";

// One piece: the elements [offset, offset + values.numel()) of the
// row-major flattening of tensor `fqn`, whose whole shape is `shape`.
struct TensorPiece {
  std::string fqn;
  std::vector<int64_t> shape;
  int64_t offset = 0;
  at::Tensor values;  // 1-D
};

// The entries and the metadata (kTensorPiecesKey) that store `pieces` in
// one file.
std::pair<NamedTensors, StringMap> piece_entries(const std::vector<TensorPiece>& pieces);

// What the index knows of a tensor without reading it.
struct TensorInfo {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  size_t pieces = 0;  // 0: stored whole
};

struct LoadOptions {
  // A destination with no tensor in the checkpoint is a FileError; otherwise
  // it is left untouched and listed in LoadReport::missing. Tensors of the
  // checkpoint that no destination asks for are never an error: under
  // pipeline parallelism each rank loads a subset.
  bool strict = true;
  // A dtype differing from the destination's is refused unless this is set,
  // in which case the stored value is converted with Tensor::copy_.
  bool allow_dtype_cast = false;
  // Check each tensor's CRC-32 recorded by the writer as it is read.
  bool verify_checksums = true;
};

struct LoadReport {
  std::vector<std::string> loaded;
  std::vector<std::string> missing;  // only when !strict
};

class TensorFileIndex {
 public:
  // Every *.safetensors file directly in `folder` (or just the file, if
  // `folder` is a file).
  explicit TensorFileIndex(const std::filesystem::path& folder);
  // Exactly these files; `location` names them in messages.
  TensorFileIndex(const std::vector<std::filesystem::path>& files,
                  std::filesystem::path location);

  bool contains(const std::string& fqn) const {
    return index_.count(fqn) != 0 || pieces_.count(fqn) != 0;
  }
  std::vector<std::string> names() const;  // sorted; pieced tensors once
  // Dtype and shape of a whole or pieced tensor; FileError when missing.
  TensorInfo info(const std::string& fqn) const;
  // The entry of a tensor stored whole. FileError naming the tensor and the
  // files searched when missing (or stored in pieces).
  const TensorEntry& entry(const std::string& fqn) const;
  const SafetensorsFile& file_of(const std::string& fqn) const;
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const {
    return files_;
  }

  // CPU tensors with the stored dtype (pieces assembled).
  at::Tensor load(const std::string& fqn, bool verify_checksum = true) const;
  // Elements [begin, end) of the tensor's row-major flattening, 1-D, reading
  // only the pieces (or the bytes of a whole entry) that hold them; a
  // checksum still covers its whole piece or entry (see
  // SafetensorsFile::read_range_into). A rank that keeps a slice of a tensor
  // (sharded experts, ZeRO-1's optimizer state) holds only the slice.
  at::Tensor load_range(const std::string& fqn, int64_t begin, int64_t end,
                        bool verify_checksum = true) const;
  // Rows [first_row, first_row + rows) of dimension 0.
  at::Tensor load_rows(const std::string& fqn, int64_t first_row, int64_t rows,
                       bool verify_checksum = true) const;
  // (Not an overload of load: {"a", "b"} would also build a std::string.)
  std::map<std::string, at::Tensor> load_many(
      const std::vector<std::string>& fqns, bool verify_checksum = true) const;

  // Copies each stored tensor into its destination (any device, kept
  // dtype), after checking shape and dtype; mismatches are FileErrors naming
  // the tensor and its file.
  LoadReport load_into(const NamedTensors& destinations,
                       const LoadOptions& options = {}) const;
  // The module's named_parameters() (not buffers: pass those explicitly).
  LoadReport load_into(const torch::nn::Module& module,
                       const LoadOptions& options = {}) const;

 private:
  void add_file(const std::filesystem::path& path);
  std::string searched() const;

  std::filesystem::path location_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> index_;  // fqn → files_ slot
  struct PieceRef {
    size_t slot;
    std::string entry;
    std::vector<int64_t> shape;
    int64_t offset;
  };
  std::map<std::string, std::vector<PieceRef>> pieces_;  // fqn → by offset
  at::Tensor assemble(const std::string& fqn, bool verify_checksum) const;
  at::Tensor assemble_range(const std::string& fqn, int64_t begin, int64_t end,
                            bool verify_checksum) const;
};

// One-shot: index `folder` and load `fqns` as CPU tensors of the stored dtype.
std::map<std::string, at::Tensor> load_tensors(
    const std::filesystem::path& folder, const std::vector<std::string>& fqns);

}  // namespace viaduct::checkpoint
