#include "ops/moe.h"

#include "core/check.h"
#include "core/torch_compat.h"
#include "kernels/fused.h"
#include "kernels/weight_cache.h"
#include "ops/linear.h"
#include "ops/recompute.h"

namespace viaduct::ops {

namespace {

// y = x_g @ w_e^T for each group g of rows of x and its expert e: x [M, K]
// in the compute dtype, w [E, N, K] an fp32 master cast through the
// options' weight cache (see Note [Low-precision weight cache],
// kernels/weight_cache.h). With `beside` ([E, N2, K], or a 0-size stand-in
// for none: custom functions take no undefined inputs on LibTorch 2.x), one
// GEMM over w and beside side by side gives [M, N + N2] (see Note [One
// gate-up GEMM for the experts]). Each weight's gradient dw_e = dy_g^T x_g
// over its columns of dy comes out of one grouped GEMM, in fp32 where the
// build writes it (ops::Capabilities).
class GroupedLinearFn : public torch::autograd::Function<GroupedLinearFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const at::Tensor& beside, const at::Tensor& offs,
                            const KernelOptions* k) {
    const auto parts = beside.numel() > 0 ? std::vector<at::Tensor>{w, beside}
                                          : std::vector<at::Tensor>{w};
    auto wc = kernels::cast_weights(k->weight_cache.get(), parts, x.scalar_type(), 1);
    ctx->save_for_backward({x, wc, offs});
    ctx->saved_data["fp32_out"] = k->capabilities.grouped_fp32_out_gemm;
    ctx->saved_data["n"] = w.size(1);
    // See Note [Per-op activation checkpointing]: a replay skips the GEMM.
    return run_saved_op([&] { return compat::grouped_mm(x, wc.transpose(1, 2), offs); });
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &wc = saved[1], &offs = saved[2];
    const int64_t n = ctx->saved_data["n"].toInt();
    const bool fp32_out = ctx->saved_data["fp32_out"].toBool();
    auto dy = grads[0].to(x.scalar_type()).contiguous();  // [M, N + N2]
    at::Tensor dx, dw, dbeside;
    if (ctx->needs_input_grad(0)) dx = compat::grouped_mm(dy, wc, offs);
    if (!fp32_out && ctx->needs_input_grad(1) && ctx->needs_input_grad(2)) {
      // See Note [One gate-up GEMM for the experts]: both weights' gradients
      // from one grouped GEMM, each half cast to its own fp32 tensor.
      const auto both = compat::grouped_mm(dy.t(), x, offs);  // [E, N + N2, K]
      // Each half widened into its own fp32 tensor by the row copy, in
      // 16-byte words: ATen's cast of a strided half goes one element a
      // thread through an offset calculator.
      const auto fp32 = [&](int64_t from, int64_t rows) {
        auto out = at::empty({both.size(0), rows, both.size(2)}, both.options().dtype(at::kFloat));
        kernels::copy_rows_into(out, both.narrow(1, from, rows));
        return out;
      };
      return {dx, fp32(0, n), fp32(n, both.size(1) - n), at::Tensor(), at::Tensor()};
    }
    if (ctx->needs_input_grad(1)) {
      dw = compat::grouped_mm_fp32(dy.narrow(1, 0, n).t(), x, offs, fp32_out);
    }
    if (ctx->needs_input_grad(2)) {
      dbeside = compat::grouped_mm_fp32(dy.narrow(1, n, dy.size(1) - n).t(), x, offs, fp32_out);
    }
    return {dx, dw, dbeside, at::Tensor(), at::Tensor()};
  }
};

// Note [One gate-up GEMM for the experts]
// The experts' w1 and w3 ([E, H, D] each) both project the same rows, so
// they run as one grouped GEMM over the two side by side: the weight
// cache's copy of the pair concatenated along dim 1 ([E, 2H, D], one
// [2H, D] matrix an expert), giving [rows, 2H] whose halves the SwiGLU
// kernel reads in place: one GEMM twice as wide fills the GPU better than
// two narrow ones (bench/kernels/grouped_gemm_shapes.py times the two
// forms), with the same bits. Backward: the rows' gradient is one GEMM over
// K = 2H (one fp32 sum where the two GEMMs rounded two parts to bf16 and
// added them). The weights' gradients: where the grouped GEMM writes only
// bf16 (the build's answer, ops::Capabilities), one GEMM gives both as
// [E, 2H, D] and each half is cast to its own contiguous fp32 tensor, as
// the optimizer keeps them: the cast every bf16 product needs anyway, now
// reading a strided half (kernels::copy_rows_into, which widens), and one
// GEMM twice as tall instead of two. The bits are the two GEMMs' (each
// output element is the same sum over the group's rows). Where it writes fp32, each weight's gradient is its own
// GEMM on its half of the [rows, 2H] gradient (a strided operand), so that
// each comes out contiguous without a copy. The optimizer writes each
// weight's rows of the copy expert by expert (ops/adamw.cpp).

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

// Note [The chosen scores' gradient without an index op]
// gather's backward adds the gradient into zeros at idx: scatter_add,
// which ATen runs as a sort and an indexed accumulation under
// deterministic algorithms (about thirty launches a call on a GPU). The
// columns a row chooses are distinct, so each score's gradient is the one
// chosen entry's or none: the sum over j of where(idx[n, j] == e, g[n, j],
// 0) is that entry exactly (a sum of it and zeros), the bits of adding it
// into zeros, in elementwise ops that are deterministic as they stand.
class GatherChosenFn : public torch::autograd::Function<GatherChosenFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& scores,
                            const at::Tensor& idx) {
    ctx->save_for_backward({idx});
    ctx->saved_data["columns"] = scores.size(-1);
    return scores.gather(-1, idx);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto idx = ctx->get_saved_variables()[0];
    const auto& g = grads[0];  // [N, K]
    const auto columns = at::arange(ctx->saved_data["columns"].toInt(), idx.options());
    const auto chosen = idx.unsqueeze(-1) == columns;  // [N, K, E]
    return {at::where(chosen, g.unsqueeze(-1), 0.0).sum(-2),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor gather_distinct_rows(const at::Tensor& src, const at::Tensor& pos) {
  return GatherDistinctRowsFn::apply(src, pos);
}

at::Tensor gather_chosen(const at::Tensor& scores, const at::Tensor& idx) {
  VIADUCT_ASSERT(scores.dim() == 2 && idx.dim() == 2 && idx.size(0) == scores.size(0),
                 "gather_chosen: scores ", scores.sizes(), " and idx ", idx.sizes());
  return GatherChosenFn::apply(scores, idx);
}

RouterLogits router_logits(const at::Tensor& x, const at::Tensor& w, const KernelOptions& k,
                           int64_t uses) {
  RouterLogits r;
  if (fused_runs(x, k) && kernels::moe_router_usable(x, w)) {
    auto out = kernels::moe_router(x, w, uses);
    r.logits = out[0];
    r.x.assign(out.begin() + 1, out.end());
    return r;
  }
  const auto st = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  r.logits = linear(x.to(st), w, at::Tensor(), k);
  r.x.assign(static_cast<size_t>(uses), x);
  return r;
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
    std::tie(d.pos, d.offs, d.counts, d.row_slot) = kernels::moe_dispatch(flat, n_experts, A);
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
                                  const ExpertWeights& w, const KernelOptions& k) {
  RECORD_FUNCTION("viaduct::grouped_experts", std::vector<c10::IValue>());  // named in profiles
  // See Note [One gate-up GEMM for the experts].
  auto h13 = GroupedLinearFn::apply(xs, w.w1, w.w3, offs, &k);
  return GroupedLinearFn::apply(kernels::swiglu_packed(h13), w.w2,
                                at::empty({0}, w.w2.options()), offs, &k);
}

ExpertOrder expert_order(const at::Tensor& flat, const at::Tensor& keep, int64_t n_experts) {
  torch::NoGradGuard g;
  ExpertOrder eo;
  eo.order = std::get<1>(at::sort(flat, /*stable=*/true, 0, false));
  eo.routed = at::bincount(flat, {}, n_experts).to(at::kCPU).contiguous();
  eo.counts = eo.routed;
  if (keep.defined()) {
    eo.order = eo.order.masked_select(keep.index_select(0, eo.order));
    eo.counts = at::bincount(flat.masked_select(keep), {}, n_experts).to(at::kCPU).contiguous();
  }
  return eo;
}

at::Tensor to_slot_order(const at::Tensor& rows, const at::Tensor& order, int64_t slots,
                         bool dropped) {
  if (!dropped) return rows.index_select(0, at::argsort(order));
  auto shape = rows.sizes().vec();
  shape[0] = slots;
  return at::zeros(shape, rows.options()).index_copy(0, order, rows);
}

at::Tensor combine_experts(const at::Tensor& y, const at::Tensor& gates) {
  return (y * gates.to(y.scalar_type()).unsqueeze(-1)).sum(1);
}

namespace {

// One expert's SwiGLU w2(silu(w1 x) * w3 x) on its rows x as three linears.
at::Tensor expert_chain(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                        const at::Tensor& w3, const KernelOptions& k) {
  const at::Tensor none;  // no bias
  return linear(at::silu(linear(x, w1, none, k)) * linear(x, w3, none, k), w2, none, k);
}

}  // namespace

MoeExperts moe_experts(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& gates,
                       const at::Tensor& keep, const ExpertWeights& w, const KernelOptions& k,
                       const std::function<at::Tensor()>& add) {
  const auto D = x.size(-1), N = idx.size(0), K = idx.size(1);
  const auto E = w.w1.size(0), hidden = w.w1.size(1);
  MoeExperts r;
  if (grouped_experts_run(x, hidden, k) && kernels::moe_permute_usable(x)) {
    // Grouped GEMMs over padded expert groups (see Note [MoE dispatch into
    // padded groups]): no host sync. Dropped copies run and their gating
    // weights are zero. The rows go in and come back in one pass each:
    // see Note [MoE rows moved in one pass] (kernels/moe_permute.cu).
    auto d = dispatch_experts(idx, E, k);
    r.routed = d.counts;
    // The dispatch kernels write pos's inverse as they place the slots: an
    // index_copy_ would take ATen's sorting path under deterministic
    // algorithms (the rows are distinct, so it needs none).
    at::Tensor row_slot = d.row_slot;
    if (!row_slot.defined()) {
      torch::NoGradGuard no_grad;
      row_slot = at::full({d.rows}, -1, d.pos.options())
                     .index_copy_(0, d.pos, at::arange(N * K, d.pos.options()));
    }
    auto xs = kernels::moe_permute(x, d.pos, row_slot, K);
    auto ys = grouped_swiglu_experts(xs, d.offs, w, k);
    auto g = keep.defined() ? gates * keep.view({N, K}).to(gates.scalar_type()) : gates;
    const auto a = add ? add() : at::Tensor();
    const bool add_in = a.defined() && a.scalar_type() == ys.scalar_type();
    r.out = kernels::moe_combine(ys, g, d.pos, row_slot, add_in ? a : at::Tensor());
    if (a.defined() && !add_in) r.out = r.out + a;
    return r;
  }
  // Every slot's row (slot n K + j is token n's j-th choice), as copies of
  // the tokens; their gradients are summed back over the K copies.
  const auto slots = x.unsqueeze(1).expand({N, K, D}).reshape({N * K, D});
  // Note [MoE dispatch without per-expert gradient fills]
  // The experts run one at a time, each on its own rows. Taken as `w1[e]` and
  // `x.index_select(0, rows_e)`, every expert's slice has a backward that
  // fills a zero tensor of the whole weight ([E, H, D]) or the whole input
  // ([N, D]) around its part, which the engine then adds up: E full-size
  // fills and adds per tensor, quadratic in the expert count for the
  // weights (E = 128 in the full flavor: 128 x 1 GiB a weight a layer).
  // Here the weights are unbound once (one node whose backward stacks the E
  // gradients) and the slots are gathered once in expert order and split
  // (one node whose backward concatenates). The gather is a permutation of
  // the slots, so its backward adds into no row twice, and the sum over a
  // token's k copies is a reduction: no scatter-add anywhere,
  // deterministic. The forward's values and the weights' gradients are the
  // same bits as the per-expert slices'; x's gradient sums the same terms
  // in another order (test Moe.DispatchHasThePerExpertFormsBits).
  const auto eo = expert_order(idx.reshape({-1}), keep, E);
  r.routed = eo.routed;
  const auto* cnt = eo.counts.data_ptr<int64_t>();
  auto rows = slots.index_select(0, eo.order).split_with_sizes(
      std::vector<int64_t>(cnt, cnt + E), 0);
  const auto w1s = w.w1.unbind(0), w2s = w.w2.unbind(0), w3s = w.w3.unbind(0);
  std::vector<at::Tensor> outs;
  for (size_t e = 0; e < rows.size(); ++e) {
    const auto& x = rows[e];
    if (x.size(0) == 0) continue;
    outs.push_back(expert_chain(x, w1s[e], w2s[e], w3s[e], k));
  }
  // Expert outputs in expert order, then back to (token, slot) order.
  auto sorted_out = at::cat(outs, 0);  // [kept, D]
  auto y = to_slot_order(sorted_out, eo.order, N * K, keep.defined()).view({N, K, D});
  r.out = combine_experts(y, gates);
  if (add) r.out = r.out + add();
  return r;
}

at::Tensor moe_local_experts(const at::Tensor& rows, const std::vector<int64_t>& pieces,
                             int64_t n_sources, int64_t hidden, bool per_source,
                             const std::function<ExpertWeights(int64_t source)>& weights,
                             const KernelOptions& k) {
  const int64_t P = n_sources, El = static_cast<int64_t>(pieces.size()) / P;
  VIADUCT_ASSERT(El * P == static_cast<int64_t>(pieces.size()), "expert parallelism: ",
                 pieces.size(), " row counts for ", P, " source ranks");
  if (!per_source && grouped_experts_run(rows, hidden, k)) {
    // One gradient for every source: the local experts as grouped GEMMs
    // over the received rows, each row's group its local expert.
    std::vector<int64_t> expert_of;
    expert_of.reserve(static_cast<size_t>(rows.size(0)));
    for (int64_t s = 0; s < P; ++s) {
      for (int64_t e = 0; e < El; ++e) {
        const auto rows_se = pieces[static_cast<size_t>(s * El + e)];
        expert_of.insert(expert_of.end(), static_cast<size_t>(rows_se), e);
      }
    }
    const auto ids = at::tensor(expert_of, at::TensorOptions(at::kLong))
                         .to(rows.device())
                         .view({-1, 1});
    auto d = dispatch_experts(ids, El, k);
    auto xs = at::zeros({d.rows, rows.size(1)}, rows.options()).index_copy(0, d.pos, rows);
    auto ys = grouped_swiglu_experts(xs, d.offs, weights(0), k);
    return gather_distinct_rows(ys, d.pos);
  }
  // A GEMM chain per (source, expert): each source's gradient its own when
  // kept per source (see Note [Expert parallelism], model/moe.h).
  auto groups = rows.split_with_sizes(pieces, 0);
  std::vector<at::Tensor> outs;
  for (int64_t s = 0; s < P; ++s) {
    bool any = false;
    for (int64_t e = 0; e < El; ++e) any = any || pieces[static_cast<size_t>(s * El + e)] > 0;
    if (!any) continue;
    const auto w = weights(s);
    const auto w1s = w.w1.unbind(0), w2s = w.w2.unbind(0), w3s = w.w3.unbind(0);
    for (int64_t e = 0; e < El; ++e) {
      const auto& x = groups[static_cast<size_t>(s * El + e)];
      if (x.size(0) == 0) continue;
      outs.push_back(expert_chain(x, w1s[static_cast<size_t>(e)], w2s[static_cast<size_t>(e)],
                                  w3s[static_cast<size_t>(e)], k));
    }
  }
  // No rows here: an empty slice of the received rows keeps the return
  // exchange's backward linked to the first one's, as on the other ranks.
  return outs.empty() ? rows.narrow(0, 0, 0) : at::cat(outs, 0);
}

}  // namespace viaduct::ops
