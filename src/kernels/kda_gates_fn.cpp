// The KDA layer's gates as autograd functions on viaduct's kernels (CUDA
// build): the decay and the gated output norm (kernels/kda_gates.h).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/kda_gates.h"

namespace viaduct::kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class KdaDecayFn : public torch::autograd::Function<KdaDecayFn> {
 public:
  // f [..., H D] (bf16 or fp32), dt_bias [H D] and A_log [H] fp32; returns
  // g [..., H, D] fp32.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& f, const at::Tensor& dt_bias,
                            const at::Tensor& A_log) {
    const auto H = A_log.size(0), C = f.size(-1), D = C / H;
    auto fc = f.contiguous();
    auto bias = dt_bias.contiguous(), A = A_log.contiguous();
    const auto rows = fc.numel() / C;
    auto sizes = f.sizes().vec();
    sizes.back() = H;
    sizes.push_back(D);
    auto g = at::empty(sizes, fc.options().dtype(at::kFloat));
    check_launch(cuda::kda_decay_forward(dtype_of(fc), fc.data_ptr(), bias.data_ptr<float>(),
                                         A.data_ptr<float>(), g.data_ptr<float>(), rows, H, D,
                                         stream_of(fc)),
                 "kda_decay_forward");
    ctx->save_for_backward({fc, bias, A});
    return g;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &f = saved[0], &bias = saved[1], &A = saved[2];
    const auto H = A.size(0), C = f.size(-1), D = C / H;
    const auto rows = f.numel() / C;
    auto dg = grads[0].to(at::kFloat).contiguous();
    auto df = at::empty_like(f);
    const auto parts = cuda::kda_decay_parts(rows);
    auto f32 = f.options().dtype(at::kFloat);
    auto pb = at::empty({parts, C}, f32), pg = at::empty({parts, C}, f32);
    check_launch(cuda::kda_decay_backward(dtype_of(f), f.data_ptr(), bias.data_ptr<float>(),
                                          A.data_ptr<float>(), dg.data_ptr<float>(),
                                          df.data_ptr(), pb.data_ptr<float>(),
                                          pg.data_ptr<float>(), rows, H, D, stream_of(f)),
                 "kda_decay_backward");
    // dA_log[h] = -exp(A_log[h]) * sum over the head's channels of dg softplus(z).
    auto dA = pg.sum(0).view({H, D}).sum(1) * A.exp().neg();
    return {df, pb.sum(0), dA};
  }
};

class GatedRmsNormFn : public torch::autograd::Function<GatedRmsNormFn> {
 public:
  // x [..., D] fp32, gl [..., D] (bf16 or fp32), w [D] fp32; returns y in
  // gl's dtype.
  // dx_rows: see kda_output_grad_rows (0: x's gradient in x's layout).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& gl,
                            const at::Tensor& w, double eps, int64_t dx_rows) {
    const auto D = x.size(-1);
    ctx->saved_data["dx_rows"] = dx_rows;
    auto x2 = x.contiguous().view({-1, D});
    auto g2 = gl.contiguous().view({-1, D});
    auto wc = w.contiguous();
    const auto rows = x2.size(0);
    auto y = at::empty_like(g2);
    auto rstd = at::empty({rows}, x2.options());
    check_launch(cuda::gated_rms_norm_forward(dtype_of(g2), x2.data_ptr<float>(), g2.data_ptr(),
                                              wc.data_ptr<float>(), y.data_ptr(),
                                              rstd.data_ptr<float>(), rows, D,
                                              static_cast<float>(eps), stream_of(x2)),
                 "gated_rms_norm_forward");
    ctx->save_for_backward({x2, g2, wc, rstd});
    return y.view(x.sizes());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x2 = saved[0], &g2 = saved[1], &wc = saved[2], &rstd = saved[3];
    const auto rows = x2.size(0), D = x2.size(1);
    auto dy = grads[0].to(g2.scalar_type()).contiguous().view({rows, D});
    const auto sizes = grads[0].sizes();
    // x's gradient in its own layout, or in KDA's chunk layout with the
    // chunks' rows past T zero (see kda_output_grad_rows), handed on as the
    // [B, T, H, D] view of it.
    const auto per_head = ctx->saved_data["dx_rows"].toInt();
    cuda::ChunkRows dx_rows;
    at::Tensor buf, dx;
    if (per_head > 0) {
      const auto B = sizes[0], T = sizes[1], H = sizes[2];
      dx_rows = {T, H, per_head};
      buf = at::empty({B, H, per_head, D}, x2.options());
      if (per_head > T) buf.narrow(2, T, per_head - T).zero_();
      dx = buf.narrow(2, 0, T).permute({0, 2, 1, 3});
    } else {
      buf = at::empty_like(x2);
      dx = buf.view(sizes);
    }
    auto dgl = at::empty_like(g2);
    auto pw = at::empty({cuda::gated_rms_norm_parts(rows), D}, x2.options());
    check_launch(cuda::gated_rms_norm_backward(dtype_of(g2), x2.data_ptr<float>(), g2.data_ptr(),
                                               wc.data_ptr<float>(), rstd.data_ptr<float>(),
                                               dy.data_ptr(), buf.data_ptr<float>(),
                                               dgl.data_ptr(), pw.data_ptr<float>(), rows, D,
                                               dx_rows, stream_of(x2)),
                 "gated_rms_norm_backward");
    return {dx, dgl.view(sizes), pw.sum(0), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool kda_decay_usable(const at::Tensor& f, const at::Tensor& dt_bias, const at::Tensor& A_log) {
  return usable(f) && f.dim() >= 1 && f.size(-1) > 0 && A_log.dim() == 1 && A_log.size(0) > 0 &&
         f.size(-1) % A_log.size(0) == 0 && dt_bias.dim() == 1 &&
         dt_bias.size(0) == f.size(-1) && dt_bias.scalar_type() == at::kFloat &&
         A_log.scalar_type() == at::kFloat && dt_bias.device() == f.device() &&
         A_log.device() == f.device();
}

at::Tensor kda_decay(const at::Tensor& f, const at::Tensor& dt_bias, const at::Tensor& A_log) {
  RECORD_FUNCTION("viaduct::kda_decay", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(kda_decay_usable(f, dt_bias, A_log),
                "fused kda_decay: f must be fp32 or bf16 [..., H D] on a CUDA device the kernels "
                "were built for, dt_bias fp32 [H D] and A_log fp32 [H] on it; got f ",
                f.scalar_type(), " ", f.sizes(), ", dt_bias ", dt_bias.sizes(), ", A_log ",
                A_log.sizes());
  return KdaDecayFn::apply(f, dt_bias, A_log);
}

bool gated_rms_norm_usable(const at::Tensor& x, const at::Tensor& gate_logits,
                           const at::Tensor& weight) {
  return usable(gate_logits) && x.defined() && x.is_cuda() && x.scalar_type() == at::kFloat &&
         x.sizes() == gate_logits.sizes() && x.device() == gate_logits.device() &&
         x.size(-1) > 0 && x.size(-1) % 32 == 0 && x.size(-1) <= cuda::kGatedNormMaxDim &&
         weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
         weight.size(0) == x.size(-1) && weight.device() == x.device();
}

at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& gate_logits,
                          const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("viaduct::gated_rms_norm", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(gated_rms_norm_usable(x, gate_logits, weight),
                "fused gated_rms_norm: x must be fp32 [..., D] (D a multiple of 32 up to ",
                cuda::kGatedNormMaxDim, ") and the gate's logits fp32 or bf16 of x's shape on a "
                "CUDA device the kernels were built for, the weight fp32 [D]; got x ",
                x.scalar_type(), " ", x.sizes(), ", gate ", gate_logits.scalar_type(), " ",
                gate_logits.sizes(), ", weight ", weight.sizes());
  return GatedRmsNormFn::apply(x, gate_logits, weight, eps, kda_output_grad_rows(x));
}

}  // namespace viaduct::kernels
