// The loss shared by every family, the FLOPs of a micro-batch's documents,
// and the helpers of model/families.h (family dispatch: model/family.cpp).
#include "model/model.h"

#include <algorithm>
#include <set>

#include "core/check.h"
#include "model/families.h"
#include "ops/options.h"

namespace viaduct {

ops::KernelOptions kernel_options(const ModelSection& model) {
  ops::KernelOptions k;
  k.fused = model.cuda_kernels;
  k.swiglu_recompute = model.swiglu_recompute;
  return k;
}

ops::ActivationCheckpoint activation_checkpoint(const ActivationCheckpointSection& section) {
  ops::ActivationCheckpoint ac;
  const auto& mode = section.mode;
  if (mode == "full") {
    ac.mode = ops::ActivationCheckpoint::Mode::kFull;
  } else if (mode == "selective") {
    const auto& option = section.selective_ac_option;
    if (option == "op") {
      ac.mode = ops::ActivationCheckpoint::Mode::kOp;
    } else {
      ac.mode = ops::ActivationCheckpoint::Mode::kSelective;
      ac.every = std::stoll(option);
    }
  }
  return ac;
}

at::Tensor summed_cross_entropy(const at::Tensor& logits,
                                const at::Tensor& targets) {
  // logits: [B, T, V], targets: [B, T]
  const auto V = logits.size(-1);
  // fp32 (fp64 for fp64 logits, as the reference tests use).
  const auto t = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::cross_entropy_loss(logits.reshape({-1, V}).to(t),
                                targets.reshape({-1}), {}, at::Reduction::Sum,
                                /*ignore_index=*/-100);
}

at::Tensor ModelPart::forward_loss(const Activations& inputs, const at::Tensor& targets) {
  return summed_cross_entropy(forward(inputs).at(0), targets);
}

std::vector<std::string> select_modules(const std::vector<std::string>& all,
                                        const std::vector<std::string>& wanted,
                                        const std::string& family) {
  if (wanted.empty()) return all;
  std::set<std::string> want(wanted.begin(), wanted.end());
  std::vector<std::string> out;
  for (const auto& m : all) {
    if (want.erase(m)) out.push_back(m);
  }
  if (!want.empty()) {
    throw ConfigError(str("module '", *want.begin(), "' is not part of this ",
                          family, " model (its modules: ", all.front(), " .. ",
                          all.back(), ")"));
  }
  return out;
}

int64_t int_or(const ModelKeys& keys, const std::string& key, int64_t fallback) {
  return keys.get_int_opt(key).value_or(fallback);
}
double float_or(const ModelKeys& keys, const std::string& key, double fallback) {
  return keys.get_float_opt(key).value_or(fallback);
}
bool bool_or(const ModelKeys& keys, const std::string& key, bool fallback) {
  return keys.get_bool_opt(key).value_or(fallback);
}

double training_flops(const ModelInfo& info, const ops::Documents& documents) {
  // See Note [FLOPs of a step's documents].
  int64_t positions = 0, pairs = 0;
  for (const auto& span : documents.spans()) {
    positions += span.length;
    pairs += span.length * span.length;
  }
  return info.flops_per_token_outside_attention * static_cast<double>(positions) +
         info.attention_flops_per_pair * static_cast<double>(pairs);
}

int64_t count_parameters(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

}  // namespace viaduct
