// The llama family (Meta's llama 3 shapes): RMSNorm, RoPE, GQA, SwiGLU,
// untied head.
#include "config/config.h"
#include "core/check.h"
#include "model/chain_transformer.h"
#include "model/families.h"

namespace viaduct {
namespace {

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
    throw ConfigError(str("unknown llama flavor '", flavor,
                          "' (choose debugmodel, 1B or 8B)"));
  }
  return s;
}

ChainSpec llama_spec(const Config& cfg) {
  return apply_model_overrides(llama_flavor(cfg.get_string("model.flavor")), cfg);
}

}  // namespace

std::vector<std::string> llama_module_fqns(const Config& cfg) {
  return chain_module_fqns(llama_spec(cfg));
}

std::shared_ptr<ModelPart> build_llama(const Config& cfg,
                                       const std::vector<std::string>& fqns) {
  return std::make_shared<ChainTransformer>(llama_spec(cfg), fqns);
}

ModelInfo describe_llama(const Config& cfg) {
  return describe_chain(llama_spec(cfg), cfg.get_int("training.seq_len"));
}

}  // namespace viaduct
