// The MoE router's logits on viaduct's kernels (CUDA build), with their
// gradients; see Note [Router logits from bf16 tokens] (kernels/moe_router.cu).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/moe_router.h"

namespace viaduct::kernels {

namespace {

class RouterFn : public torch::autograd::Function<RouterFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w) {
    auto xc = x.contiguous();
    auto wc = w.contiguous();
    const int64_t N = xc.size(0), D = xc.size(1), E = wc.size(0);
    auto logits = at::empty({N, E}, xc.options().dtype(at::kFloat));
    check_launch(cuda::moe_router_forward(xc.data_ptr(), wc.data_ptr<float>(), N, D,
                                          static_cast<int>(E), logits.data_ptr<float>(),
                                          stream_of(xc)),
                 "moe_router_forward");
    ctx->save_for_backward({xc, wc});
    return logits;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1];
    const int64_t N = x.size(0), D = x.size(1), E = w.size(0);
    auto dl = grads[0].to(at::kFloat).contiguous();
    auto dx = at::empty_like(x);
    auto part = at::empty({cuda::moe_router_backward_parts(N), E, D},
                          x.options().dtype(at::kFloat));
    check_launch(cuda::moe_router_backward(dl.data_ptr<float>(), x.data_ptr(),
                                           w.data_ptr<float>(), N, D, static_cast<int>(E),
                                           dx.data_ptr(), part.data_ptr<float>(), stream_of(x)),
                 "moe_router_backward");
    return {dx, part.sum(0)};
  }
};

}  // namespace

bool moe_router_usable(const at::Tensor& x, const at::Tensor& w) {
  return usable(x) && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) > 0 &&
         x.size(1) % 8 == 0 && w.dim() == 2 && w.scalar_type() == at::kFloat &&
         w.device() == x.device() && w.size(1) == x.size(1) && w.size(0) >= 1 &&
         w.size(0) <= cuda::kMoeRouterMaxExperts;
}

at::Tensor moe_router(const at::Tensor& x, const at::Tensor& w) {
  RECORD_FUNCTION("viaduct::moe_router", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(moe_router_usable(x, w),
                "fused moe_router: x must be bf16 [N, D] with D a multiple of 8 on a CUDA "
                "device the kernels were built for, w fp32 [E, D] on it with E <= ",
                cuda::kMoeRouterMaxExperts, "; got x ", x.scalar_type(), " ", x.sizes(), ", w ",
                w.scalar_type(), " ", w.sizes());
  return RouterFn::apply(x, w);
}

}  // namespace viaduct::kernels
