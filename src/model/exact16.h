// The exact16 model family: an AttnRes model whose every activation
// gradient is a small integer times the loss scale, so a block gradient's
// contributions add to the same bits in any order and grouping. It is the
// model the AttnRes transports are proven exact with: the rank cache, the
// whole stack and one process must agree bitwise with each other and with
// the closed form (tests/pipeline/attn_res/test_attn_res_exact.cpp).
//
// Note [exact16: integer gradients]
// The part contract is see Note [Kimi-K3 part activations] (kimi_k3.h): stack
// [e_0 = embedding, e_1, ...] of completed block sums, the open block's
// partial sum as `hidden`, a block's first layer pushes the incoming stream.
// What differs from the K3 layer is that everything is linear with fixed
// small-integer coefficients:
//   read(sources)      = sum of the sources (the AttnRes read with every depth
//                        weight 1 instead of a softmax; no norm)
//   layer j            = two reads, like the K3 layer:
//                        partial += attention.scale * read(stack + partial)
//                                   + attention.bias
//                        out = partial + feed_forward.scale
//                                   * read(stack + partial) + feed_forward.bias
//   attn_res_final     = read(stack + hidden)          -> agg [B, T, D]
//   lm_head            = sum over channels of agg      -> readout [B, T]
//   loss (forward_loss)= sum of the readout over the tokens whose target is
//                        not -100 (targets are otherwise unused: this is not
//                        a language model)
// `scale` is a fixed buffer with entries in {1, 0, -2} (exact16_scale);
// `tok_embeddings.weight` and the biases train. d loss / d agg = 1 at every
// counted token, and since the model is linear every activation gradient is
// an integer independent of the values, times the trainer's loss scale
// 1 / tokens. The family therefore refuses (ConfigError) what would break
// that: a token count per step that is not a power of two (1 / tokens would
// round), bf16 compute, the K3 hybrid's model keys it does not have, and
// shapes whose gradient sums reach 2^24 (exact16_gradient_bound).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/model.h"

namespace viaduct {

struct Exact16Options {
  int64_t n_layers = 16;
  int64_t block_size = 4;
  int64_t dim = 16;
  int64_t vocab_size = 320;
  // See Note [Activation checkpointing] (ops/recompute.h): which layers.
  ops::ActivationCheckpoint activation_checkpoint;

  bool opens_block(int64_t layer) const { return layer % block_size == 0; }
  int64_t block_of(int64_t layer) const { return layer / block_size; }
  // Stack entries after the last layer: e_0 .. e_{n-1}.
  int64_t n_entries() const { return (n_layers + block_size - 1) / block_size; }
};

// The shape (model.n_layers, model.dim, model.vocab_size,
// model.attn_res_block_size over its debugmodel's 16 / 16 / 320 / 4); refuses
// every other model key and shapes past exact16_gradient_bound: the family's
// parse of its [model] keys (job.model.keys), with the job's activation
// checkpointing.
Exact16Options exact16_options(const JobConfig& job);
// What training this model needs on top (its part builder checks it):
// float32 and a power-of-two token count per step (training and
// parallelism sections).
void check_exact16_training(const JobConfig& job);

// The fixed coefficient of layer `layer`'s attention (`ffn` = false) or
// feed-forward (`ffn` = true) sublayer at `channel`: 1, 0 or -2.
float exact16_scale(int64_t layer, int64_t channel, bool ffn);
// An upper bound, in units of the loss scale, on every activation gradient
// and on every partial sum of a block gradient's contributions, whatever
// their order: the sum of their magnitudes (464 for the debugmodel shape).
// Every such sum is exact in fp32 while the bound stays below 2^24.
double exact16_gradient_bound(const Exact16Options& o);

// One sublayer: y = scale * x + bias; FQNs <name>.scale (buffer, [D]) and
// <name>.bias (parameter, [D]).
class Exact16MixImpl : public torch::nn::Module {
 public:
  Exact16MixImpl(int64_t layer, int64_t dim, bool ffn);
  at::Tensor forward(const at::Tensor& x) const { return x * scale + bias; }

  at::Tensor scale, bias;
};
TORCH_MODULE(Exact16Mix);

class Exact16Part : public ModelPart {
 public:
  Exact16Part(const Exact16Options& o, const std::vector<std::string>& fqns);
  // First part: {tokens [B, T] int64}; between parts as kimi_k3; the last
  // part returns {readout [B, T] fp32}.
  Activations forward(const Activations& inputs) override;
  // The readout summed over the tokens whose target is not -100.
  at::Tensor forward_loss(const Activations& inputs, const at::Tensor& targets) override;
  // tok_embeddings.weight: integers in [-2, 2]; biases: integers in [-1, 1];
  // both from (seed, FQN).
  void init_weights(uint64_t seed) override;

  // Tests: called during backward with the whole gradient of every stack
  // entry this part pushes (a block's first layer pushes it; e_0 is the
  // embedding) -- `forward_index` counts this part's forwards with autograd
  // on, from 0, so under any schedule that runs a stage's forwards in
  // micro-batch order it is step * micro-batches + micro-batch.
  using BlockGradientProbe =
      std::function<void(int64_t forward_index, int64_t entry, const at::Tensor& grad)>;
  void set_block_gradient_probe(BlockGradientProbe probe) { probe_ = std::move(probe); }

  const Exact16Options& options() const { return opts_; }

  torch::nn::Embedding tok_embeddings{nullptr};
  // Per held layer, in order: its global id and its two sublayers.
  struct Layer {
    int64_t id;
    Exact16Mix attention, feed_forward;
  };
  const std::vector<Layer>& layers() const { return layers_; }

 private:
  at::Tensor layer_forward(const Layer& l, const at::Tensor& hidden,
                           std::vector<at::Tensor>& stack, int64_t forward_index);

  Exact16Options opts_;
  std::vector<Layer> layers_;
  BlockGradientProbe probe_;
  int64_t grad_forwards_ = 0;
};

}  // namespace viaduct
