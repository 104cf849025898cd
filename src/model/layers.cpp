#include "model/layers.h"

#include "core/check.h"
#include "core/rng.h"
#include "ops/layer_norm.h"
#include "ops/rms_norm.h"
#include "ops/swiglu.h"

namespace viaduct {

at::Tensor linear(const at::Tensor& x, const torch::nn::Linear& l, const ops::KernelOptions& k) {
  return ops::linear(x, l->weight, l->options.bias() ? l->bias : at::Tensor(), k);
}

torch::nn::Linear make_linear(torch::nn::Module& parent, const std::string& name,
                              int64_t in, int64_t out, bool bias) {
  return parent.register_module(
      name, torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias)));
}

RopeTables register_rope_buffers(torch::nn::Module& parent, const RopeTables& tables) {
  return {parent.register_buffer("rope_cos", tables.cos),
          parent.register_buffer("rope_sin", tables.sin)};
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}
void RMSNormImpl::reset_parameters() {
  torch::NoGradGuard g;
  weight.fill_(1.0);
}
at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  return ops::rms_norm(x, weight, eps_, kernel_options_);
}

std::pair<at::Tensor, at::Tensor> RMSNormImpl::forward_with_residual(const at::Tensor& x,
                                                                     const at::Tensor& res) {
  return ops::add_rms_norm(x, res, weight, eps_, kernel_options_);
}

LayerNormImpl::LayerNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
  bias = register_parameter("bias", torch::zeros({dim}));
}
void LayerNormImpl::reset_parameters() {
  torch::NoGradGuard g;
  weight.fill_(1.0);
  bias.zero_();
}
at::Tensor LayerNormImpl::forward(const at::Tensor& x) {
  return ops::layer_norm(x, weight, bias, eps_, kernel_options_);
}

std::pair<at::Tensor, at::Tensor> LayerNormImpl::forward_with_residual(const at::Tensor& x,
                                                                       const at::Tensor& res) {
  return ops::add_layer_norm(x, res, weight, bias, eps_, kernel_options_);
}

AttentionImpl::AttentionImpl(const AttentionOptions& o) : opts_(o) {
  VIADUCT_CHECK(o.dim % o.n_heads == 0, "model.dim ", o.dim,
                " must be divisible by model.n_heads ", o.n_heads);
  VIADUCT_CHECK(o.n_heads % o.n_kv_heads == 0, "model.n_heads ", o.n_heads,
                " must be divisible by model.n_kv_heads ", o.n_kv_heads);
  head_dim_ = o.dim / o.n_heads;
  const int64_t kv = o.n_kv_heads * head_dim_;
  wq = make_linear(*this, "wq", o.dim, o.dim, o.bias);
  wk = make_linear(*this, "wk", o.dim, kv, o.bias);
  wv = make_linear(*this, "wv", o.dim, kv, o.bias);
  wo = make_linear(*this, "wo", o.dim, o.dim, o.bias);
  if (o.rope) {
    rope_ = register_rope_buffers(*this, make_scaled_rope_tables(head_dim_, o.max_seq_len,
                                                                 o.rope_theta, o.rope_scaling));
  }
}

void AttentionImpl::init_weights(uint64_t seed, const std::string& p,
                                 double std_in, double std_out,
                                 bool truncated) {
  auto init = [&](torch::nn::Linear& l, const std::string& name, double std) {
    if (truncated) {
      init_trunc_normal_(l->weight, std, -2.0, 2.0, seed, p + name + ".weight");
    } else {
      init_normal_(l->weight, std, seed, p + name + ".weight");
    }
    if (l->options.bias()) {
      torch::NoGradGuard g;
      l->bias.zero_();
    }
  };
  init(wq, "wq", std_in);
  init(wk, "wk", std_in);
  init(wv, "wv", std_in);
  init(wo, "wo", std_out);
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const ops::Documents* documents) {
  // x: [B, T, D]
  const auto B = x.size(0), T = x.size(1);
  const auto H = opts_.n_heads, hd = head_dim_;
  const auto& ko = kernel_options_;
  const at::Tensor none;  // no bias
  const auto p = ops::qkv_projection(x, wq->weight, wk->weight, wv->weight,
                                     opts_.bias ? wq->bias : none, opts_.bias ? wk->bias : none,
                                     opts_.bias ? wv->bias : none, hd, ko);
  // Module::to() moves buffers with set_data, so rope_ stays valid.
  auto y = ops::causal_attention(p.q, p.k, p.v, opts_.rope ? &rope_ : nullptr, ko, documents,
                                 p.packed);  // [B, H, T, hd]
  y = y.transpose(1, 2).reshape({B, T, H * hd});
  return linear(y, wo, ko);
}

SwiGLUImpl::SwiGLUImpl(int64_t dim, int64_t hidden) {
  w1 = make_linear(*this, "w1", dim, hidden, false);
  w2 = make_linear(*this, "w2", hidden, dim, false);
  w3 = make_linear(*this, "w3", dim, hidden, false);
}
void SwiGLUImpl::init_weights(uint64_t seed, const std::string& p,
                              double std_in, double std_out) {
  init_trunc_normal_(w1->weight, std_in, -2.0, 2.0, seed, p + "w1.weight");
  init_trunc_normal_(w2->weight, std_out, -2.0, 2.0, seed, p + "w2.weight");
  init_trunc_normal_(w3->weight, std_out, -2.0, 2.0, seed, p + "w3.weight");
}
at::Tensor SwiGLUImpl::forward(const at::Tensor& x) {
  return ops::swiglu_ffn(x, w1->weight, w2->weight, w3->weight, kernel_options_);
}

GeluMLPImpl::GeluMLPImpl(int64_t dim, int64_t hidden) {
  w1 = make_linear(*this, "w1", dim, hidden, true);
  w2 = make_linear(*this, "w2", hidden, dim, true);
}
void GeluMLPImpl::init_weights(uint64_t seed, const std::string& p,
                               double std_in, double std_out) {
  init_normal_(w1->weight, std_in, seed, p + "w1.weight");
  init_normal_(w2->weight, std_out, seed, p + "w2.weight");
  torch::NoGradGuard g;
  w1->bias.zero_();
  w2->bias.zero_();
}
at::Tensor GeluMLPImpl::forward(const at::Tensor& x) {
  return linear(at::gelu(linear(x, w1, kernel_options_), "tanh"), w2, kernel_options_);
}

int64_t llama_ffn_hidden(int64_t dim, int64_t multiple_of,
                         double ffn_dim_multiplier) {
  int64_t hidden = 4 * dim;
  hidden = 2 * hidden / 3;
  hidden = static_cast<int64_t>(ffn_dim_multiplier * hidden);
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

}  // namespace viaduct
