// viaduct's CUDA kernels on raw device pointers: what every launch header
// (kernels/<op>.h) shares. No LibTorch here, so the kernels/<op>.cu files
// compile with nvcc alone; ops/ wraps the launches for autograd.
//
// Every tensor is contiguous, row-major. `DType` names the activation type;
// norms' weights, statistics and partial sums are fp32, and all arithmetic is
// fp32. Every reduction has a fixed order (no atomics): the same inputs give
// the same bits on every run and every layout.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace viaduct::cuda {

enum class DType { kFloat32, kBFloat16 };

// True when the kernels were compiled for `device`'s architecture (sm_90a:
// compute capability 9.0). Cached per device.
bool device_supported(int device);

// How many partial rows a norm's backward (RMSNorm, LayerNorm) writes for
// its weight gradients: eight rows per block (a short serial chain per
// block, many blocks in flight), at most 4096 parts (16 MiB of fp32
// partials at dim 1024). The caller sums the parts.
int64_t norm_backward_parts(int64_t rows);

}  // namespace viaduct::cuda
