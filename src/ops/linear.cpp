#include "ops/linear.h"

#include "core/torch_compat.h"
#include "kernels/fused.h"
#include "ops/recompute.h"
#include "kernels/weight_cache.h"

namespace viaduct::ops {

namespace {

// Note [Linear with an fp32 weight gradient]
// On the fused-kernel path a
// linear whose fp32 master weight is used in the bf16 input's dtype computes
// its weight gradient with one GEMM writing fp32 (compat::matmul_into_fp32_)
// instead of a bf16 product cast up by autograd's ToCopyBackward: one pass
// less over every weight gradient, and no bf16 rounding of it. The weight
// may come in parts (q, k and v: one GEMM, see Note [One qkv projection]); the
// bf16 weight is their concatenation from the weight cache (Note
// [Low-precision weight cache]), kept for the backward as at::linear keeps
// its cast weight, and the fp32 gradient is split back into the parts.
struct MixedLinear {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            at::TensorList w, const at::Tensor& b) {
    auto wc = kernels::weight_cache::get(w, x.scalar_type());
    ctx->save_for_backward({x, wc});
    std::vector<int64_t> rows;
    for (const auto& p : w) rows.push_back(p.size(0));
    ctx->saved_data["rows"] = rows;
    // See Note [Per-op activation checkpointing]: the GEMM alone is skipped in
    // a replay; the node and what it saves are the same.
    if (!b.defined()) return run_saved_op([&] { return at::linear(x, wc); });
    ctx->saved_data["b_dtype"] = static_cast<int64_t>(b.scalar_type());
    return run_saved_op([&] { return at::linear(x, wc, b.to(x.scalar_type())); });
  }
  // {dx, dw per part..., db}; db only when `bias_slot`.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 const torch::autograd::variable_list& grads,
                                                 bool bias_slot) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &wc = saved[1];
    const auto rows = ctx->saved_data["rows"].toIntVector();
    const auto n = rows.size();
    const auto out_f = wc.size(0), in_f = wc.size(1);
    auto dy = grads[0].to(x.scalar_type()).reshape({-1, out_f});
    torch::autograd::variable_list out(1 + n + (bias_slot ? 1 : 0));
    if (ctx->needs_input_grad(0)) out[0] = at::mm(dy, wc).view(x.sizes());
    bool any_w = false;
    for (size_t i = 0; i < n; ++i) any_w = any_w || ctx->needs_input_grad(1 + i);
    if (any_w) {
      auto dw = at::empty({out_f, in_f}, dy.options().dtype(at::kFloat));
      compat::matmul_into_fp32_(dw, dy.t(), x.reshape({-1, in_f}), /*accumulate=*/false);
      int64_t row = 0;
      for (size_t i = 0; i < n; ++i) {
        // Rows of a contiguous tensor: contiguous views, no copies.
        if (ctx->needs_input_grad(1 + i)) out[1 + i] = n == 1 ? dw : dw.narrow(0, row, rows[i]);
        row += rows[i];
      }
    }
    if (bias_slot && ctx->needs_input_grad(1 + n)) {
      out[1 + n] = dy.sum(0, false, at::kFloat)
                       .to(static_cast<at::ScalarType>(ctx->saved_data["b_dtype"].toInt()));
    }
    return out;
  }
};

// Custom functions cannot take an undefined tensor as an input on LibTorch
// 2.x (their input metadata reads its device), so a linear without a bias is
// its own function rather than MixedLinearFn with an empty bias.
class MixedLinearFn : public torch::autograd::Function<MixedLinearFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            at::TensorList w, const at::Tensor& b) {
    return MixedLinear::forward(ctx, x, w, b);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return MixedLinear::backward(ctx, grads, /*bias_slot=*/true);
  }
};

class MixedLinearNoBiasFn : public torch::autograd::Function<MixedLinearNoBiasFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            at::TensorList w) {
    return MixedLinear::forward(ctx, x, w, at::Tensor());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return MixedLinear::backward(ctx, grads, /*bias_slot=*/false);
  }
};

// The ATen form: y = x W^T (+ b) with W and b already in x's dtype, as an
// autograd function of its own so that see Note [Per-op activation
// checkpointing] can answer the forward from a saved output while the node
// and its backward stay the same. The backward is the one autograd derives
// for the matmul over x's rows: dx = dy W, dW = dy^T x, db = the sum of
// dy's rows.
struct AtenLinear {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const at::Tensor& b) {
    ctx->save_for_backward({x, w});
    return run_saved_op([&] { return b.defined() ? at::linear(x, w, b) : at::linear(x, w); });
  }
  // {dx, dw, db}; db only when `bias_slot`.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 const torch::autograd::variable_list& grads,
                                                 bool bias_slot) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1];
    const auto out_f = w.size(0), in_f = w.size(1);
    auto dy = grads[0].reshape({-1, out_f});  // [rows, out]
    torch::autograd::variable_list out(bias_slot ? 3 : 2);
    if (ctx->needs_input_grad(0)) out[0] = dy.mm(w).view(x.sizes());
    if (ctx->needs_input_grad(1)) out[1] = dy.t().mm(x.reshape({-1, in_f}));
    if (bias_slot && ctx->needs_input_grad(2)) out[2] = dy.sum(0);
    return out;
  }
};

class AtenLinearFn : public torch::autograd::Function<AtenLinearFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const at::Tensor& b) {
    return AtenLinear::forward(ctx, x, w, b);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return AtenLinear::backward(ctx, grads, /*bias_slot=*/true);
  }
};

class AtenLinearNoBiasFn : public torch::autograd::Function<AtenLinearNoBiasFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w) {
    return AtenLinear::forward(ctx, x, w, at::Tensor());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return AtenLinear::backward(ctx, grads, /*bias_slot=*/false);
  }
};

}  // namespace

bool mixed_linear_applies(const at::Tensor& x, at::TensorList w, const KernelOptions& k) {
  if (x.scalar_type() != at::kBFloat16 || !fused_runs(x, k)) return false;
  for (const auto& p : w) {
    if (p.scalar_type() != at::kFloat || !p.requires_grad() || p.dim() != 2) return false;
  }
  return true;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                  const KernelOptions& k) {
  return linear_parts(x, {w}, b, k);
}

at::Tensor linear_parts(const at::Tensor& x, at::TensorList w, const at::Tensor& b,
                        const KernelOptions& k) {
  if (mixed_linear_applies(x, w, k)) {
    return b.defined() ? MixedLinearFn::apply(x, w, b) : MixedLinearNoBiasFn::apply(x, w);
  }
  const auto whole = w.size() == 1 ? w[0] : at::cat(w);
  const auto wc = whole.scalar_type() == x.scalar_type() ? whole : whole.to(x.scalar_type());
  if (b.defined()) {
    const auto bc = b.scalar_type() == x.scalar_type() ? b : b.to(x.scalar_type());
    return AtenLinearFn::apply(x, wc, bc);
  }
  return AtenLinearNoBiasFn::apply(x, wc);
}

}  // namespace viaduct::ops
