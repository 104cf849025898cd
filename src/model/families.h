// The model families. Each provides its module list, a part builder and its
// description; model.cpp dispatches on model.family.
#pragma once

#include "model/model.h"

namespace viaduct {

std::vector<std::string> llama_module_fqns(const Config& cfg);
std::shared_ptr<ModelPart> build_llama(const Config& cfg,
                                       const std::vector<std::string>& fqns);
ModelInfo describe_llama(const Config& cfg);

std::vector<std::string> gpt2_module_fqns(const Config& cfg);
std::shared_ptr<ModelPart> build_gpt2(const Config& cfg,
                                      const std::vector<std::string>& fqns);
ModelInfo describe_gpt2(const Config& cfg);

std::vector<std::string> kimi_k3_module_fqns(const Config& cfg);
std::shared_ptr<ModelPart> build_kimi_k3(const Config& cfg,
                                         const std::vector<std::string>& fqns);
ModelInfo describe_kimi_k3(const Config& cfg);

// Shared helpers for families.
// Keep `wanted` (empty = all of `all`), checking every name is a module of
// the model; returns the kept list in model order.
std::vector<std::string> select_modules(const std::vector<std::string>& all,
                                        const std::vector<std::string>& wanted,
                                        const std::string& family);
// Config value or the flavor's default.
int64_t int_or(const Config& cfg, const std::string& key, int64_t fallback);
double float_or(const Config& cfg, const std::string& key, double fallback);
bool bool_or(const Config& cfg, const std::string& key, bool fallback);
// Count parameters of a part (module tree) without building tensors twice.
int64_t count_parameters(const torch::nn::Module& m);

}  // namespace viaduct
