// The llama family (Meta's llama 3 shapes): RMSNorm, RoPE, GQA, SwiGLU,
// untied head.
#include "core/check.h"
#include "model/chain_transformer.h"
#include "model/families.h"
#include "model/hf_adapter.h"

namespace viaduct {
namespace {

const std::vector<std::string> kFlavors{"debugmodel", "1B", "8B"};

ChainSpec llama_flavor(const std::string& flavor) {
  ChainSpec s;
  s.family = "llama";
  s.flavor = flavor;
  s.norm_eps = 1e-5;
  s.rope_theta = 500000.0;
  if (flavor == "debugmodel") {
    // Tiny and CPU-friendly; 8 layers so pp4 x 2 stages per rank splits.
    s.n_layers = 8;
    s.dim = 128;
    s.n_heads = 8;
    s.n_kv_heads = 4;
    s.vocab_size = 320;  // >= the byte tokenizer's 257
    s.ffn_hidden = 384;
    s.max_seq_len = 2048;
    s.rope_theta = 10000.0;
  } else if (flavor == "1B") {
    // llama-3.2-1B shape.
    s.n_layers = 16;
    s.dim = 2048;
    s.n_heads = 32;
    s.n_kv_heads = 8;
    s.vocab_size = 128256;
    s.ffn_hidden = 8192;
    s.max_seq_len = 8192;
  } else if (flavor == "8B") {
    // llama-3.1-8B shape.
    s.n_layers = 32;
    s.dim = 4096;
    s.n_heads = 32;
    s.n_kv_heads = 8;
    s.vocab_size = 128256;
    s.ffn_hidden = 14336;
    s.max_seq_len = 8192;
  } else {
    throw unknown_flavor_error("llama", flavor, kFlavors);
  }
  return s;
}

ChainSpec llama_spec(const JobConfig& job) {
  return apply_model_overrides(llama_flavor(job.model.flavor), job);
}

}  // namespace

ModelFamily llama_family() {
  ModelFamily f;
  f.name = "llama";
  f.flavors = kFlavors;
  f.module_fqns = [](const JobConfig& job) { return chain_module_fqns(llama_spec(job)); };
  f.build = [](const JobConfig& job,
               const std::vector<std::string>& fqns) -> std::shared_ptr<ModelPart> {
    return std::make_shared<ChainTransformer>(llama_spec(job), fqns);
  };
  f.describe = [](const JobConfig& job) {
    return describe_chain(llama_spec(job), job.training.seq_len);
  };
  f.check_part = [](const JobConfig& job, const std::vector<std::string>& fqns) {
    check_chain_part(llama_spec(job), fqns);
  };
  f.hf_model_type = kLlamaModelType;
  f.state_dict_adapter = [](const JobConfig& job) { return llama_hf_adapter(llama_spec(job)); };
  f.model_keys = chain_model_keys(true, true);
  return f;
}

}  // namespace viaduct
