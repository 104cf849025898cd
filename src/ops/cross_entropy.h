// The loss of the model's head: cross-entropy of h W^T against the
// targets, in chunks of rows so the logits are never all held.
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "ops/options.h"

namespace viaduct::ops {

// Note [Chunked head loss]
// sum_t CE(h_t W^T, y_t) without ever holding the [tokens x vocab] logits:
// rows of h go through the head in chunks of `chunk_tokens`; each chunk's
// logits are made, reduced to its loss, and its gradient (softmax - onehot)
// turned at once into the chunk's dh and its share of dW, which backward
// scales by the incoming gradient. Peak extra memory is one chunk's logits
// instead of all of them (fp32: 4 x tokens x vocab bytes). h: [N, D] in the
// compute dtype, W: [V, D] (cast to h's dtype), targets: [N] (-100 ignored).
// Where the kernels run, each chunk's loss and gradient come from one
// kernel that overwrites the logits (kernels::cross_entropy_rows_).
at::Tensor chunked_head_cross_entropy(const at::Tensor& h, const at::Tensor& weight,
                                      const at::Tensor& targets, int64_t chunk_tokens,
                                      const KernelOptions& k);

// model.loss_chunk_tokens = -1 (auto) where the kernels run: chunks of 4096
// tokens keep the [chunk x vocab] logits small while each chunk's GEMMs
// still fill the GPU.
inline constexpr int64_t kAutoLossChunkTokens = 4096;

// The chunk (see Note [Chunked head loss]) that model.loss_chunk_tokens =
// `configured` gives for the head's input h under k: > 0 as configured, 0
// (the plain loss over whole logits) as configured, < 0 (auto)
// kAutoLossChunkTokens where the kernels run on h, else 0.
int64_t loss_chunk_tokens(int64_t configured, const at::Tensor& h, const KernelOptions& k);
// The same where whether the kernels run is known without a tensor (the
// memory estimate, before any model exists).
int64_t loss_chunk_tokens(int64_t configured, bool kernels_run);

}  // namespace viaduct::ops
