// Building blocks shared by the model families: norms, rotary embeddings,
// attention (MHA/GQA through scaled-dot-product attention), feed-forwards.
//
// Note [Mixed precision]
// Parameters stay in fp32 (the master weights). The first stage casts its
// output to the compute dtype (bf16 on CUDA when training.dtype = bfloat16);
// every matmul casts its fp32 weight to the activation's dtype on the fly, so
// autograd returns fp32 gradients to the master weights. Norms and softmaxes
// compute in fp32 and return the input dtype.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "ops/linear.h"
#include "ops/options.h"
#include "ops/rope.h"
#include "model/rope_scaling.h"

namespace viaduct {

// ops::linear through a torch::nn::Linear used as the parameter holder.
at::Tensor linear(const at::Tensor& x, const torch::nn::Linear& l, const ops::KernelOptions& k);
// A parameter holder registered as `name` (FQN `<name>.weight`/`.bias`).
torch::nn::Linear make_linear(torch::nn::Module& parent, const std::string& name,
                              int64_t in, int64_t out, bool bias);

class RMSNormImpl : public torch::nn::Module, public ops::KernelUser {
 public:
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);  // x: [..., D]
  // (h, forward(h)) for h = x + res (ops::add_rms_norm).
  std::pair<at::Tensor, at::Tensor> forward_with_residual(const at::Tensor& x,
                                                          const at::Tensor& res);
  void reset_parameters();
  at::Tensor weight;
  double eps_;
};
TORCH_MODULE(RMSNorm);

class LayerNormImpl : public torch::nn::Module, public ops::KernelUser {
 public:
  LayerNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  // (h, forward(h)) for h = x + res (ops::add_layer_norm).
  std::pair<at::Tensor, at::Tensor> forward_with_residual(const at::Tensor& x,
                                                          const at::Tensor& res);
  void reset_parameters();
  at::Tensor weight, bias;
  double eps_;
};
TORCH_MODULE(LayerNorm);

using ops::make_rope_tables;
using ops::RopeTables;

// `tables` as `parent`'s buffers rope_cos and rope_sin, so Module::to(device)
// moves them once (with set_data, so the returned handles stay valid); not
// persistent state, as checkpoints hold parameters only.
RopeTables register_rope_buffers(torch::nn::Module& parent, const RopeTables& tables);

struct AttentionOptions {
  int64_t dim = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  bool bias = false;
  bool rope = true;
  int64_t max_seq_len = 0;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;  // llama-3.1/3.2 frequency scaling; off by default
};

// Causal self-attention with grouped KV heads; FQNs wq, wk, wv, wo.
class AttentionImpl : public torch::nn::Module, public ops::KernelUser {
 public:
  explicit AttentionImpl(const AttentionOptions& opts);
  // x: [B, T, D] -> [B, T, D]; `documents`: see Note [Document boundaries].
  at::Tensor forward(const at::Tensor& x, const ops::Documents* documents = nullptr);
  void init_weights(uint64_t seed, const std::string& prefix, double std_in,
                    double std_out, bool truncated);
  AttentionOptions opts_;
  int64_t head_dim_;
  torch::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};
  RopeTables rope_;
};
TORCH_MODULE(Attention);

// SwiGLU: w2(silu(w1 x) * w3 x).
class SwiGLUImpl : public torch::nn::Module, public ops::KernelUser {
 public:
  SwiGLUImpl(int64_t dim, int64_t hidden);
  at::Tensor forward(const at::Tensor& x);
  void init_weights(uint64_t seed, const std::string& prefix, double std_in,
                    double std_out);
  torch::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(SwiGLU);

// GPT-2 MLP: w2(gelu_tanh(w1 x + b1)) + b2.
class GeluMLPImpl : public torch::nn::Module, public ops::KernelUser {
 public:
  GeluMLPImpl(int64_t dim, int64_t hidden);
  at::Tensor forward(const at::Tensor& x);
  void init_weights(uint64_t seed, const std::string& prefix, double std_in,
                    double std_out);
  torch::nn::Linear w1{nullptr}, w2{nullptr};
};
TORCH_MODULE(GeluMLP);

// SwiGLU hidden size as Meta's llama computes it from dim.
int64_t llama_ffn_hidden(int64_t dim, int64_t multiple_of,
                         double ffn_dim_multiplier);

}  // namespace viaduct
