// The model families' registry entries (model/family.h) and the helpers the
// family files share. Each <name>_family() lives in model/<name>.cpp;
// model_families() (model/family.cpp) lists them.
#pragma once

#include "config/job_config.h"
#include "model/family.h"
#include "model/model.h"

namespace viaduct {

ModelFamily llama_family();    // model/llama.cpp
ModelFamily gpt2_family();     // model/gpt2.cpp
ModelFamily kimi_k3_family();  // model/kimi_k3.cpp
ModelFamily exact16_family();  // model/exact16.cpp

// Shared helpers for families.
// Keep `wanted` (empty = all of `all`), checking every name is a module of
// the model; returns the kept list in model order.
std::vector<std::string> select_modules(const std::vector<std::string>& all,
                                        const std::vector<std::string>& wanted,
                                        const std::string& family);
// A family's [model] key as the config sets it, or the flavor's default.
int64_t int_or(const ModelKeys& keys, const std::string& key, int64_t fallback);
double float_or(const ModelKeys& keys, const std::string& key, double fallback);
bool bool_or(const ModelKeys& keys, const std::string& key, bool fallback);
// Count parameters of a part (module tree) without building tensors twice.
int64_t count_parameters(const torch::nn::Module& m);
// ModelFamily::model_keys of the chain families (model/chain_transformer.cpp
// reads them); gpt2 has learned positions and a GELU MLP, so neither the
// RoPE keys nor the SwiGLU one.
std::vector<std::string> chain_model_keys(bool rope, bool swiglu);

}  // namespace viaduct
