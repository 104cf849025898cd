// The MoE router's logits on viaduct's kernels (CUDA build), with their
// gradients; see Note [Router logits from bf16 tokens] (kernels/moe_router.cu).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/moe_router.h"

namespace viaduct::kernels {

namespace {

// Note [The router's backward sums x's gradient]
// The MoE layer's input x feeds three ops: the router, the routed experts'
// permutation and the shared expert. Autograd sums their three gradients
// of x with two standalone bf16 adds, each a pass over [N, D] that reads
// two tensors and writes one. Here the router's function also hands x on
// to the other consumers (its outputs after the logits are x itself,
// which autograd gives new views of), so its backward receives their
// gradients with its own and its dx kernel adds them as it writes: two
// more reads in a pass it makes anyway, where the adds made three reads
// and two writes. Its backward runs once every handle's gradient is in (a
// node runs when all of its outputs' gradients are). The sums keep the
// roundings of autograd's adds in the order its engine made them for this
// layer (the permutation's and the shared expert's gradients first, the
// router's last): a + b rounded to bf16, plus the router's term rounded,
// rounded again; the same bits.
class RouterFn : public torch::autograd::Function<RouterFn> {
 public:
  // Returns the logits, then `uses` handles of x for its other consumers.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& w,
                                                int64_t uses) {
    auto xc = x.contiguous();
    auto wc = w.contiguous();
    const int64_t N = xc.size(0), D = xc.size(1), E = wc.size(0);
    auto logits = at::empty({N, E}, xc.options().dtype(at::kFloat));
    check_launch(cuda::moe_router_forward(xc.data_ptr(), wc.data_ptr<float>(), N, D,
                                          static_cast<int>(E), logits.data_ptr<float>(),
                                          stream_of(xc)),
                 "moe_router_forward");
    ctx->save_for_backward({xc, wc});
    torch::autograd::variable_list out{logits};
    for (int64_t i = 0; i < uses; ++i) out.push_back(x);
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1];
    const int64_t N = x.size(0), D = x.size(1), E = w.size(0);
    auto dl = grads[0].to(at::kFloat).contiguous();
    // The other consumers' gradients (at most two: moe_router checks),
    // bf16 [N, D] (autograd hands zeros for a handle nothing used).
    std::vector<at::Tensor> adds;
    for (size_t i = 1; i < grads.size(); ++i) {
      adds.push_back(grads[i].to(x.scalar_type()).contiguous().view({N, D}));
    }
    auto dx = at::empty_like(x);
    auto part = at::empty({cuda::moe_router_backward_parts(N), E, D},
                          x.options().dtype(at::kFloat));
    check_launch(cuda::moe_router_backward(
                     dl.data_ptr<float>(), x.data_ptr(), w.data_ptr<float>(), N, D,
                     static_cast<int>(E), adds.size() > 0 ? adds[0].data_ptr() : nullptr,
                     adds.size() > 1 ? adds[1].data_ptr() : nullptr, dx.data_ptr(),
                     part.data_ptr<float>(), stream_of(x)),
                 "moe_router_backward");
    return {dx, part.sum(0), at::Tensor()};
  }
};

}  // namespace

bool moe_router_usable(const at::Tensor& x, const at::Tensor& w) {
  return usable(x) && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) > 0 &&
         x.size(1) % 8 == 0 && w.dim() == 2 && w.scalar_type() == at::kFloat &&
         w.device() == x.device() && w.size(1) == x.size(1) && w.size(0) >= 1 &&
         w.size(0) <= cuda::kMoeRouterMaxExperts;
}

std::vector<at::Tensor> moe_router(const at::Tensor& x, const at::Tensor& w, int64_t uses) {
  RECORD_FUNCTION("viaduct::moe_router", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(moe_router_usable(x, w),
                "fused moe_router: x must be bf16 [N, D] with D a multiple of 8 on a CUDA "
                "device the kernels were built for, w fp32 [E, D] on it with E <= ",
                cuda::kMoeRouterMaxExperts, "; got x ", x.scalar_type(), " ", x.sizes(), ", w ",
                w.scalar_type(), " ", w.sizes());
  VIADUCT_CHECK(uses >= 0 && uses <= 2,
                "fused moe_router: x's other consumers must be 0 to 2, got ", uses);
  // See Note [The router's backward sums x's gradient]: x's gradient only
  // where something wants it.
  if (!x.requires_grad() || !at::GradMode::is_enabled()) {
    auto out = RouterFn::apply(x, w, 0);
    for (int64_t i = 0; i < uses; ++i) out.push_back(x);
    return out;
  }
  return RouterFn::apply(x, w, uses);
}

}  // namespace viaduct::kernels
