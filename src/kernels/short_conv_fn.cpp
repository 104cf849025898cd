// KDA's short convolution + SiLU as an autograd function (CUDA build).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/short_conv.h"

namespace viaduct::kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const int32_t* offsets_of(const at::Tensor& t) {
  return t.numel() ? t.data_ptr<int32_t>() : nullptr;
}

// x as the kernels read it: in place where its tokens are evenly spaced
// rows of contiguous channels (a column slice of one wider projection,
// see Note [One GEMM for the projections of one input], ops/linear.cpp),
// else a contiguous copy.
at::Tensor as_read(const at::Tensor& x) {
  const auto T = x.size(1), C = x.size(2);
  const bool rows = x.stride(2) == 1 && x.stride(1) >= C && x.stride(0) == T * x.stride(1);
  return rows ? x : x.contiguous();
}

// The forward's saved state, shared by both functions: x as the kernels
// read it, the weight contiguous, the document offsets (int32 [B, T], or a
// 0-size stand-in for none: an autograd function takes no undefined inputs
// on LibTorch 2.x), and where x is a part of a packed projection, the
// columns of the product's gradient that dx goes to (see Note [Packed
// projection gradients in place], kernels/fused.h).
struct ConvInputs {
  at::Tensor x, w;
  ConvInputs(AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& weight,
             const at::Tensor& offsets, const PackedGradColumns& dx_into)
      : x(as_read(x_in)), w(weight.contiguous()) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["offsets"] = offsets;
    save_packed_grad_columns(ctx, dx_into);
  }
};

// The backward's view of that state, with its outputs and scratch: the
// weight gradient's partial sums (scratch), dx in x's dtype (its own
// tensor, or its columns of the packed product's gradient, dxs apart), dw
// fp32.
struct ConvGrads {
  at::Tensor x, w, offsets;
  int64_t B, T, C, dxs;
  int K;
  at::Tensor partial, dx, dw;
  explicit ConvGrads(AutogradContext* ctx) {
    const auto saved = ctx->get_saved_variables();
    x = saved[0];
    w = saved[1];
    offsets = ctx->saved_data["offsets"].toTensor();
    B = x.size(0);
    T = x.size(1);
    C = x.size(2);
    K = static_cast<int>(w.size(1));
    const auto f32 = x.options().dtype(at::kFloat);
    partial = at::empty({cuda::short_conv_partials(B, T), C, K}, f32);
    const auto into = saved_packed_grad_columns(ctx);
    if (into.slot.defined()) {
      dx = packed_grad_view(into, C);
    } else {
      dx = at::empty({B, T, C}, x.options());
    }
    dxs = dx.stride(1);
    dw = at::empty({C, K}, f32);
  }
};

class ShortConvSiluFn : public torch::autograd::Function<ShortConvSiluFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& offsets, const PackedGradColumns* dx_into) {
    const ConvInputs in(ctx, x, weight, offsets, *dx_into);
    auto y = at::empty(in.x.sizes(), in.x.options());
    check_launch(cuda::short_conv_silu_forward(dtype_of(in.x), in.x.data_ptr(), in.x.stride(1),
                                               in.w.data_ptr<float>(), offsets_of(offsets),
                                               y.data_ptr(), in.x.size(0), in.x.size(1),
                                               in.x.size(2), static_cast<int>(in.w.size(1)),
                                               stream_of(in.x)),
                 "short_conv_silu_forward");
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    ConvGrads g(ctx);
    auto dy = grads[0].to(g.x.scalar_type()).contiguous();
    check_launch(cuda::short_conv_silu_backward(
                     dtype_of(g.x), g.x.data_ptr(), g.x.stride(1), g.w.data_ptr<float>(),
                     offsets_of(g.offsets), dy.data_ptr(), g.dx.data_ptr(), g.dxs,
                     g.partial.data_ptr<float>(), g.dw.data_ptr<float>(), g.B, g.T, g.C, g.K,
                     stream_of(g.x)),
                 "short_conv_silu_backward");
    return {g.dx, g.dw, at::Tensor(), at::Tensor()};
  }
};

// The convolution and each head's L2 norm (see short_conv_silu_l2 in
// kernels/fused.h): saves x (as read) and the weight; the norm's input is
// recomputed in the backward.
class ShortConvSiluL2Fn : public torch::autograd::Function<ShortConvSiluL2Fn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& offsets, int64_t head_dim, double eps,
                            double scale, const PackedGradColumns* dx_into) {
    const ConvInputs in(ctx, x, weight, offsets, *dx_into);
    ctx->saved_data["head_dim"] = head_dim;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["scale"] = scale;
    auto y = at::empty(in.x.sizes(), in.x.options().dtype(at::kFloat));
    check_launch(cuda::short_conv_silu_l2_forward(
                     dtype_of(in.x), in.x.data_ptr(), in.x.stride(1), in.w.data_ptr<float>(),
                     offsets_of(offsets), y.data_ptr<float>(), in.x.size(0), in.x.size(1),
                     in.x.size(2), static_cast<int>(in.w.size(1)), head_dim,
                     static_cast<float>(eps), static_cast<float>(scale), stream_of(in.x)),
                 "short_conv_silu_l2_forward");
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    ConvGrads g(ctx);
    auto dy = grads[0].to(at::kFloat).contiguous();
    check_launch(cuda::short_conv_silu_l2_backward(
                     dtype_of(g.x), g.x.data_ptr(), g.x.stride(1), g.w.data_ptr<float>(),
                     offsets_of(g.offsets), dy.data_ptr<float>(), g.dx.data_ptr(), g.dxs,
                     g.partial.data_ptr<float>(), g.dw.data_ptr<float>(), g.B, g.T, g.C, g.K,
                     ctx->saved_data["head_dim"].toInt(),
                     static_cast<float>(ctx->saved_data["eps"].toDouble()),
                     static_cast<float>(ctx->saved_data["scale"].toDouble()), stream_of(g.x)),
                 "short_conv_silu_l2_backward");
    return {g.dx, g.dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// offsets: undefined, or checked int32 [B, T] on x's device; as the
// functions take it (a 0-size stand-in for none).
at::Tensor offsets_arg(const at::Tensor& x, const at::Tensor& offsets) {
  if (!offsets.defined()) return at::empty({0}, x.options().dtype(at::kInt));
  VIADUCT_CHECK(offsets.scalar_type() == at::kInt && offsets.device() == x.device() &&
                    offsets.dim() == 2 && offsets.size(0) == x.size(0) &&
                    offsets.size(1) == x.size(1) && offsets.is_contiguous(),
                "fused short convolution: document offsets must be contiguous int32 [B, T] = [",
                x.size(0), ", ", x.size(1), "] on ", x.device(), ", got ", offsets.sizes(), " ",
                offsets.scalar_type(), " on ", offsets.device());
  return offsets;
}

}  // namespace

bool short_conv_silu_usable(const at::Tensor& x, const at::Tensor& weight) {
  return usable(x) && x.dim() == 3 && weight.dim() == 2 && weight.scalar_type() == at::kFloat &&
         weight.device() == x.device() && weight.size(0) == x.size(2) && weight.size(1) >= 1 &&
         weight.size(1) <= cuda::kShortConvMaxTaps &&
         cuda::short_conv_partials(x.size(0), x.size(1)) <= 65535;
}

at::Tensor short_conv_silu(const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& offsets) {
  RECORD_FUNCTION("viaduct::short_conv_silu", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(short_conv_silu_usable(x, weight),
                "fused short_conv_silu: x must be [B, T, C] on a CUDA device the kernels were "
                "built for and the weight fp32 [C, K] with K <= ",
                cuda::kShortConvMaxTaps, "; got x ", x.sizes(), ", weight ", weight.sizes());
  const auto dx_into = packed_grad_columns(x);
  return ShortConvSiluFn::apply(x, weight, offsets_arg(x, offsets), &dx_into);
}

bool short_conv_silu_l2_usable(const at::Tensor& x, const at::Tensor& weight, int64_t head_dim) {
  // The walks' bounds are short_conv_silu_usable's; a warp takes whole
  // heads of these widths.
  return short_conv_silu_usable(x, weight) &&
         (head_dim == 32 || head_dim == 64 || head_dim == 128) && x.size(2) % head_dim == 0;
}

at::Tensor short_conv_silu_l2(const at::Tensor& x, const at::Tensor& weight, int64_t head_dim,
                              double eps, double scale, const at::Tensor& offsets) {
  RECORD_FUNCTION("viaduct::short_conv_silu_l2", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(short_conv_silu_l2_usable(x, weight, head_dim),
                "fused short_conv_silu_l2: x must be [B, T, C] on a CUDA device the kernels were "
                "built for, C a multiple of a head width of 32, 64 or 128 (got ", head_dim,
                "), the weight fp32 [C, K] with K <= ", cuda::kShortConvMaxTaps, "; got x ",
                x.sizes(), ", weight ", weight.sizes());
  const auto dx_into = packed_grad_columns(x);
  return ShortConvSiluL2Fn::apply(x, weight, offsets_arg(x, offsets), head_dim, eps, scale,
                                  &dx_into);
}

}  // namespace viaduct::kernels
