// The chain families' Hugging Face layouts (checkpoint::StateDictAdapter,
// checkpoint/state_dict_adapter.h): llama as transformers' LlamaForCausalLM
// (model/llama_hf.cpp) and gpt2 as GPT2LMHeadModel (model/gpt2_hf.cpp), for
// the model one ChainSpec describes, and what the two share. A family hands
// its adapter out through ModelFamily::state_dict_adapter (model/family.h).
//
// Note [HF rotary layout]
// viaduct's RoPE rotates interleaved pairs (x[2i], x[2i+1]) of each head, as
// Meta's llama does; transformers' llama rotates halves (x[i], x[i + hd/2]).
// The two agree when the rows of q_proj and k_proj are permuted within each
// head: HF row j < hd/2 is viaduct row 2j, HF row hd/2 + j is viaduct row
// 2j + 1 (transformers' convert_llama_weights_to_hf `permute`). The scores
// q.k are unchanged by a permutation applied to both q and k, so the
// attention output is the same.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/state_dict_adapter.h"
#include "core/check.h"
#include "model/chain_transformer.h"

namespace viaduct {

// transformers' model_type of each layout (ModelFamily::hf_model_type).
inline constexpr const char* kLlamaModelType = "llama";
inline constexpr const char* kGpt2ModelType = "gpt2";

std::unique_ptr<checkpoint::StateDictAdapter> llama_hf_adapter(
    const ChainSpec& spec);
std::unique_ptr<checkpoint::StateDictAdapter> gpt2_hf_adapter(
    const ChainSpec& spec);

// The row permutation on a [n_heads * head_dim, in] weight (or a [n_heads *
// head_dim] bias), and its inverse; see Note [HF rotary layout].
at::Tensor interleaved_to_half_rows(const at::Tensor& w, int64_t n_heads);
at::Tensor half_to_interleaved_rows(const at::Tensor& w, int64_t n_heads);

// What the adapters share.
namespace hf {

using checkpoint::TensorMap;

std::string layer(int64_t i);  // "layers.<i>."
// The tensor `name` of `m`; a FileError naming it and `source` if missing.
const at::Tensor& need(const TensorMap& m, const std::string& name,
                       const std::string& source);
// A FileError naming the tensor, `source` and both shapes unless t has `shape`.
void expect_shape(const at::Tensor& t, const std::vector<int64_t>& shape,
                  const std::string& name, const std::string& source);
at::Tensor cpu(const at::Tensor& t);  // detached, on the CPU, contiguous

// An adapter's from_hf reads an HF state dict through a Taker, which keeps
// the names it was asked for: a checkpoint holding tensors the model never
// reads (a deeper or wider model's, another architecture's) is refused
// naming them, rather than loading part of it without a word.
class Taker {
 public:
  Taker(const TensorMap& tensors, std::string source);
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  // The tensor `name` as fp32, contiguous; a FileError naming it and the
  // source if it is missing or not of `shape`.
  at::Tensor operator()(const std::string& name, const std::vector<int64_t>& shape);
  // A tied model's head stored beside its embedding (GPT2LMHeadModel's
  // state dict holds both): taken, and a FileError unless it equals
  // `embedding` (the embedding `embedding_name` as loaded).
  void take_tied_head(const std::string& head, const at::Tensor& embedding,
                      const std::string& embedding_name);
  // A FileError naming the source, how many tensors were never taken and
  // the first few, unless `ignorable` says a name is no weight.
  void expect_all_taken(const std::function<bool(const std::string&)>& ignorable = {}) const;

 private:
  const TensorMap& tensors_;
  std::string source_;
  std::set<std::string> taken_;
};

// config.json's integer `key`; a ConfigError naming `source` if absent.
int64_t get_int(const nlohmann::json& c, const std::string& key,
                const std::string& source);
// config.json's number `key`, or `fallback`.
double get_number(const nlohmann::json& c, const std::string& key,
                  double fallback);

// A ConfigError unless config.json's model_type is `model_type`, the type of
// the family `family` (the config's model.family): another family's type
// names both (from `folder`), a type no family reads is refused (from
// `folder`/config.json) listing the ones the families read
// (ModelFamily::hf_model_type).
void check_model_type(const nlohmann::json& c, const std::string& model_type,
                      const std::string& family, const std::string& folder);

// The ConfigError of a config.json field that differs from the model.
template <typename A, typename B>
[[noreturn]] void differ(const std::string& folder, const std::string& hf_field,
                         const A& hf, const std::string& key,
                         const B& viaduct) {
  throw ConfigError(str(folder, ": config.json ", hf_field, " = ", hf,
                        " but the viaduct config has ", key, " = ", viaduct));
}

// "key=value" as Config::apply_override reads it; numbers written so that
// they read back to the same bits.
std::string override_of(const std::string& key, const nlohmann::json& value);

// config.json's names of the ChainSpec fields both layouts have; an empty
// max_seq_len is a field the layout does not check (llama's RoPE takes any
// length, gpt2's position table does not).
struct ChainFieldNames {
  std::string n_layers, dim, n_heads, n_kv_heads, ffn_hidden, vocab_size, max_seq_len,
      norm_eps;
};
// The overrides that make the config's model the HF model `h` in those fields
// and the tie, with model.family = `family`.
std::vector<std::string> chain_overrides(const std::string& family, const ChainSpec& h);
// A ConfigError (differ) at the first of those fields in which config.json's
// model `h` (from `folder`) is not the config's `v`; h's vocabulary may be
// smaller than v's (padded rows).
void check_chain_fields(const std::string& folder, const ChainFieldNames& names,
                        const ChainSpec& h, const ChainSpec& v);

// The embedding `name` ([hf_vocab, dim]) with zero rows up to `vocab`.
at::Tensor padded_embedding(Taker& take, const std::string& name, int64_t hf_vocab,
                            int64_t vocab, int64_t dim);
// v's lm_head.weight from `head` (padded as the embedding) where the model is
// untied, or the embedding's copy where the checkpoint has none; where tied,
// a stored `head` must equal the embedding `embedding_name` as loaded.
void take_head(Taker& take, TensorMap& v, bool tied, const std::string& head,
               const std::string& embedding_name, int64_t hf_vocab, int64_t vocab,
               int64_t dim);

}  // namespace hf
}  // namespace viaduct
