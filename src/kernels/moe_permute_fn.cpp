// The MoE's rows into padded expert groups and back on viaduct's kernels
// (CUDA build), with their gradients; see Note [MoE rows moved in one pass]
// (kernels/moe_permute.cu).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/moe_permute.h"

namespace viaduct::kernels {

namespace {

void check_rows(const at::Tensor& t, const char* what) {
  VIADUCT_CHECK(moe_permute_usable(t), "fused ", what, ": rows must be bf16 [R, D] with D a ",
                "multiple of 8 on a CUDA device the kernels were built for; got ",
                t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

void check_index(const at::Tensor& t, const at::Tensor& like, const char* what) {
  VIADUCT_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.device() == like.device(),
                "fused moe_permute/moe_combine: ", what, " must be int64 [n] on ", like.device(),
                "; got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

class PermuteFn : public torch::autograd::Function<PermuteFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& pos, const at::Tensor& row_slot, int64_t k) {
    auto xc = x.contiguous();
    const int64_t N = xc.size(0), D = xc.size(1), rows = row_slot.size(0);
    auto out = at::empty({rows, D}, xc.options());
    check_launch(cuda::moe_permute(xc.data_ptr(), row_slot.data_ptr<int64_t>(), rows, D,
                                   static_cast<int>(k), out.data_ptr(), stream_of(xc)),
                 "moe_permute");
    ctx->save_for_backward({pos});
    ctx->saved_data["n"] = N;
    ctx->saved_data["k"] = k;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto pos = ctx->get_saved_variables()[0];
    const auto g = grads[0].to(at::kBFloat16).contiguous();
    const int64_t N = ctx->saved_data["n"].toInt(), k = ctx->saved_data["k"].toInt();
    auto dx = at::empty({N, g.size(1)}, g.options());
    check_launch(cuda::moe_permute_backward(g.data_ptr(), pos.data_ptr<int64_t>(), N, g.size(1),
                                            static_cast<int>(k), dx.data_ptr(), stream_of(g)),
                 "moe_permute_backward");
    return {dx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class CombineFn : public torch::autograd::Function<CombineFn> {
 public:
  // base: [N, D] added after the sum, or a 0-size stand-in for none (an
  // autograd function takes no undefined inputs on LibTorch 2.x).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& ys,
                            const at::Tensor& gates, const at::Tensor& pos,
                            const at::Tensor& row_slot, const at::Tensor& base) {
    auto yc = ys.contiguous();
    const int64_t N = gates.size(0), k = gates.size(1), D = yc.size(1);
    // The gates in the rows' dtype, as the ATen form's gates.to(bf16).
    auto gb = gates.detach().to(yc.scalar_type()).contiguous();
    auto bc = base.numel() ? base.contiguous() : at::Tensor();
    auto out = at::empty({N, D}, yc.options());
    check_launch(cuda::moe_combine(yc.data_ptr(), pos.data_ptr<int64_t>(), gb.data_ptr(),
                                   bc.defined() ? bc.data_ptr() : nullptr, N, D,
                                   static_cast<int>(k), out.data_ptr(), stream_of(yc)),
                 "moe_combine");
    ctx->save_for_backward({yc, gb, pos, row_slot});
    ctx->saved_data["gates_dtype"] = static_cast<int64_t>(gates.scalar_type());
    ctx->saved_data["has_base"] = bc.defined();
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &ys = saved[0], &gb = saved[1], &pos = saved[2], &row_slot = saved[3];
    auto dout = grads[0].to(ys.scalar_type()).contiguous();
    const int64_t N = gb.size(0), k = gb.size(1), rows = ys.size(0), D = ys.size(1);
    auto dys = at::empty_like(ys);
    auto dg = at::empty({N, k}, ys.options().dtype(at::kFloat));
    check_launch(cuda::moe_combine_backward(dout.data_ptr(), ys.data_ptr(), gb.data_ptr(),
                                            pos.data_ptr<int64_t>(),
                                            row_slot.data_ptr<int64_t>(), N, rows, D,
                                            static_cast<int>(k), dys.data_ptr(),
                                            dg.data_ptr<float>(), stream_of(ys)),
                 "moe_combine_backward");
    const auto gates_dtype = static_cast<at::ScalarType>(ctx->saved_data["gates_dtype"].toInt());
    // The add passes its gradient to base unchanged.
    const bool has_base = ctx->saved_data["has_base"].toBool();
    return {dys, dg.to(gates_dtype), at::Tensor(), at::Tensor(),
            has_base ? dout : at::Tensor()};
  }
};

}  // namespace

bool moe_permute_usable(const at::Tensor& x) {
  return usable(x) && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) > 0 &&
         x.size(1) % 8 == 0 && aligned16(x.data_ptr());
}

at::Tensor moe_permute(const at::Tensor& x, const at::Tensor& pos, const at::Tensor& row_slot,
                       int64_t k) {
  RECORD_FUNCTION("viaduct::moe_permute", std::vector<c10::IValue>());  // named in profiles
  check_rows(x, "moe_permute");
  check_index(pos, x, "pos");
  check_index(row_slot, x, "row_slot");
  VIADUCT_CHECK(k >= 1 && pos.size(0) == x.size(0) * k,
                "fused moe_permute: pos must name a row for each of the ", x.size(0), " x ", k,
                " slots; got ", pos.size(0));
  return PermuteFn::apply(x, pos.contiguous(), row_slot.contiguous(), k);
}

at::Tensor moe_combine(const at::Tensor& ys, const at::Tensor& gates, const at::Tensor& pos,
                       const at::Tensor& row_slot, const at::Tensor& base) {
  RECORD_FUNCTION("viaduct::moe_combine", std::vector<c10::IValue>());  // named in profiles
  check_rows(ys, "moe_combine");
  check_index(pos, ys, "pos");
  check_index(row_slot, ys, "row_slot");
  VIADUCT_CHECK(gates.dim() == 2 && gates.device() == ys.device() &&
                    pos.size(0) == gates.size(0) * gates.size(1) &&
                    row_slot.size(0) == ys.size(0),
                "fused moe_combine: gates [N, K] on the rows' device with pos [N K] and "
                "row_slot [rows]; got gates ", gates.sizes(), ", pos ", pos.sizes(),
                ", row_slot ", row_slot.sizes(), ", rows ", ys.sizes());
  VIADUCT_CHECK(!base.defined() ||
                    (base.scalar_type() == ys.scalar_type() && base.device() == ys.device() &&
                     base.dim() == 2 && base.size(0) == gates.size(0) &&
                     base.size(1) == ys.size(1)),
                "fused moe_combine: the added base must be [N, D] = [", gates.size(0), ", ",
                ys.size(1), "] of the rows' dtype and device; got ", base.sizes());
  const auto none = at::empty({0}, ys.options());
  return CombineFn::apply(ys, gates, pos.contiguous(), row_slot.contiguous(),
                          base.defined() ? base : none);
}

}  // namespace viaduct::kernels
