// Row L2 normalisation as an autograd function (CUDA build).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/l2_norm.h"

namespace viaduct::kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class L2NormFn : public torch::autograd::Function<L2NormFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double eps, double scale) {
    auto xc = x.contiguous();
    ctx->save_for_backward({xc});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["scale"] = scale;
    auto y = at::empty(xc.sizes(), xc.options().dtype(at::kFloat));
    const auto d = xc.size(-1);
    check_launch(cuda::l2_norm_forward(dtype_of(xc), xc.data_ptr(), y.data_ptr<float>(),
                                       xc.numel() / d, d, static_cast<float>(eps),
                                       static_cast<float>(scale), stream_of(xc)),
                 "l2_norm_forward");
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto x = ctx->get_saved_variables()[0];
    auto dy = grads[0].to(at::kFloat).contiguous();
    auto dx = at::empty_like(x);
    const auto d = x.size(-1);
    check_launch(cuda::l2_norm_backward(dtype_of(x), x.data_ptr(), dy.data_ptr<float>(),
                                        dx.data_ptr(), x.numel() / d, d,
                                        static_cast<float>(ctx->saved_data["eps"].toDouble()),
                                        static_cast<float>(ctx->saved_data["scale"].toDouble()),
                                        stream_of(x)),
                 "l2_norm_backward");
    return {dx, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor l2_normalize(const at::Tensor& x, double eps, double scale) {
  RECORD_FUNCTION("viaduct::l2_normalize", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(usable(x) && x.dim() >= 1 && x.size(-1) > 0,
                "fused l2_normalize: x must be fp32 or bf16 [..., d] on a CUDA device the "
                "kernels were built for");
  return L2NormFn::apply(x, eps, scale);
}

}  // namespace viaduct::kernels
