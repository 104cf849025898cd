// RoPE and repeated heads as autograd functions (CUDA build).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/rope.h"

namespace viaduct::kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Output head h of y [B, T, H_out, hd] (token and head pitch yT and yH,
// see cuda::rope) from x's heads as cuda::rope combines them: repeat > 0
// each head of x
// written `repeat` times (the forward of a grouped-KV rotation); repeat < 0
// each run of -repeat heads summed (its backward); 1 a plain rotation.
// Undefined tables: no rotation (repeat_heads). Strided x (SDPA's
// transposed gradients, q/k sliced from one qkv projection) is read in
// place; only a non-unit last stride is copied.
void rope_into(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse,
               int64_t repeat, void* y, int64_t yT, int64_t yH) {
  auto xc = x.stride(3) == 1 ? x : x.contiguous();
  const int64_t rep = repeat > 0 ? repeat : -repeat;
  const int64_t H_out = repeat > 0 ? xc.size(2) * rep : xc.size(2) / rep;
  check_launch(cuda::rope(dtype_of(xc), xc.data_ptr(),
                          cos.defined() ? cos.data_ptr<float>() : nullptr,
                          sin.defined() ? sin.data_ptr<float>() : nullptr, y, xc.size(0),
                          xc.size(1), H_out, xc.size(3), xc.stride(0), xc.stride(1),
                          xc.stride(2), inverse,
                          /*div=*/repeat > 0 ? rep : 1, /*mul=*/repeat > 0 ? 1 : rep,
                          /*cnt=*/repeat > 0 ? 1 : rep, stream_of(xc), yT, yH),
               "rope");
}

// rope_into a new contiguous [B, T, H_out, hd].
at::Tensor rope_launch(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       bool inverse, int64_t repeat) {
  const int64_t rep = repeat > 0 ? repeat : -repeat;
  const int64_t H_out = repeat > 0 ? x.size(2) * rep : x.size(2) / rep;
  auto y = at::empty({x.size(0), x.size(1), H_out, x.size(3)},
                     x.options().memory_format(at::MemoryFormat::Contiguous));
  rope_into(x, cos, sin, inverse, repeat, y.data_ptr(), H_out * x.size(3), x.size(3));
  return y;
}

class RopeFn : public torch::autograd::Function<RopeFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin, int64_t repeat) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["repeat"] = repeat;
    return rope_launch(x, cos, sin, /*inverse=*/false, repeat);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto repeat = ctx->saved_data["repeat"].toInt();
    return {rope_launch(grads[0], saved[0], saved[1], /*inverse=*/true,
                        repeat == 1 ? 1 : -repeat),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Note [Repeated heads without a gather]
// V's grouped heads repeated for
// SDPA went through repeat_interleave, a strided gather from the qkv GEMM's
// output far below the memory bandwidth, and its backward through a
// reduction kernel. The RoPE kernel already writes
// and sums repeated heads through strides; without tables it does so with
// no rotation, vectorised.
class RepeatHeadsFn : public torch::autograd::Function<RepeatHeadsFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t repeat) {
    ctx->saved_data["repeat"] = repeat;
    return rope_launch(x, at::Tensor(), at::Tensor(), /*inverse=*/false, repeat);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto repeat = ctx->saved_data["repeat"].toInt();
    return {rope_launch(grads[0], at::Tensor(), at::Tensor(), /*inverse=*/false, -repeat),
            at::Tensor()};
  }
};

// Note [The qkv gradient written whole]
// q, k and v are slices of one qkv GEMM's product [B, T, (H + 2 KV) hd]
// (see Note [One GEMM for the projections of one input], ops/linear.cpp).
// Rotated and repeated separately, their three gradients came back through
// the slices' backward, a concatenation: one more pass reading and writing
// the whole product's gradient. Here the three are one function of the
// product: the forward runs the same three launches as rope(q),
// rope(k, rep) and repeat_heads(v, rep), and the backward's three launches
// write the rotated-back (and summed) gradients straight into their slices
// of one [B, T, (H + 2 KV) hd] tensor. The arithmetic is the same, so are
// the bits. v is written even where rep is 1 (a copy; the concatenation it
// saves in the backward reads and writes three times as much).
class RopeQkvFn : public torch::autograd::Function<RopeQkvFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& qkv, const at::Tensor& cos,
                               const at::Tensor& sin, int64_t H, int64_t KV) {
    const auto B = qkv.size(0), T = qkv.size(1), hd = qkv.size(2) / (H + 2 * KV);
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["H"] = H;
    ctx->saved_data["KV"] = KV;
    auto part = [&](int64_t first, int64_t heads) {
      return qkv.narrow(2, first * hd, heads * hd).view({B, T, heads, hd});
    };
    const auto rep = H / KV;
    return {rope_launch(part(0, H), cos, sin, /*inverse=*/false, 1),
            rope_launch(part(H, KV), cos, sin, /*inverse=*/false, rep),
            rope_launch(part(H + KV, KV), at::Tensor(), at::Tensor(), /*inverse=*/false, rep)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto H = ctx->saved_data["H"].toInt(), KV = ctx->saved_data["KV"].toInt();
    const auto rep = H / KV;
    // An unused output's gradient arrives as zeros (the functions
    // materialise undefined gradients).
    const auto& g0 = grads[0];
    const auto B = g0.size(0), T = g0.size(1), hd = g0.size(3), W = (H + 2 * KV) * hd;
    auto d = at::empty({B, T, W}, g0.options().memory_format(at::MemoryFormat::Contiguous));
    auto* base = static_cast<char*>(d.data_ptr());
    const auto elem = static_cast<int64_t>(d.element_size());
    // The first head of q's, k's and v's slice.
    const int64_t first[3] = {0, H, H + KV};
    for (int i = 0; i < 3; ++i) {
      const bool rotate = i < 2;
      rope_into(grads[i].to(d.scalar_type()), rotate ? saved[0] : at::Tensor(),
                rotate ? saved[1] : at::Tensor(), /*inverse=*/rotate, i == 0 ? 1 : -rep,
                base + first[i] * hd * elem, W, hd);
    }
    return {d, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Note [MLA's rotary channels written in place]
// MLA's attention reads q [B, T, H, nope + pe] with its last pe channels
// rotated, and k: kv's first nope channels beside k_pe's pe channels,
// rotated once and repeated for every head. Built as rope then cat, each
// cat was a pass over a [tokens, H, nope + pe] tensor, and the backward
// sent the slices' gradients through zero-filled full-size tensors added
// together (q's two slices, kv's two). Here one function of q, k_pe and
// kv: the forward copies the nope channels and lets the RoPE kernel write
// the rotated ones into their place in the same tensors (a head pitch of
// nope + pe), and copies v out of kv (zero-padded to the width flash's
// kernel wants, where the caller asks); the backward writes q's and kv's
// gradients whole and k_pe's as the RoPE kernel's fp32 sum of the heads,
// rotated back. The forward and q's and kv's gradients have the bits of
// rope, cat and narrow; k_pe's gradient is rounded once, where the ATen
// form rounded the heads' sum and then the rotation.
class MlaQkvFn : public torch::autograd::Function<MlaQkvFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k_pe,
                               const at::Tensor& kv, const at::Tensor& cos, const at::Tensor& sin,
                               int64_t nope, int64_t v_width) {
    const auto B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3), pe = D - nope;
    const auto vd = kv.size(3) - nope;
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["nope"] = nope;
    ctx->saved_data["vd"] = vd;
    // 0-size tables stand for none (no rotation: the channels copied).
    const auto c = cos.numel() > 0 ? cos : at::Tensor(), s = sin.numel() > 0 ? sin : at::Tensor();
    const auto elem = static_cast<int64_t>(q.element_size());
    auto qf = at::empty({B, T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
    auto kf = at::empty({B, T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
    copy_rows_into(qf.narrow(3, 0, nope), q.narrow(3, 0, nope));
    copy_rows_into(kf.narrow(3, 0, nope), kv.narrow(3, 0, nope));
    rope_into(q.narrow(3, nope, pe), c, s, /*inverse=*/false, 1,
              static_cast<char*>(qf.data_ptr()) + nope * elem, H * D, D);
    rope_into(k_pe, c, s, /*inverse=*/false, H, static_cast<char*>(kf.data_ptr()) + nope * elem,
              H * D, D);
    auto v = at::empty({B, T, H, v_width}, kv.options().memory_format(at::MemoryFormat::Contiguous));
    copy_rows_into(v.narrow(3, 0, vd), kv.narrow(3, nope, vd));
    if (v_width == vd) return {qf, kf, v};
    v.narrow(3, vd, v_width - vd).zero_();
    return {qf, kf, v};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto nope = ctx->saved_data["nope"].toInt();
    const auto &dqf = grads[0], &dkf = grads[1], &dv = grads[2];
    const auto B = dqf.size(0), T = dqf.size(1), H = dqf.size(2), D = dqf.size(3), pe = D - nope;
    const auto vd = ctx->saved_data["vd"].toInt();
    const auto elem = static_cast<int64_t>(dqf.element_size());
    const bool rotate = saved[0].numel() > 0;
    const auto c = rotate ? saved[0] : at::Tensor(), s = rotate ? saved[1] : at::Tensor();
    auto dq = at::empty({B, T, H, D}, dqf.options().memory_format(at::MemoryFormat::Contiguous));
    copy_rows_into(dq.narrow(3, 0, nope), dqf.narrow(3, 0, nope));
    rope_into(dqf.narrow(3, nope, pe), c, s, /*inverse=*/rotate, 1,
              static_cast<char*>(dq.data_ptr()) + nope * elem, H * D, D);
    auto dk_pe =
        at::empty({B, T, 1, pe}, dkf.options().memory_format(at::MemoryFormat::Contiguous));
    rope_into(dkf.narrow(3, nope, pe), c, s, /*inverse=*/rotate, -H, dk_pe.data_ptr(), pe, pe);
    auto dkv = at::empty({B, T, H, nope + vd},
                         dkf.options().memory_format(at::MemoryFormat::Contiguous));
    copy_rows_into(dkv.narrow(3, 0, nope), dkf.narrow(3, 0, nope));
    copy_rows_into(dkv.narrow(3, nope, vd), dv.narrow(3, 0, vd));
    return {dq, dk_pe, dkv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                int64_t repeat) {
  RECORD_FUNCTION("viaduct::rope", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(x.dim() == 4 && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                    cos.is_contiguous() && sin.is_contiguous() && cos.size(0) >= x.size(1) &&
                    2 * cos.size(1) == x.size(3),
                "fused rope: x must be [B, T, H, hd] and cos/sin contiguous fp32 [>= T, hd/2]");
  VIADUCT_CHECK(repeat >= 1, "fused rope: repeat must be >= 1, got ", repeat);
  return RopeFn::apply(x, cos, sin, repeat);
}

at::Tensor repeat_heads(const at::Tensor& x, int64_t repeat) {
  RECORD_FUNCTION("viaduct::repeat_heads", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(x.dim() == 4 && repeat >= 1,
                "fused repeat_heads: x must be [B, T, H, hd] and repeat >= 1");
  if (repeat == 1) return x;
  return RepeatHeadsFn::apply(x, repeat);
}

std::vector<at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                 const at::Tensor& sin, int64_t H, int64_t KV) {
  RECORD_FUNCTION("viaduct::rope", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(qkv.dim() == 3 && H >= 1 && KV >= 1 && H % KV == 0 &&
                    qkv.size(2) % (H + 2 * KV) == 0 && qkv.stride(2) == 1,
                "fused rope_qkv: qkv must be [B, T, (H + 2 KV) hd] with a dense last dimension "
                "and H a multiple of KV, got ", qkv.sizes(), ", H ", H, ", KV ", KV);
  const auto hd = qkv.size(2) / (H + 2 * KV);
  VIADUCT_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                    cos.is_contiguous() && sin.is_contiguous() && cos.size(0) >= qkv.size(1) &&
                    2 * cos.size(1) == hd,
                "fused rope_qkv: cos/sin must be contiguous fp32 [>= T, hd/2]");
  return RopeQkvFn::apply(qkv, cos, sin, H, KV);
}

std::vector<at::Tensor> mla_qkv(const at::Tensor& q, const at::Tensor& k_pe,
                                const at::Tensor& kv, const at::Tensor& cos,
                                const at::Tensor& sin, int64_t nope, int64_t v_width) {
  RECORD_FUNCTION("viaduct::mla_qkv", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(q.dim() == 4 && k_pe.dim() == 4 && kv.dim() == 4 && k_pe.size(2) == 1 &&
                    q.size(0) == kv.size(0) && q.size(1) == kv.size(1) &&
                    q.size(2) == kv.size(2) && k_pe.size(0) == q.size(0) &&
                    k_pe.size(1) == q.size(1) && nope >= 0 && nope < q.size(3) &&
                    k_pe.size(3) == q.size(3) - nope && kv.size(3) > nope &&
                    q.stride(3) == 1 && k_pe.stride(3) == 1 && kv.stride(3) == 1 &&
                    q.scalar_type() == kv.scalar_type() &&
                    k_pe.scalar_type() == q.scalar_type(),
                "fused mla_qkv: q [B, T, H, nope + pe], k_pe [B, T, 1, pe], kv [B, T, H, "
                "nope + vd] of one dtype with dense last dimensions; got ",
                q.sizes(), ", ", k_pe.sizes(), ", ", kv.sizes(), ", nope ", nope);
  const auto pe = q.size(3) - nope, vd = kv.size(3) - nope;
  VIADUCT_CHECK(v_width == 0 || v_width >= vd, "fused mla_qkv: v_width ", v_width,
                " is narrower than the values' ", vd);
  VIADUCT_CHECK(!cos.defined() || (cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                                   cos.is_contiguous() && sin.is_contiguous() &&
                                   cos.size(0) >= q.size(1) && 2 * cos.size(1) == pe),
                "fused mla_qkv: cos/sin must be contiguous fp32 [>= T, pe/2]");
  return MlaQkvFn::apply(q, k_pe, kv, cos.defined() ? cos : at::empty({0}, q.options()),
                         sin.defined() ? sin : at::empty({0}, q.options()), nope,
                         v_width == 0 ? vd : v_width);
}

}  // namespace viaduct::kernels
