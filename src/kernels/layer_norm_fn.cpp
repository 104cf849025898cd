// LayerNorm as an autograd function on viaduct's kernels (CUDA build).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/layer_norm.h"

namespace viaduct::kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// res2 defined: normalises h = x2 + res2, written to *h (same shape).
at::Tensor norm_forward(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& b,
                        double eps, at::Tensor& mean, at::Tensor& rstd,
                        const at::Tensor& res2 = at::Tensor(), at::Tensor* h = nullptr) {
  const auto rows = x2.size(0), D = x2.size(1);
  auto y = at::empty_like(x2);
  mean = at::empty({rows}, x2.options().dtype(at::kFloat));
  rstd = at::empty({rows}, x2.options().dtype(at::kFloat));
  if (res2.defined()) *h = at::empty_like(x2);
  check_launch(cuda::layer_norm_forward(dtype_of(x2), x2.data_ptr(),
                                        res2.defined() ? res2.data_ptr() : nullptr,
                                        w.data_ptr<float>(), b.data_ptr<float>(),
                                        res2.defined() ? h->data_ptr() : nullptr, y.data_ptr(),
                                        mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, D,
                                        static_cast<float>(eps), stream_of(x2)),
               "layer_norm_forward");
  return y;
}

// The norm's backward; dres2 defined: added to dx
// (see Note [Residual add inside the norm], kernels/rms_norm_fn.cpp).
// Returns dx, dw and db.
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward(
    const at::Tensor& dy2, const at::Tensor& x2, const at::Tensor& w, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& dres2) {
  const auto rows = x2.size(0), D = x2.size(1);
  auto dx = at::empty_like(x2);
  const auto parts = cuda::norm_backward_parts(rows);
  auto pw = at::empty({parts, D}, x2.options().dtype(at::kFloat));
  auto pb = at::empty({parts, D}, x2.options().dtype(at::kFloat));
  check_launch(cuda::layer_norm_backward(dtype_of(x2), dy2.data_ptr(), x2.data_ptr(),
                                         w.data_ptr<float>(), mean.data_ptr<float>(),
                                         rstd.data_ptr<float>(),
                                         dres2.defined() ? dres2.data_ptr() : nullptr,
                                         dx.data_ptr(), pw.data_ptr<float>(),
                                         pb.data_ptr<float>(), rows, D, stream_of(x2)),
               "layer_norm_backward");
  return {dx, pw.sum(0), pb.sum(0)};
}

class LayerNormFn : public torch::autograd::Function<LayerNormFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& b, double eps) {
    const auto D = x.size(-1);
    auto x2 = x.contiguous().view({-1, D});
    auto wc = w.contiguous(), bc = b.contiguous();
    at::Tensor mean, rstd;
    auto y = norm_forward(x2, wc, bc, eps, mean, rstd);
    ctx->save_for_backward({x2, wc, mean, rstd});
    return y.view(x.sizes());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x2 = saved[0], &wc = saved[1], &mean = saved[2], &rstd = saved[3];
    const auto rows = x2.size(0), D = x2.size(1);
    auto dy = grads[0].to(x2.scalar_type()).contiguous().view({rows, D});
    auto [dx, dw, db] = norm_backward(dy, x2, wc, mean, rstd, at::Tensor());
    return {dx.view(grads[0].sizes()), dw, db, at::Tensor()};
  }
};

// (h, layer_norm(h)) for h = x + res in one kernel each way: the bits of
// the add followed by the norm kernel
// (see Note [Residual add inside the norm], kernels/rms_norm_fn.cpp).
class AddLayerNormFn : public torch::autograd::Function<AddLayerNormFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& res,
                               const at::Tensor& w, const at::Tensor& b, double eps) {
    const auto D = x.size(-1);
    auto x2 = x.contiguous().view({-1, D});
    auto r2 = res.contiguous().view({-1, D});
    auto wc = w.contiguous(), bc = b.contiguous();
    at::Tensor mean, rstd, h2;
    auto y = norm_forward(x2, wc, bc, eps, mean, rstd, r2, &h2);
    ctx->save_for_backward({h2, wc, mean, rstd});
    return {h2.view(x.sizes()), y.view(x.sizes())};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &h2 = saved[0], &wc = saved[1], &mean = saved[2], &rstd = saved[3];
    const auto g = residual_norm_grads(grads, h2);
    auto [dx, dw, db] = norm_backward(g.dy, h2, wc, mean, rstd, g.dres);
    auto out = dx.view(g.sizes);
    return {out, out, dw, db, at::Tensor()};
  }
};

}  // namespace

bool layer_norm_usable(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  return usable(x) && weight.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat &&
         weight.dim() == 1 && bias.dim() == 1 && x.dim() >= 1 && weight.size(0) == x.size(-1) &&
         bias.size(0) == x.size(-1) && weight.device() == x.device() &&
         bias.device() == x.device();
}

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      double eps) {
  RECORD_FUNCTION("viaduct::layer_norm", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(layer_norm_usable(x, weight, bias),
                "fused layer_norm: x must be fp32 or bf16 [..., D] on a CUDA device the kernels "
                "were built for, weight and bias fp32 [D] on it; got x ", x.scalar_type(), " ",
                x.sizes(), ", weight ", weight.sizes(), ", bias ", bias.sizes());
  return LayerNormFn::apply(x, weight, bias, eps);
}

std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& res,
                                                 const at::Tensor& weight,
                                                 const at::Tensor& bias, double eps) {
  RECORD_FUNCTION("viaduct::add_layer_norm", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(layer_norm_usable(x, weight, bias) && x.sizes() == res.sizes() &&
                    x.scalar_type() == res.scalar_type() && res.device() == x.device(),
                "fused add_layer_norm: x and res must have one shape and type (fp32 or bf16 on "
                "a CUDA device the kernels were built for), weight and bias fp32 [D]; got x ",
                x.scalar_type(), " ", x.sizes(), ", res ", res.scalar_type(), " ", res.sizes());
  auto out = AddLayerNormFn::apply(x, res, weight, bias, eps);
  return {out[0], out[1]};
}

}  // namespace viaduct::kernels
