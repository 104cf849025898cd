#include "ops/linear.h"

#include "core/check.h"
#include "core/torch_compat.h"
#include "kernels/fused.h"
#include "kernels/weight_cache.h"
#include "ops/recompute.h"

namespace viaduct::ops {

namespace {

// Note [Linear with an fp32 weight gradient]
// On the fused-kernel path a linear whose fp32 master weight is used in the
// bf16 input's dtype computes its weight gradient with one GEMM writing fp32
// (compat::matmul_into_fp32_, where the build takes it: ops::Capabilities)
// instead of a bf16 product cast up by autograd's ToCopyBackward: one pass
// less over every weight gradient, and no bf16 rounding of it. The weight
// may come in parts (q, k and v in one GEMM:
// see Note [One GEMM for the projections of one input]);
// the bf16 weight is their concatenation from the options' weight cache
// (see Note [Low-precision weight cache], kernels/weight_cache.h), kept for
// the backward as at::linear keeps its cast weight, and the fp32 gradient is
// split back into the parts.
struct MixedLinear {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            at::TensorList w, const at::Tensor& b, const KernelOptions& k,
                            const kernels::PackedGradColumns& dx_into) {
    auto wc = kernels::cast_weights(k.weight_cache.get(), w, x.scalar_type());
    ctx->save_for_backward({x, wc});
    std::vector<int64_t> rows;
    for (const auto& p : w) rows.push_back(p.size(0));
    ctx->saved_data["rows"] = rows;
    ctx->saved_data["fp32_out"] = k.capabilities.fp32_out_gemm;
    kernels::save_packed_grad_columns(ctx, dx_into);
    // The product over x's rows as one 2-D GEMM: x may be a column slice of
    // a packed projection (rows further apart than its width), which cuBLAS
    // reads in place as a 2-D view, where a strided 3-D input would take
    // at::linear's matmul and add the bias after the GEMM, not in it.
    auto out_sizes = x.sizes().vec();
    out_sizes.back() = wc.size(0);
    const auto x2 = x.reshape({-1, x.size(-1)});
    // See Note [Per-op activation checkpointing]: the GEMM alone is skipped
    // in a replay; the node and what it saves are the same.
    if (!b.defined()) return run_saved_op([&] { return at::linear(x2, wc).view(out_sizes); });
    ctx->saved_data["b_dtype"] = static_cast<int64_t>(b.scalar_type());
    if (k.capabilities.fp32_out_gemm && b.requires_grad()) {
      ctx->saved_data["ones"] = kernels::ones_row(k.weight_cache.get(), x.numel() / x.size(-1),
                                                  x.scalar_type(), x.device());
    }
    // The bias's cast comes from the cache too (one launch less a linear and
    // step where the host's launches set the pace).
    const auto bc = b.scalar_type() == x.scalar_type()
                        ? b
                        : kernels::cast_weights(k.weight_cache.get(), {b}, x.scalar_type());
    return run_saved_op([&] { return at::linear(x2, wc, bc).view(out_sizes); });
  }
  // {dx, dw per part..., db, none for the options and for the columns};
  // db only when `bias_slot`.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 const torch::autograd::variable_list& grads,
                                                 bool bias_slot) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &wc = saved[1];
    const auto rows = ctx->saved_data["rows"].toIntVector();
    const auto n = rows.size();
    const auto out_f = wc.size(0), in_f = wc.size(1);
    auto dy = grads[0].to(x.scalar_type()).reshape({-1, out_f});
    torch::autograd::variable_list out(1 + n + (bias_slot ? 1 : 0) + 2);
    if (ctx->needs_input_grad(0)) {
      const auto into = kernels::saved_packed_grad_columns(ctx);
      if (into.slot.defined()) {
        // Written into its columns of the packed product's gradient, rows
        // that product's width apart: cuBLAS takes the view as its output
        // (see Note [Packed projection gradients in place],
        // kernels/fused.h).
        auto dx = kernels::packed_grad_view(into, in_f);
        auto dx2 = dx.view({-1, in_f});
        at::mm_out(dx2, dy, wc);
        out[0] = dx;
      } else {
        out[0] = at::mm(dy, wc).view(x.sizes());
      }
    }
    bool any_w = false;
    for (size_t i = 0; i < n; ++i) any_w = any_w || ctx->needs_input_grad(1 + i);
    if (any_w) {
      auto dw = at::empty({out_f, in_f}, dy.options().dtype(at::kFloat));
      compat::matmul_into_fp32_(dw, dy.t(), x.reshape({-1, in_f}), /*accumulate=*/false,
                                ctx->saved_data["fp32_out"].toBool());
      int64_t row = 0;
      for (size_t i = 0; i < n; ++i) {
        // Rows of a contiguous tensor: contiguous views, no copies.
        if (ctx->needs_input_grad(1 + i)) out[1 + i] = n == 1 ? dw : dw.narrow(0, row, rows[i]);
        row += rows[i];
      }
    }
    if (bias_slot && ctx->needs_input_grad(1 + n)) {
      // Note [Bias gradient as a product with ones]
      // The bias gradient, dy summed over the rows, is one GEMM of a row of
      // ones with dy writing fp32 where the build has that GEMM: cuBLAS
      // reads dy faster than ATen's column sum over [rows, out] (layer_bench's
      // "bias grad" rows compare the two). The fp32 accumulation is the
      // sum's; without the fp32-output GEMM the sum stays (a bf16 product
      // would round the gradient).
      at::Tensor db;
      if (ctx->saved_data.count("ones") == 1) {
        db = at::empty({1, out_f}, dy.options().dtype(at::kFloat));
        compat::matmul_into_fp32_(db, ctx->saved_data["ones"].toTensor(), dy,
                                  /*accumulate=*/false, /*fp32_out=*/true);
        db = db.view({out_f});
      } else {
        db = dy.sum(0, false, at::kFloat);
      }
      out[1 + n] = db.to(static_cast<at::ScalarType>(ctx->saved_data["b_dtype"].toInt()));
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
                            at::TensorList w, const at::Tensor& b, const KernelOptions* k,
                            const kernels::PackedGradColumns* dx_into) {
    return MixedLinear::forward(ctx, x, w, b, *k, *dx_into);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return MixedLinear::backward(ctx, grads, /*bias_slot=*/true);
  }
};

class MixedLinearNoBiasFn : public torch::autograd::Function<MixedLinearNoBiasFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            at::TensorList w, const KernelOptions* k,
                            const kernels::PackedGradColumns* dx_into) {
    return MixedLinear::forward(ctx, x, w, at::Tensor(), *k, *dx_into);
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
    // x's gradient goes into a packed product's where x is one of its parts.
    const auto dx_into = kernels::packed_grad_columns(x);
    return b.defined() ? MixedLinearFn::apply(x, w, b, &k, &dx_into)
                       : MixedLinearNoBiasFn::apply(x, w, &k, &dx_into);
  }
  const auto whole = w.size() == 1 ? w[0] : at::cat(w);
  const auto wc = whole.scalar_type() == x.scalar_type() ? whole : whole.to(x.scalar_type());
  if (b.defined()) {
    const auto bc = b.scalar_type() == x.scalar_type() ? b : b.to(x.scalar_type());
    return AtenLinearFn::apply(x, wc, bc);
  }
  return AtenLinearNoBiasFn::apply(x, wc);
}

namespace {

// The one GEMM of linear_split's fused form: x times the concatenated
// weights (and biases), [..., sum of the weights' rows].
at::Tensor packed_projection(const at::Tensor& x, at::TensorList w, const KernelOptions& k,
                             at::TensorList b) {
  return linear_parts(x, w, b.empty() ? at::Tensor() : at::cat(b), k);
}

}  // namespace

std::vector<at::Tensor> linear_split(const at::Tensor& x, at::TensorList w,
                                     const KernelOptions& k, at::TensorList b,
                                     const std::vector<int64_t>& parts) {
  VIADUCT_ASSERT(b.empty() || b.size() == w.size(), "linear_split: ", b.size(),
                 " biases for ", w.size(), " weights");
  // The outputs' widths: the weights' rows, or `parts`, each weight's rows
  // a run of consecutive parts (parts_of: how many).
  std::vector<int64_t> widths;
  std::vector<size_t> parts_of(w.size(), 1);
  if (parts.empty()) {
    for (const auto& wi : w) widths.push_back(wi.size(0));
  } else {
    widths = parts;
    size_t j = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      int64_t rows = 0;
      parts_of[i] = 0;
      while (rows < w[i].size(0) && j < parts.size()) {
        rows += parts[j++];
        ++parts_of[i];
      }
      VIADUCT_ASSERT(rows == w[i].size(0) && parts_of[i] > 0,
                     "linear_split: parts ", at::IntArrayRef(parts),
                     " do not divide weight ", i, "'s ", w[i].size(0), " rows");
    }
    VIADUCT_ASSERT(j == parts.size(), "linear_split: parts ",
                   at::IntArrayRef(parts), " exceed the weights' rows");
  }
  std::vector<at::Tensor> out;
  if (!fused_runs(x, k) || (w.size() < 2 && parts.empty())) {
    size_t j = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      const auto y = linear(x, w[i], b.empty() ? at::Tensor() : b[i], k);
      if (parts_of[i] == 1) {
        out.push_back(y);
        ++j;
        continue;
      }
      int64_t column = 0;
      for (size_t n = 0; n < parts_of[i]; ++n, ++j) {
        out.push_back(y.narrow(-1, column, widths[j]));
        column += widths[j];
      }
    }
    return out;
  }
  // Note [One GEMM for the projections of one input]
  // On the fused-kernel path the projections of one input come from one
  // GEMM over the concatenated weights: a wider product instead of several
  // (some of them only a few columns wide), and in the backward one GEMM
  // for dx instead of one per weight plus the additions of their dx. The
  // outputs are strided views of the one product; the ops after them read
  // the views in place or copy what they need contiguous. The weights are
  // the parts of one linear (see Note [Linear with an fp32 weight
  // gradient]): their bf16 concatenation from the weight cache, the fp32
  // gradient split back into the parts. Elsewhere (the ATen forms) one
  // linear per weight, so the CPU keeps the bits of separate projections.
  // The parts' gradients land in the product's: see Note [Packed
  // projection gradients in place] (kernels/fused.h).
  return kernels::split_packed(packed_projection(x, w, k, b), widths);
}

QkvProjection qkv_projection(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& wk,
                             const at::Tensor& wv, const at::Tensor& bq, const at::Tensor& bk,
                             const at::Tensor& bv, int64_t head_dim, const KernelOptions& k) {
  // x: [B, T, D]
  const auto B = x.size(0), T = x.size(1);
  const auto hd = head_dim, H = wq.size(0) / hd, KV = wk.size(0) / hd;
  // Where the kernels run, one GEMM whose strided slices the RoPE kernel
  // and SDPA read in place.
  QkvProjection p;
  if (fused_runs(x, k)) {
    // linear_split's one GEMM, its product kept whole as well.
    p.packed = bq.defined() ? packed_projection(x, {wq, wk, wv}, k, {bq, bk, bv})
                            : packed_projection(x, {wq, wk, wv}, k, {});
    p.q = p.packed.narrow(-1, 0, H * hd).view({B, T, H, hd});
    p.k = p.packed.narrow(-1, H * hd, KV * hd).view({B, T, KV, hd});
    p.v = p.packed.narrow(-1, (H + KV) * hd, KV * hd).view({B, T, KV, hd});
    return p;
  }
  const auto parts = bq.defined() ? linear_split(x, {wq, wk, wv}, k, {bq, bk, bv})
                                  : linear_split(x, {wq, wk, wv}, k);
  p.q = parts[0].view({B, T, H, hd});
  p.k = parts[1].view({B, T, KV, hd});
  p.v = parts[2].view({B, T, KV, hd});
  return p;
}

}  // namespace viaduct::ops
