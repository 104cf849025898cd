// Hugging Face checkpoints in and out: the transformers layout of llama
// (`LlamaForCausalLM`) and gpt2 (`GPT2LMHeadModel`) against viaduct's
// FQN-keyed tensors, config.json against viaduct's model shape, and HF model
// folders (config.json + model.safetensors, or shards with
// model.safetensors.index.json).
//
// Note [HF rotary layout]
// viaduct's RoPE rotates interleaved pairs (x[2i], x[2i+1]) of each head, as
// Meta's llama does; transformers' llama rotates halves (x[i], x[i + hd/2]).
// The two agree when the rows of q_proj and k_proj are permuted within each
// head: HF row j < hd/2 is viaduct row 2j, HF row hd/2 + j is viaduct row
// 2j + 1 (transformers' convert_llama_weights_to_hf `permute`). The scores
// q.k are unchanged by a permutation applied to both q and k, so the
// attention output is the same.
//
// gpt2: transformers stores Conv1D weights as [in, out] (viaduct's Linear is
// [out, in]) and fuses q, k, v into c_attn ([D, 3D], q first); lm_head is
// tied to wte. A padded viaduct vocab (50,304) is written whole and
// config.json says so; an HF vocab smaller than viaduct's is padded with
// zero rows on the way in.
#pragma once

#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace viaduct::checkpoint {

// The shape both sides describe; family "llama" or "gpt2".
struct HfModelShape {
  std::string family;
  int64_t n_layers = 0;
  int64_t dim = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t vocab_size = 0;
  int64_t ffn_hidden = 0;
  int64_t max_seq_len = 0;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;  // llama
  // llama: HF rope_scaling of type "llama3" (factor 0: none).
  double rope_scaling_factor = 0.0;
  double rope_scaling_low_freq_factor = 1.0;
  double rope_scaling_high_freq_factor = 4.0;
  int64_t rope_scaling_original_max_seq_len = 8192;
  bool tie_embeddings = false;
};

using TensorMap = std::map<std::string, at::Tensor>;

// config.json for `shape`; `torch_dtype` is "float32", "bfloat16" or
// "float16".
nlohmann::json hf_config_json(const HfModelShape& shape,
                              const std::string& torch_dtype);
// The shape config.json describes. A ConfigError names `source` and the
// field for an architecture or setting viaduct does not model (another
// model_type, a rope_scaling other than "llama3", biases in llama, another
// activation).
HfModelShape shape_from_hf_config(const nlohmann::json& config,
                                  const std::string& source);
// A ConfigError naming the first field that differs, with both values, when
// the HF checkpoint does not fit the viaduct model (an HF vocab smaller than
// viaduct's fits: it is padded).
void check_hf_shape(const HfModelShape& hf, const HfModelShape& viaduct,
                    const std::string& source);

// viaduct FQN -> tensor to HF name -> tensor (same dtype, CPU, contiguous).
TensorMap to_hf_tensors(const TensorMap& viaduct, const HfModelShape& shape);
// HF name -> tensor to viaduct FQN -> tensor for the viaduct shape `shape`
// (`hf_vocab` rows of the embedding come from HF, the rest are zero). A
// missing tensor or a wrong shape is a FileError naming it and `source`.
TensorMap from_hf_tensors(const TensorMap& hf, const HfModelShape& shape,
                          int64_t hf_vocab, const std::string& source);

// The permutation of Note [HF rotary layout] on the rows of a [n_heads *
// head_dim, in] weight (or a [n_heads * head_dim] bias), and its inverse.
at::Tensor interleaved_to_half_rows(const at::Tensor& w, int64_t n_heads);
at::Tensor half_to_interleaved_rows(const at::Tensor& w, int64_t n_heads);

struct HfFolder {
  nlohmann::json config;
  HfModelShape shape;
  TensorMap tensors;  // HF names, stored dtypes
};
// Reads config.json and every tensor of model.safetensors or of the shards
// model.safetensors.index.json lists. A missing or corrupt file is a
// FileError naming it.
HfFolder read_hf_folder(const std::filesystem::path& folder);
// True when `folder` holds a config.json (an HF model folder).
bool is_hf_folder(const std::filesystem::path& folder);

// A file copied byte for byte into an HF model folder as `name`.
struct HfExtraFile {
  std::filesystem::path source;
  std::string name;
};

// The files of the tokenizer `tokenizer` names (a tokenizer.json, a folder
// holding one, or a tiktoken .tiktoken file: what `prepare-data --tokenizer`
// takes) for an HF model folder: the file itself, a .json one as
// tokenizer.json, and the tokenizer_config.json and special_tokens_map.json
// that sit beside it. A missing file is a FileError naming `key` (the
// option or config key) and the path.
std::vector<HfExtraFile> hf_tokenizer_files(const std::filesystem::path& tokenizer,
                                            const std::string& key);

struct HfWriteOptions {
  at::ScalarType dtype = at::kFloat;  // kFloat, kBFloat16 or kHalf
  int64_t max_shard_bytes = 5'000'000'000;
  // Copied beside the weights (the tokenizer's files: hf_tokenizer_files).
  std::vector<HfExtraFile> extra_files;
};
// Writes `viaduct` (FQN-keyed) as an HF model folder at `folder`, which must
// not exist: everything goes to a temporary sibling that is fsynced and
// renamed into place (Note [Atomic replace] in core/file_io.h). An extra
// file that is missing, or two files of one name, are refused before
// anything is written.
void write_hf_folder(const std::filesystem::path& folder,
                     const TensorMap& viaduct, const HfModelShape& shape,
                     const HfWriteOptions& options);

// "float32" / "bfloat16" / "float16" for --dtype fp32 / bf16 / fp16 (also
// accepted as written); ConfigError otherwise.
at::ScalarType parse_hf_dtype(const std::string& name);
std::string torch_dtype_name(at::ScalarType dtype);

}  // namespace viaduct::checkpoint
