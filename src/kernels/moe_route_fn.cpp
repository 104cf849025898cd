// MoE routing on viaduct's kernels (CUDA build): the top-k choice and the
// dispatch into padded expert groups. Neither carries a gradient (the
// choice is a selection; the routing weights' gradient flows through the
// caller's gather of the chosen scores).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/moe_route.h"

namespace viaduct::kernels {

namespace {
// The count pass keeps 32 counters per expert in shared memory (128 KiB
// at this bound).
constexpr int64_t kMaxDispatchExperts = 1024;
}  // namespace

bool moe_topk_usable(const at::Tensor& scores, int64_t k) {
  return usable(scores) && scores.scalar_type() == at::kFloat && scores.dim() == 2 &&
         scores.size(1) <= cuda::kMoeTopkMaxExperts && k >= 1 && k <= scores.size(1);
}

at::Tensor moe_topk(const at::Tensor& scores, const at::Tensor& bias, int64_t k) {
  RECORD_FUNCTION("viaduct::moe_topk", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(moe_topk_usable(scores, k) && bias.dim() == 1 && bias.size(0) == scores.size(1),
                "fused moe_topk: scores must be fp32 [N, E] on a CUDA device the kernels were "
                "built for, E <= ", cuda::kMoeTopkMaxExperts, ", 1 <= k <= E and bias [E]; got "
                "scores ", scores.sizes(), ", bias ", bias.sizes(), ", k ", k);
  torch::NoGradGuard no_grad;
  auto s = scores.detach().contiguous();
  auto b = bias.detach().to(s.options()).contiguous();
  auto idx = at::empty({s.size(0), k}, s.options().dtype(at::kLong));
  check_launch(cuda::moe_topk(s.data_ptr<float>(), b.data_ptr<float>(), s.size(0),
                              static_cast<int>(s.size(1)), static_cast<int>(k),
                              idx.data_ptr<int64_t>(), stream_of(s)),
               "moe_topk");
  return idx;
}

bool moe_dispatch_usable(const at::Tensor& expert, int64_t n_experts) {
  return expert.defined() && expert.is_cuda() && expert.scalar_type() == at::kLong &&
         n_experts >= 1 && n_experts <= kMaxDispatchExperts &&
         cuda::device_supported(expert.device().index());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_dispatch(
    const at::Tensor& expert, int64_t n_experts, int64_t align) {
  RECORD_FUNCTION("viaduct::moe_dispatch", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(moe_dispatch_usable(expert, n_experts) && align >= 1,
                "fused moe_dispatch: expert ids must be int64 on a CUDA device the kernels were "
                "built for, 1 <= n_experts <= ", kMaxDispatchExperts, " and align >= 1; got ",
                expert.scalar_type(), " on ", expert.device(), ", n_experts ", n_experts,
                ", align ", align);
  torch::NoGradGuard no_grad;
  auto e = expert.reshape({-1}).contiguous();
  const int64_t S = e.size(0);
  const int64_t blocks = std::max<int64_t>(1, (S + cuda::kMoeDispatchBlock - 1) /
                                                  cuda::kMoeDispatchBlock);
  auto i32 = e.options().dtype(at::kInt);
  auto rank = at::empty({S}, i32), hist = at::empty({blocks, n_experts}, i32);
  auto counts = at::empty({n_experts}, e.options()), pos = at::empty({S}, e.options());
  auto offs = at::empty({n_experts}, i32);
  auto row_slot = at::empty({cuda::moe_dispatch_rows(S, n_experts, align)}, e.options());
  check_launch(cuda::moe_dispatch(e.data_ptr<int64_t>(), S, static_cast<int>(n_experts),
                                  static_cast<int>(align), rank.data_ptr<int32_t>(),
                                  hist.data_ptr<int32_t>(), counts.data_ptr<int64_t>(),
                                  offs.data_ptr<int32_t>(), pos.data_ptr<int64_t>(),
                                  row_slot.data_ptr<int64_t>(), stream_of(e)),
               "moe_dispatch");
  return {pos, offs, counts, row_slot};
}

}  // namespace viaduct::kernels
