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

namespace viaduct {

// One read: FQNs `<name>.query` [D] and `<name>.norm.weight` [D].
class AttnResReadImpl : public torch::nn::Module {
 public:
  AttnResReadImpl(int64_t dim, double eps);
  // sources: N tensors [B, T, D] (N >= 1) -> [B, T, D] in the sources' dtype.
  at::Tensor forward(const std::vector<at::Tensor>& sources);
  // The softmax weights over depth, [N, B, T] fp32 (for tests and probes).
  at::Tensor weights(const std::vector<at::Tensor>& sources);
  void init_weights();  // query = 0, norm weight = 1
  static int64_t count_params(int64_t dim) { return 2 * dim; }

  at::Tensor query;
  RMSNorm norm{nullptr};
};
TORCH_MODULE(AttnResRead);

// FLOPs of one read per token, forward only: the keys' norm and the dot with
// the query (about 4 D per source) and the weighted sum (2 D per source).
inline double attn_res_read_flops(int64_t n_sources, int64_t dim) {
  return 6.0 * static_cast<double>(n_sources) * static_cast<double>(dim);
}

}  // namespace viaduct
