// Multi-head Latent Attention (DeepSeek-V3 shapes): low-rank joint KV
// compression with a decoupled rotary key shared by all heads, an optional
// low-rank query. With `rope = false` the rotary channels are kept but not
// rotated (NoPE, as Kimi Linear runs its MLA layers: KDA carries position).
// Training uses the non-absorbed form: K and V are expanded per head and fed
// to causal scaled-dot-product attention.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "model/layers.h"

namespace viaduct {

struct MlaOptions {
  int64_t dim = 0;
  int64_t n_heads = 0;
  int64_t q_lora_rank = 0;  // 0: q = wq x directly
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  bool rope = false;
  int64_t max_seq_len = 0;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
};

// FQNs: wq | (wq_a, q_norm, wq_b), wkv_a, kv_norm, wkv_b, wo.
class MlaImpl : public torch::nn::Module, public ops::KernelUser {
 public:
  explicit MlaImpl(const MlaOptions& opts);
  // x: [B, T, D] -> [B, T, D]; under `documents` each document attends
  // within itself (see Note [Document boundaries], ops/documents.h).
  at::Tensor forward(const at::Tensor& x, const ops::Documents* documents = nullptr);
  void init_weights(uint64_t seed, const std::string& prefix, double std_in,
                    double std_out);
  static int64_t count_params(const MlaOptions& o);
  // Training FLOPs of the score and value products per (query, key) pair
  // (forward + backward): 6 H (qk_head_dim + v_head_dim). A token of a
  // window of T counts T pairs, no causal discount.
  // See Note [FLOPs per token] (model/chain_transformer.cpp).
  static double attention_flops_per_pair(const MlaOptions& o);

  MlaOptions opts_;
  // The rotation and attention of q [B, T, H, nope + pe], the rotary key
  // k_pe [B, T, 1, pe] and kv [B, T, H, nope + vd], rotated by `tables`
  // (none: no rotation): y [B, T, H, vd]. With `documents`, attention
  // within each document through flash's variable-length kernel, and
  // `tables` hold one row per token of the B x T.
  at::Tensor attend(const at::Tensor& q, at::Tensor k_pe, const at::Tensor& kv,
                    const RopeTables& tables, const ops::Documents* documents = nullptr);
  torch::nn::Linear wq{nullptr}, wq_a{nullptr}, wq_b{nullptr};
  RMSNorm q_norm{nullptr};
  torch::nn::Linear wkv_a{nullptr}, wkv_b{nullptr}, wo{nullptr};
  RMSNorm kv_norm{nullptr};
  RopeTables rope_;
};
TORCH_MODULE(Mla);

}  // namespace viaduct
