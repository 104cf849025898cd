// RoPE and repeated heads as autograd functions (CUDA build).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/rope.h"

namespace viaduct::kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// repeat > 0: each head of x written `repeat` times (the forward of a
// grouped-KV rotation); repeat < 0: each run of -repeat heads summed (its
// backward); 1: a plain rotation.
at::Tensor rope_launch(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       bool inverse, int64_t repeat) {
  // Strided input (SDPA's transposed gradients, q/k sliced from one qkv
  // projection) is read in place; only a non-unit last stride is copied.
  auto xc = x.stride(3) == 1 ? x : x.contiguous();
  const int64_t rep = repeat > 0 ? repeat : -repeat;
  const int64_t H_out = repeat > 0 ? xc.size(2) * rep : xc.size(2) / rep;
  auto y = at::empty({xc.size(0), xc.size(1), H_out, xc.size(3)},
                     xc.options().memory_format(at::MemoryFormat::Contiguous));
  // Undefined tables: no rotation (repeat_heads).
  check_launch(cuda::rope(dtype_of(xc), xc.data_ptr(),
                          cos.defined() ? cos.data_ptr<float>() : nullptr,
                          sin.defined() ? sin.data_ptr<float>() : nullptr, y.data_ptr(), xc.size(0), xc.size(1), H_out,
                          xc.size(3), xc.stride(0), xc.stride(1), xc.stride(2), inverse,
                          /*div=*/repeat > 0 ? rep : 1, /*mul=*/repeat > 0 ? 1 : rep,
                          /*cnt=*/repeat > 0 ? 1 : rep, stream_of(xc)),
               "rope");
  return y;
}

class RopeFn : public torch::autograd::Function<RopeFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin, int64_t repeat) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["repeat"] = repeat;
    return rope_launch(x, cos, sin, /*inverse=*/false, repeat);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto repeat = ctx->saved_data["repeat"].toInt();
    return {rope_launch(grads[0], saved[0], saved[1], /*inverse=*/true,
                        repeat == 1 ? 1 : -repeat),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Note [Repeated heads without a gather]
// V's grouped heads repeated for
// SDPA went through repeat_interleave, a strided gather from the qkv GEMM's
// output far below the memory bandwidth, and its backward through a
// reduction kernel. The RoPE kernel already writes
// and sums repeated heads through strides; without tables it does so with
// no rotation, vectorised.
class RepeatHeadsFn : public torch::autograd::Function<RepeatHeadsFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t repeat) {
    ctx->saved_data["repeat"] = repeat;
    return rope_launch(x, at::Tensor(), at::Tensor(), /*inverse=*/false, repeat);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto repeat = ctx->saved_data["repeat"].toInt();
    return {rope_launch(grads[0], at::Tensor(), at::Tensor(), /*inverse=*/false, -repeat),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                int64_t repeat) {
  RECORD_FUNCTION("viaduct::rope", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(x.dim() == 4 && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                    cos.is_contiguous() && sin.is_contiguous() && cos.size(0) >= x.size(1) &&
                    2 * cos.size(1) == x.size(3),
                "fused rope: x must be [B, T, H, hd] and cos/sin contiguous fp32 [>= T, hd/2]");
  VIADUCT_CHECK(repeat >= 1, "fused rope: repeat must be >= 1, got ", repeat);
  return RopeFn::apply(x, cos, sin, repeat);
}

at::Tensor repeat_heads(const at::Tensor& x, int64_t repeat) {
  RECORD_FUNCTION("viaduct::repeat_heads", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(x.dim() == 4 && repeat >= 1,
                "fused repeat_heads: x must be [B, T, H, hd] and repeat >= 1");
  if (repeat == 1) return x;
  return RepeatHeadsFn::apply(x, repeat);
}

}  // namespace viaduct::kernels
