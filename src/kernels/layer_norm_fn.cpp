// LayerNorm as an autograd function on viaduct's kernels (CUDA build).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/layer_norm.h"

namespace viaduct::kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class LayerNormFn : public torch::autograd::Function<LayerNormFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& b, double eps) {
    const auto D = x.size(-1);
    auto x2 = x.contiguous().view({-1, D});
    auto wc = w.contiguous(), bc = b.contiguous();
    const auto rows = x2.size(0);
    auto y = at::empty_like(x2);
    auto mean = at::empty({rows}, x2.options().dtype(at::kFloat));
    auto rstd = at::empty({rows}, x2.options().dtype(at::kFloat));
    check_launch(cuda::layer_norm_forward(dtype_of(x2), x2.data_ptr(), wc.data_ptr<float>(),
                                          bc.data_ptr<float>(), y.data_ptr(),
                                          mean.data_ptr<float>(), rstd.data_ptr<float>(), rows,
                                          D, static_cast<float>(eps), stream_of(x2)),
                 "layer_norm_forward");
    ctx->save_for_backward({x2, wc, mean, rstd});
    return y.view(x.sizes());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x2 = saved[0], &wc = saved[1], &mean = saved[2], &rstd = saved[3];
    const auto rows = x2.size(0), D = x2.size(1);
    auto dy = grads[0].to(x2.scalar_type()).contiguous().view({rows, D});
    auto dx = at::empty_like(x2);
    const auto parts = cuda::norm_backward_parts(rows);
    auto pw = at::empty({parts, D}, x2.options().dtype(at::kFloat));
    auto pb = at::empty({parts, D}, x2.options().dtype(at::kFloat));
    check_launch(cuda::layer_norm_backward(dtype_of(x2), dy.data_ptr(), x2.data_ptr(),
                                           wc.data_ptr<float>(), mean.data_ptr<float>(),
                                           rstd.data_ptr<float>(), dx.data_ptr(),
                                           pw.data_ptr<float>(), pb.data_ptr<float>(), rows, D,
                                           stream_of(x2)),
                 "layer_norm_backward");
    return {dx.view(grads[0].sizes()), pw.sum(0), pb.sum(0), at::Tensor()};
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

}  // namespace viaduct::kernels
