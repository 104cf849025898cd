// The gpt2 family: learned positions, LayerNorm, GELU MLP, biases, tied
// embeddings by default.
#include "core/check.h"
#include "model/chain_transformer.h"
#include "model/families.h"
#include "model/hf_adapter.h"

namespace viaduct {
namespace {

const std::vector<std::string> kFlavors{"debugmodel", "124M"};

ChainSpec gpt2_flavor(const std::string& flavor) {
  ChainSpec s;
  s.family = "gpt2";
  s.flavor = flavor;
  s.norm_eps = 1e-5;
  s.layer_norm = true;
  s.gelu_mlp = true;
  s.bias = true;
  s.learned_positions = true;
  s.tie_embeddings = true;
  s.depth_init = false;
  if (flavor == "debugmodel") {
    s.n_layers = 8;
    s.dim = 128;
    s.n_heads = 4;
    s.vocab_size = 320;
    s.max_seq_len = 1024;
  } else if (flavor == "124M") {
    s.n_layers = 12;
    s.dim = 768;
    s.n_heads = 12;
    s.vocab_size = 50304;  // 50257 padded to a multiple of 128
    s.max_seq_len = 1024;
  } else {
    throw unknown_flavor_error("gpt2", flavor, kFlavors);
  }
  s.n_kv_heads = s.n_heads;
  s.ffn_hidden = 4 * s.dim;
  return s;
}

ChainSpec gpt2_spec(const JobConfig& job) {
  return apply_model_overrides(gpt2_flavor(job.model.flavor), job);
}

}  // namespace

ModelFamily gpt2_family() {
  ModelFamily f;
  f.name = "gpt2";
  f.flavors = kFlavors;
  f.module_fqns = [](const JobConfig& job) { return chain_module_fqns(gpt2_spec(job)); };
  f.build = [](const JobConfig& job,
               const std::vector<std::string>& fqns) -> std::shared_ptr<ModelPart> {
    return std::make_shared<ChainTransformer>(gpt2_spec(job), fqns);
  };
  f.describe = [](const JobConfig& job) {
    return describe_chain(gpt2_spec(job), job.training.seq_len);
  };
  f.check_part = [](const JobConfig& job, const std::vector<std::string>& fqns) {
    check_chain_part(gpt2_spec(job), fqns);
  };
  f.hf_model_type = kGpt2ModelType;
  f.state_dict_adapter = [](const JobConfig& job) { return gpt2_hf_adapter(gpt2_spec(job)); };
  f.model_keys = chain_model_keys(false, false);
  return f;
}

}  // namespace viaduct
