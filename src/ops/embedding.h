// The token embedding: rows of a table read by token id.
#pragma once

#include <torch/torch.h>

#include "ops/options.h"

namespace viaduct::ops {

// weight [vocab, D] read at tokens (int64, any shape): [..., D] in weight's
// dtype. Where viaduct's kernels run on an fp32 table, the table's gradient
// comes from kernels::embedding_weight_grad: ATen's CUDA form sorts the
// tokens and copies the count of distinct ones to the host, a device sync
// at the end of every backward that leaves the GPU idle while the host
// queues the optimizer.
at::Tensor embedding(const at::Tensor& weight, const at::Tensor& tokens, const KernelOptions& k);

}  // namespace viaduct::ops
