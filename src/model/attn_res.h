// Block Attention Residuals: the read that replaces the residual add.
//
// Note [AttnRes stack]
// A Kimi-K3 layer does not add into a single residual stream. The blocks
// completed so far form a stack [b_0 = embedding, b_1, ...] and the open
// block keeps a partial sum. Each sublayer input is a softmax over depth of
// w . RMSNorm(v) across the sources (the stack, plus the partial sum when the
// block already has one), with a learned pseudo-query w that starts at zero
// (a uniform mean) and no temperature. The logits and the softmax are fp32.
// The final aggregation before the model's norm is one more such read.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "model/layers.h"
#include "ops/options.h"

namespace viaduct {

// One read: FQNs `<name>.query` [D] and `<name>.norm.weight` [D].
class AttnResReadImpl : public torch::nn::Module, public ops::KernelUser {
 public:
  AttnResReadImpl(int64_t dim, double eps);
  // sources: N tensors [B, T, D] (N >= 1) -> [B, T, D] in the sources' dtype.
  // slots, when given (one entry per source, undefined for none): the
  // source's gradient is added into its slot instead of being returned
  // (see Note [AttnRes block gradients in place]).
  at::Tensor forward(const std::vector<at::Tensor>& sources,
                     const std::vector<at::Tensor>* slots = nullptr);
  // next(forward(sources, slots)): the read and the RMSNorm in one kernel
  // each way where those kernels run (see Note [AttnRes read with its norm],
  // kernels/attn_res_read.cu).
  at::Tensor forward_normed(const std::vector<at::Tensor>& sources,
                            const std::vector<at::Tensor>* slots, RMSNormImpl& next);
  // The softmax weights over depth, [N, B, T] fp32 (for tests and probes).
  at::Tensor weights(const std::vector<at::Tensor>& sources);
  void init_weights();  // query = 0, norm weight = 1
  static int64_t count_params(int64_t dim) { return 2 * dim; }

  at::Tensor query;
  RMSNorm norm{nullptr};
};
TORCH_MODULE(AttnResRead);

// Note [AttnRes block gradients in place]
// A completed block is a source of every later read, so autograd would sum
// one new [B, T, D] gradient tensor per read into the block's gradient (an
// out-of-place add each: two reads and a write of the block's size). With
// a slot, the reads' backward adds into one buffer per block instead (the
// read kernels in the same pass as the gradient itself):
//  - attn_res_block_sink(block, slot) stands for the block on the stack;
//    its backward returns the slot's sum (plus any gradient that reached the
//    block another way) and empties the slot. Every read of the block runs
//    its backward before the sink (autograd's dependency order).
//  - A read with a slot for source i returns no gradient for it; it adds
//    dv_i rounded to the source's dtype into the slot, the first one
//    becoming the slot. That is the rounding and the order in which
//    autograd's own accumulation adds the same tensors, so the bits are
//    those of the autograd sum.
//  - attn_res_seed(outputs, slots) wraps a part's outputs: their gradients
//    (from the next stage) are copied into the blocks' slots before any read
//    of the part runs its backward (the seed node is the only one the
//    outputs' gradients reach), so a block's sum starts where autograd's
//    would: with the later stages' gradient.
// A slot is a tensor whose storage the first gradient replaces (Tensor::set_);
// every read and the sink hold the same TensorImpl. Reruns of the backward
// (zero-bubble's W pass) start from an empty slot again: the sink empties it.
at::Tensor attn_res_new_slot(const at::Tensor& like);
at::Tensor attn_res_block_sink(const at::Tensor& block, const at::Tensor& slot);
// Note [AttnRes partial sums in place]
// An open block's partial sum p is read by the next sublayer and added to
// by it (p' = p + x), so autograd would sum p's two gradients, the read's
// and the add's, in a standalone add each sublayer. With slots on the
// partial sums (the blocks' mechanism above):
//  - attn_res_partial_add(p, p_slot, x, out_slot) is p + x; its backward
//    takes out_slot's sum (emptying it) plus any gradient that reached p'
//    another way, returns it as x's gradient and starts p_slot's sum with
//    it (the same storage, so every later add into a slot is out of place).
//  - p's read, with p_slot as p's slot, runs its backward after that add's
//    (the read's output feeds x), so its kernel adds the slot's sum as it
//    writes p's gradient, in the pass it makes anyway.
//  - the layer's incoming partial sum is a sink with a slot (as a block
//    is), which returns the slot's sum to whatever made it.
// Each sum is the add autograd would make of the same two tensors, so the
// bits are autograd's.
at::Tensor attn_res_partial_add(const at::Tensor& partial, const at::Tensor& partial_slot,
                                const at::Tensor& x, const at::Tensor& out_slot);
// outputs[i] with slots[i] defined: its gradient goes to the slot. Returns
// the outputs (views) in order.
std::vector<at::Tensor> attn_res_seed(const std::vector<at::Tensor>& outputs,
                                      const std::vector<at::Tensor>& slots);
// FLOPs of one read per token, forward only: the keys' norm and the dot with
// the query (about 4 D per source) and the weighted sum (2 D per source).
inline double attn_res_read_flops(int64_t n_sources, int64_t dim) {
  return 6.0 * static_cast<double>(n_sources) * static_cast<double>(dim);
}

}  // namespace viaduct
