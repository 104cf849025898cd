// The Kimi-K3-style hybrid: Block AttnRes instead of residual adds, KDA
// token mixing with MLA at the full-attention layers, MoE FFNs after the
// first dense ones, and an optional vision tower.
//
// Note [Kimi-K3 part activations]
// A part's forward takes and returns the AttnRes stack explicitly:
//   first part in:   {tokens [B, T] int64} or {tokens, images [B, n, C, S, S]}
//   between parts:   {hidden [B, T, D], block_0, ..., block_{k-1}}, each block
//                    [B, T, D] in the compute dtype; block_0 is the embedding
//                    (after the image merge). `hidden` is the stream the next
//                    layer receives: the open block's partial sum, or, when the
//                    next layer opens a block, the block just completed (not
//                    yet on the stack: the opening layer pushes it). Before
//                    layer 0 the stack is empty and hidden is the embedding.
//                    A boundary inside a block therefore needs nothing extra.
//   last part out:   {logits [B, T, V]}
// The layer order is fixed, so a chain of parts gives the whole model's bits.
//
// With model.attn_res = false (the comparison model) every read is
// replaced by a plain residual add, h = h + attention(norm(h)), h = h +
// ffn(norm(h)): no AttnRes parameters, no attn_res_final, and parts hand on
// {hidden [B, T, D]} alone, like the chain families.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "model/attn_res.h"
#include "model/kda.h"
#include "model/layers.h"
#include "model/mla.h"
#include "model/model.h"
#include "model/moe.h"
#include "model/vision.h"

namespace viaduct {

// A flavor with the config's overrides applied.
struct KimiK3Options {
  std::string flavor;
  int64_t n_layers = 0;
  int64_t dim = 0;
  int64_t n_heads = 0;
  int64_t vocab_size = 0;
  int64_t ffn_hidden_dim = 0;  // dense SwiGLU
  int64_t max_seq_len = 0;
  double norm_eps = 1e-5;
  int64_t block_size = 0;  // AttnRes layers per block
  int64_t first_k_dense = 0;
  bool moe_ffn = true;
  bool vision = false;
  bool attn_res = true;  // false: plain residuals (Note above)
  // See Note [AttnRes block gradients in place] (model/attn_res.h). No config
  // key: false (autograd's own sums) is the reference the tests compare
  // the slots against.
  bool attn_res_grad_in_place = true;
  bool synthetic_images = false;
  int64_t image_token_id = 0;
  KdaOptions kda;
  MlaOptions mla;
  MoeOptions moe;
  VisionOptions vis;

  int64_t mla_interval = 4;  // model.mla_interval
  // See Note [Activation checkpointing] (ops/recompute.h): which layers.
  ops::ActivationCheckpoint activation_checkpoint;

  // Full-attention rule: MLA at every mla_interval-th layer (every fourth by
  // default: 3, 7, ...) and at the last; KDA elsewhere.
  bool is_mla(int64_t layer) const {
    return layer % mla_interval == mla_interval - 1 || layer == n_layers - 1;
  }
  bool is_moe(int64_t layer) const { return moe_ffn && layer >= first_k_dense; }
  bool opens_block(int64_t layer) const { return layer % block_size == 0; }
  int64_t block_of(int64_t layer) const { return layer / block_size; }
};
// The family's parse of its [model] keys (job.model.keys) over the flavor's
// defaults, with the job's activation checkpointing; checks the result.
KimiK3Options kimi_k3_options(const JobConfig& job);

// One layer: FQNs attn_res_attn, attention_norm, attention (KDA or MLA),
// attn_res_ffn, ffn_norm, and feed_forward (dense) or moe.
class KimiK3LayerImpl : public torch::nn::Module {
 public:
  KimiK3LayerImpl(const KimiK3Options& o, int64_t layer_id);
  // hidden: the incoming stream [B, T, D]; blocks: the completed stack,
  // extended in place when this layer opens a block. Returns the new partial
  // sum of the open block. Without AttnRes: hidden + both sublayers' outputs,
  // and `blocks` is left alone.
  // slots, when given, runs parallel to blocks: each block this layer opens
  // goes on the stack as its sink with a new slot, and the reads add into
  // the slots (see Note [AttnRes block gradients in place]).
  // `documents`: see Note [Document boundaries] (ops/documents.h).
  at::Tensor forward(const at::Tensor& hidden, std::vector<at::Tensor>& blocks,
                     std::vector<at::Tensor>* slots = nullptr,
                     const ops::DocumentsPtr& documents = nullptr);
  void init_weights(uint64_t seed, const std::string& prefix, double std_in,
                    double std_out);

  int64_t layer_id_;
  bool attn_res_;
  bool opens_block_;  // false without AttnRes
  bool checkpointed_;  // See Note [Activation checkpointing]
  bool keep_op_outputs_;  // See Note [Per-op activation checkpointing]
  AttnResRead attn_res_attn{nullptr}, attn_res_ffn{nullptr};
  RMSNorm attention_norm{nullptr}, ffn_norm{nullptr};
  Kda kda{nullptr};
  Mla mla{nullptr};
  SwiGLU feed_forward{nullptr};
  Moe moe{nullptr};
  // Tests: when set, each read appends its sources here.
  std::vector<std::vector<at::Tensor>>* trace_ = nullptr;

 private:
  // The layer after the block push: the two reads and sublayers from the
  // completed blocks and the open block's partial sum (undefined in an
  // opening layer). The region activation checkpointing recomputes.
  at::Tensor forward_sublayers(const std::vector<at::Tensor>& blocks, at::Tensor partial,
                               const std::vector<at::Tensor>* slots,
                               const ops::Documents* documents);
  // without AttnRes
  at::Tensor forward_plain(const at::Tensor& hidden, const ops::Documents* documents);
  // The token mixer, MLA or KDA, of n [B, T, D].
  at::Tensor mix(const at::Tensor& n, const ops::Documents* documents);
};
TORCH_MODULE(KimiK3Layer);

class KimiK3Part : public ModelPart, public ops::KernelUser {
 public:
  KimiK3Part(const KimiK3Options& o, const std::vector<std::string>& fqns);
  Activations forward(const Activations& inputs) override;
  void init_weights(uint64_t seed) override;
  void after_optimizer_step() override;  // MoE balancing bias updates
  std::vector<std::pair<std::string, at::Tensor>> extra_state() override;
  std::vector<at::Tensor> replica_statistics() override;

  const KimiK3Options& options() const { return opts_; }
  // Held layers in order, with their global ids.
  const std::vector<KimiK3Layer>& layers() const { return layers_; }
  // The synthetic demo image for a batch of B sequences: [B, 1, C, S, S].
  at::Tensor synthetic_images(int64_t batch) const;

  torch::nn::Embedding tok_embeddings{nullptr};
  VisionTower vision_tower{nullptr};
  RMSNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};
  AttnResRead attn_res_final{nullptr};

 private:
  KimiK3Options opts_;
  std::vector<KimiK3Layer> layers_;
};

}  // namespace viaduct
