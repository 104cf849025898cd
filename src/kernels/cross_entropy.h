// Cross-entropy launch (kernels/cross_entropy.cu).
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

// Cross-entropy of each row of logits [rows, vocab] against targets[row]
// (== ignore_index: skipped). Writes row_loss[row] = logsumexp - logit[target]
// (0 when skipped) and overwrites the logits, in place, with the gradient of
// the row's loss: softmax - onehot(target) (all zero when skipped), times
// *grad_scale where grad_scale (an fp32 scalar on the device) is given.
cudaError_t cross_entropy_forward_backward(DType dt, void* logits,
                                           const int64_t* targets,
                                           float* row_loss, int64_t rows,
                                           int64_t vocab, int64_t ignore_index,
                                           const float* grad_scale, cudaStream_t stream);

// t[i] *= *num / *den (den null: *num) for the n elements of t, num and den
// fp32 scalars on the device. Where the ratio is exactly 1 every block
// returns before touching t, so the call moves no data.
cudaError_t scale_by_ratio(DType dt, void* t, int64_t n, const float* num, const float* den,
                           cudaStream_t stream);

}  // namespace viaduct::cuda
