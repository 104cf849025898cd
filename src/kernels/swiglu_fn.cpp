// SwiGLU and SwiGLU followed by a linear as autograd functions (CUDA build).
#include "kernels/fused.h"

#include "kernels/weight_cache.h"
#include "core/torch_compat.h"
#include "kernels/fn_common.h"
#include "kernels/swiglu.h"

namespace viaduct::kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor swiglu_launch(const at::Tensor& a, const at::Tensor& b) {
  auto y = at::empty_like(a);
  check_launch(cuda::swiglu_forward(dtype_of(a), a.data_ptr(), b.data_ptr(), y.data_ptr(),
                                    a.numel(), stream_of(a)),
               "swiglu_forward");
  return y;
}

std::pair<at::Tensor, at::Tensor> swiglu_grads(const at::Tensor& dy, const at::Tensor& a,
                                               const at::Tensor& b) {
  auto g = dy.contiguous().to(a.scalar_type());
  auto da = at::empty_like(a), db = at::empty_like(b);
  check_launch(cuda::swiglu_backward(dtype_of(a), g.data_ptr(), a.data_ptr(), b.data_ptr(),
                                     da.data_ptr(), db.data_ptr(), a.numel(), stream_of(a)),
               "swiglu_backward");
  return {da, db};
}

// silu(ab[..., :F]) * ab[..., F:] for the [..., 2F] output of one w1/w3
// GEMM (see Note [One w1/w3 projection]), and its gradient as one [..., 2F]
// tensor: the halves read and written in place, no split copies.
at::Tensor swiglu_launch_packed(const at::Tensor& ab) {
  const auto F = ab.size(-1) / 2;
  auto sizes = ab.sizes().vec();
  sizes.back() = F;
  auto y = at::empty(sizes, ab.options());
  const auto elem = static_cast<int64_t>(ab.element_size());
  const auto* a = static_cast<const char*>(ab.data_ptr());
  check_launch(cuda::swiglu_forward(dtype_of(ab), a, a + F * elem, y.data_ptr(), y.numel(),
                                    stream_of(ab), F, 2 * F),
               "swiglu_forward");
  return y;
}
at::Tensor swiglu_grads_packed(const at::Tensor& dy, const at::Tensor& ab) {
  const auto F = ab.size(-1) / 2;
  auto g = dy.contiguous().to(ab.scalar_type());
  auto dab = at::empty_like(ab);
  const auto elem = static_cast<int64_t>(ab.element_size());
  const auto* a = static_cast<const char*>(ab.data_ptr());
  auto* da = static_cast<char*>(dab.data_ptr());
  check_launch(cuda::swiglu_backward(dtype_of(ab), g.data_ptr(), a, a + F * elem, da,
                                     da + F * elem, g.numel(), stream_of(ab), F, 2 * F),
               "swiglu_backward");
  return dab;
}

// silu(ab[..., :F]) * ab[..., F:], its gradient one [..., 2F] tensor.
class SwiGLUPackedFn : public torch::autograd::Function<SwiGLUPackedFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& ab) {
    auto abc = ab.contiguous();
    ctx->save_for_backward({abc});
    return swiglu_launch_packed(abc);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {swiglu_grads_packed(grads[0], ctx->get_saved_variables()[0])};
  }
};

// packed: a is the [..., 2F] output of one w1/w3 GEMM and b a 0-size
// stand-in (custom functions take no undefined inputs on LibTorch 2.x).
class SwiGLULinearFn : public torch::autograd::Function<SwiGLULinearFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                            const at::Tensor& w, bool packed, const SwiGLULinearOptions* o) {
    auto ac = a.contiguous(), bc = packed ? b : b.contiguous();
    // Kept: the backward needs the same cast, from the options' weight
    // cache (see Note [Low-precision weight cache]).
    auto wc = w.scalar_type() == a.scalar_type() ? w
                                                 : cast_weights(o->cache, {w}, a.scalar_type());
    auto h = packed ? swiglu_launch_packed(ac) : swiglu_launch(ac, bc);
    ctx->save_for_backward({ac, bc, w, wc, o->recompute ? at::Tensor() : h});
    ctx->saved_data["packed"] = packed;
    ctx->saved_data["fp32_out"] = o->fp32_out_gemm;
    return at::linear(h, wc);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &a = saved[0], &b = saved[1], &w = saved[2], &wc = saved[3];
    const bool packed = ctx->saved_data["packed"].toBool();
    const auto F = w.size(1);
    const auto D = w.size(0);
    // Note [SwiGLU recompute]
    // Without model.swiglu_recompute the product
    // was kept by the forward; with it, recomputed here (one [tokens x F]
    // activation less per layer, one more elementwise pass).
    auto h = (saved[4].defined() ? saved[4]
              : packed         ? swiglu_launch_packed(a)
                               : swiglu_launch(a, b))
                 .view({-1, F});
    auto dy = grads[0].contiguous().view({-1, D}).to(a.scalar_type());
    // fp32 straight from the GEMM (see Note [Linear with an fp32 weight
    // gradient], ops/linear.cpp).
    auto dw = at::empty(w.sizes(), w.options());
    compat::matmul_into_fp32_(dw, dy.t(), h, /*accumulate=*/false,
                              ctx->saved_data["fp32_out"].toBool());
    auto dh = at::mm(dy, wc);
    h.reset();
    if (packed) return {swiglu_grads_packed(dh, a), at::Tensor(), dw, at::Tensor(), at::Tensor()};
    auto [da, db] = swiglu_grads(dh.view(a.sizes()), a, b);
    return {da, db, dw, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor swiglu_packed(const at::Tensor& ab) {
  RECORD_FUNCTION("viaduct::swiglu", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(ab.dim() >= 1 && ab.size(-1) % 2 == 0,
                "fused swiglu_packed: ab must be [..., 2F], got ", ab.sizes());
  return SwiGLUPackedFn::apply(ab);
}

at::Tensor swiglu_linear(const at::Tensor& a, const at::Tensor& b, const at::Tensor& w,
                         const SwiGLULinearOptions& o) {
  RECORD_FUNCTION("viaduct::swiglu_linear", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && w.dim() == 2 &&
                    w.size(1) == a.size(-1),
                "fused swiglu_linear: a, b must match and w be [D, ", a.size(-1), "]");
  return SwiGLULinearFn::apply(a, b, w, false, &o);
}

at::Tensor swiglu_linear_packed(const at::Tensor& ab, const at::Tensor& w,
                                const SwiGLULinearOptions& o) {
  RECORD_FUNCTION("viaduct::swiglu_linear", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(ab.dim() >= 1 && ab.size(-1) % 2 == 0 && w.dim() == 2 &&
                    2 * w.size(1) == ab.size(-1),
                "fused swiglu_linear_packed: ab must be [..., 2F] and w [D, F], got ",
                ab.sizes(), " and ", w.sizes());
  return SwiGLULinearFn::apply(ab, at::empty({0}, ab.options()), w, true, &o);
}

}  // namespace viaduct::kernels
