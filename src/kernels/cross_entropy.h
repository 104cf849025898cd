// Cross-entropy launch (kernels/cross_entropy.cu).
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

// Cross-entropy of each row of logits [rows, vocab] against targets[row]
// (== ignore_index: skipped). Writes row_loss[row] = logsumexp - logit[target]
// (0 when skipped) and overwrites the logits, in place, with the gradient of
// the row's loss: softmax - onehot(target) (all zero when skipped).
cudaError_t cross_entropy_forward_backward(DType dt, void* logits,
                                           const int64_t* targets,
                                           float* row_loss, int64_t rows,
                                           int64_t vocab, int64_t ignore_index,
                                           cudaStream_t stream);

}  // namespace viaduct::cuda
