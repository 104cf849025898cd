#include "ops/moe.h"

#include "core/check.h"
#include "core/torch_compat.h"
#include "kernels/fused.h"
#include "kernels/weight_cache.h"
#include "ops/recompute.h"

namespace viaduct::ops {

namespace {

// y = x_g @ w_e^T for each group g of rows of x and its expert e: x [M, K]
// in the compute dtype, w [E, N, K] an fp32 master (see Note [Low-precision
// weight cache]). The weight gradient dw_e = dy_g^T x_g comes out of one
// grouped GEMM in fp32.
class GroupedLinearFn : public torch::autograd::Function<GroupedLinearFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const at::Tensor& offs) {
    auto wc = kernels::weight_cache::get({w}, x.scalar_type());
    ctx->save_for_backward({x, wc, offs});
    // See Note [Per-op activation checkpointing]: a replay skips the GEMM.
    return run_saved_op([&] { return compat::grouped_mm(x, wc.transpose(1, 2), offs); });
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &wc = saved[1], &offs = saved[2];
    auto dy = grads[0].to(x.scalar_type()).contiguous();
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = compat::grouped_mm(dy, wc, offs);
    if (ctx->needs_input_grad(1)) dw = compat::grouped_mm_fp32(dy.t(), x, offs);
    return {dx, dw, at::Tensor()};
  }
};

// Rows of src at pos, where pos names no row twice (a permutation into a
// buffer): the backward writes each gradient row into its place with
// index_copy. index_select's own backward adds into zeros (atomics, or a
// sort under deterministic algorithms) to allow repeated rows.
class GatherDistinctRowsFn : public torch::autograd::Function<GatherDistinctRowsFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& src,
                            const at::Tensor& pos) {
    ctx->save_for_backward({pos});
    ctx->saved_data["rows"] = src.size(0);
    return src.index_select(0, pos);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto pos = ctx->get_saved_variables()[0];
    auto g = grads[0].contiguous();
    auto sizes = g.sizes().vec();
    sizes[0] = ctx->saved_data["rows"].toInt();
    return {at::zeros(sizes, g.options()).index_copy_(0, pos, g), at::Tensor()};
  }
};

}  // namespace

at::Tensor gather_distinct_rows(const at::Tensor& src, const at::Tensor& pos) {
  return GatherDistinctRowsFn::apply(src, pos);
}

bool grouped_experts_run(const at::Tensor& x, int64_t hidden, const KernelOptions& k) {
  return compat::kGroupedMm && fused_runs(x, k) && x.scalar_type() == at::kBFloat16 &&
         x.size(-1) % 8 == 0 && hidden % 8 == 0;
}

ExpertDispatch dispatch_experts(const at::Tensor& idx, int64_t n_experts,
                                const KernelOptions& opts) {
  torch::NoGradGuard no_grad;
  const int64_t A = kExpertAlign;
  auto flat = idx.reshape({-1});
  const int64_t S = flat.size(0);
  ExpertDispatch d;
  d.rows = S + A * n_experts;
  if (opts.fused && kernels::moe_dispatch_usable(flat, n_experts)) {
    // Two kernels (a count pass, a placement pass) instead of the chain
    // below: the same rows.
    std::tie(d.pos, d.offs, d.counts) = kernels::moe_dispatch(flat, n_experts, A);
    return d;
  }
  auto order = std::get<1>(at::sort(flat, /*stable=*/true, 0, false));
  auto expert = flat.index_select(0, order);  // the slots' experts, sorted
  d.counts = at::bincount(flat, {}, n_experts);
  auto padded = (at::floor_divide(d.counts + (A - 1), A) * A).clamp_min(A);
  auto end = padded.cumsum(0);
  auto start = end - padded;
  auto first = d.counts.cumsum(0) - d.counts;  // each expert's first sorted slot
  auto pos_sorted = start.index_select(0, expert) + at::arange(S, flat.options()) -
                    first.index_select(0, expert);
  d.pos = at::empty_like(pos_sorted).index_copy_(0, order, pos_sorted);
  d.offs = end.to(at::kInt);
  return d;
}

at::Tensor top_experts(const at::Tensor& scores, const at::Tensor& bias, int64_t k,
                       const KernelOptions& opts) {
  torch::NoGradGuard no_grad;
  if (fused_runs(scores, opts) && kernels::moe_topk_usable(scores, k)) {
    return kernels::moe_topk(scores, bias, k);
  }
  auto sums = scores.detach() + bias.to(scores.scalar_type());
  return std::get<1>(at::sort(sums, /*stable=*/true, -1, /*descending=*/true))
      .narrow(-1, 0, k)
      .contiguous();
}

at::Tensor grouped_swiglu_experts(const at::Tensor& xs, const at::Tensor& offs,
                                  const at::Tensor& w1, const at::Tensor& w2,
                                  const at::Tensor& w3) {
  RECORD_FUNCTION("viaduct::grouped_experts", std::vector<c10::IValue>());  // named in profiles
  auto h1 = GroupedLinearFn::apply(xs, w1, offs);
  auto h3 = GroupedLinearFn::apply(xs, w3, offs);
  return GroupedLinearFn::apply(kernels::swiglu(h1, h3), w2, offs);
}

}  // namespace viaduct::ops
