// Kimi Delta Attention (KDA): the linear-attention layer of the Kimi-K3
// hybrid (every layer that the full-attention rule does not give to MLA):
// projections, short convolutions, the gated delta rule (ops/kda.h) with
// its per-channel decay and beta, and the gated, normalised output.
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "model/layers.h"
#include "ops/kda.h"

namespace viaduct {

// Depthwise causal convolution followed by SiLU; FQN `<name>.weight`
// [channels, kernel].
class ShortConvImpl : public torch::nn::Module, public ops::KernelUser {
 public:
  ShortConvImpl(int64_t channels, int64_t kernel);
  // x: [B, T, C] -> [B, T, C]; over `documents` x is zero before each
  // document's first token (see Note [Document boundaries]).
  at::Tensor forward(const at::Tensor& x, const ops::Documents* documents = nullptr);
  at::Tensor weight;
};
TORCH_MODULE(ShortConv);

struct KdaOptions {
  int64_t dim = 0;
  int64_t n_heads = 0;
  int64_t head_dim = 0;  // dk = dv, and the rank of the decay / gate maps
  int64_t conv_size = 4;
  int64_t chunk_size = 64;
  double norm_eps = 1e-5;
};

// The inputs of the gated delta rule (ops/kda.h) for one layer's input.
struct KdaRuleInputs {
  at::Tensor q, k;  // [B, T, H, dk], L2-normalised (q scaled by dk^-1/2)
  at::Tensor v;     // [B, T, H, dv]
  at::Tensor g;     // [B, T, H, dk] per-channel log-decays (<= 0)
  at::Tensor beta;  // [B, T, H]
};

// The layer's projections of its input x [B, T, D]: one GEMM where the
// kernels run (see Note [One GEMM for the projections of one input],
// ops/linear.cpp), so x's gradient is one GEMM with no additions.
struct KdaProjections {
  at::Tensor q, k, v;  // [B, T, H dk]: q_proj, k_proj, v_proj x
  at::Tensor f;        // [B, T, dk]: f_a x, the decay's low-rank input
  at::Tensor b;        // [B, T, H]: b_proj x, beta's logits
  at::Tensor g;        // [B, T, dk]: g_a x, the output gate's low-rank input
};

// FQNs: q_proj, k_proj, v_proj, q_conv, k_conv, v_conv, f_a, f_b (decay),
// A_log, dt_bias, b_proj (beta), g_a, g_b (output gate), o_norm, o_proj.
class KdaImpl : public torch::nn::Module, public ops::KernelUser {
 public:
  explicit KdaImpl(const KdaOptions& opts);
  // x: [B, T, D] -> [B, T, D]: output(x, ops::kda(rule_inputs(x), ...)),
  // each document alone under `documents` (see Note [Document boundaries]):
  // the convolutions and the recurrence take them.
  at::Tensor forward(const at::Tensor& x, const ops::Documents* documents = nullptr);
  // The layer's parts around the recurrence: the projections of x; from
  // them the convolutions, norms, decay and beta; and from the
  // recurrence's o [B, T, H, dv] the gated, normalised output projection.
  // A test evaluates the layer with another form of the rule between them.
  KdaProjections project(const at::Tensor& x);
  KdaRuleInputs rule_inputs(const KdaProjections& p, const ops::Documents* documents = nullptr);
  at::Tensor output(const KdaProjections& p, const at::Tensor& o);
  void init_weights(uint64_t seed, const std::string& prefix, double std_in,
                    double std_out);
  static int64_t count_params(const KdaOptions& o);
  // Training FLOPs per token (forward + backward) of the token mixing alone
  // (the projections are in 6 N).
  static double mixing_flops(const KdaOptions& o);

  KdaOptions opts_;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr};
  ShortConv q_conv{nullptr}, k_conv{nullptr}, v_conv{nullptr};
  torch::nn::Linear f_a{nullptr}, f_b{nullptr}, b_proj{nullptr};
  torch::nn::Linear g_a{nullptr}, g_b{nullptr}, o_proj{nullptr};
  at::Tensor A_log, dt_bias;
  RMSNorm o_norm{nullptr};
};
TORCH_MODULE(Kda);

}  // namespace viaduct
