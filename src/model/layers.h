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

namespace viaduct {

// y = x W^T (+ b), with W cast to x's dtype (on the fused-kernel path the
// cast comes from the weight cache, Note [Low-precision weight cache]).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w,
                  const at::Tensor& b = {});
// The same with W the concatenation of `w` along dim 0 (one GEMM for
// several projections of x); each part gets its own gradient.
at::Tensor linear_parts(const at::Tensor& x, at::TensorList w, const at::Tensor& b = {});
// The same through a torch::nn::Linear used as the parameter holder.
at::Tensor linear(const at::Tensor& x, const torch::nn::Linear& l);
// A parameter holder registered as `name` (FQN `<name>.weight`/`.bias`).
torch::nn::Linear make_linear(torch::nn::Module& parent, const std::string& name,
                              int64_t in, int64_t out, bool bias);

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);  // x: [..., D]
  // (h, forward(h)) for h = x + res: one fused kernel where the kernels
  // run (Note [Residual add inside the norm]), the two ops elsewhere.
  std::pair<at::Tensor, at::Tensor> forward_with_residual(const at::Tensor& x,
                                                          const at::Tensor& res);
  void reset_parameters();
  at::Tensor weight;
  double eps_;
};
TORCH_MODULE(RMSNorm);

class LayerNormImpl : public torch::nn::Module {
 public:
  LayerNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  void reset_parameters();
  at::Tensor weight, bias;
  double eps_;
};
TORCH_MODULE(LayerNorm);

// Rotary tables: cos/sin [max_seq_len, head_dim / 2] in fp64, cast at use to
// fp32 (fp64 for fp64 input): the rotation itself runs in fp32.
struct RopeTables {
  at::Tensor cos, sin;
};
RopeTables make_rope_tables(int64_t head_dim, int64_t max_seq_len,
                            double theta);
// x: [B, T, H, hd], rotating interleaved pairs (x[2i], x[2i+1]) as Meta's
// llama does. Returns x's dtype.
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope);

struct AttentionOptions {
  int64_t dim = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  bool bias = false;
  bool rope = true;
  int64_t max_seq_len = 0;
  double rope_theta = 10000.0;
};

// Causal self-attention with grouped KV heads; FQNs wq, wk, wv, wo.
class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const AttentionOptions& opts);
  at::Tensor forward(const at::Tensor& x);  // x: [B, T, D] -> [B, T, D]
  void init_weights(uint64_t seed, const std::string& prefix, double std_in,
                    double std_out, bool truncated);
  AttentionOptions opts_;
  int64_t head_dim_;
  torch::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};
  RopeTables rope_;
};
TORCH_MODULE(Attention);

// SwiGLU: w2(silu(w1 x) * w3 x).
class SwiGLUImpl : public torch::nn::Module {
 public:
  SwiGLUImpl(int64_t dim, int64_t hidden);
  at::Tensor forward(const at::Tensor& x);
  void init_weights(uint64_t seed, const std::string& prefix, double std_in,
                    double std_out);
  torch::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(SwiGLU);

// GPT-2 MLP: w2(gelu_tanh(w1 x + b1)) + b2.
class GeluMLPImpl : public torch::nn::Module {
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
