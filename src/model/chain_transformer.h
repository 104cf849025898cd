// The pre-norm transformer whose residual is a chain (llama, gpt2): each
// layer is x += attn(norm(x)); x += ffn(norm(x)) (each add made by the norm
// after it: see Note [Deferred residual add]). The families
// differ only in a ChainSpec, so both share this one implementation.
#pragma once

#include <torch/torch.h>

#include "model/layers.h"
#include "model/model.h"
#include "ops/recompute.h"

namespace viaduct {

struct ChainSpec {
  std::string family;
  std::string flavor;
  int64_t n_layers = 0;
  int64_t dim = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t vocab_size = 0;
  int64_t ffn_hidden = 0;
  int64_t max_seq_len = 0;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;      // llama: model.rope_scaling_* (off by default)
  bool layer_norm = false;       // gpt2: LayerNorm with bias; llama: RMSNorm
  bool gelu_mlp = false;         // gpt2: GELU MLP with biases; llama: SwiGLU
  bool bias = false;             // attention biases
  bool learned_positions = false;  // gpt2: pos_embeddings (pinned first)
  bool tie_embeddings = false;
  // model.loss_chunk_tokens: > 0 chunks (see Note [Chunked head loss],
  // ops/cross_entropy.h); 0: plain; < 0: auto (ops::loss_chunk_tokens).
  int64_t loss_chunk_tokens = -1;
  bool depth_init = true;        // llama: wo/w2/w3 std 0.02/sqrt(2(l+1))
  // See Note [Activation checkpointing] (ops/recompute.h): which layers.
  ops::ActivationCheckpoint activation_checkpoint;
};

// Note [Deferred residual add]
// A block ends in x' = h + ffn(ffn_norm(h)), and the next block starts with
// attention_norm(x'). The block returns the two terms unsummed, {stream h,
// pending ffn output}, and the next block's attention norm adds them as it
// normalises (ops::add_rms_norm for llama's RMSNorm, ops::add_layer_norm
// for gpt2's LayerNorm: one kernel each way where the kernels run, the two
// ATen ops elsewhere; see Note [Residual add inside the norm]); the block's
// own h = x + attention(...) is made the same way by its FFN norm. On the
// part with the head the
// final norm takes the last block's pair the same way. Forward, the sum is
// rounded as the add rounded it; backward, x' has the same two uses (the
// next block's attention norm, and the residual its h adds), whose
// gradients the norm's backward adds where autograd added them: the bits
// of the plain adds. Where the stream must be one tensor the pending term is added
// explicitly:
//  - at the end of a part without the head (a stage boundary: the part
//    hands on one activation);
//  - around a checkpointed layer (see Note [Activation checkpointing]):
//    before it, so the layer keeps one [B, T, D] input rather than two, and
//    at the end of its body, so it hands on one tensor made in the body
//    (the fused norm's h is a view, which the checkpoint would copy to hang
//    its node on).
// The first block of a part gets nothing pending: a plain norm.
struct ChainResidual {
  at::Tensor stream;   // [B, T, D]
  at::Tensor pending;  // [B, T, D], not yet added to `stream`; undefined: none
  // stream + pending (stream alone when nothing is pending).
  at::Tensor sum() const { return pending.defined() ? stream + pending : stream; }
};

class ChainBlockImpl : public torch::nn::Module {
 public:
  ChainBlockImpl(const ChainSpec& spec, int64_t layer_id);
  // [B, T, D] -> [B, T, D] as stream + pending
  // (see Note [Deferred residual add]); `documents`: see Note [Document boundaries].
  ChainResidual forward(const ChainResidual& x,
                        const ops::DocumentsPtr& documents = nullptr);
  void init_weights(uint64_t seed, const std::string& prefix);

 private:
  // forward() without checkpointing
  ChainResidual forward_layer(const ChainResidual& x, const ops::Documents* documents);
  const ChainSpec spec_;
  int64_t layer_id_;
  Attention attention_{nullptr};
  RMSNorm attention_rms_{nullptr}, ffn_rms_{nullptr};
  LayerNorm attention_ln_{nullptr}, ffn_ln_{nullptr};
  SwiGLU swiglu_{nullptr};
  GeluMLP gelu_{nullptr};
};
TORCH_MODULE(ChainBlock);

class ChainTransformer : public ModelPart, public ops::KernelUser {
 public:
  ChainTransformer(const ChainSpec& spec, const std::vector<std::string>& fqns);
  Activations forward(const Activations& inputs) override;
  at::Tensor forward_loss(const Activations& inputs, const at::Tensor& targets) override;
  void init_weights(uint64_t seed) override;
  const ChainSpec& spec() const { return spec_; }

 private:
  ChainSpec spec_;
  torch::nn::Embedding tok_embeddings_{nullptr};
  torch::nn::Embedding pos_embeddings_{nullptr};
  torch::nn::ModuleDict layers_{nullptr};
  std::vector<std::pair<int64_t, ChainBlock>> blocks_;  // in order
  RMSNorm norm_rms_{nullptr};
  LayerNorm norm_ln_{nullptr};
  torch::nn::Linear lm_head_{nullptr};  // null when tied
  bool has_norm_ = false, has_head_ = false;
  // Embedding through the blocks (and the final norm on the last part).
  at::Tensor trunk(const Activations& inputs);
};

std::vector<std::string> chain_module_fqns(const ChainSpec& spec);
// What a part of these modules needs of the spec (tied embeddings: the
// embedding and the head together); ModelFamily::check_part of the chains.
void check_chain_part(const ChainSpec& spec, const std::vector<std::string>& fqns);
ModelInfo describe_chain(const ChainSpec& spec, int64_t seq_len);

// Apply the [model] overrides on top of a flavor's spec and check it: the
// chain families' parse of their [model] keys (with the job's activation
// checkpointing, and training.seq_len against model.max_seq_len).
ChainSpec apply_model_overrides(ChainSpec spec, const JobConfig& job);

}  // namespace viaduct
