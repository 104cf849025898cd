// What the CUDA build's autograd wrappers (kernels/<op>_fn.cpp) share:
// the kernels' dtype and stream of a tensor, and the launch check.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <torch/torch.h>

#include <cstdint>

#include "core/check.h"
#include "kernels/common.h"

namespace viaduct::kernels {

inline cuda::DType dtype_of(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat ? cuda::DType::kFloat32 : cuda::DType::kBFloat16;
}

inline cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

inline void check_launch(cudaError_t err, const char* what) {
  VIADUCT_CHECK(err == cudaSuccess, "CUDA kernel ", what, " failed: ", cudaGetErrorString(err));
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace viaduct::kernels
