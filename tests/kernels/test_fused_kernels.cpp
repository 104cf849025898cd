// viaduct's CUDA kernels (src/kernels) against ATen references computed in
// fp64 from the same inputs. Built only in the CUDA build; every test skips
// without a GPU the kernels were compiled for.
//
// Error bound: relative Frobenius error ||out - reference|| / ||reference|| below 1e-5
// for fp32 inputs and 1e-2 for bf16 (the inputs are rounded to bf16 before
// the reference sees them, so the bound covers the kernel's own roundings).
// Inputs are fresh random draws per run (the seed is printed on failure);
// the caching allocator's free memory is poisoned with NaN before each call,
// so an output element a kernel never writes shows up as NaN.
#include <gtest/gtest.h>

#include <cmath>

#include <c10/cuda/CUDAStream.h>

#include "config/job_config.h"
#include "core/torch_compat.h"
#include "kernels/adamw.h"
#include "kernels/attn_res_read.h"
#include "kernels/fused.h"
#include "kernels/weight_cache.h"
#include "model/attn_res.h"
#include "model/layers.h"
#include "model/model.h"
#include "ops/cross_entropy.h"
#include "ops/documents.h"
#include "ops/embedding.h"
#include "ops/l2_norm.h"
#include "ops/short_conv.h"
#include "ops/linear.h"
#include "ops/rope.h"
#include "train/optimizer.h"
#include "common/cuda_test.h"

namespace viaduct {
namespace {

using testing_cuda::fresh_seed;
using testing_cuda::have_gpu;
using testing_cuda::rel_err;

// Fills the caching allocator's free blocks with NaN.
void poison() {
  auto p = at::full({256LL << 20}, NAN, at::TensorOptions(at::kCUDA).dtype(at::kFloat));
  p.reset();
}

// The kernel's and the fp64 reference's backward with the same output
// gradient (a fresh random one unless given), the allocator poisoned first.
void backward_both(const at::Tensor& y, const at::Tensor& yr, at::Tensor dy = {}) {
  if (!dy.defined()) dy = at::randn(y.sizes(), y.options());
  poison();
  y.backward(dy);
  yr.backward(dy.to(at::kCPU, at::kDouble));
}

double bound(at::ScalarType t) { return t == at::kFloat ? 1e-5 : 1e-2; }

const at::ScalarType kTypes[] = {at::kFloat, at::kBFloat16};

// A CUDA tensor of dtype t, and the same values as a CPU fp64 leaf.
std::pair<at::Tensor, at::Tensor> draw(at::IntArrayRef shape, at::ScalarType t, double scale = 1.0) {
  auto x = (at::randn(shape, at::TensorOptions(at::kCUDA).dtype(at::kFloat)) * scale).to(t);
  auto reference = x.to(at::kCPU, at::kDouble).detach().requires_grad_(true);
  return {x.detach().requires_grad_(true), reference};
}

TEST(FusedKernels, RMSNormForwardBackward) {
  REQUIRE_GPU();
  // Widths for both backward forms: the register form (one or two slices
  // per thread, vectorised or not, a partial last slice) and the loop form.
  for (int64_t D : {2048, 3000, 300, 5000, 1001})
  for (auto t : kTypes) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "dim " << D);
    auto [x, xr] = draw({3, 37, D}, t, 2.0);
    auto w = (1.0 + 0.1 * at::randn({D}, at::TensorOptions(at::kCUDA))).requires_grad_(true);
    auto wr = w.detach().to(at::kCPU, at::kDouble).requires_grad_(true);
    const double eps = 1e-5;
    poison();
    auto y = kernels::rms_norm(x, w, eps);
    auto yr = xr * at::rsqrt(xr.pow(2).mean(-1, true) + eps) * wr;
    ASSERT_EQ(y.scalar_type(), t);
    EXPECT_LT(rel_err(y, yr), bound(t)) << "seed " << seed << " " << t;
    backward_both(y, yr);
    EXPECT_LT(rel_err(x.grad(), xr.grad()), bound(t)) << "seed " << seed << " " << t;
    EXPECT_LT(rel_err(w.grad(), wr.grad()), bound(t)) << "seed " << seed << " " << t;
  }
}

TEST(FusedKernels, AddRMSNormIsBitwiseTheTwoOps) {
  REQUIRE_GPU();
  // See Note [Residual add inside the norm]: (h, norm(h)) for h = x + res and
  // the gradients of x and res (h also used elsewhere, as on the residual)
  // have the bits of the add followed by the norm kernel, for both backward
  // forms; and they match an fp64 reference.
  for (int64_t D : {2048, 5000, 300})
  for (auto t : kTypes) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "dim " << D << " " << t << " seed " << seed);
    auto [x, xr] = draw({3, 37, D}, t, 2.0);
    auto [r, rr] = draw({3, 37, D}, t, 2.0);
    auto w = (1.0 + 0.1 * at::randn({D}, at::TensorOptions(at::kCUDA))).requires_grad_(true);
    const double eps = 1e-5;
    auto gh = at::randn({3, 37, D}, at::TensorOptions(at::kCUDA)).to(t);
    auto gy = at::randn({3, 37, D}, at::TensorOptions(at::kCUDA)).to(t);
    poison();
    auto [h, y] = kernels::add_rms_norm(x, r, w, eps);
    torch::autograd::backward({h, y}, {gh, gy});
    // The two ops, on copies of the same leaves.
    auto x2 = x.detach().clone().requires_grad_(true);
    auto r2 = r.detach().clone().requires_grad_(true);
    auto w2 = w.detach().clone().requires_grad_(true);
    auto h2 = x2 + r2;
    auto y2 = kernels::rms_norm(h2, w2, eps);
    torch::autograd::backward({h2, y2}, {gh, gy});
    EXPECT_TRUE(at::equal(h, h2));
    EXPECT_TRUE(at::equal(y, y2));
    EXPECT_TRUE(at::equal(x.grad(), x2.grad()));
    EXPECT_TRUE(at::equal(r.grad(), r2.grad()));
    EXPECT_TRUE(at::equal(w.grad(), w2.grad()));
    // fp64 reference.
    auto hr = xr + rr;
    auto yr = hr * at::rsqrt(hr.pow(2).mean(-1, true) + eps) *
              w.detach().to(at::kCPU, at::kDouble);
    EXPECT_LT(rel_err(y, yr), bound(t));
    torch::autograd::backward({hr, yr}, {gh.to(at::kCPU, at::kDouble), gy.to(at::kCPU, at::kDouble)});
    EXPECT_LT(rel_err(x.grad(), xr.grad()), bound(t));
  }
}

TEST(FusedKernels, RMSNormBackwardIsDeterministic) {
  REQUIRE_GPU();
  fresh_seed();
  auto x = at::randn({4096, 512}, at::TensorOptions(at::kCUDA).dtype(at::kBFloat16));
  auto w = at::randn({512}, at::TensorOptions(at::kCUDA));
  auto dy = at::randn_like(x);
  std::vector<at::Tensor> gx, gw;
  for (int run = 0; run < 2; ++run) {
    auto xi = x.detach().requires_grad_(true), wi = w.detach().requires_grad_(true);
    kernels::rms_norm(xi, wi, 1e-6).backward(dy);
    gx.push_back(xi.grad());
    gw.push_back(wi.grad());
  }
  EXPECT_TRUE(at::equal(gx[0], gx[1]));
  EXPECT_TRUE(at::equal(gw[0], gw[1]));
}

TEST(FusedKernels, LayerNormForwardBackward) {
  REQUIRE_GPU();
  // gpt2's widths (768) and others, vectorised or not; an offset mean, so
  // the variance must be taken about it; against the fp64 layer_norm, and
  // the same bits run to run.
  for (int64_t D : {768, 1024, 300, 5000, 1001})
  for (auto t : kTypes) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "dim " << D << " " << t << " seed " << seed);
    auto x = draw({3, 37, D}, t, 2.0).first;
    auto opt = at::TensorOptions(at::kCUDA);
    auto w = (1.0 + 0.1 * at::randn({D}, opt)).requires_grad_(true);
    auto b = (0.1 * at::randn({D}, opt)).requires_grad_(true);
    auto wr = w.detach().to(at::kCPU, at::kDouble).requires_grad_(true);
    auto br = b.detach().to(at::kCPU, at::kDouble).requires_grad_(true);
    const double eps = 1e-5;
    poison();
    auto xs = (x + 3.0).to(t).detach().requires_grad_(true);  // mean 3
    auto xsr = xs.detach().to(at::kCPU, at::kDouble).requires_grad_(true);
    auto y = kernels::layer_norm(xs, w, b, eps);
    auto yr = at::layer_norm(xsr, {D}, wr, br, eps);
    ASSERT_EQ(y.scalar_type(), t);
    EXPECT_LT(rel_err(y, yr), bound(t));
    auto dy = at::randn(y.sizes(), opt).to(t);
    y.backward(dy);
    yr.backward(dy.to(at::kCPU, at::kDouble));
    EXPECT_LT(rel_err(xs.grad(), xsr.grad()), bound(t));
    EXPECT_LT(rel_err(w.grad(), wr.grad()), bound(t));
    EXPECT_LT(rel_err(b.grad(), br.grad()), bound(t));
    auto xs2 = xs.detach().requires_grad_(true);
    auto w2 = w.detach().requires_grad_(true), b2 = b.detach().requires_grad_(true);
    auto y2 = kernels::layer_norm(xs2, w2, b2, eps);
    y2.backward(dy);
    EXPECT_TRUE(at::equal(y, y2));
    EXPECT_TRUE(at::equal(xs.grad(), xs2.grad()));
    EXPECT_TRUE(at::equal(w.grad(), w2.grad()));
    EXPECT_TRUE(at::equal(b.grad(), b2.grad()));
  }
}

TEST(FusedKernels, AddLayerNormIsBitwiseTheTwoOps) {
  REQUIRE_GPU();
  // See Note [Residual add inside the norm]: (h, layer_norm(h)) for h = x +
  // res and the gradients of x, res, the weight and the bias (h also used
  // elsewhere, as on the residual) have the bits of the add followed by
  // the LayerNorm kernel; and they match an fp64 reference.
  for (int64_t D : {768, 300})
  for (auto t : kTypes) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "dim " << D << " " << t << " seed " << seed);
    auto [x, xr] = draw({3, 37, D}, t, 2.0);
    auto [r, rr] = draw({3, 37, D}, t, 2.0);
    const auto opt = at::TensorOptions(at::kCUDA);
    auto w = (1.0 + 0.1 * at::randn({D}, opt)).requires_grad_(true);
    auto b = (0.1 * at::randn({D}, opt)).requires_grad_(true);
    const double eps = 1e-5;
    auto gh = at::randn({3, 37, D}, opt).to(t);
    auto gy = at::randn({3, 37, D}, opt).to(t);
    poison();
    auto [h, y] = kernels::add_layer_norm(x, r, w, b, eps);
    torch::autograd::backward({h, y}, {gh, gy});
    auto x2 = x.detach().clone().requires_grad_(true);
    auto r2 = r.detach().clone().requires_grad_(true);
    auto w2 = w.detach().clone().requires_grad_(true);
    auto b2 = b.detach().clone().requires_grad_(true);
    auto h2 = x2 + r2;
    auto y2 = kernels::layer_norm(h2, w2, b2, eps);
    torch::autograd::backward({h2, y2}, {gh, gy});
    EXPECT_TRUE(at::equal(h, h2));
    EXPECT_TRUE(at::equal(y, y2));
    EXPECT_TRUE(at::equal(x.grad(), x2.grad()));
    EXPECT_TRUE(at::equal(r.grad(), r2.grad()));
    EXPECT_TRUE(at::equal(w.grad(), w2.grad()));
    EXPECT_TRUE(at::equal(b.grad(), b2.grad()));
    auto hr = xr + rr;
    auto wr = w.detach().to(at::kCPU, at::kDouble).requires_grad_(true);
    auto br = b.detach().to(at::kCPU, at::kDouble).requires_grad_(true);
    auto yr = at::layer_norm(hr, {D}, wr, br, eps);
    EXPECT_LT(rel_err(y, yr), bound(t));
    torch::autograd::backward({hr, yr},
                              {gh.to(at::kCPU, at::kDouble), gy.to(at::kCPU, at::kDouble)});
    EXPECT_LT(rel_err(x.grad(), xr.grad()), bound(t));
    EXPECT_LT(rel_err(w.grad(), wr.grad()), bound(t));
    EXPECT_LT(rel_err(b.grad(), br.grad()), bound(t));
  }
}

TEST(FusedKernels, RopeForwardBackward) {
  REQUIRE_GPU();
  const int64_t B = 2, T = 96, H = 6, hd = 64;
  auto tables = make_rope_tables(hd, 128, 10000.0);
  for (auto t : kTypes) {
    const auto seed = fresh_seed();
    auto [x, xr] = draw({B, T, H, hd}, t);
    auto c = tables.cos.to(at::kCUDA, at::kFloat).contiguous();
    auto s = tables.sin.to(at::kCUDA, at::kFloat).contiguous();
    poison();
    auto y = kernels::rope(x, c, s);
    // Reference: the ATen path in fp64 (ops::rope on CPU fp64 input).
    auto yr = ops::rope(xr, tables, ops::KernelOptions{});
    EXPECT_LT(rel_err(y, yr), bound(t)) << "seed " << seed << " " << t;
    backward_both(y, yr);
    EXPECT_LT(rel_err(x.grad(), xr.grad()), bound(t)) << "seed " << seed << " " << t;
  }
}

TEST(FusedKernels, RopeReadsStridedInput) {
  REQUIRE_GPU();
  // q sliced out of a wider qkv projection, as the attention feeds it.
  const int64_t B = 2, T = 40, H = 4, hd = 64, W = 3 * H * hd;
  auto tables = make_rope_tables(hd, 64, 10000.0);
  auto c = tables.cos.to(at::kCUDA, at::kFloat).contiguous();
  auto s = tables.sin.to(at::kCUDA, at::kFloat).contiguous();
  for (auto t : kTypes) {
    const auto seed = fresh_seed();
    auto qkv = at::randn({B, T, W}, at::TensorOptions(at::kCUDA)).to(t);
    auto q = qkv.narrow(-1, H * hd, H * hd).view({B, T, H, hd});
    ASSERT_FALSE(q.is_contiguous());
    poison();
    auto strided = kernels::rope(q, c, s);
    auto dense = kernels::rope(q.contiguous(), c, s);
    EXPECT_TRUE(at::equal(strided, dense)) << "seed " << seed << " " << t;
    // and a transposed (SDPA-gradient-like) input
    auto qt = at::randn({B, H, T, hd}, at::TensorOptions(at::kCUDA)).to(t).transpose(1, 2);
    EXPECT_TRUE(at::equal(kernels::rope(qt, c, s), kernels::rope(qt.contiguous(), c, s)))
        << "seed " << seed << " " << t;
  }
}

TEST(FusedKernels, RopeQkvIsTheThreeOpsBitwise) {
  REQUIRE_GPU();
  // The rotation of q, k and v as one function of the qkv product gives the
  // three ops' outputs, and its backward their gradients as the slices'
  // concatenation would, bit for bit; grouped (rep 3) and plain (rep 1) heads.
  const int64_t B = 2, T = 40, H = 6, hd = 64;
  auto tables = make_rope_tables(hd, 64, 10000.0);
  auto c = tables.cos.to(at::kCUDA, at::kFloat).contiguous();
  auto s = tables.sin.to(at::kCUDA, at::kFloat).contiguous();
  for (auto t : kTypes) {
    for (int64_t KV : {int64_t{2}, H}) {
      const auto seed = fresh_seed();
      const int64_t rep = H / KV, W = (H + 2 * KV) * hd;
      auto base = at::randn({B, T, W}, at::TensorOptions(at::kCUDA)).to(t);
      auto packed = base.clone().requires_grad_(true);
      auto sliced = base.clone().requires_grad_(true);
      poison();
      auto r = kernels::rope_qkv(packed, c, s, H, KV);
      auto part = [&](const at::Tensor& x, int64_t first, int64_t heads) {
        return x.narrow(2, first * hd, heads * hd).view({B, T, heads, hd});
      };
      std::vector<at::Tensor> e{kernels::rope(part(sliced, 0, H), c, s),
                                kernels::rope(part(sliced, H, KV), c, s, rep),
                                kernels::repeat_heads(part(sliced, H + KV, KV), rep)};
      for (int i = 0; i < 3; ++i) {
        ASSERT_EQ(r[i].sizes(), (std::vector<int64_t>{B, T, H, hd}));
        EXPECT_TRUE(at::equal(r[i], e[i])) << "output " << i << " seed " << seed << " " << t;
      }
      // SDPA-like (transposed) gradients, the same for both.
      at::Tensor loss_r, loss_e;
      for (int i = 0; i < 3; ++i) {
        auto g = at::randn({B, H, T, hd}, at::TensorOptions(at::kCUDA)).to(t).transpose(1, 2);
        auto lr = (r[i].to(at::kFloat) * g.to(at::kFloat)).sum();
        auto le = (e[i].to(at::kFloat) * g.to(at::kFloat)).sum();
        loss_r = i == 0 ? lr : loss_r + lr;
        loss_e = i == 0 ? le : loss_e + le;
      }
      loss_r.backward();
      loss_e.backward();
      EXPECT_TRUE(packed.grad().is_contiguous());
      EXPECT_TRUE(at::equal(packed.grad(), sliced.grad()))
          << "KV " << KV << " seed " << seed << " " << t;
    }
  }
}

TEST(FusedKernels, MlaInputsAreRopeCatAndNarrow) {
  REQUIRE_GPU();
  // MLA's attention inputs as one function against the separate ops it
  // replaces (the RoPE kernel, cat, narrow) on the same tensors: the
  // outputs and q's and kv's gradients bit for bit, k_pe's (its heads' sum
  // rounded once, where expand's backward rounded it before the rotation)
  // against fp64; q strided (a slice of a wider product), with and without
  // the rotation, v as it is and zero-padded to q's width.
  const int64_t B = 2, T = 40, H = 4, nope = 64, pe = 32, vd = 48;
  const auto tables = make_rope_tables(pe, 64, 10000.0);
  const ops::KernelOptions k;
  for (auto t : kTypes) {
    for (const auto& [rotate, v_width] :
         std::vector<std::pair<bool, int64_t>>{{true, 0}, {false, 0}, {true, nope + pe}}) {
      const auto seed = fresh_seed();
      const auto vw = v_width > 0 ? v_width : vd;
      const auto o = at::TensorOptions(at::kCUDA).dtype(t);
      auto wide = at::randn({B, T, H * (nope + pe) + 16}, o);
      auto kv0 = at::randn({B, T, H, nope + vd}, o);
      auto kpe0 = at::randn({B, T, 1, pe}, o);
      const ops::RopeTables none;
      const auto& tb = rotate ? tables : none;
      const std::vector<at::Tensor> g{
          at::randn({B, T, H, nope + pe}, at::TensorOptions(at::kCUDA)),
          at::randn({B, T, H, nope + pe}, at::TensorOptions(at::kCUDA)),
          at::randn({B, T, H, vw}, at::TensorOptions(at::kCUDA))};
      struct Run {
        ops::MlaAttentionInputs in;
        at::Tensor wide, kv, kpe;  // the leaves, with their gradients
      };
      auto run = [&](bool one_function) {
        Run r;
        r.wide = wide.clone().requires_grad_(true);
        r.kv = kv0.clone().requires_grad_(true);
        r.kpe = kpe0.clone().requires_grad_(true);
        auto q = r.wide.narrow(2, 16, H * (nope + pe)).view({B, T, H, nope + pe});
        if (one_function) {
          r.in = ops::mla_attention_inputs(q, r.kpe, r.kv, nope, tb, k, v_width);
        } else {
          auto q_pe = q.narrow(3, nope, pe);
          auto kp = at::Tensor(r.kpe);
          if (rotate) {
            q_pe = ops::rope(q_pe, tables, k);
            kp = ops::rope(kp, tables, k);
          }
          r.in = {at::cat({q.narrow(3, 0, nope), q_pe}, -1),
                  at::cat({r.kv.narrow(3, 0, nope), kp.expand({B, T, H, pe})}, -1),
                  at::constant_pad_nd(r.kv.narrow(3, nope, vd), {0, vw - vd})};
        }
        auto loss = (r.in.q.to(at::kFloat) * g[0]).sum() + (r.in.k.to(at::kFloat) * g[1]).sum() +
                    (r.in.v.to(at::kFloat) * g[2]).sum();
        loss.backward();
        return r;
      };
      poison();
      auto fused = run(true);
      auto ref = run(false);
      EXPECT_TRUE(at::equal(fused.in.q, ref.in.q)) << "seed " << seed << " " << t;
      EXPECT_TRUE(at::equal(fused.in.k, ref.in.k)) << "seed " << seed << " " << t;
      EXPECT_TRUE(at::equal(fused.in.v, ref.in.v)) << "seed " << seed << " " << t;
      EXPECT_TRUE(fused.in.q.is_contiguous() && fused.in.k.is_contiguous() &&
                  fused.in.v.is_contiguous());
      EXPECT_TRUE(at::equal(fused.wide.grad(), ref.wide.grad())) << "seed " << seed << " " << t;
      EXPECT_TRUE(at::equal(fused.kv.grad(), ref.kv.grad())) << "seed " << seed << " " << t;
      // k_pe's gradient: the heads' sum, rotated back, in fp64 on the CPU.
      auto gk = g[1].narrow(3, nope, pe).to(at::kCPU, at::kDouble).sum(2, /*keepdim=*/true);
      auto kr = kpe0.to(at::kCPU, at::kDouble).requires_grad_(true);
      auto rot = rotate ? ops::rope(kr, tables, k) : kr;
      (rot * gk).sum().backward();
      EXPECT_LT(rel_err(fused.kpe.grad(), kr.grad()), bound(t)) << "seed " << seed << " " << t;
    }
  }
}

// The word copies against ATen's: narrowed channels of 2- to 4-dim tensors
// (rows contiguous, strided, transposed heads), the same bytes; layouts the
// words cannot take (an odd offset, a row of 3 values) fall back to ATen's
// copy.
TEST(FusedKernels, WordCopiesAreAtensCopies) {
  REQUIRE_GPU();
  for (auto t : kTypes) {
    SCOPED_TRACE(testing::Message() << t);
    const auto o = at::TensorOptions(at::kCUDA).dtype(t);
    const int64_t w = t == at::kFloat ? 4 : 8;  // values in 16 bytes
    auto src4 = at::randn({2, 5, 3, 6 * w}, o);
    auto wide = at::randn({2, 5, 3, 9 * w}, o);
    struct Case {
      const char* what;
      at::Tensor src, dst;
      bool words;  // the word kernel takes it (else ATen's copy)
    };
    const std::vector<Case> cases{
        {"narrowed channels", src4.narrow(3, w, 4 * w), wide.narrow(3, 2 * w, 4 * w), true},
        {"transposed heads", src4.transpose(1, 2).narrow(3, 0, 2 * w),
         wide.transpose(1, 2).narrow(3, 3 * w, 2 * w), true},
        {"three dims", src4.view({10, 3, 6 * w}).narrow(2, w, w),
         wide.view({10, 3, 9 * w}).narrow(2, 0, w), true},
        {"two dims", src4.view({30, 6 * w}), wide.view({30, 9 * w}).narrow(1, w, 6 * w), true},
        {"odd offset", src4.narrow(3, 1, 2 * w), wide.narrow(3, 1, 2 * w), false},
        {"row of 3", src4.narrow(3, 0, 3), wide.narrow(3, 0, 3), false},
    };
    for (const auto& c : cases) {
      auto expect = wide.clone();
      auto dst_expect = expect.as_strided(c.dst.sizes(), c.dst.strides(), c.dst.storage_offset());
      dst_expect.copy_(c.src);
      auto before = wide.clone();
      EXPECT_EQ(kernels::copy_rows_into(c.dst, c.src), c.words) << c.what;
      EXPECT_TRUE(at::equal(wide, expect)) << c.what;
      wide.copy_(before);
    }
  }
}

// The word copy widening bf16 into fp32 (the experts' weight gradients'
// halves): ATen's cast bit for bit, NaN, infinities, signed zeros and
// subnormals among the values, into a contiguous and a strided fp32
// destination; a layout the words cannot take falls back to ATen's cast.
TEST(FusedKernels, WordCopiesWidenBf16AsAtensCast) {
  REQUIRE_GPU();
  const auto cuda = at::TensorOptions(at::kCUDA);
  auto both = at::randn({4, 48, 40}, cuda).to(at::kBFloat16);
  const auto special = at::tensor({std::nanf(""), INFINITY, -INFINITY, -0.0f, 0.0f, 1e-40f,
                                   -1e-40f, 3.0e38f},
                                  cuda)
                           .to(at::kBFloat16);
  both.view(-1).narrow(0, 16, 8).copy_(special);  // inside the first half
  for (const int64_t from : {0, 16}) {
    const auto half = both.narrow(1, from, 32 - from);
    const auto expect = half.to(at::kFloat);
    auto out = at::full(half.sizes(), 7.0, cuda.dtype(at::kFloat));
    EXPECT_TRUE(kernels::copy_rows_into(out, half)) << "from " << from;
    // Bit patterns, so that NaN compares equal to itself.
    EXPECT_TRUE(at::equal(out.view(at::kInt), expect.view(at::kInt))) << "from " << from;
    auto wide = at::full({4, 48, 56}, 7.0, cuda.dtype(at::kFloat));
    auto strided = wide.narrow(1, 0, 32 - from).narrow(2, 8, 40);
    EXPECT_TRUE(kernels::copy_rows_into(strided, half)) << "from " << from;
    EXPECT_TRUE(at::equal(strided.contiguous().view(at::kInt), expect.view(at::kInt)));
    EXPECT_TRUE(at::equal(wide.narrow(2, 0, 8), at::full({4, 48, 8}, 7.0, wide.options())));
  }
  const auto odd = both.narrow(2, 1, 3);  // rows of 6 bytes: ATen's cast
  auto out = at::empty(odd.sizes(), cuda.dtype(at::kFloat));
  EXPECT_FALSE(kernels::copy_rows_into(out, odd));
  EXPECT_TRUE(at::equal(out.view(at::kInt), odd.to(at::kFloat).view(at::kInt)));
}

TEST(FusedKernels, RopeRepeatsGroupedHeads) {
  REQUIRE_GPU();
  // Grouped KV heads: rope(k, repeat) is rope(k) repeated on the head dim,
  // bit for bit; its backward sums the copies' (SDPA-transposed) gradients.
  const int64_t B = 2, T = 40, KV = 2, rep = 3, hd = 64;
  auto tables = make_rope_tables(hd, 64, 10000.0);
  auto c = tables.cos.to(at::kCUDA, at::kFloat).contiguous();
  auto s = tables.sin.to(at::kCUDA, at::kFloat).contiguous();
  for (auto t : kTypes) {
    const auto seed = fresh_seed();
    auto [x, xr] = draw({B, T, KV, hd}, t);
    poison();
    auto y = kernels::rope(x, c, s, rep);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{B, T, KV * rep, hd}));
    EXPECT_TRUE(at::equal(y, kernels::rope(x.detach(), c, s).repeat_interleave(rep, 2)))
        << "seed " << seed << " " << t;
    auto yr = ops::rope(xr, tables, ops::KernelOptions{}).repeat_interleave(rep, 2);
    // An SDPA-like (transposed) gradient.
    backward_both(y, yr,
                  at::randn({B, KV * rep, T, hd}, at::TensorOptions(at::kCUDA)).to(t).transpose(1, 2));
    EXPECT_LT(rel_err(x.grad(), xr.grad()), bound(t)) << "seed " << seed << " " << t;
  }
}

TEST(FusedKernels, UnrotatedAttentionOverTheQkvProductHasTheSlicesGradient) {
  REQUIRE_GPU();
  // See Note [The unrotated qkv gradient written whole]: gpt2's attention on
  // the fused kernel, given the qkv product its q, k and v are slices of,
  // against the same slices with no product named (their gradients
  // through narrow's backward): the same output and product gradient, bf16,
  // under deterministic algorithms (flash's kernel, whose gradients repeat).
  const bool det = at::globalContext().deterministicAlgorithms();
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  const int64_t B = 2, T = 256, H = 4, hd = 64;
  const auto seed = fresh_seed();
  const auto o = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
  const auto qkv0 = at::randn({B, T, 3 * H * hd}, o);
  const auto dy = at::randn({B, H, T, hd}, o);
  auto run = [&](bool product) {
    auto qkv = qkv0.clone().requires_grad_(true);
    auto part = [&](int64_t i) { return qkv.narrow(-1, i * H * hd, H * hd).view({B, T, H, hd}); };
    auto y = ops::causal_attention(part(0), part(1), part(2), nullptr, ops::KernelOptions{},
                                   nullptr, product ? qkv : at::Tensor());
    y.backward(dy);
    return std::vector<at::Tensor>{y.detach(), qkv.grad()};
  };
  const auto whole = run(true), apart = run(false);
  EXPECT_TRUE(at::equal(whole[0], apart[0])) << "seed " << seed;
  EXPECT_TRUE(at::equal(whole[1], apart[1])) << "seed " << seed;
  EXPECT_GT(whole[1].narrow(-1, 2 * H * hd, H * hd).abs().sum().item<double>(), 0.0);
  at::globalContext().setDeterministicAlgorithms(det, /*warn_only=*/false);
}

TEST(FusedKernels, AttentionCoreRunsSdpasKernel) {
  REQUIRE_GPU();
  if (!VIADUCT_FUSED_ATTENTION) GTEST_SKIP() << "no fused attention ops in this LibTorch";
  // ops::causal_attention's core calls the forward and backward ops of the
  // kernel scaled_dot_product_attention picks for the same tensors: the
  // same output bits as SDPA, gradients within bf16 rounding of SDPA's
  // (the same kernels; cuDNN's backward may sum in another order), and
  // under deterministic algorithms cuDNN's forward (where SDPA takes cuDNN's
  // kernel without them: the same output bits as that SDPA) with flash's
  // backward, or flash's pair; either way gradients that repeat bit for
  // bit, and within bf16 rounding of flash's own pair's.
  const bool det = at::globalContext().deterministicAlgorithms();
  const int64_t B = 2, T = 256, H = 4, hd = 64;
  for (const bool deterministic : {true, false}) {
    at::globalContext().setDeterministicAlgorithms(deterministic, /*warn_only=*/false);
    const auto seed = fresh_seed();
    const auto o = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
    const auto q0 = at::randn({B, T, H, hd}, o), k0 = at::randn({B, T, H, hd}, o),
               v0 = at::randn({B, T, H, hd}, o), dy = at::randn({B, H, T, hd}, o);
    // Asked as the layer asks: of [B, H, T, hd] views of leaves that need
    // their gradients.
    const auto kernel = compat::fused_attention_for(
        q0.clone().requires_grad_(true).transpose(1, 2),
        k0.clone().requires_grad_(true).transpose(1, 2),
        v0.clone().requires_grad_(true).transpose(1, 2));
    ASSERT_NE(kernel, compat::FusedAttention::kNone) << "deterministic " << deterministic;
    if (deterministic) {
      EXPECT_TRUE(kernel == compat::FusedAttention::kFlash ||
                  kernel == compat::FusedAttention::kCudnnFlash);
    } else {
      EXPECT_NE(kernel, compat::FusedAttention::kCudnnFlash);
    }
    // The reference SDPA runs where the forward's kernel is the same: with
    // deterministic algorithms off for kCudnnFlash's (cuDNN's).
    const bool sdpa_deterministic =
        deterministic && kernel != compat::FusedAttention::kCudnnFlash;
    auto run = [&](bool ours, const at::Tensor& g) {
      auto q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true),
           v = v0.clone().requires_grad_(true);
      if (!ours) at::globalContext().setDeterministicAlgorithms(sdpa_deterministic, false);
      auto y = ours ? ops::causal_attention(q, k, v, nullptr, ops::KernelOptions{})
                    : at::scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                       v.transpose(1, 2), {}, 0.0, true);
      y.backward(g);
      at::globalContext().setDeterministicAlgorithms(deterministic, false);
      return std::vector<at::Tensor>{y.detach(), q.grad(), k.grad(), v.grad()};
    };
    // Flash's own pair, forward and backward, as the second algorithm for
    // the mixed pair's gradients.
    auto flash_pair = [&](const at::Tensor& g) {
      auto q = q0.clone().requires_grad_(true).transpose(1, 2),
           k = k0.clone().requires_grad_(true).transpose(1, 2),
           v = v0.clone().requires_grad_(true).transpose(1, 2);
      auto fwd = compat::causal_fused_forward(compat::FusedAttention::kFlash, q, k, v);
      auto d = compat::causal_fused_backward(compat::FusedAttention::kFlash, g.contiguous(), q,
                                             k, v, fwd);
      return std::vector<at::Tensor>{fwd[0], d[0], d[1], d[2]};
    };
    // The output's gradient in the token layout ([B, T, H, hd] memory, as
    // the projection after the attention hands it back), after a call with
    // a contiguous one: the same gradients (cuDNN's backward, handed the
    // token layout as it is, reused the graph built for the other strides
    // and returned wrong gradients).
    const auto dy_tokens = dy.transpose(1, 2).contiguous().transpose(1, 2);
    const auto ours = run(true, dy), sdpa = run(false, dy), again = run(true, dy),
               tokens = run(true, dy_tokens);
    EXPECT_TRUE(at::equal(ours[0], sdpa[0])) << "seed " << seed << " deterministic "
                                             << deterministic;
    for (size_t i = 1; i < ours.size(); ++i) {
      EXPECT_LT(rel_err(ours[i], sdpa[i]), 1e-2) << "gradient " << i << " seed " << seed;
      EXPECT_LT(rel_err(tokens[i], sdpa[i]), 1e-2) << "gradient " << i << " seed " << seed;
      if (deterministic) {
        EXPECT_TRUE(at::equal(ours[i], again[i])) << "gradient " << i;
        EXPECT_TRUE(at::equal(ours[i], tokens[i])) << "gradient " << i;
      }
    }
    if (deterministic) {
      // ours' gradients are of [B, T, H, hd] leaves, flash's of their
      // [B, H, T, hd] views.
      const auto flash = flash_pair(dy);
      EXPECT_LT(rel_err(ours[0], flash[0]), 1e-2) << "output, seed " << seed;
      for (size_t i = 1; i < ours.size(); ++i) {
        EXPECT_LT(rel_err(ours[i], flash[i].transpose(1, 2)), 1e-2)
            << "gradient " << i << " against flash's pair, seed " << seed;
      }
    }
  }
  at::globalContext().setDeterministicAlgorithms(det, /*warn_only=*/false);
}

TEST(FusedKernels, AttentionCoreTakesNarrowerValueHeads) {
  REQUIRE_GPU();
  if (!VIADUCT_FUSED_ATTENTION) GTEST_SKIP() << "no fused attention ops in this LibTorch";
  // See Note [Narrow value heads on flash's kernel]: MLA's shapes (q and k
  // 192 wide, v 128) against causal attention in fp64 on the CPU, output
  // and gradients; under deterministic algorithms through flash's backward
  // (after cuDNN's forward or flash's) on zero-padded values, gradients
  // repeating bit for bit.
  const bool det = at::globalContext().deterministicAlgorithms();
  const int64_t B = 2, H = 4, T = 256, d = 192, dv = 128;
  for (const bool deterministic : {true, false}) {
    at::globalContext().setDeterministicAlgorithms(deterministic, /*warn_only=*/false);
    const auto seed = fresh_seed();
    const auto o = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
    const auto q0 = at::randn({B, H, T, d}, o), k0 = at::randn({B, H, T, d}, o),
               v0 = at::randn({B, H, T, dv}, o), dy = at::randn({B, H, T, dv}, o);
    if (deterministic) {
      const auto padded = at::constant_pad_nd(v0, {0, d - dv}).requires_grad_(true);
      const auto kernel = compat::fused_attention_for(q0.clone().requires_grad_(true),
                                                      k0.clone().requires_grad_(true), padded);
      EXPECT_TRUE(kernel == compat::FusedAttention::kFlash ||
                  kernel == compat::FusedAttention::kCudnnFlash);
    }
    auto run = [&] {
      auto q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true),
           v = v0.clone().requires_grad_(true);
      auto y = ops::causal_attention_core(q, k, v);
      y.backward(dy);
      return std::vector<at::Tensor>{y.detach(), q.grad(), k.grad(), v.grad()};
    };
    const auto ours = run(), again = run();
    auto f64 = [](const at::Tensor& t) {
      return t.to(at::kCPU, at::kDouble).detach().requires_grad_(true);
    };
    auto q = f64(q0), k = f64(k0), v = f64(v0);
    auto s = at::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(d));
    auto mask = at::ones({T, T}, at::kBool).triu(1);
    auto y = at::matmul(at::softmax(s.masked_fill(mask, -INFINITY), -1), v);
    y.backward(dy.to(at::kCPU, at::kDouble));
    const std::vector<at::Tensor> ref{y.detach(), q.grad(), k.grad(), v.grad()};
    ASSERT_EQ(ours[0].sizes(), ref[0].sizes());
    for (size_t i = 0; i < ours.size(); ++i) {
      EXPECT_LT(rel_err(ours[i], ref[i]), 1e-2)
          << "tensor " << i << " seed " << seed << " deterministic " << deterministic;
      if (deterministic) EXPECT_TRUE(at::equal(ours[i], again[i])) << "tensor " << i;
    }
  }
  at::globalContext().setDeterministicAlgorithms(det, /*warn_only=*/false);
}

TEST(FusedKernels, VarlenAttentionIsEachSequenceAlone) {
  REQUIRE_GPU();
  if (!VIADUCT_FUSED_ATTENTION) GTEST_SKIP() << "no fused attention ops in this LibTorch";
  // Three sequences packed end to end through flash's variable-length
  // kernel: each one's output and gradients against causal attention of
  // that sequence alone in fp64 on the CPU; head widths equal (llama) and
  // the values narrower (MLA); gradients repeat bit for bit under
  // deterministic algorithms.
  const bool det = at::globalContext().deterministicAlgorithms();
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  const std::vector<int64_t> lengths{37, 100, 119};
  const int64_t N = 256, H = 4;
  const auto cu = at::tensor(std::vector<int32_t>{0, 37, 137, 256},
                             at::TensorOptions(at::kCUDA).dtype(at::kInt));
  for (const auto& [d, dv] : std::vector<std::pair<int64_t, int64_t>>{{64, 64}, {192, 128}}) {
    const auto seed = fresh_seed();
    const auto o = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
    const auto q0 = at::randn({N, H, d}, o), k0 = at::randn({N, H, d}, o),
               v0 = at::randn({N, H, dv}, o), dy = at::randn({N, H, dv}, o);
    auto run = [&] {
      auto q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true),
           v = v0.clone().requires_grad_(true);
      auto y = ops::varlen_causal_attention(q, k, v, cu, 119);
      y.backward(dy);
      return std::vector<at::Tensor>{y.detach(), q.grad(), k.grad(), v.grad()};
    };
    const auto ours = run(), again = run();
    for (size_t i = 0; i < ours.size(); ++i) {
      EXPECT_TRUE(at::equal(ours[i], again[i])) << "tensor " << i << " d " << d;
    }
    int64_t start = 0;
    for (const int64_t L : lengths) {
      auto f64 = [&](const at::Tensor& t) {  // [L, H, w] -> [H, L, w], fp64 leaf
        return t.narrow(0, start, L).transpose(0, 1).to(at::kCPU, at::kDouble).detach()
            .requires_grad_(true);
      };
      auto q = f64(q0), k = f64(k0), v = f64(v0);
      auto s = at::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(d));
      auto mask = at::ones({L, L}, at::kBool).triu(1);
      auto y = at::matmul(at::softmax(s.masked_fill(mask, -INFINITY), -1), v);
      y.backward(dy.narrow(0, start, L).transpose(0, 1).to(at::kCPU, at::kDouble));
      const std::vector<at::Tensor> ref{y.detach(), q.grad(), k.grad(), v.grad()};
      for (size_t i = 0; i < ours.size(); ++i) {
        EXPECT_LT(rel_err(ours[i].narrow(0, start, L).transpose(0, 1), ref[i]), 1e-2)
            << "tensor " << i << " sequence at " << start << " d " << d << " seed " << seed;
      }
      start += L;
    }
  }
  at::globalContext().setDeterministicAlgorithms(det, /*warn_only=*/false);
}

TEST(FusedKernels, BlockCausalAttentionIsEachDocumentAlone) {
  REQUIRE_GPU();
  if (!VIADUCT_FUSED_ATTENTION) GTEST_SKIP() << "no fused attention ops in this LibTorch";
  // block_causal attention on CUDA (rows as one sequence, RoPE per token,
  // flash's variable-length kernel) against the CPU's route in fp64 (each
  // document through the plain op from its own first position, the path the
  // A|B|C tests prove equal to a document alone): outputs and gradients,
  // grouped KV heads, positions reset and running through the window.
  const int64_t B = 2, T = 96, H = 4, KV = 2, hd = 64;
  auto tables = make_rope_tables(hd, T, 10000.0);
  auto starts = at::zeros({B, T}, at::kBool);
  for (const int64_t t : {17, 18, 50}) starts[0][t] = true;  // a 1-token document
  for (const int64_t t : {63, 64}) starts[1][t] = true;
  for (const bool reset : {true, false}) {
    const ops::Documents docs(starts, reset);
    const auto seed = fresh_seed();
    auto [q, qr] = draw({B, T, H, hd}, at::kBFloat16);
    auto [k, kr] = draw({B, T, KV, hd}, at::kBFloat16);
    auto [v, vr] = draw({B, T, KV, hd}, at::kBFloat16);
    auto y = ops::causal_attention(q, k, v, &tables, ops::KernelOptions{}, &docs);
    auto yr = ops::causal_attention(qr, kr, vr, &tables, ops::KernelOptions{}, &docs);
    ASSERT_EQ(y.sizes(), yr.sizes());
    EXPECT_LT(rel_err(y, yr), 1e-2) << "seed " << seed << " reset " << reset;
    backward_both(y, yr);
    EXPECT_LT(rel_err(q.grad(), qr.grad()), 1e-2) << "seed " << seed << " reset " << reset;
    EXPECT_LT(rel_err(k.grad(), kr.grad()), 1e-2) << "seed " << seed << " reset " << reset;
    EXPECT_LT(rel_err(v.grad(), vr.grad()), 1e-2) << "seed " << seed << " reset " << reset;
  }
}

TEST(FusedKernels, RepeatHeadsMatchesRepeatInterleave) {
  REQUIRE_GPU();
  // See Note [Repeated heads without a gather]: v's grouped heads, a strided
  // slice of one qkv output as in the attention layer, repeated for SDPA:
  // bit for bit repeat_interleave's copy; the backward sums the copies.
  const int64_t B = 2, T = 40, H = 6, KV = 2, rep = H / KV, hd = 64;
  for (auto t : kTypes) {
    const auto seed = fresh_seed();
    auto [qkv, qkv_reference] = draw({B, T, (H + 2 * KV) * hd}, t);
    auto v = qkv.narrow(-1, (H + KV) * hd, KV * hd).view({B, T, KV, hd});
    auto vr = qkv_reference.narrow(-1, (H + KV) * hd, KV * hd).view({B, T, KV, hd});
    poison();
    auto y = kernels::repeat_heads(v, rep);
    auto yr = vr.repeat_interleave(rep, 2);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{B, T, H, hd}));
    EXPECT_TRUE(at::equal(y.detach().to(at::kCPU, at::kDouble), yr.detach()))
        << "seed " << seed << " " << t;
    backward_both(y, yr,
                  at::randn({B, H, T, hd}, at::TensorOptions(at::kCUDA)).to(t).transpose(1, 2));
    EXPECT_LT(rel_err(qkv.grad(), qkv_reference.grad()), bound(t)) << "seed " << seed << " " << t;
  }
}

// n sources of `shape` (the last dim the width) and type t, source i scaled
// by 1 + i / 2, as CUDA leaves and fp64 CPU copies; the query and the norm
// weight. shifted: source 0 starts one element past a 16-byte boundary, so
// the kernels read the rows one value at a time.
struct ReadInputs {
  std::vector<at::Tensor> src, src_reference;
  at::Tensor q, w;
};
ReadInputs draw_read(at::IntArrayRef shape, int64_t n, at::ScalarType t, bool shifted = false) {
  ReadInputs in;
  for (int64_t i = 0; i < n; ++i) {
    auto [v, vr] = draw(shape, t, 1.0 + 0.5 * static_cast<double>(i));
    if (shifted && i == 0) {
      auto buf = at::empty({v.numel() + 1}, v.options());
      buf.narrow(0, 1, v.numel()).copy_(v.detach().flatten());
      v = buf.narrow(0, 1, v.numel()).view(v.sizes()).detach().requires_grad_(true);
    }
    in.src.push_back(v);
    in.src_reference.push_back(vr);
  }
  const auto D = shape.back();
  in.q = (at::randn({D}, at::TensorOptions(at::kCUDA)) * 0.3).requires_grad_(true);
  in.w = (1.0 + 0.1 * at::randn({D}, at::TensorOptions(at::kCUDA))).requires_grad_(true);
  return in;
}

// The read kernels against the module's ATen
// form in fp64 on the CPU: the output and the gradients of every source,
// the query and the norm weight.
void expect_read_matches_aten(int64_t D, int64_t n, at::ScalarType t, bool shifted = false) {
  const auto seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "dim " << D << " sources " << n << " " << t
                                  << (shifted ? " shifted" : "") << " seed " << seed);
  auto in = draw_read({2, 37, D}, n, t, shifted);
  AttnResRead reference(D, 1e-5);
  reference->to(at::kDouble);
  {
    torch::NoGradGuard g;
    reference->query.copy_(in.q.detach().cpu());
    reference->norm->weight.copy_(in.w.detach().cpu());
  }
  poison();
  auto y = kernels::attn_res_read(in.src, in.q, in.w, 1e-5);
  auto yr = reference->forward(in.src_reference);
  ASSERT_EQ(y.scalar_type(), t);
  EXPECT_LT(rel_err(y, yr), bound(t));
  backward_both(y, yr);
  // Past 9 sources the fp32 gradients sum many small, cancelling terms per
  // value and land just past 1e-5 from fp64 at wide rows, so fp32 is held
  // to 5e-5 there, the bound two fp32 orders of these sums keep (bf16 keeps
  // its bound).
  const double b = t == at::kFloat && n > 9 ? 5e-5 : bound(t);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_LT(rel_err(in.src[i].grad(), in.src_reference[i].grad()), b) << "source " << i;
  }
  EXPECT_LT(rel_err(in.q.grad(), reference->query.grad()), b);
  EXPECT_LT(rel_err(in.w.grad(), reference->norm->weight.grad()), b);
}

// The read's output, then the gradients of the sources, the query and the
// norm weight, from fresh leaves over `in`'s values and output gradient dy.
std::vector<at::Tensor> read_outputs(const ReadInputs& in, const at::Tensor& dy) {
  std::vector<at::Tensor> src;
  for (const auto& v : in.src) src.push_back(v.detach().requires_grad_(true));
  auto q = in.q.detach().requires_grad_(true), w = in.w.detach().requires_grad_(true);
  poison();
  auto y = kernels::attn_res_read(src, q, w, 1e-5);
  y.backward(dy);
  std::vector<at::Tensor> out{y.detach()};
  for (const auto& v : src) out.push_back(v.grad());
  out.push_back(q.grad());
  out.push_back(w.grad());
  return out;
}

TEST(FusedKernels, AttnResReadMatchesAtenRead) {
  REQUIRE_GPU();
  // Widths vectorised (512) and scalar (100); one source and several.
  for (int64_t D : {512, 100})
  for (int64_t n : {1, 5})
  for (auto t : kTypes) expect_read_matches_aten(D, n, t);
}

TEST(FusedKernels, AttnResReadWarpPerRowMatchesAtenRead) {
  REQUIRE_GPU();
  // The warp-per-row kernels (see Note [Fused AttnRes read, warp per row]):
  // register forms (2048: whole rows in bf16, the loop form in fp32; 1000:
  // lanes past the row's end) and loop forms (4096; the odd 1001 and a
  // source off 16-byte alignment, read one value at a time). n = 40 puts
  // sources in the lanes' second slot.
  struct Width {
    int64_t D;
    bool shifted;
  };
  for (auto c : {Width{2048, false}, Width{1000, false}, Width{4096, false}, Width{1001, false},
                 Width{2048, true}})
  for (int64_t n : {1, 3, 9, 40})
  for (auto t : kTypes) expect_read_matches_aten(c.D, n, t, c.shifted);
}

TEST(FusedKernels, AttnResReadIsDeterministic) {
  REQUIRE_GPU();
  // Run to run, bit for bit, on 9000 rows (several rows per warp in the
  // backward): register forms (2048 bf16, 1000 fp32) and loop forms (4096
  // bf16, 1001 fp32).
  const std::pair<int64_t, at::ScalarType> cases[] = {
      {2048, at::kBFloat16}, {1000, at::kFloat}, {4096, at::kBFloat16}, {1001, at::kFloat}};
  for (const auto& [D, t] : cases) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "dim " << D << " " << t << " seed " << seed);
    auto in = draw_read({2, 4500, D}, 5, t);
    auto dy = at::randn({2, 4500, D}, at::TensorOptions(at::kCUDA)).to(t);
    const auto first = read_outputs(in, dy), second = read_outputs(in, dy);
    ASSERT_EQ(first.size(), second.size());
    for (size_t i = 0; i < first.size(); ++i) {
      EXPECT_TRUE(at::isfinite(first[i]).all().item<bool>()) << "output " << i;
      EXPECT_TRUE(at::equal(first[i], second[i])) << "output " << i;
    }
  }
}

TEST(FusedKernels, AttnResReadAddsIntoSlotsWithAutogradsBits) {
  REQUIRE_GPU();
  // See Note [AttnRes block gradients in place] (model/attn_res.h): a slot that
  // holds a gradient receives it + this read's gradient as the source's
  // dtype adds them (autograd's sum), an empty slot becomes the gradient,
  // and the source itself gets none; bit for bit against the read without
  // slots. The register (2048) and loop (4096, 1001) forms add in the
  // kernel.
  for (int64_t D : {2048, 4096, 1001})
  for (auto t : kTypes) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "dim " << D << " " << t << " seed " << seed);
    auto in = draw_read({2, 45, D}, 3, t);
    auto dy = at::randn({2, 45, D}, at::TensorOptions(at::kCUDA)).to(t);
    auto prior = at::randn({2, 45, D}, at::TensorOptions(at::kCUDA)).to(t);
    const auto plain = read_outputs(in, dy);  // y, dv_0..2, dq, dw
    std::vector<at::Tensor> src;
    for (const auto& v : in.src) src.push_back(v.detach().requires_grad_(true));
    auto q = in.q.detach().requires_grad_(true), w = in.w.detach().requires_grad_(true);
    std::vector<at::Tensor> slots{attn_res_new_slot(src[0]), attn_res_new_slot(src[1]),
                                  at::Tensor()};
    // The slot's first sum shares its storage with another holder (as a
    // partial sum's slot does with x's gradient): the read must not write it.
    auto held = prior.clone();
    kernels::attn_res_slot_add(slots[0], held);
    poison();
    auto y = kernels::attn_res_read(src, q, w, 1e-5, &slots);
    y.backward(dy);
    EXPECT_TRUE(at::equal(y, plain[0]));
    EXPECT_TRUE(at::equal(slots[0], prior + plain[1])) << "slot with a gradient";
    EXPECT_TRUE(at::equal(held, prior)) << "the slot's earlier storage was written";
    EXPECT_TRUE(at::equal(slots[1], plain[2])) << "empty slot";
    EXPECT_FALSE(src[0].grad().defined());
    EXPECT_FALSE(src[1].grad().defined());
    EXPECT_TRUE(at::equal(src[2].grad(), plain[3])) << "source without a slot";
    EXPECT_TRUE(at::equal(q.grad(), plain[4]));
    EXPECT_TRUE(at::equal(w.grad(), plain[5]));
  }
}

// See Note [AttnRes read with its norm]: norm(read(sources)) in one kernel each
// way against the fp64 modules (the read, then the RMSNorm): register forms
// (2048 and 1000 bf16: lanes past the row's end; 1000 and 512 fp32), 1 to 6
// sources, with slots (one holding a gradient, one empty) and without; both
// backward forms (see Note [Read with its norm in two passes]: two passes up to
// 5 sources, three beyond), each chosen by the source count.
TEST(FusedKernels, AttnResReadNormMatchesAtenReadThenNorm) {
  REQUIRE_GPU();
  struct Case {
    int64_t D;
    at::ScalarType t;
  };
  for (auto c : {Case{2048, at::kBFloat16}, Case{1000, at::kBFloat16}, Case{1000, at::kFloat},
                 Case{512, at::kFloat}})
  for (int64_t n : {1, 2, 3, 4, 5, 6})
  for (bool slots_on : {false, true}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << (n <= 5 ? "two" : "three") << " passes, dim " << c.D
                                    << " " << c.t << " sources " << n
                                    << (slots_on ? " with slots" : "") << " seed " << seed);
    auto in = draw_read({2, 37, c.D}, n, c.t);
    auto ow = (1.0 + 0.1 * at::randn({c.D}, at::TensorOptions(at::kCUDA))).requires_grad_(true);
    AttnResRead reference_read(c.D, 1e-5);
    RMSNorm reference_norm(c.D, 1e-6);
    reference_read->to(at::kDouble);
    reference_norm->to(at::kDouble);
    {
      torch::NoGradGuard g;
      reference_read->query.copy_(in.q.detach().cpu());
      reference_read->norm->weight.copy_(in.w.detach().cpu());
      reference_norm->weight.copy_(ow.detach().cpu());
    }
    ASSERT_TRUE(kernels::attn_res_read_norm_usable(in.src, ow));
    std::vector<at::Tensor> slots(in.src.size());
    auto prior = at::randn({2, 37, c.D}, at::TensorOptions(at::kCUDA)).to(c.t);
    auto held = prior.clone();  // shared with slot 0, never written
    if (slots_on) {
      slots[0] = attn_res_new_slot(in.src[0]);
      kernels::attn_res_slot_add(slots[0], held);
      if (n > 1) slots[1] = attn_res_new_slot(in.src[1]);
    }
    poison();
    auto y = kernels::attn_res_read_norm(in.src, in.q, in.w, 1e-5, &slots, ow, 1e-6);
    auto yr = reference_norm->forward(reference_read->forward(in.src_reference));
    ASSERT_EQ(y.scalar_type(), c.t);
    EXPECT_LT(rel_err(y, yr), bound(c.t));
    backward_both(y, yr);
    for (int64_t i = 0; i < n; ++i) {
      const auto& slot = slots[static_cast<size_t>(i)];
      if (slot.defined()) {
        EXPECT_FALSE(in.src[i].grad().defined()) << "source " << i << " has a slot";
        // Slot 0 started with `prior`: it holds prior + the gradient.
        auto reference = i == 0 ? prior.to(at::kCPU, at::kDouble) + in.src_reference[i].grad()
                           : in.src_reference[i].grad();
        EXPECT_LT(rel_err(slot, reference), bound(c.t)) << "slot " << i;
      } else {
        EXPECT_LT(rel_err(in.src[i].grad(), in.src_reference[i].grad()), bound(c.t)) << "source " << i;
      }
    }
    EXPECT_TRUE(at::equal(held, prior)) << "slot 0's earlier storage was written";
    EXPECT_LT(rel_err(in.q.grad(), reference_read->query.grad()), bound(c.t));
    EXPECT_LT(rel_err(in.w.grad(), reference_read->norm->weight.grad()), bound(c.t));
    EXPECT_LT(rel_err(ow.grad(), reference_norm->weight.grad()), bound(c.t));
  }
}

// Run to run, bit for bit, on 9000 rows (several rows a warp), both backward
// forms (5 sources: two passes; 6: three); rows the kernel does not take
// (4096 bf16) are refused, and the module then runs the read and the norm
// as two ops, the same values.
TEST(FusedKernels, AttnResReadNormIsDeterministicAndFallsBack) {
  REQUIRE_GPU();
  for (int64_t n : {5, 6})
  for (auto [D, t] : {std::pair{int64_t{2048}, at::kBFloat16}, std::pair{int64_t{1000}, at::kFloat}}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << (n <= 5 ? "two" : "three") << " passes, dim " << D
                                    << " " << t << " seed " << seed);
    auto in = draw_read({2, 4500, D}, n, t);
    auto ow = (1.0 + 0.1 * at::randn({D}, at::TensorOptions(at::kCUDA))).requires_grad_(true);
    auto dy = at::randn({2, 4500, D}, at::TensorOptions(at::kCUDA)).to(t);
    auto run = [&] {
      std::vector<at::Tensor> src;
      for (const auto& v : in.src) src.push_back(v.detach().requires_grad_(true));
      auto q = in.q.detach().requires_grad_(true), w = in.w.detach().requires_grad_(true);
      auto o = ow.detach().requires_grad_(true);
      poison();
      auto y = kernels::attn_res_read_norm(src, q, w, 1e-5, nullptr, o, 1e-5);
      y.backward(dy);
      std::vector<at::Tensor> out{y.detach(), q.grad(), w.grad(), o.grad()};
      for (const auto& v : src) out.push_back(v.grad());
      return out;
    };
    const auto first = run(), second = run();
    for (size_t i = 0; i < first.size(); ++i) {
      EXPECT_TRUE(at::isfinite(first[i]).all().item<bool>()) << "output " << i;
      EXPECT_TRUE(at::equal(first[i], second[i])) << "output " << i;
    }
  }
  auto wide = draw_read({2, 5, 4096}, 3, at::kBFloat16);
  RMSNorm next(4096, 1e-5);
  next->to(at::kCUDA);
  EXPECT_FALSE(kernels::attn_res_read_norm_usable(wide.src, next->weight));
  AttnResRead m(4096, 1e-5);
  m->to(at::kCUDA);
  {
    torch::NoGradGuard g;
    m->query.copy_(wide.q.detach());
  }
  EXPECT_TRUE(at::equal(m->forward_normed(wide.src, nullptr, *next),
                        next->forward(m->forward(wide.src))));
}

// See Note [Summing the read's partial rows]: the column sums of [sets, parts,
// dim] fp32 partial rows against fp64 sums, the products bit for bit the
// separate multiplies of the sum, and run to run the same bits. Shapes: the
// K3 read's (1024 parts of 2048, one and two sets), parts and columns that
// are not multiples of 32, fewer parts than warps.
TEST(FusedKernels, SumPartsMatchesFp64Sums) {
  REQUIRE_GPU();
  struct Case { int sets; int64_t parts, dim; };
  for (const auto& c : {Case{1, 1024, 2048}, Case{2, 1024, 2048}, Case{2, 37, 1001}, Case{1, 5, 31}}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << c.sets << " x " << c.parts << " x " << c.dim << " seed " << seed);
    const auto f32 = at::TensorOptions(at::kCUDA).dtype(at::kFloat);
    auto partial = at::randn({c.sets, c.parts, c.dim}, f32);
    auto a = at::randn({c.dim}, f32), b = at::randn({c.dim}, f32);
    std::vector<at::Tensor> runs;
    for (int run = 0; run < 2; ++run) {
      poison();
      auto out = at::empty({c.sets, c.dim}, f32);
      auto oa = at::empty({c.dim}, f32), ob = at::empty({c.dim}, f32);
      cuda::PartsProducts prod{a.data_ptr<float>(), b.data_ptr<float>(), oa.data_ptr<float>(),
                               ob.data_ptr<float>()};
      ASSERT_EQ(cuda::sum_parts(partial.data_ptr<float>(), c.parts, c.dim, c.sets,
                                out.data_ptr<float>(),
                                c10::cuda::getCurrentCUDAStream().stream(), &prod),
                cudaSuccess);
      EXPECT_LT(rel_err(out, partial.to(at::kCPU, at::kDouble).sum(1)), 1e-6);
      EXPECT_TRUE(at::equal(oa, out[0] * a));
      EXPECT_TRUE(at::equal(ob, out[0] * b));
      runs.push_back(out);
    }
    EXPECT_TRUE(at::equal(runs[0], runs[1]));
  }
  // Bad shapes are refused, not launched.
  EXPECT_EQ(cuda::sum_parts(nullptr, 0, 8, 1, nullptr, nullptr), cudaErrorInvalidValue);
}

TEST(FusedKernels, MixedLinearWeightGradientIsFp32) {
  REQUIRE_GPU();
  // bf16 input, fp32 master weight and bias: the weight gradient comes from
  // a GEMM writing fp32 (see Note [Linear with an fp32 weight gradient]), so
  // against the fp64 product of the same bf16 values it is off by fp32
  // accumulation only (~1e-7), not by a bf16 rounding (~1e-3).
  const auto seed = fresh_seed();
  auto [x, xr] = draw({3, 37, 256}, at::kBFloat16);
  auto w = (at::randn({96, 256}, at::TensorOptions(at::kCUDA)) * 0.05).requires_grad_(true);
  auto b = at::randn({96}, at::TensorOptions(at::kCUDA)).requires_grad_(true);
  // The reference's leaves are the weight and bias rounded to bf16, as the
  // forward uses them; their fp64 gradients are the exact ones.
  auto wr = w.detach().to(at::kBFloat16).to(at::kCPU, at::kDouble).requires_grad_(true);
  auto br = b.detach().to(at::kBFloat16).to(at::kCPU, at::kDouble).requires_grad_(true);
  poison();
  auto y = ops::linear(x, w, b, ops::KernelOptions{});
  auto yr = at::linear(xr, wr, br);
  ASSERT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_LT(rel_err(y, yr), bound(at::kBFloat16)) << "seed " << seed;
  backward_both(y, yr);
  ASSERT_EQ(w.grad().scalar_type(), at::kFloat);
  ASSERT_EQ(b.grad().scalar_type(), at::kFloat);
  EXPECT_LT(rel_err(x.grad(), xr.grad()), bound(at::kBFloat16)) << "seed " << seed;
  EXPECT_LT(rel_err(w.grad(), wr.grad()), 1e-5) << "seed " << seed;
  EXPECT_LT(rel_err(b.grad(), br.grad()), 1e-5) << "seed " << seed;

  // Without a bias (llama's linears): its own autograd function, since
  // LibTorch 2.x refuses an undefined tensor as a custom function's input.
  w.mutable_grad() = at::Tensor();
  auto [x2, xr2] = draw({2, 19, 256}, at::kBFloat16);
  auto wr2 = w.detach().to(at::kBFloat16).to(at::kCPU, at::kDouble).requires_grad_(true);
  auto y2 = ops::linear(x2, w, at::Tensor(), ops::KernelOptions{});
  auto yr2 = at::linear(xr2, wr2);
  EXPECT_LT(rel_err(y2, yr2), bound(at::kBFloat16)) << "seed " << seed;
  backward_both(y2, yr2);
  ASSERT_EQ(w.grad().scalar_type(), at::kFloat);
  EXPECT_LT(rel_err(x2.grad(), xr2.grad()), bound(at::kBFloat16)) << "seed " << seed;
  EXPECT_LT(rel_err(w.grad(), wr2.grad()), 1e-5) << "seed " << seed;
}

// One forward_loss + backward of a fresh model built from `overrides` (init
// seed 11): the loss and every parameter's gradient (zeros where none
// reached it). gpu_step runs it on the GPU as configured; fp64_step on the
// CPU in fp64 (the ATen path), the reference the fp32 GPU forms are
// measured against.
struct StepResult {
  double loss;
  std::vector<at::Tensor> grads;
};
StepResult run_step(const std::vector<std::string>& overrides, const at::Tensor& tokens,
                    const at::Tensor& targets, bool fp64_cpu) {
  auto model = build_model_part(JobConfig::parse("", "test", overrides));
  model->init_weights(11);
  if (fp64_cpu) {
    model->to(at::kDouble);
    model->set_compute_dtype(at::kDouble);
  } else {
    model->to(at::kCUDA);
  }
  auto loss = fp64_cpu ? model->forward_loss({tokens.cpu()}, targets.cpu())
                       : model->forward_loss({tokens}, targets);
  loss.backward();
  StepResult r{loss.item<double>(), {}};
  for (const auto& p : model->parameters()) {
    r.grads.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
  }
  return r;
}
StepResult gpu_step(const std::vector<std::string>& overrides, const at::Tensor& tokens,
                    const at::Tensor& targets) {
  return run_step(overrides, tokens, targets, false);
}
StepResult fp64_step(const std::vector<std::string>& overrides, const at::Tensor& tokens,
                     const at::Tensor& targets) {
  return run_step(overrides, tokens, targets, true);
}
// Two such steps agree: the loss to 1e-5 relative, each gradient to 1e-4.
void expect_same_step(const StepResult& a, const StepResult& b, uint64_t seed) {
  EXPECT_LT(std::abs(a.loss - b.loss) / std::abs(b.loss), 1e-5) << "seed " << seed;
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    EXPECT_LT(rel_err(a.grads[i], b.grads[i]), 1e-4) << "parameter " << i << " seed " << seed;
  }
}

TEST(FusedKernels, LlamaStepMatchesAtenPath) {
  REQUIRE_GPU();
  // The whole fused path (norms, one qkv GEMM, RoPE, SwiGLU, chunked loss)
  // against the ATen ops, fp32 on the GPU, same weights and tokens.
  const auto seed = fresh_seed();
  const std::vector<std::string> cfg{"model.n_layers=2", "training.seq_len=64",
                                     "model.loss_chunk_tokens=50"};
  auto tokens = at::randint(0, 300, {2, 64}, at::TensorOptions(at::kCUDA).dtype(at::kLong));
  auto targets = at::randint(0, 300, {2, 64}, at::TensorOptions(at::kCUDA).dtype(at::kLong));
  const auto fused = gpu_step(cfg, tokens, targets);
  auto aten_cfg = cfg;
  aten_cfg.push_back("model.cuda_kernels=false");
  const auto aten = gpu_step(aten_cfg, tokens, targets);
  expect_same_step(fused, aten, seed);
}

TEST(FusedKernels, KimiK3FusedReadNormMatchesAtenStep) {
  REQUIRE_GPU();
  // The read with its norm through a kimi_k3 step (debugmodel: every read,
  // the final one too, with the in-place block gradients), fp32 on the GPU,
  // against the same model on the ATen ops (model.cuda_kernels = false).
  const auto seed = fresh_seed();
  auto tokens = at::randint(0, 300, {2, 64}, at::TensorOptions(at::kCUDA).dtype(at::kLong));
  auto targets = at::randint(0, 300, {2, 64}, at::TensorOptions(at::kCUDA).dtype(at::kLong));
  std::vector<std::string> cfg{"model.family=kimi_k3", "model.flavor=debugmodel",
                               "training.seq_len=64", "model.mla_interval=1",
                               "model.moe_ffn=false"};
  const auto fused = gpu_step(cfg, tokens, targets);
  auto aten_cfg = cfg;
  aten_cfg.push_back("model.cuda_kernels=false");
  const auto two_ops = gpu_step(aten_cfg, tokens, targets);
  // Both fp32 forms are measured against the fp64 step: the fused one may
  // round differently (the two-pass backward sums in another order), so
  // each of its errors is bounded by the ATen ops' own fp32 error (three
  // times it) or 1e-4, whichever is larger: a fixed 1e-4 between the two
  // fp32 forms could not tell rounding from a fault.
  const auto reference = fp64_step(cfg, tokens, targets);
  EXPECT_LT(std::abs(fused.loss - reference.loss) / std::abs(reference.loss), 1e-5) << "seed " << seed;
  ASSERT_EQ(fused.grads.size(), reference.grads.size());
  for (size_t i = 0; i < reference.grads.size(); ++i) {
    const double e_fused = rel_err(fused.grads[i], reference.grads[i]);
    const double e_two = rel_err(two_ops.grads[i], reference.grads[i]);
    EXPECT_LT(e_fused, std::max(1e-4, 3 * e_two))
        << "parameter " << i << " (two ops: " << e_two << ") seed " << seed;
  }
}

// See Note [One w1/w3 projection]: the packed form reads the halves of one
// [tokens, 2F] tensor in place. Against the two-tensor form on the same
// values it is the same arithmetic: every output and gradient bit for bit
// (with the recompute on and off). Then the module's bf16 step (one GEMM
// over w1 and w3) against two projections, to GEMM rounding.
TEST(FusedKernels, SwiGLUPackedMatchesTwoTensors) {
  REQUIRE_GPU();
  for (bool recompute : {false, true}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "recompute " << recompute << " seed " << seed);
    auto a = at::randn({3, 37, 96}, at::TensorOptions(at::kCUDA)).to(at::kBFloat16);
    auto b = at::randn({3, 37, 96}, at::TensorOptions(at::kCUDA)).to(at::kBFloat16);
    auto w = (at::randn({64, 96}, at::TensorOptions(at::kCUDA)) * 0.1).requires_grad_(true);
    auto w2 = w.detach().clone().requires_grad_(true);
    auto dy = at::randn({3, 37, 64}, at::TensorOptions(at::kCUDA)).to(at::kBFloat16);
    auto al = a.clone().requires_grad_(true), bl = b.clone().requires_grad_(true);
    auto y = kernels::swiglu_linear(al, bl, w, {.recompute = recompute});
    y.backward(dy);
    auto ab = at::cat({a, b}, -1).requires_grad_(true);
    auto yp = kernels::swiglu_linear_packed(ab, w2, {.recompute = recompute});
    yp.backward(dy);
    EXPECT_TRUE(at::equal(y, yp));
    EXPECT_TRUE(at::equal(ab.grad(), at::cat({al.grad(), bl.grad()}, -1)));
    EXPECT_TRUE(at::equal(w.grad(), w2.grad()));
  }
  // The module's bf16 step (one GEMM over w1 and w3) against the same
  // module in fp64 on the CPU (two projections, ATen), to bf16 rounding.
  const auto seed = fresh_seed();
  SwiGLU m(256, 512);
  m->init_weights(3, "f.", 0.05, 0.05);
  SwiGLU reference_swiglu(256, 512);
  {
    torch::NoGradGuard g;
    for (const auto& pair : {std::pair{&m->w1, &reference_swiglu->w1}, std::pair{&m->w2, &reference_swiglu->w2},
                       std::pair{&m->w3, &reference_swiglu->w3}}) {
      (*pair.second)->weight.copy_((*pair.first)->weight.to(at::kBFloat16));
    }
  }
  reference_swiglu->to(at::kDouble);
  m->to(at::kCUDA);
  auto x = at::randn({2, 50, 256}, at::TensorOptions(at::kCUDA)).to(at::kBFloat16);
  auto xl = x.clone().requires_grad_(true);
  auto xr = x.to(at::kCPU, at::kDouble).requires_grad_(true);
  auto y = m->forward(xl);
  auto dy = at::randn(y.sizes(), y.options());
  y.backward(dy);
  std::vector<at::Tensor> got{xl.grad()};
  for (auto* l : {&m->w1, &m->w2, &m->w3}) got.push_back((*l)->weight.grad().clone());
  auto yr = reference_swiglu->forward(xr);
  yr.backward(dy.to(at::kCPU, at::kDouble));
  std::vector<at::Tensor> reference{xr.grad()};
  for (auto* l : {&reference_swiglu->w1, &reference_swiglu->w2, &reference_swiglu->w3}) reference.push_back((*l)->weight.grad());
  EXPECT_LT(rel_err(y, yr), 1e-2) << "seed " << seed;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_LT(rel_err(got[i], reference[i]), 1e-2) << "gradient " << i << " (x, w1, w2, w3) seed "
                                              << seed;
  }
}

TEST(FusedKernels, SwiGLULinearMatchesUnfused) {
  REQUIRE_GPU();
  for (auto t : kTypes) {
    const auto seed = fresh_seed();
    // Kept product (the default) and model.swiglu_recompute: both against
    // the fp64 reference, and the same bits as each other (same kernels).
    std::vector<at::Tensor> first;
    for (bool recompute : {false, true}) {
      torch::manual_seed(seed);
      auto [a, ar] = draw({4, 50, 512}, t, 2.0);
      auto [b, br] = draw({4, 50, 512}, t);
      auto w = (at::randn({256, 512}, at::TensorOptions(at::kCUDA)) * 0.05).requires_grad_(true);
      auto wr = w.detach().to(at::kCPU, at::kDouble).requires_grad_(true);
      poison();
      auto y = kernels::swiglu_linear(a, b, w, {.recompute = recompute});
      auto yr = at::linear(at::silu(ar) * br, wr);
      ASSERT_EQ(y.scalar_type(), t);
      EXPECT_LT(rel_err(y, yr), bound(t)) << "seed " << seed << " " << t;
      backward_both(y, yr);
      ASSERT_EQ(w.grad().scalar_type(), at::kFloat);  // fp32 master gradient
      EXPECT_LT(rel_err(a.grad(), ar.grad()), bound(t)) << "seed " << seed << " " << t;
      EXPECT_LT(rel_err(b.grad(), br.grad()), bound(t)) << "seed " << seed << " " << t;
      EXPECT_LT(rel_err(w.grad(), wr.grad()), bound(t)) << "seed " << seed << " " << t;
      std::vector<at::Tensor> got{y.detach(), a.grad(), b.grad(), w.grad()};
      if (first.empty()) {
        first = got;
      } else {
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_TRUE(at::equal(first[i], got[i])) << "output " << i << " differs with recompute";
        }
      }
    }
  }
}

// V = 5003 runs the one-block form on a row not a multiple of the block;
// 128256 (llama 3's vocabulary) and 100000 split a row over a cluster of
// blocks, the latter with a shorter last slice.
TEST(FusedKernels, CrossEntropyRowsAndGradient) {
  REQUIRE_GPU();
  const int64_t n = 67;
  for (int64_t V : {5003, 128256, 100000}) {
    for (auto t : kTypes) {
      const auto seed = fresh_seed();
      auto logits = (at::randn({n, V}, at::TensorOptions(at::kCUDA)) * 4.0).to(t);
      auto targets = at::randint(0, V, {n}, at::TensorOptions(at::kCUDA).dtype(at::kLong));
      targets.index_put_({at::arange(0, n, 7, targets.options())}, -100);  // some ignored
      auto reference_in = logits.to(at::kCPU, at::kDouble).requires_grad_(true);
      auto tc = targets.cpu();
      auto reference_rows = at::cross_entropy_loss(reference_in, tc, {}, at::Reduction::None, -100);
      reference_rows.sum().backward();
      auto g = logits.clone();
      poison();
      auto rows = kernels::cross_entropy_rows_(g, targets);
      EXPECT_LT(rel_err(rows, reference_rows), bound(t) / 10)
          << "seed " << seed << " " << t << " V " << V;
      EXPECT_LT(rel_err(g, reference_in.grad()), bound(t))
          << "seed " << seed << " " << t << " V " << V;
      // Run to run the same bits: a cluster's parts combine in rank order.
      auto g2 = logits.clone();
      auto rows2 = kernels::cross_entropy_rows_(g2, targets);
      EXPECT_TRUE(at::equal(rows, rows2)) << "V " << V;
      EXPECT_TRUE(at::equal(g, g2)) << "V " << V;
      // Ignored rows: zero loss, zero gradient, exactly.
      auto ignored = (tc == -100).nonzero().squeeze(1);
      EXPECT_EQ(rows.cpu().index_select(0, ignored).abs().sum().item<double>(), 0.0);
      EXPECT_EQ(g.cpu().index_select(0, ignored).abs().sum().item<double>(), 0.0);
    }
  }
}

// KDA's q/k normalisation against the ATen form in fp64, with its gradient;
// d = 40 leaves lanes idle in the warp per row. The output is fp32 whatever
// the input's dtype (the recurrence's precision).
TEST(FusedKernels, L2NormalizeMatchesAten) {
  REQUIRE_GPU();
  for (auto t : kTypes) {
    for (int64_t d : {64, 128, 40}) {
      const auto seed = fresh_seed();
      auto [x, xr] = draw({2, 37, 3, d}, t, 3.0);
      auto y = ops::l2_normalize(x, 1e-6, 0.125, ops::KernelOptions{});
      auto yr = ops::l2_normalize(xr, 1e-6, 0.125, ops::KernelOptions{});  // CPU: ATen
      EXPECT_EQ(y.scalar_type(), at::kFloat);
      EXPECT_LT(rel_err(y, yr), t == at::kFloat ? 1e-6 : 1e-5) << "seed " << seed << " d " << d;
      backward_both(y, yr);
      EXPECT_LT(rel_err(x.grad(), xr.grad()), bound(t)) << "seed " << seed << " d " << d;
    }
  }
}

// KDA's short convolution + SiLU against the ATen form in fp64 (conv1d,
// then silu), every input's gradient; T = 133 leaves a short last span of
// the weight gradient's partial sums, C = 72 a partial block, K = 6 the
// kernels' wider window, and the backward twice gives the same bits.
TEST(FusedKernels, ShortConvSiluMatchesAtenConv) {
  REQUIRE_GPU();
  const int64_t B = 2, T = 133, C = 72;
  for (auto t : kTypes) {
    for (int64_t K : {4, 2, 6}) {
      const auto seed = fresh_seed();
      auto [x, xr] = draw({B, T, C}, t);
      auto w = (at::randn({C, K}, at::TensorOptions(at::kCUDA)) * 0.5).requires_grad_(true);
      auto wr = w.detach().to(at::kCPU, at::kDouble).requires_grad_(true);
      ASSERT_TRUE(kernels::short_conv_silu_usable(x, w));
      auto y = ops::short_conv_silu(x, w, ops::KernelOptions{});
      auto yr = ops::short_conv_silu(xr, wr, ops::KernelOptions{});  // CPU: the ATen form
      EXPECT_LT(rel_err(y, yr), bound(t)) << "seed " << seed << " " << t << " K " << K;
      auto dy = at::randn(y.sizes(), y.options());
      backward_both(y, yr, dy);
      EXPECT_LT(rel_err(x.grad(), xr.grad()), bound(t)) << "seed " << seed << " " << t;
      EXPECT_LT(rel_err(w.grad(), wr.grad()), bound(t)) << "seed " << seed << " " << t;
      auto x2 = x.detach().requires_grad_(true);
      auto w2 = w.detach().requires_grad_(true);
      ops::short_conv_silu(x2, w2, ops::KernelOptions{}).backward(dy);
      EXPECT_TRUE(at::equal(x2.grad(), x.grad()));
      EXPECT_TRUE(at::equal(w2.grad(), w.grad()));
      // x as a column slice of a wider product (read in place, its tokens
      // 3 C apart): the bits of the contiguous x.
      auto wide = at::randn({B, T, 3 * C}, x.options()).detach();
      wide.narrow(2, C, C).copy_(x.detach());
      auto wide_leaf = wide.requires_grad_(true);
      auto w3 = w.detach().requires_grad_(true);
      auto y3 = ops::short_conv_silu(wide_leaf.narrow(2, C, C), w3, ops::KernelOptions{});
      EXPECT_TRUE(at::equal(y3, y)) << "seed " << seed << " " << t;
      y3.backward(dy);
      EXPECT_TRUE(at::equal(wide_leaf.grad().narrow(2, C, C), x.grad()));
      EXPECT_TRUE(at::equal(w3.grad(), w.grad()));
    }
  }
}

// A sequence longer than the grid's y limit (65,535 tokens): the kernels'
// token loop covers the rest, forward and backward, against the ATen form.
TEST(FusedKernels, ShortConvSiluPastTheGridLimit) {
  REQUIRE_GPU();
  const int64_t B = 1, T = 70001, C = 8, K = 4;
  const auto seed = fresh_seed();
  auto [x, xr] = draw({B, T, C}, at::kFloat);
  auto w = (at::randn({C, K}, at::TensorOptions(at::kCUDA)) * 0.5).requires_grad_(true);
  auto wr = w.detach().to(at::kCPU, at::kDouble).requires_grad_(true);
  ASSERT_TRUE(kernels::short_conv_silu_usable(x, w));
  auto y = ops::short_conv_silu(x, w, ops::KernelOptions{});
  auto yr = ops::short_conv_silu(xr, wr, ops::KernelOptions{});  // CPU: the ATen form
  EXPECT_LT(rel_err(y, yr), bound(at::kFloat)) << "seed " << seed;
  EXPECT_LT(rel_err(y.narrow(1, T - 100, 100), yr.narrow(1, T - 100, 100)), bound(at::kFloat))
      << "the tokens past the limit, seed " << seed;
  backward_both(y, yr, at::randn(y.sizes(), y.options()));
  EXPECT_LT(rel_err(x.grad(), xr.grad()), bound(at::kFloat)) << "seed " << seed;
  EXPECT_LT(rel_err(w.grad(), wr.grad()), bound(at::kFloat)) << "seed " << seed;
}

// The short convolution over documents on the kernel, each token's taps
// bounded by its document (see Note [KDA chunks over documents]), against
// the kernel on each document alone: outputs and the input's gradient bit
// for bit; the weight's gradient sums over every document in another
// order, so it is compared with the sum of the documents' own within
// rounding.
TEST(FusedKernels, ShortConvOverDocumentsIsEachDocumentAlone) {
  REQUIRE_GPU();
  const int64_t B = 2, T = 150, C = 72, K = 4;
  auto starts = at::zeros({B, T}, at::kBool);
  for (const int64_t t : {1, 2, 40, 149}) starts[0][t] = true;
  starts[1][77] = true;
  const ops::Documents docs(starts, true);
  for (auto t : kTypes) {
    const auto seed = fresh_seed();
    auto x = at::randn({B, T, C}, at::TensorOptions(at::kCUDA).dtype(t)).requires_grad_(true);
    auto w = (at::randn({C, K}, at::TensorOptions(at::kCUDA)) * 0.5).requires_grad_(true);
    auto y = ops::short_conv_silu(x, w, ops::KernelOptions{}, &docs);
    auto dy = at::randn(y.sizes(), y.options());
    y.backward(dy);
    at::Tensor w_sum = at::zeros_like(w);
    for (const auto& s : docs.spans()) {
      auto cut = [&](const at::Tensor& a) { return a.narrow(0, s.row, 1).narrow(1, s.start, s.length); };
      auto xa = cut(x).detach().clone().requires_grad_(true);
      auto wa = w.detach().clone().requires_grad_(true);
      auto ya = ops::short_conv_silu(xa, wa, ops::KernelOptions{});
      ya.backward(cut(dy));
      w_sum += wa.grad();
      EXPECT_TRUE(at::equal(cut(y), ya)) << "seed " << seed << " " << t << " span at " << s.start;
      EXPECT_TRUE(at::equal(cut(x.grad()), xa.grad()))
          << "seed " << seed << " " << t << " span at " << s.start;
    }
    EXPECT_LT(rel_err(w.grad(), w_sum), bound(t)) << "seed " << seed << " " << t;
  }
}

// The convolution with each head's L2 norm in one kernel each way (KDA's q
// and k) against the convolution kernel followed by the L2 norm kernel:
// the output and the gradients of x and the weight bit for bit, for x
// contiguous and as a column slice of a wider product, with and without
// documents, heads of 32, 64 and 128, filters of 2, 4 and 6 taps.
TEST(FusedKernels, ShortConvL2IsBitwiseTheTwoKernels) {
  REQUIRE_GPU();
  const int64_t B = 2, T = 150;
  auto starts = at::zeros({B, T}, at::kBool);
  for (const int64_t t : {1, 40, 149}) starts[0][t] = true;
  starts[1][77] = true;
  const ops::Documents docs(starts, true);
  for (int64_t K : {4, 2, 6})
  for (int64_t d : {32, 64, 128})
  for (auto t : kTypes)
  for (const bool slice : {false, true})
  for (const bool with_docs : {false, true}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "K " << K << " d " << d << " " << t << " slice " << slice
                                    << " docs " << with_docs << " seed " << seed);
    const int64_t C = 3 * d;
    const auto opt = at::TensorOptions(at::kCUDA);
    auto wide = at::randn({B, T, slice ? 2 * C : C}, opt.dtype(t));
    auto w = (at::randn({C, K}, opt) * 0.5);
    const auto offsets = with_docs ? docs.offsets(at::kCUDA) : at::Tensor();
    const double eps = 1e-6, scale = 1.0 / std::sqrt(static_cast<double>(d));
    auto run = [&](bool fused) {
      auto xl = wide.detach().requires_grad_(true);
      auto wl = w.detach().requires_grad_(true);
      auto x = slice ? xl.narrow(2, C / 2, C) : xl;
      auto y = fused ? kernels::short_conv_silu_l2(x, wl, d, eps, scale, offsets)
                     : kernels::l2_normalize(
                           kernels::short_conv_silu(x, wl, offsets).view({B, T, C / d, d}), eps,
                           scale)
                           .view({B, T, C});
      return std::make_tuple(y, xl, wl);
    };
    auto [y, x, wf] = run(true);
    auto [y2, x2, w2] = run(false);
    ASSERT_EQ(y.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(y, y2));
    // The op the layer calls takes the fused kernel: the same bits.
    auto xo = slice ? wide.narrow(2, C / 2, C) : wide;
    auto yo = ops::short_conv_silu_l2(xo, w, d, eps, scale, ops::KernelOptions{},
                                      with_docs ? &docs : nullptr);
    EXPECT_TRUE(at::equal(yo.reshape({B, T, C}), y));
    auto dy = at::randn(y.sizes(), opt);
    y.backward(dy);
    y2.backward(dy);
    EXPECT_TRUE(at::equal(x.grad(), x2.grad()));
    EXPECT_TRUE(at::equal(wf.grad(), w2.grad()));
  }
}

// The table's gradient against a host loop that adds each token's rows in
// increasing row order (the kernel's order: equal bits), and against
// ATen's embedding backward (another order: close). Token 7 takes a third of
// the rows (one long run), some tokens never occur (zero rows), and D = 6
// takes the scalar path.
TEST(FusedKernels, EmbeddingGradientSumsRowsInOrder) {
  REQUIRE_GPU();
  const int64_t V = 64, B = 3, T = 337;
  for (int64_t D : {64, 6}) {
    const auto seed = fresh_seed();
    auto cuda = at::TensorOptions(at::kCUDA);
    auto tokens = at::randint(0, 48, {B, T}, cuda.dtype(at::kLong));
    tokens.masked_fill_(at::rand({B, T}, cuda) < 0.33, 7);
    auto grad = at::randn({B, T, D}, cuda);
    poison();
    auto dw = kernels::embedding_weight_grad(grad, tokens, V);
    auto tc = tokens.cpu().reshape({-1});
    auto gc = grad.cpu().reshape({-1, D});
    auto reference = at::zeros({V, D});
    auto r = reference.accessor<float, 2>();
    auto g = gc.accessor<float, 2>();
    auto t = tc.accessor<int64_t, 1>();
    for (int64_t row = 0; row < tc.size(0); ++row) {
      for (int64_t c = 0; c < D; ++c) r[t[row]][c] += g[row][c];
    }
    EXPECT_TRUE(at::equal(dw.cpu(), reference)) << "seed " << seed << " D " << D;
    auto aten = at::embedding_dense_backward(grad, tokens, V, -1, false);
    EXPECT_LT(rel_err(dw, aten.to(at::kDouble).cpu()), 1e-6) << "seed " << seed << " D " << D;
    EXPECT_TRUE(at::equal(kernels::embedding_weight_grad(grad, tokens, V), dw));
    // Through the op's autograd: the weight's gradient is the kernel's.
    auto w = at::randn({V, D}, cuda).requires_grad_(true);
    auto y = ops::embedding(w, tokens, ops::KernelOptions{});
    EXPECT_TRUE(at::equal(y, at::embedding(w.detach(), tokens)));
    y.backward(grad);
    EXPECT_TRUE(at::equal(w.grad(), dw)) << "seed " << seed << " D " << D;
  }
}

// The head loss tests' inputs: 300 bf16 tokens of dim 64, an fp32 head of
// 1000 rows, random targets; h and w take gradients.
struct HeadLossInputs {
  static constexpr int64_t N = 300, D = 64, V = 1000;
  const at::TensorOptions on = at::TensorOptions(at::kCUDA);
  at::Tensor h = at::randn({N, D}, on).to(at::kBFloat16).requires_grad_(true);
  at::Tensor w = (at::randn({V, D}, on) * 0.2).requires_grad_(true);
  at::Tensor y = at::randint(0, V, {N}, on.dtype(at::kLong));
};

TEST(FusedKernels, ChunkedHeadLossMatchesAten) {
  REQUIRE_GPU();
  const auto seed = fresh_seed();
  HeadLossInputs in;
  auto &h = in.h, &w = in.w, &y = in.y;
  auto l1 = ops::chunked_head_cross_entropy(h, w, y, 128, ops::KernelOptions{});
  l1.backward();
  auto gh1 = h.grad().clone(), gw1 = w.grad().clone();
  h.mutable_grad().reset();
  w.mutable_grad().reset();
  ops::KernelOptions aten;
  aten.fused = false;  // the ATen chunked path
  auto l2 = ops::chunked_head_cross_entropy(h, w, y, 128, aten);
  l2.backward();
  EXPECT_LT(rel_err(l1, l2), 1e-5) << "seed " << seed;
  EXPECT_LT(rel_err(gh1, h.grad()), 1e-2) << "seed " << seed;
  EXPECT_LT(rel_err(gw1, w.grad()), 1e-2) << "seed " << seed;
}

// The loss's gradient scale applied by the loss kernel in the forward: for
// a power of two, the bits of scaling the gradients after (the backward
// then leaves them untouched); for any other factor close to it; and where
// the backward receives another factor than the forward applied, the
// gradients of the factor received.
TEST(FusedKernels, HeadLossScaledInItsForwardHasTheBitsOfScalingAfter) {
  REQUIRE_GPU();
  const auto seed = fresh_seed();
  HeadLossInputs in;
  auto &h = in.h, &w = in.w, &y = in.y;
  y.index_put_({at::arange(0, in.N, 11, y.options())}, -100);  // some ignored
  auto grads = [&](const ops::KernelOptions& k, double backward_factor) {
    h.mutable_grad().reset();
    w.mutable_grad().reset();
    auto loss = ops::chunked_head_cross_entropy(h, w, y, 128, k);
    (loss * backward_factor).backward();
    return std::make_tuple(loss.detach(), h.grad().clone(), w.grad().clone());
  };
  auto scaled = [](double factor) {
    ops::KernelOptions k;
    k.loss_grad_scale = std::make_shared<ops::LossGradScale>();
    k.loss_grad_scale->value = at::full({}, factor, at::TensorOptions(at::kCUDA).dtype(at::kFloat));
    return k;
  };
  for (double factor : {1.0 / 1024.0, 1.0 / 300.0}) {
    const auto [l0, gh0, gw0] = grads(ops::KernelOptions{}, factor);  // scaled in the backward
    const auto [l1, gh1, gw1] = grads(scaled(factor), factor);       // scaled in the forward
    EXPECT_TRUE(at::equal(l0, l1)) << "seed " << seed << " factor " << factor;
    if (factor == 1.0 / 1024.0) {
      EXPECT_TRUE(at::equal(gh0, gh1)) << "seed " << seed;
      EXPECT_TRUE(at::equal(gw0, gw1)) << "seed " << seed;
    } else {
      EXPECT_LT(rel_err(gh1, gh0), 1e-2) << "seed " << seed;
      EXPECT_LT(rel_err(gw1, gw0), 1e-2) << "seed " << seed;
    }
    EXPECT_GT(gw1.abs().sum().item<double>(), 0.0);
    // The backward receives three times the factor the forward applied.
    const auto [l2, gh2, gw2] = grads(scaled(factor), 3.0 * factor);
    const auto [l3, gh3, gw3] = grads(ops::KernelOptions{}, 3.0 * factor);
    EXPECT_LT(rel_err(gh2, gh3), 1e-2) << "seed " << seed << " factor " << factor;
    EXPECT_LT(rel_err(gw2, gw3), 1e-2) << "seed " << seed << " factor " << factor;
  }
}

// The in-place ratio: t times num / den, or t itself where the two are equal.
TEST(FusedKernels, ScaleByRatioLeavesTWhereTheRatioIsOne) {
  REQUIRE_GPU();
  const auto on = at::TensorOptions(at::kCUDA).dtype(at::kFloat);
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    for (int64_t n : {4096, 1001}) {  // vector groups, and a tail of scalars
      const auto t0 = at::randn({n}, on).to(dt);
      auto t = t0.clone();
      const auto third = at::full({}, 1.0 / 3.0, on);
      kernels::scale_by_ratio_(t, third, third);
      EXPECT_TRUE(at::equal(t, t0)) << dt << " " << n;
      kernels::scale_by_ratio_(t, at::full({}, 0.75, on), at::full({}, 0.25, on));
      EXPECT_TRUE(at::equal(t, (t0.to(at::kFloat) * 3.0).to(dt))) << dt << " " << n;
      t = t0.clone();
      kernels::scale_by_ratio_(t, at::full({}, 0.5, on), at::Tensor());
      EXPECT_TRUE(at::equal(t, (t0.to(at::kFloat) * 0.5).to(dt))) << dt << " " << n;
    }
  }
}

TEST(FusedKernels, FusedAdamWMatchesLoop) {
  REQUIRE_GPU();
  if (!compat::kTorch2) GTEST_SKIP() << "no fused AdamW kernel in this LibTorch";
  const auto seed = fresh_seed();
  auto make = [](at::Device dev) {
    std::vector<NamedParam> ps;
    torch::manual_seed(7);
    ps.push_back({"a.weight", at::randn({64, 33}).to(dev).requires_grad_(true), true});
    ps.push_back({"a.norm", at::randn({33}).to(dev).requires_grad_(true), false});
    return ps;
  };
  auto gpu = make(at::kCUDA), cpu = make(at::kCPU);
  AdamW og(gpu, 0.9, 0.95, 1e-8, 0.1), oc(cpu, 0.9, 0.95, 1e-8, 0.1);
  for (int step = 1; step <= 3; ++step) {
    for (size_t i = 0; i < gpu.size(); ++i) {
      auto g = at::randn(gpu[i].param.sizes());
      gpu[i].param.mutable_grad() = g.to(at::kCUDA);
      cpu[i].param.mutable_grad() = g;
    }
    og.step(1e-2);  // fused on CUDA
    oc.step(1e-2);  // the loop on CPU
  }
  for (size_t i = 0; i < gpu.size(); ++i) {
    EXPECT_LT(rel_err(gpu[i].param.detach(), cpu[i].param.detach()), 1e-6)
        << gpu[i].fqn << " seed " << seed;
  }
}

// See Note [AdamW over many tensors in one launch]: 30 tensors, from 152
// values to a million, updated in one launch get the bits of one adamw_
// call each: parameters, moments and the bf16 copies, with and without
// weight decay, with a clip coefficient. Tensors that do not qualify are
// refused.
TEST(FusedKernels, AdamWManyHasTheBitsOfOneCallEach) {
  REQUIRE_GPU();
  const auto seed = fresh_seed();
  const auto f32 = at::TensorOptions(at::kCUDA).dtype(at::kFloat);
  std::vector<kernels::AdamWTensors> batch, single;
  for (int i = 0; i < 30; ++i) {
    // Whole chunks, several chunks with a partial last one, a large tensor,
    // and small ones sharing the launch.
    const int64_t n = i == 0   ? 65536
                      : i == 1 ? 3 * 4 * cuda::kAdamWChunkGroups + 4
                      : i == 2 ? (int64_t{1} << 20) + 12
                               : 4 * (1 + 37 * i);
    auto p = at::randn({n}, f32), g = at::randn({n}, f32), m = at::randn({n}, f32) * 0.1,
         v = at::rand({n}, f32) * 0.01;
    auto low = i % 3 == 0 ? at::empty({n}, f32.dtype(at::kBFloat16)) : at::Tensor();
    const double wd = i % 2 == 0 ? 0.1 : 0.0;
    batch.push_back({p.clone(), g, m.clone(), v.clone(), low.defined() ? low.clone() : low, wd});
    single.push_back({p.clone(), g, m.clone(), v.clone(), low.defined() ? low.clone() : low, wd});
    ASSERT_TRUE(kernels::adamw_many_takes(batch.back())) << "tensor " << i;
  }
  for (int step = 1; step <= 2; ++step) {
    const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.95, step);
    kernels::adamw_many_(batch, 3e-3, 0.9, 0.95, 1e-8, bc1, bc2, 0.37);
    for (auto& t : single) {
      kernels::adamw_(t.p, t.g, t.m, t.v, 3e-3, 0.9, 0.95, 1e-8, t.weight_decay, bc1, bc2, t.low,
                      0.37);
    }
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    EXPECT_TRUE(at::equal(batch[i].p, single[i].p)) << "tensor " << i << " seed " << seed;
    EXPECT_TRUE(at::equal(batch[i].m, single[i].m)) << "tensor " << i;
    EXPECT_TRUE(at::equal(batch[i].v, single[i].v)) << "tensor " << i;
    if (batch[i].low.defined()) EXPECT_TRUE(at::equal(batch[i].low, single[i].low)) << "tensor " << i;
  }
  auto odd = at::randn({33}, f32), big = at::randn({65540}, f32);
  EXPECT_FALSE(kernels::adamw_many_takes({odd, odd, odd.clone(), odd.clone(), {}, 0.0}));
  EXPECT_TRUE(kernels::adamw_many_takes({big, big, big.clone(), big.clone(), {}, 0.0}));
  auto base = at::randn({64}, f32);
  auto shifted = base.narrow(0, 1, 60);  // not 16-byte aligned
  EXPECT_FALSE(kernels::adamw_many_takes({shifted, shifted, shifted.clone(), shifted.clone(), {}, 0.0}));
}

// The clip tests' parameters, the same values every call: the first
// `count` of a [96, 40] weight (decayed), an odd [37] one (the kernel's
// scalar path), a [256] one (batched small tensors), an [8] one left
// without a gradient.
std::vector<NamedParam> clip_test_params(size_t count) {
  std::vector<NamedParam> ps;
  torch::manual_seed(5);
  const auto cuda = at::TensorOptions(at::kCUDA);
  ps.push_back({"w", at::randn({96, 40}, cuda).requires_grad_(true), true});
  ps.push_back({"n", at::randn({37}, cuda).requires_grad_(true), false});
  ps.push_back({"q", at::randn({256}, cuda).requires_grad_(true), false});
  ps.push_back({"u", at::randn({8}, cuda).requires_grad_(true), false});
  ps.resize(count);
  return ps;
}

TEST(FusedKernels, AdamWFoldsTheClipBitwise) {
  REQUIRE_GPU();
  // See Note [Clip folded into AdamW]: step_scaled(lr, c) through the kernel
  // gives the bits of scaling the gradients in place and then step(lr), and
  // leaves the gradients unscaled.
  const auto seed = fresh_seed();
  auto folded = clip_test_params(2), scaled = clip_test_params(2);
  AdamW of(folded, 0.9, 0.95, 1e-8, 0.1), os(scaled, 0.9, 0.95, 1e-8, 0.1);
  const double coefs[] = {0.3717, 1.0, 0.01234567};
  for (double c : coefs) {
    for (size_t i = 0; i < folded.size(); ++i) {
      auto g = at::randn(folded[i].param.sizes(), at::TensorOptions(at::kCUDA)) * 3.0;
      folded[i].param.mutable_grad() = g.clone();
      scaled[i].param.mutable_grad() = g.clone();
    }
    const auto g0 = folded[0].param.grad().clone();
    of.step_scaled(1e-2, c);
    multiply_grads(scaled, c);
    os.step(1e-2);
    EXPECT_TRUE(at::equal(folded[0].param.grad(), g0)) << "the gradient was written, coef " << c;
    for (size_t i = 0; i < folded.size(); ++i) {
      EXPECT_TRUE(at::equal(folded[i].param.detach(), scaled[i].param.detach()))
          << folded[i].fqn << " coef " << c << " seed " << seed;
    }
  }
}

// See Note [Clip coefficient on the device]: the norm formed on the device is
// the host's to the bit, and the update that reads its coefficient there
// has the bits of step_scaled with the host's coefficient, clipping (0.5),
// not clipping (1e9) and off (0); the values fetched with the norm are the
// losses as item() reads them. A non-finite gradient updates nothing.
TEST(FusedKernels, ClipOnTheDeviceHasTheHostBits) {
  REQUIRE_GPU();
  const auto seed = fresh_seed();
  for (double max_norm : {0.5, 1e9, 0.0}) {
    SCOPED_TRACE(testing::Message() << "max_norm " << max_norm << " seed " << seed);
    auto dev = clip_test_params(4), host = clip_test_params(4);
    AdamW od(dev, 0.9, 0.95, 1e-8, 0.1), oh(host, 0.9, 0.95, 1e-8, 0.1);
    ASSERT_TRUE(od.takes_device_scale());
    for (int step = 0; step < 3; ++step) {
      std::vector<at::Tensor> grads;
      for (size_t i = 0; i + 1 < dev.size(); ++i) {
        auto g = at::randn(dev[i].param.sizes(), at::TensorOptions(at::kCUDA)) * 3.0;
        dev[i].param.mutable_grad() = g.clone();
        host[i].param.mutable_grad() = g.clone();
        grads.push_back(dev[i].param.grad());
      }
      auto loss = at::randn({}, at::TensorOptions(at::kCUDA));
      const double norm = total_norm(grad_squared_norms(host));
      auto clip = kernels::clip_on_device(grads, max_norm, {loss});
      auto fetch = kernels::fetch_clip_values(clip);
      od.step_device_scaled(1e-2, clip.scale);
      oh.step_scaled(1e-2, clip_coefficient(norm, max_norm));
      const auto v = fetch();
      ASSERT_EQ(v.size(), 2u);
      EXPECT_EQ(v[0], norm) << "step " << step;
      EXPECT_EQ(v[1], loss.item<double>());
      for (size_t i = 0; i < dev.size(); ++i) {
        EXPECT_TRUE(at::equal(dev[i].param.detach(), host[i].param.detach()))
            << dev[i].fqn << " step " << step;
      }
    }
  }
  auto ps = clip_test_params(4);
  AdamW o(ps, 0.9, 0.95, 1e-8, 0.1);
  const auto before = ps[0].param.detach().clone();
  auto g = at::randn(ps[0].param.sizes(), at::TensorOptions(at::kCUDA));
  g[3][7].fill_(INFINITY);
  ps[0].param.mutable_grad() = g;
  auto clip = kernels::clip_on_device({g}, 1.0);
  auto fetch = kernels::fetch_clip_values(clip);
  o.step_device_scaled(1e-2, clip.scale);
  EXPECT_FALSE(std::isfinite(fetch()[0]));
  EXPECT_TRUE(std::isnan(clip.scale.item<float>()));
  EXPECT_TRUE(at::equal(ps[0].param.detach(), before)) << "a non-finite norm updated the weight";
}

TEST(FusedKernels, AdamWWritesTheWeightCache) {
  REQUIRE_GPU();
  // See Note [Low-precision weight cache]: after a step of the fused AdamW the
  // bf16 copy of q|k is current (no cast on the next forward) and holds the
  // bits a fresh cast of the new weights gives.
  const auto seed = fresh_seed();
  ops::KernelOptions k;
  k.weight_cache = std::make_shared<kernels::WeightCache>();
  const auto cuda = at::TensorOptions(at::kCUDA);
  std::vector<NamedParam> ps;
  ps.push_back({"q", (at::randn({48, 64}, cuda) * 0.1).requires_grad_(true), true});
  ps.push_back({"k", (at::randn({16, 64}, cuda) * 0.1).requires_grad_(true), true});
  AdamW opt(ps, 0.9, 0.95, 1e-8, 0.1);
  opt.set_own_kernel_options(k);
  auto x = at::randn({2, 9, 64}, cuda).to(at::kBFloat16);
  for (int step = 0; step < 3; ++step) {
    auto y = ops::linear_parts(x, {ps[0].param, ps[1].param}, {}, k);
    y.to(at::kFloat).square().sum().backward();
    ASSERT_EQ(ps[1].param.grad().scalar_type(), at::kFloat);
    const auto casts = k.weight_cache->casts();
    opt.step(1e-2);
    opt.zero_grad();
    auto copy = k.weight_cache->get({ps[0].param, ps[1].param}, at::kBFloat16);
    EXPECT_EQ(k.weight_cache->casts(), casts) << "step " << step << " seed " << seed;
    auto fresh = at::cat({ps[0].param, ps[1].param}).detach().to(at::kBFloat16);
    EXPECT_TRUE(at::equal(copy.view(at::kShort), fresh.view(at::kShort)))
        << "step " << step << " seed " << seed;
  }
}

// The experts' w1 and w3 as one [E, 2H, D] copy (see Note [One gate-up
// GEMM for the experts]): the fused AdamW writes each weight's rows of it
// expert by expert, so after a step the copy is current and holds a fresh
// cast's bits, and the weights and moments are the bits of the same
// update without the copy.
TEST(FusedKernels, AdamWWritesTheExpertsSideBySideCopy) {
  REQUIRE_GPU();
  const auto seed = fresh_seed();
  const auto cuda = at::TensorOptions(at::kCUDA);
  auto make = [&](bool cached) {
    torch::manual_seed(static_cast<uint64_t>(seed));
    std::vector<NamedParam> ps;
    ps.push_back({"w1", (at::randn({4, 24, 32}, cuda) * 0.1).requires_grad_(true), true});
    ps.push_back({"w3", (at::randn({4, 24, 32}, cuda) * 0.1).requires_grad_(true), true});
    ops::KernelOptions k;
    if (cached) k.weight_cache = std::make_shared<kernels::WeightCache>();
    return std::make_pair(ps, k);
  };
  auto [ps, k] = make(true);
  auto [ref, kr] = make(false);
  AdamW opt(ps, 0.9, 0.95, 1e-8, 0.1), opt_ref(ref, 0.9, 0.95, 1e-8, 0.1);
  opt.set_own_kernel_options(k);
  opt_ref.set_own_kernel_options(kr);
  for (int step = 0; step < 3; ++step) {
    auto copy = k.weight_cache->get({ps[0].param, ps[1].param}, at::kBFloat16, 1);
    const auto g = at::randn({2, 4, 24, 32}, cuda);  // the same gradients on both sides
    for (int i = 0; i < 2; ++i) {
      ps[i].param.mutable_grad() = g[i].clone();
      ref[i].param.mutable_grad() = g[i].clone();
    }
    const auto casts = k.weight_cache->casts();
    opt.step(1e-2);
    opt_ref.step(1e-2);
    auto after = k.weight_cache->get({ps[0].param, ps[1].param}, at::kBFloat16, 1);
    EXPECT_EQ(after.data_ptr(), copy.data_ptr());
    EXPECT_EQ(k.weight_cache->casts(), casts) << "step " << step << " seed " << seed;
    auto fresh = at::cat({ps[0].param, ps[1].param}, 1).detach().to(at::kBFloat16);
    EXPECT_TRUE(at::equal(after.view(at::kShort), fresh.view(at::kShort)))
        << "step " << step << " seed " << seed;
    for (int i = 0; i < 2; ++i) {
      EXPECT_TRUE(at::equal(ps[i].param, ref[i].param)) << "step " << step << " seed " << seed;
    }
  }
}

// A linear whose input is a part of a packed projection (ops::linear_split
// on the fused path) reads it in place and writes its input gradient into
// the product's gradient (see Note [Packed projection gradients in place]):
// outputs and gradients have the bits of the same linears on contiguous
// copies of the parts, with and without a bias, for rows of two lengths.
TEST(FusedKernels, LinearOnAPackedPartWritesItsGradientInPlaceWithTheSameBits) {
  REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto f32 = at::TensorOptions(at::kCUDA).dtype(at::kFloat);
  const ops::KernelOptions k;
  const int64_t width = 64 + 32 + 24;
  for (const int64_t T : {70, 128}) {
    const auto x0 = at::randn({2, T, 96}, f32).to(at::kBFloat16);
    std::vector<at::Tensor> w0{at::randn({64, 96}, f32) * 0.1, at::randn({32, 96}, f32) * 0.1,
                               at::randn({24, 96}, f32) * 0.1, at::randn({48, 32}, f32) * 0.1,
                               at::randn({40, 24}, f32) * 0.1, at::randn({40}, f32)};
    const auto da = at::randn({2, T, 64}, f32), df = at::randn({2, T, 48}, f32);
    const auto dg = at::randn({2, T, 40}, f32);
    auto run = [&](bool in_place) {
      auto x = x0.detach().requires_grad_(true);
      std::vector<at::Tensor> w;
      for (const auto& wi : w0) w.push_back(wi.clone().requires_grad_(true));
      const auto parts = ops::linear_split(x, {w[0], w[1], w[2]}, k);
      EXPECT_EQ(parts[1].stride(1), width);  // a view of the one product
      const auto f = in_place ? parts[1] : parts[1].contiguous();
      const auto g = in_place ? parts[2] : parts[2].contiguous();
      std::vector<int64_t> handed_strides;
      for (const auto& p : {f, g}) {
        p.register_hook([&handed_strides](const at::Tensor& grad) {
          handed_strides.push_back(grad.stride(1));
        });
      }
      const auto yf = ops::linear(f, w[3], at::Tensor(), k);
      const auto yg = ops::linear(g, w[4], w[5], k);
      ((parts[0].to(at::kFloat) * da).sum() + (yf.to(at::kFloat) * df).sum() +
       (yg.to(at::kFloat) * dg).sum())
          .backward();
      // In place, both gradients are columns of the product's gradient.
      EXPECT_EQ(handed_strides.size(), 2u);
      for (const auto s : handed_strides) EXPECT_EQ(s == width, in_place) << "T " << T;
      std::vector<at::Tensor> out{yf.detach(), yg.detach(), x.grad()};
      for (const auto& wi : w) out.push_back(wi.grad());
      return out;
    };
    const auto a = run(false), b = run(true);
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(b[i].defined()) << "T " << T << ", tensor " << i;
      EXPECT_TRUE(at::equal(a[i], b[i])) << "T " << T << ", tensor " << i;
    }
    EXPECT_GT(b[2].abs().sum().item<double>(), 0.0);
  }
}

// linear_split's finer parts on the fused path (MLA's q latent, kv latent
// and k's rotary part) against the same product split by weight and the
// second part narrowed: the same outputs and, the parts' gradients going
// into the product's, the same input and weight gradients.
TEST(FusedKernels, PackedPartsFinerThanTheWeightsHaveTheNarrowsBits) {
  REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto f32 = at::TensorOptions(at::kCUDA).dtype(at::kFloat);
  const ops::KernelOptions k;
  const auto x0 = at::randn({2, 70, 96}, f32).to(at::kBFloat16);
  const auto wq0 = at::randn({64, 96}, f32) * 0.1, wkv0 = at::randn({48, 96}, f32) * 0.1;
  const auto dq = at::randn({2, 70, 64}, f32), dc = at::randn({2, 70, 32}, f32);
  const auto dp = at::randn({2, 70, 16}, f32);
  auto run = [&](bool parts) {
    auto x = x0.detach().requires_grad_(true);
    auto wq = wq0.clone().requires_grad_(true), wkv = wkv0.clone().requires_grad_(true);
    std::vector<at::Tensor> y;
    if (parts) {
      y = ops::linear_split(x, {wq, wkv}, k, {}, {64, 32, 16});
    } else {
      const auto two = ops::linear_split(x, {wq, wkv}, k);
      y = {two[0], two[1].narrow(-1, 0, 32), two[1].narrow(-1, 32, 16)};
    }
    ((y[0].to(at::kFloat) * dq).sum() + (y[1].to(at::kFloat) * dc).sum() +
     (y[2].to(at::kFloat) * dp).sum())
        .backward();
    std::vector<at::Tensor> out;
    for (const auto& t : y) out.push_back(t.detach());
    out.insert(out.end(), {x.grad(), wq.grad(), wkv.grad()});
    return out;
  };
  const auto a = run(false), b = run(true);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::equal(a[i], b[i])) << "tensor " << i;
  }
  EXPECT_GT(b[4].abs().sum().item<double>(), 0.0);
}

TEST(FusedKernels, WeightCacheChangesNoBit) {
  REQUIRE_GPU();
  // Three bf16 AdamW steps of a small llama with a cache kept across steps
  // (copies written by the AdamW kernel) and with none (fresh casts): the
  // same losses and parameters, bit for bit. Deterministic kernels, as
  // training.deterministic.
  const auto seed = fresh_seed();
  const bool det = at::globalContext().deterministicAlgorithms();
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  auto cfg = JobConfig::parse("", "test", {"model.n_layers=2", "training.seq_len=64"});
  auto tokens = at::randint(0, 300, {2, 64}, at::TensorOptions(at::kCUDA).dtype(at::kLong));
  auto targets = at::randint(0, 300, {2, 64}, at::TensorOptions(at::kCUDA).dtype(at::kLong));
  std::vector<std::vector<double>> losses(2);
  std::vector<std::vector<at::Tensor>> params(2);
  for (int keep = 0; keep < 2; ++keep) {
    // keep = 1: one cache for the model and the optimizer, as a rank's
    // model holds it; keep = 0: none, every forward casts afresh.
    auto k = kernel_options(cfg.model);
    if (keep == 1) k.weight_cache = std::make_shared<kernels::WeightCache>();
    auto model = build_model_part(cfg);
    ops::set_kernel_options(*model, k);
    model->init_weights(11);
    model->to(at::kCUDA);
    model->set_compute_dtype(at::kBFloat16);
    std::vector<NamedParam> ps;
    for (const auto& kv : model->named_parameters()) {
      ps.push_back({kv.key(), kv.value(), kv.value().dim() >= 2});
    }
    AdamW opt(ps, 0.9, 0.95, 1e-8, 0.1);
    opt.set_own_kernel_options(k);
    for (int step = 0; step < 3; ++step) {
      auto loss = model->forward_loss({tokens}, targets);
      loss.backward();
      losses[keep].push_back(loss.item<double>());
      opt.step(1e-3);
      opt.zero_grad();
    }
    for (const auto& p : model->parameters()) params[keep].push_back(p.detach().clone());
  }
  at::globalContext().setDeterministicAlgorithms(det, /*warn_only=*/false);
  EXPECT_EQ(losses[0], losses[1]) << "seed " << seed;
  ASSERT_EQ(params[0].size(), params[1].size());
  for (size_t i = 0; i < params[0].size(); ++i) {
    EXPECT_TRUE(at::equal(params[0][i], params[1][i])) << "parameter " << i << " seed " << seed;
  }
}

}  // namespace
}  // namespace viaduct
