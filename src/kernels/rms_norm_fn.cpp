// RMSNorm and the residual add with it as autograd functions (CUDA build).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/rms_norm.h"

namespace viaduct::kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// res2 defined: normalises h = x2 + res2, written to h (same shape).
at::Tensor norm_forward(const at::Tensor& x2, const at::Tensor& w, double eps, at::Tensor& rstd,
                        const at::Tensor& res2 = at::Tensor(), at::Tensor* h = nullptr) {
  auto y = at::empty_like(x2);
  rstd = at::empty({x2.size(0)}, x2.options().dtype(at::kFloat));
  if (res2.defined()) *h = at::empty_like(x2);
  check_launch(cuda::rms_norm_forward(dtype_of(x2), x2.data_ptr(),
                                      res2.defined() ? res2.data_ptr() : nullptr,
                                      w.data_ptr<float>(), res2.defined() ? h->data_ptr() : nullptr,
                                      y.data_ptr(), rstd.data_ptr<float>(), x2.size(0),
                                      x2.size(1), static_cast<float>(eps), stream_of(x2)),
               "rms_norm_forward");
  return y;
}

// The norm's backward; dres2 defined: added to dx (see Note [Residual add
// inside the norm]). Returns dx and dw.
std::pair<at::Tensor, at::Tensor> norm_backward(const at::Tensor& dy2, const at::Tensor& x2,
                                                const at::Tensor& w, const at::Tensor& rstd,
                                                const at::Tensor& dres2) {
  const auto rows = x2.size(0), D = x2.size(1);
  auto dx = at::empty_like(x2);
  auto partial = at::empty({cuda::norm_backward_parts(rows), D},
                           x2.options().dtype(at::kFloat));
  check_launch(cuda::rms_norm_backward(dtype_of(x2), dy2.data_ptr(), x2.data_ptr(),
                                       w.data_ptr<float>(), rstd.data_ptr<float>(),
                                       dres2.defined() ? dres2.data_ptr() : nullptr,
                                       dx.data_ptr(), partial.data_ptr<float>(), rows, D,
                                       stream_of(x2)),
               "rms_norm_backward");
  return {dx, partial.sum(0)};
}

class RMSNormFn : public torch::autograd::Function<RMSNormFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps) {
    const auto D = x.size(-1);
    auto x2 = x.contiguous().view({-1, D});
    auto wc = w.contiguous();  // the backward reads the same pointer
    at::Tensor rstd;
    auto y = norm_forward(x2, wc, eps, rstd);
    ctx->save_for_backward({x2, wc, rstd});
    return y.view(x.sizes());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x2 = saved[0], &w = saved[1], &rstd = saved[2];
    const auto rows = x2.size(0), D = x2.size(1);
    auto dy = grads[0].contiguous().view({rows, D}).to(x2.scalar_type());
    auto [dx, dw] = norm_backward(dy, x2, w, rstd, at::Tensor());
    return {dx.view(grads[0].sizes()), dw, at::Tensor()};
  }
};

// Note [Residual add inside the norm]
// A block's h = x + attn(...) is
// normalised for the FFN and also carried on the residual. As two ops, the
// forward wrote h and read it back for the norm, and the backward wrote
// the norm's dx, then autograd added the residual's gradient in another
// kernel (two reads and a write). Here one kernel adds and normalises
// (h written once), and the norm's backward adds the residual's gradient
// as it writes dx. Each sum is rounded to the activation type at the point
// where the two ops rounded it, so the bits are those of the two ops.
class AddRMSNormFn : public torch::autograd::Function<AddRMSNormFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& res,
                               const at::Tensor& w, double eps) {
    const auto D = x.size(-1);
    auto x2 = x.contiguous().view({-1, D});
    auto r2 = res.contiguous().view({-1, D});
    auto wc = w.contiguous();
    at::Tensor rstd, h2;
    auto y = norm_forward(x2, wc, eps, rstd, r2, &h2);
    ctx->save_for_backward({h2, wc, rstd});
    return {h2.view(x.sizes()), y.view(x.sizes())};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &h2 = saved[0], &w = saved[1], &rstd = saved[2];
    const auto g = residual_norm_grads(grads, h2);
    auto [dx, dw] = norm_backward(g.dy, h2, w, rstd, g.dres);
    auto out = dx.view(g.sizes);
    return {out, out, dw, at::Tensor()};
  }
};

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("viaduct::rms_norm", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                    weight.size(0) == x.size(-1),
                "fused rms_norm: weight must be fp32 [", x.size(-1), "], got ",
                weight.scalar_type(), " ", weight.sizes());
  return RMSNormFn::apply(x, weight, eps);
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& res,
                                               const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("viaduct::add_rms_norm", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(x.sizes() == res.sizes() && x.scalar_type() == res.scalar_type() &&
                    weight.dim() == 1 && weight.size(0) == x.size(-1) &&
                    weight.scalar_type() == at::kFloat,
                "fused add_rms_norm: x and res must have one shape and type, weight fp32 [D]");
  auto out = AddRMSNormFn::apply(x, res, weight, eps);
  return {out[0], out[1]};
}

}  // namespace viaduct::kernels
