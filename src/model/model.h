// The model interface every family implements and every pipeline stage uses.
//
// Note [Model parts]
// A model is built as a *part*: the subset of its top-level modules that one
// pipeline stage owns (`tok_embeddings`, `layers.7`, `norm`, `lm_head`, ...).
// The whole model is the part holding every module. FQNs are global and never
// renumbered: layer 17 is `layers.17` on whichever stage holds it, so
// checkpoints, optimizer state and splits agree across layouts. Weights are
// initialised from (seed, FQN) alone (core/rng.h), so every layout starts from
// the same bits.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <map>
#include <string>
#include <vector>

#include "ops/documents.h"
#include "ops/recompute.h"
#include "ops/options.h"

namespace viaduct {

struct JobConfig;  // config/job_config.h
struct ModelSection;
struct ActivationCheckpointSection;

// What crosses a stage boundary. The first part receives {tokens [B, T]
// int64} (plus optional extra inputs such as images); the last part returns
// {logits [B, T, V]}. In between: {hidden [B, T, D]} for chain models, and
// {hidden, block_0, ..., block_k} for AttnRes models.
using Activations = std::vector<at::Tensor>;

class ModelPart : public torch::nn::Module {
 public:
  ~ModelPart() override = default;

  virtual Activations forward(const Activations& inputs) = 0;
  // The last part's summed token cross-entropy (fp32) against targets
  // [B, T]. The default runs forward() and summed_cross_entropy; a family
  // may fuse its head with the loss (see Note [Chunked head loss],
  // ops/cross_entropy.h).
  virtual at::Tensor forward_loss(const Activations& inputs, const at::Tensor& targets);
  // Initialise every parameter from (seed, FQN); buffers too where relevant.
  virtual void init_weights(uint64_t seed) = 0;

  bool has_first() const { return has_first_; }
  bool has_last() const { return has_last_; }
  // Top-level module FQNs held, in model order.
  const std::vector<std::string>& module_fqns() const { return module_fqns_; }

  // Called after each optimizer step (MoE bias updates and the like).
  virtual void after_optimizer_step() {}
  // Persistent non-parameter state by FQN (e.g. MoE selection biases):
  // checkpointed with the parameters, loaded under any layout.
  virtual std::vector<std::pair<std::string, at::Tensor>> extra_state() { return {}; }
  // Counters that must be summed over data-parallel replicas before
  // after_optimizer_step (e.g. MoE tokens per expert), updated in place.
  virtual std::vector<at::Tensor> replica_statistics() { return {}; }

  // The documents of the micro-batch the next forward or forward_loss runs
  // (see Note [Document boundaries], ops/documents.h); null: the window is
  // one causal sequence. The caller sets them before every forward.
  void set_documents(ops::DocumentsPtr documents) { documents_ = std::move(documents); }
  const ops::DocumentsPtr& documents() const { return documents_; }

  // The dtype activations leave the first part in (see Note [Mixed precision]).
  void set_compute_dtype(at::ScalarType t) { compute_dtype_ = t; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }

 protected:
  at::ScalarType compute_dtype_ = at::kFloat;
  ops::DocumentsPtr documents_;
  bool has_first_ = false;
  bool has_last_ = false;
  std::vector<std::string> module_fqns_;
};

// Per-layer facts for `viaduct describe`.
struct LayerInfo {
  int64_t layer = 0;
  std::string attention;  // "mha", "gqa", "mla", "kda"
  std::string ffn;        // "swiglu", "gelu", "moe", "dense"
  int64_t block = -1;     // AttnRes block, -1 when not an AttnRes model
  bool opens_block = false;
  // See Note [Activation memory estimate]: the values (in the compute dtype)
  // this layer keeps for its backward per token of a micro-batch, from its
  // shapes: norm inputs and outputs, q/k/v and the attention output, the
  // FFN's hidden activations. Attention is counted as the fused (flash)
  // form keeps it, without [T, T] scores; small per-head statistics and
  // temporaries are left out. 0: the family does not say.
  double saved_values_per_token = 0;
  // A layer under activation checkpointing (see Note [Activation
  // checkpointing], ops/recompute.h) keeps its input alone (the hidden
  // stream, D values; saved_values_per_token says that), and this many
  // while its backward recomputes it (what it keeps without). 0: not
  // checkpointed.
  double recompute_values_per_token = 0;
  // The outputs of the layer's expensive ops per token (its linear
  // projections, attention's core, MoE expert GEMMs, KDA's chunk scan and
  // its states: see Note [Per-op activation checkpointing], ops/recompute.h),
  // which a layer under selective_ac_option = "op" keeps beside its input.
  // 0: the family does not say.
  double op_output_values_per_token = 0;
};

struct ModelInfo {
  std::string family;
  std::string flavor;
  int64_t n_layers = 0;
  int64_t params = 0;            // total parameters
  int64_t active_params = 0;     // per token (MoE: activated experts only)
  int64_t embedding_params = 0;  // excluded from the 6N FLOP count
  int64_t dim = 0;               // width of the hidden state
  int64_t vocab_size = 0;        // rows of the head's logits
  // The head's loss in chunks of this many tokens (see Note [Chunked head
  // loss]); 0: plain (all logits at once); -1: chunks of 4096 where the
  // fused kernels run, else plain.
  int64_t loss_chunk_tokens = 0;
  double flops_per_token = 0;    // training FLOPs per token (fwd + bwd)
  // flops_per_token in two parts: attention's score and value products per
  // (query, key) pair over every layer (fwd + bwd), and the rest, what a
  // token costs whatever it attends to. A token counts every key of its
  // window, T = training.seq_len, with no causal discount, so
  // flops_per_token = flops_per_token_outside_attention +
  // attention_flops_per_pair x T.
  // See Note [FLOPs per token] (model/chain_transformer.cpp).
  // KDA's and the AttnRes reads' costs do not grow with the window and
  // count in the rest; a family without attention has 0 per pair.
  double flops_per_token_outside_attention = 0;
  double attention_flops_per_pair = 0;
  // MoE families: every layer's routed experts' parameters together (what
  // expert parallelism shards), the routed experts of a layer and the
  // experts each token picks. 0 without MoE layers.
  int64_t routed_expert_params = 0;
  int64_t routed_experts = 0;
  int64_t experts_per_token = 0;
  // flops_per_token by top-level module FQN (layers.i, lm_head, ...; a
  // module missing costs nothing); they add up to flops_per_token. Empty
  // where a family does not say (exact16). The pipeline plan weighs its
  // stages with them (see Note [Bubble weighted by FLOPs]).
  std::map<std::string, double> module_flops;
  std::vector<LayerInfo> layers;
  // Pinned modules: these ride with the first / last stage and count as no
  // split unit (a vision tower, the AttnRes final aggregation).
  std::vector<std::string> pinned_first;
  std::vector<std::string> pinned_last;
};

// Every top-level module FQN of the whole model, in order (pinned ones
// included): tok_embeddings, [pinned first], layers.0 .. layers.L-1, norm,
// lm_head, [pinned last] -- the exact list is the family's.
std::vector<std::string> model_module_fqns(const JobConfig& job);

// Note [FLOPs of a step's documents]
// Under model.attn_mask_type = "block_causal" a token attends to the tokens
// of its own document only (see Note [Document boundaries],
// ops/documents.h), so where flops_per_token counts the T keys of the
// window, a token of a document piece of L tokens counts L: the piece costs
// flops_per_token_outside_attention x L + attention_flops_per_pair x L^2.
// L^2 keeps flops_per_token's convention of every key for every token, and
// a window that is one document costs flops_per_token x T, as under
// "causal". Every position runs through the model, those whose target
// block_causal ignores too, so the pieces' lengths add up to the window.
// Under block_causal a step's MFU counts these FLOPs (train/pipeline_metrics.h).
//
// The training FLOPs (fwd + bwd) of a micro-batch whose windows hold
// `documents`.
double training_flops(const ModelInfo& info, const ops::Documents& documents);

// Build the part holding `module_fqns` (empty = the whole model) on CPU in
// fp32 with uninitialised weights; call init_weights or load a checkpoint.
// Builds the part and sets its modules' kernel options from the config
// (kernel_options; see Note [Ops own the kernel choice], ops/options.h); a
// training rank completes them with its capabilities and weight cache
// (train/rank_model.cpp).
std::shared_ptr<ModelPart> build_model_part(
    const JobConfig& job, const std::vector<std::string>& module_fqns = {});
// model.cuda_kernels and model.swiglu_recompute as the ops' options (no
// capabilities probed, no weight cache).
ops::KernelOptions kernel_options(const ModelSection& model);
// activation_checkpoint.mode and .selective_ac_option (checked on load).
ops::ActivationCheckpoint activation_checkpoint(const ActivationCheckpointSection& ac);

ModelInfo describe_model(const JobConfig& job);

// Summed token cross-entropy (fp32) over logits [B, T, V] and targets [B, T];
// targets < 0 are ignored. Divide by the global token count yourself.
at::Tensor summed_cross_entropy(const at::Tensor& logits,
                                const at::Tensor& targets);

}  // namespace viaduct
