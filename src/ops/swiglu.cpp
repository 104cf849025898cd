#include "ops/swiglu.h"

#include "kernels/fused.h"
#include "ops/linear.h"

namespace viaduct::ops {

at::Tensor swiglu_ffn(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                      const at::Tensor& w3, const KernelOptions& k) {
  if (fused_runs(x, k)) {
    // Note [One w1/w3 projection]
    // As the qkv projection, w1 and w3 are the parts of one GEMM, [tokens,
    // 2F] (see Note [One GEMM for the projections of one input], ops/linear.cpp); the SwiGLU kernels
    // read its halves in place and write their gradient as one [tokens, 2F]
    // tensor, so the backward's dx is one GEMM and x's two gradients need
    // no addition. bf16 with fp32 weights only (elsewhere the concatenation
    // would be a copy).
    const kernels::SwiGLULinearOptions o{k.weight_cache.get(),
                                         k.capabilities.fp32_out_gemm, k.swiglu_recompute};
    if (mixed_linear_applies(x, {w1, w3}, k)) {
      return kernels::swiglu_linear_packed(linear_parts(x, {w1, w3}, {}, k), w2, o);
    }
    return kernels::swiglu_linear(linear(x, w1, {}, k), linear(x, w3, {}, k), w2, o);
  }
  return linear(at::silu(linear(x, w1, {}, k)) * linear(x, w3, {}, k), w2, {}, k);
}

}  // namespace viaduct::ops
