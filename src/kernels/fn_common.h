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

// The incoming gradients of a norm with its residual add inside, (h,
// norm(h)) for h = x + res (see Note [Residual add inside the norm],
// kernels/rms_norm_fn.cpp), as [rows, D] rows of h2's dtype: dres, h's own
// (undefined where h had no other use), and dy, the norm's (zeros where
// none); `sizes`: the shape of x and res, for their gradient.
struct ResidualNormGrads {
  at::Tensor dres, dy;
  std::vector<int64_t> sizes;
};
inline ResidualNormGrads residual_norm_grads(const torch::autograd::variable_list& grads,
                                             const at::Tensor& h2) {
  const auto rows = h2.size(0), D = h2.size(1);
  auto as_rows = [&](const at::Tensor& g) {
    return g.defined() ? g.contiguous().view({rows, D}).to(h2.scalar_type()) : g;
  };
  ResidualNormGrads r;
  r.sizes = (grads[1].defined() ? grads[1] : grads[0]).sizes().vec();
  r.dres = as_rows(grads[0]);
  r.dy = grads[1].defined() ? as_rows(grads[1]) : at::zeros_like(h2);
  return r;
}

}  // namespace viaduct::kernels
