// Copy launches (kernels/copy.cu): the strided channel copies that ATen
// runs one element a thread at a time.
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

// A tensor of up to four dims whose last dim is dense: rows indexed by the
// three leading dims (sizes n0, n1, n2, strides in bytes), each row
// `row_bytes` long.
struct StridedRows {
  int64_t n0, n1, n2;
  int64_t s0, s1, s2;  // bytes
};

// dst[i0, i1, i2, :] = src[i0, i1, i2, :] for every row of `shape` (the
// sizes both share; the strides each its own), in 16-byte words: pointers,
// strides and row_bytes (the source's) must be multiples of 16. `widen`:
// src bf16 and dst fp32, each value widened exactly (a destination row is
// 2 row_bytes long).
cudaError_t copy_rows(const void* src, const StridedRows& src_rows, void* dst,
                      const StridedRows& dst_rows, int64_t row_bytes, bool widen,
                      cudaStream_t stream);

}  // namespace viaduct::cuda
