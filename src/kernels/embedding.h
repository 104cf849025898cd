// Embedding-table gradient launch (kernels/embedding.cu).
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

// dw[t, :] = the sum of grad[r, :] over the rows r whose token is t, in
// increasing r: sorted [n] holds the n tokens in ascending order by a stable
// sort and order [n] the row each sorted position came from. dw [vocab, d]
// must be zero before the call (a token that does not occur keeps its zero
// row); grad [n, d] and dw are fp32. Tokens outside [0, vocab) are skipped.
cudaError_t embedding_backward(const int64_t* sorted, const int64_t* order, const float* grad,
                               float* dw, int64_t n, int64_t d, int64_t vocab,
                               cudaStream_t stream);

}  // namespace viaduct::cuda
