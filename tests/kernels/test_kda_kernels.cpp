// viaduct's KDA kernels (kernels/kda.h through ops::kda) against the
// step-by-step recurrence in fp64 and the chunked ATen form in fp32, on
// fresh random inputs (the seed is printed on failure): the output, the
// final state and every input's gradient, the initial state's too. Built
// only in the CUDA build; every test skips without a GPU the kernels were
// compiled for.
//
// Bounds (relative Frobenius error against fp64): 2e-5 for the forward
// and 1e-4 for the gradients. The kernels and the ATen form both run in
// fp32 with different summation orders; the decays are drawn as the layer
// draws them (up to -16 per step and channel at the extreme), so products
// of up to 64 decays meet in one sum.
#include <gtest/gtest.h>


#include "kernels/fused.h"
#include "kernels/kda.h"
#include "model/kda.h"
#include "ops/kda.h"
#include "ops/rms_norm.h"
#include "common/cuda_test.h"

namespace viaduct {
namespace {

using testing_cuda::fresh_seed;
using testing_cuda::have_gpu;
using testing_cuda::rel_err;

struct Inputs {
  std::vector<at::Tensor> x;  // q, k, v, g, beta, S0 (fp64, CPU)
};

// Normalised q (scaled) and k, v ~ N(0, 1), the layer's decay law
// g = -exp(A) softplus(f) with A in [0, log 16], beta in (0, 1), and an
// initial state ~ N(0, 1) when asked.
Inputs draw(int64_t B, int64_t T, int64_t H, int64_t D, bool with_state) {
  auto o = at::TensorOptions().dtype(at::kDouble);
  auto nrm = [](const at::Tensor& x) { return x / x.norm(2, -1, true); };
  Inputs in;
  in.x.push_back(nrm(at::randn({B, T, H, D}, o)) / std::sqrt(double(D)));
  in.x.push_back(nrm(at::randn({B, T, H, D}, o)));
  in.x.push_back(at::randn({B, T, H, D}, o));
  auto A = at::rand({1, 1, H, 1}, o) * std::log(16.0);
  in.x.push_back(-A.exp() * at::softplus(at::randn({B, T, H, D}, o) - 3.0));
  in.x.push_back(at::sigmoid(at::randn({B, T, H}, o)));
  in.x.push_back(with_state ? at::randn({B, H, D, D}, o) : at::Tensor());
  return in;
}

struct Result {
  at::Tensor o;
  std::vector<at::Tensor> grads;  // q, k, v, g, beta, S0 (when given)
};

// Runs `f` on leaves made from the inputs (cast to `t` on device `dev`)
// and back-propagates dO (and dS through the final state when `dS` is
// given, for the kernel form that returns it).
template <typename F>
Result run(const Inputs& in, at::Device dev, at::ScalarType t, const at::Tensor& dO, F f) {
  std::vector<at::Tensor> leaves;
  for (const auto& x : in.x) {
    leaves.push_back(x.defined() ? x.to(dev, t).detach().requires_grad_(true) : at::Tensor());
  }
  Result r;
  r.o = f(leaves);
  r.o.backward(dO.to(dev, t));
  for (const auto& l : leaves) r.grads.push_back(l.defined() ? l.grad() : at::Tensor());
  return r;
}

const char* kNames[] = {"q", "k", "v", "g", "beta", "initial state"};

void expect_close(const Result& out, const Result& reference, double fwd_bound, double grad_bound,
                  const std::string& what) {
  EXPECT_LT(rel_err(out.o, reference.o), fwd_bound) << what << ": output";
  for (size_t i = 0; i < reference.grads.size(); ++i) {
    if (!reference.grads[i].defined()) continue;
    ASSERT_TRUE(out.grads[i].defined()) << what << ": no gradient for " << kNames[i];
    const double e = rel_err(out.grads[i], reference.grads[i]);
    EXPECT_LT(e, grad_bound) << what << ": gradient of " << kNames[i];
    std::printf("  %s d%s: %.2e\n", what.c_str(), kNames[i], e);
  }
}

at::Tensor kernel_o(const std::vector<at::Tensor>& x) {
  return kernels::kda_chunk(x[0], x[1], x[2], x[3], x[4], x[5]).first;
}

struct Shape {
  int64_t B, T, H, D;
  bool state;
};

class KdaKernels : public testing::TestWithParam<Shape> {};

TEST_P(KdaKernels, MatchFp64RecurrenceAndAtenChunks) {
  REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto p = GetParam();
  const auto in = draw(p.B, p.T, p.H, p.D, p.state);
  const auto dO = at::randn({p.B, p.T, p.H, p.D}, at::kDouble);
  const at::Device gpu(at::kCUDA);
  auto reference = run(in, at::kCPU, at::kDouble, dO, [](const std::vector<at::Tensor>& x) {
    return ops::kda_recurrent(x[0], x[1], x[2], x[3], x[4], x[5]);
  });
  auto kern = run(in, gpu, at::kFloat, dO, kernel_o);
  auto aten = run(in, gpu, at::kFloat, dO, [](const std::vector<at::Tensor>& x) {
    return ops::kda_chunked(x[0], x[1], x[2], x[3], x[4], 64, x[5]);
  });
  expect_close(kern, reference, 2e-5, 1e-4, "kernels vs fp64");
  expect_close(aten, reference, 2e-5, 1e-4, "aten fp32 vs fp64");
}

INSTANTIATE_TEST_SUITE_P(Shapes, KdaKernels,
                         testing::Values(Shape{2, 100, 3, 64, false},
                                         Shape{1, 64, 2, 128, false},
                                         Shape{2, 131, 2, 128, true},
                                         Shape{1, 7, 1, 64, true}),
                         [](const testing::TestParamInfo<Shape>& i) {
                           const auto& s = i.param;
                           return "B" + std::to_string(s.B) + "T" + std::to_string(s.T) + "H" +
                                  std::to_string(s.H) + "D" + std::to_string(s.D) +
                                  (s.state ? "WithState" : "");
                         });

// The final state and the initial state compose: the final state of
// [0, T) as the initial state of [T, 2T) gives one call's outputs and final
// state on [0, 2T), and the same gradients for a loss on both.
TEST(KdaKernelsState, SplitCallsEqualOneCall) {
  REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t B = 1, T = 90, H = 2, D = 64;
  const auto in2 = draw(B, 2 * T, H, D, true);
  const at::Device gpu(at::kCUDA);
  std::vector<at::Tensor> x;
  for (const auto& t : in2.x) x.push_back(t.defined() ? t.to(gpu, at::kFloat) : t);
  auto whole = kernels::kda_chunk(x[0], x[1], x[2], x[3], x[4], x[5]);
  auto half = [&](int64_t from, const at::Tensor& s0) {
    auto sl = [&](const at::Tensor& t) { return t.narrow(1, from, T); };
    return kernels::kda_chunk(sl(x[0]), sl(x[1]), sl(x[2]), sl(x[3]), sl(x[4]), s0);
  };
  auto first = half(0, x[5]);
  auto second = half(T, first.second);
  EXPECT_LT(rel_err(at::cat({first.first, second.first}, 1), whole.first), 2e-5);
  EXPECT_LT(rel_err(second.second, whole.second), 2e-5);
  // Gradient through the split: the loss on both halves' outputs and the
  // final state, against the same loss on the whole call.
  auto leaves = [&]() {
    std::vector<at::Tensor> l;
    for (const auto& t : x) l.push_back(t.detach().requires_grad_(true));
    return l;
  };
  auto w = at::randn({B, 2 * T, H, D}, x[0].options());
  auto ws = at::randn({B, H, D, D}, x[0].options());
  auto l1 = leaves();
  auto r1 = kernels::kda_chunk(l1[0], l1[1], l1[2], l1[3], l1[4], l1[5]);
  ((r1.first * w).sum() + (r1.second * ws).sum()).backward();
  auto l2 = leaves();
  auto sl = [&](const at::Tensor& t, int64_t from) { return t.narrow(1, from, T); };
  auto a = kernels::kda_chunk(sl(l2[0], 0), sl(l2[1], 0), sl(l2[2], 0), sl(l2[3], 0),
                              sl(l2[4], 0), l2[5]);
  auto b = kernels::kda_chunk(sl(l2[0], T), sl(l2[1], T), sl(l2[2], T), sl(l2[3], T),
                              sl(l2[4], T), a.second);
  ((at::cat({a.first, b.first}, 1) * w).sum() + (b.second * ws).sum()).backward();
  for (size_t i = 0; i < l1.size(); ++i) {
    EXPECT_LT(rel_err(l2[i].grad(), l1[i].grad()), 1e-4) << kNames[i];
  }
}

// Two calls on the same inputs give the same bits, forward and backward.
TEST(KdaKernelsState, RunToRunBitwise) {
  REQUIRE_GPU();
  fresh_seed();
  const auto in = draw(2, 200, 4, 128, true);
  const auto dO = at::randn({2, 200, 4, 128}, at::kDouble);
  const at::Device gpu(at::kCUDA);
  auto a = run(in, gpu, at::kFloat, dO, kernel_o);
  auto b = run(in, gpu, at::kFloat, dO, kernel_o);
  EXPECT_TRUE(at::equal(a.o, b.o));
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(at::equal(a.grads[i], b.grads[i])) << kNames[i];
}

// A bf16 v is read as it is: the output, the final state and every other
// gradient have the bits of the same values' fp32 copy, and v's gradient
// is that copy's gradient rounded to bf16.
TEST(KdaKernelsState, Bf16VHasTheBitsOfItsFp32Copy) {
  REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const at::Device gpu(at::kCUDA);
  for (const int64_t D : {64, 128}) {
    const int64_t B = 2, T = 131, H = 2;
    const auto in = draw(B, T, H, D, true);
    const auto dO = at::randn({B, T, H, D}, at::kDouble).to(gpu, at::kFloat);
    const auto dS = at::randn({B, H, D, D}, at::kDouble).to(gpu, at::kFloat);
    const auto v16 = in.x[2].to(gpu, at::kBFloat16);
    auto leaves = [&](const at::Tensor& v) {
      std::vector<at::Tensor> l;
      for (size_t i = 0; i < in.x.size(); ++i) {
        l.push_back((i == 2 ? v : in.x[i].to(gpu, at::kFloat)).detach().requires_grad_(true));
      }
      return l;
    };
    auto a = leaves(v16.to(at::kFloat)), b = leaves(v16);
    auto ra = kernels::kda_chunk(a[0], a[1], a[2], a[3], a[4], a[5]);
    auto rb = kernels::kda_chunk(b[0], b[1], b[2], b[3], b[4], b[5]);
    SCOPED_TRACE("D " + std::to_string(D));
    EXPECT_TRUE(at::equal(ra.first, rb.first)) << "output";
    EXPECT_TRUE(at::equal(ra.second, rb.second)) << "final state";
    ((ra.first * dO).sum() + (ra.second * dS).sum()).backward();
    ((rb.first * dO).sum() + (rb.second * dS).sum()).backward();
    ASSERT_EQ(b[2].grad().scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(a[2].grad().to(at::kBFloat16), b[2].grad())) << "dv";
    for (size_t i = 0; i < a.size(); ++i) {
      if (i == 2) continue;
      EXPECT_TRUE(at::equal(a[i].grad(), b[i].grad())) << kNames[i];
    }
  }
}

// The short convolutions on parts of a packed projection write their input
// gradients into the product's gradient (see Note [Packed projection
// gradients in place]): the product's gradient and the weights' have the
// bits of autograd's split, whose parts' gradients are concatenated. With a
// part that another op takes and rows of two lengths.
TEST(KdaKernelsLayer, ConvolutionsWriteIntoThePackedGradientWithTheSameBits) {
  REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto opt = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const auto f32 = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  const std::vector<int64_t> widths{256, 256, 16, 128};
  for (const int64_t T : {70, 128}) {
    const auto x0 = at::randn({2, T, 656}, opt);
    const auto wq = at::randn({256, 4}, f32), wv = at::randn({256, 4}, f32);
    const auto wk = at::randn({128, 4}, f32);
    const auto dq = at::randn({2, T, 256}, f32), dv = at::randn({2, T, 256}, opt);
    const auto db = at::randn({2, T, 16}, opt), dk = at::randn({2, T, 128}, f32);
    auto run = [&](bool packed) {
      auto x = x0.detach().requires_grad_(true);
      std::vector<at::Tensor> w{wq.clone().requires_grad_(true), wv.clone().requires_grad_(true),
                                wk.clone().requires_grad_(true)};
      auto y = x * 1;  // a product, as the projection's
      const auto p = packed ? kernels::split_packed(y, widths) : y.split_with_sizes(widths, -1);
      auto q = kernels::short_conv_silu_l2(p[0], w[0], 64, 1e-6, 0.125);
      auto v = kernels::short_conv_silu(p[1], w[1]);
      auto b = at::sigmoid(p[2].to(at::kFloat));
      auto k = kernels::short_conv_silu_l2(p[3], w[2], 128, 1e-6, 1.0);
      ((q * dq).sum() + (v * dv).sum() + (b * db).sum() + (k * dk).sum()).backward();
      std::vector<at::Tensor> g{x.grad()};
      for (const auto& wi : w) g.push_back(wi.grad());
      return g;
    };
    const auto a = run(false), b = run(true);
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(at::equal(a[i], b[i])) << "T " << T << ", gradient " << i;
    }
  }
}

// The batched products over the chunks (cuda::kda_gemm) against fp64 for
// each layout of A and B (a tensor or its transpose), with alpha -1, beta 1
// and an output whose rows are wider than the product (a column range of a
// larger tensor, as the backward writes dW). Bound 1e-6 relative: split-tf32
// keeps about fp32's accuracy where one tf32 product would miss by ~1e-3.
TEST(KdaGemm, MatchesFp64ForEveryLayout) {
  REQUIRE_GPU();
  fresh_seed();
  const int64_t Z = 3, M = 128, N = 64, K = 96;
  const auto f32 = at::TensorOptions(at::kCUDA).dtype(at::kFloat);
  for (const bool at_ : {false, true}) {
    for (const bool bt : {false, true}) {
      SCOPED_TRACE(std::string("A ") + (at_ ? "transposed" : "plain") + ", B " +
                   (bt ? "transposed" : "plain"));
      auto a = at_ ? at::randn({Z, K, M}, f32).transpose(1, 2) : at::randn({Z, M, K}, f32);
      auto b = bt ? at::randn({Z, N, K}, f32).transpose(1, 2) : at::randn({Z, K, N}, f32);
      auto wide = at::randn({Z, M, N + 64}, f32);
      auto c = wide.narrow(2, 32, N);
      auto reference = c.to(at::kDouble) - at::bmm(a.to(at::kDouble), b.to(at::kDouble));
      const auto before = wide.clone();
      cuda::KdaGemm g;
      g.batch = Z;
      g.M = M;
      g.N = N;
      g.K = K;
      g.A = {a.data_ptr<float>(), a.stride(0), a.stride(1), a.stride(2)};
      g.B = {b.data_ptr<float>(), b.stride(0), b.stride(1), b.stride(2)};
      g.C = c.data_ptr<float>();
      g.c_batch = c.stride(0);
      g.c_row = c.stride(1);
      g.alpha = -1.f;
      g.beta = 1.f;
      ASSERT_EQ(cuda::kda_gemm(g, nullptr), cudaSuccess);
      EXPECT_LT(rel_err(c.to(at::kDouble).cpu(), reference.cpu()), 1e-6);
      // The columns either side of the product are untouched.
      EXPECT_TRUE(at::equal(wide.narrow(2, 0, 32), before.narrow(2, 0, 32)));
      EXPECT_TRUE(at::equal(wide.narrow(2, 32 + N, 32), before.narrow(2, 32 + N, 32)));
    }
  }
  cuda::KdaGemm bad;
  bad.batch = 1;
  bad.M = 48;  // not a multiple of the tile
  EXPECT_EQ(cuda::kda_gemm(bad, nullptr), cudaErrorInvalidValue);
}

// A batch past the grid's z limit (65535) runs in slices: every matrix of
// 70,000 is the product of its own operands, those either side of the
// slice edge included. The operands overlap (matrix z starts z floats in)
// so that each is distinct without 70,000 copies; C is 1.1 GB.
TEST(KdaGemm, BatchPastTheGridLimit) {
  REQUIRE_GPU();
  fresh_seed();
  const int64_t Z = 70000, M = 64, N = 64, K = 32;
  const auto f32 = at::TensorOptions(at::kCUDA).dtype(at::kFloat);
  auto a_buf = at::randn({Z + M * K}, f32), b_buf = at::randn({Z + K * N}, f32);
  auto c = at::zeros({Z, M, N}, f32);
  cuda::KdaGemm g;
  g.batch = Z;
  g.M = M;
  g.N = N;
  g.K = K;
  g.A = {a_buf.data_ptr<float>(), 1, K, 1};
  g.B = {b_buf.data_ptr<float>(), 1, N, 1};
  g.C = c.data_ptr<float>();
  g.c_batch = M * N;
  g.c_row = N;
  ASSERT_EQ(cuda::kda_gemm(g, nullptr), cudaSuccess);
  for (const int64_t z : {int64_t{0}, int64_t{65534}, int64_t{65535}, int64_t{65536}, Z - 1}) {
    const auto a = a_buf.narrow(0, z, M * K).view({M, K}).to(at::kDouble);
    const auto b = b_buf.narrow(0, z, K * N).view({K, N}).to(at::kDouble);
    EXPECT_LT(rel_err(c[z].to(at::kDouble).cpu(), at::mm(a, b).cpu()), 1e-6) << z;
  }
}

// Decays far stronger than the layer's law stay finite and match fp64.
TEST(KdaKernelsState, StrongDecayStaysFinite) {
  REQUIRE_GPU();
  fresh_seed();
  auto in = draw(1, 128, 2, 64, false);
  in.x[3] = -60.0 * at::rand_like(in.x[3]);
  const auto dO = at::randn({1, 128, 2, 64}, at::kDouble);
  auto reference = run(in, at::kCPU, at::kDouble, dO, [](const std::vector<at::Tensor>& x) {
    return ops::kda_recurrent(x[0], x[1], x[2], x[3], x[4], x[5]);
  });
  auto kern = run(in, at::Device(at::kCUDA), at::kFloat, dO, kernel_o);
  expect_close(kern, reference, 2e-5, 1e-4, "strong decay");
}

// The whole layer as the model runs it in bf16: with the kernels (chunk 64,
// heads of 128) against the same layer on the ATen chunked form, output and
// every parameter's gradient within bf16 bounds.
TEST(KdaKernelsLayer, LayerMatchesAtenForm) {
  REQUIRE_GPU();
  fresh_seed();
  KdaOptions o;
  o.dim = 512;
  o.n_heads = 4;
  o.head_dim = 128;
  o.chunk_size = 64;
  auto x = at::randn({2, 150, o.dim}, at::TensorOptions(at::kCUDA).dtype(at::kBFloat16));
  auto dy = at::randn_like(x);
  auto run_layer = [&](bool fused) {
    Kda m(o);
    m->init_weights(5, "kda.", 0.05, 0.05);
    m->to(at::kCUDA);
    ops::KernelOptions k;
    k.fused = fused;
    ops::set_kernel_options(*m, k);
    auto xi = x.detach().requires_grad_(true);
    auto y = m->forward(xi);
    y.backward(dy);
    std::vector<at::Tensor> out{y.detach(), xi.grad()};
    for (const auto& p : m->parameters()) out.push_back(p.grad());
    return out;
  };
  auto a = run_layer(true), b = run_layer(false);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LT(rel_err(a[i], b[i]), 2e-2) << "tensor " << i;
}

// Documents on the kernels, the chunks over them in place (see Note [KDA
// chunks over documents]): one call over a micro-batch's documents, the
// state restarted at each document's first chunk, against ops::kda on each
// document alone (the kernels again, one call a document): outputs and
// every input's gradient bit for bit. Documents of 1 token, shorter than a
// chunk, across chunk edges, and a window cut mid-document.
TEST(KdaKernelsState, DocumentsInPlaceAreEachAlone) {
  REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t B = 2, T = 200, H = 2;
  auto starts = at::zeros({B, T}, at::kBool);
  for (const int64_t t : {1, 70, 135, 199}) starts[0][t] = true;
  for (const int64_t t : {64, 100}) starts[1][t] = true;
  const ops::Documents docs(starts, true);
  for (const int64_t D : {64, 128}) {
    const auto in = draw(B, T, H, D, false);
    std::vector<at::Tensor> x;
    for (int i = 0; i < 5; ++i) x.push_back(in.x[i].to(at::kCUDA, at::kFloat).requires_grad_());
    auto run = [](const std::vector<at::Tensor>& a, const ops::Documents* d) {
      return ops::kda(a[0], a[1], a[2], a[3], a[4], 64, ops::KernelOptions{}, {}, d);
    };
    auto y = run(x, &docs);
    auto w = at::randn(y.sizes(), y.options());
    auto grads = torch::autograd::grad({(y * w).sum()}, x);
    for (const auto& s : docs.spans()) {
      auto cut = [&](const at::Tensor& t) {
        return t.narrow(0, s.row, 1).narrow(1, s.start, s.length);
      };
      std::vector<at::Tensor> alone;
      for (const auto& t : x) alone.push_back(cut(t).detach().clone().requires_grad_());
      auto ya = run(alone, nullptr);
      auto ga = torch::autograd::grad({(ya * cut(w)).sum()}, alone);
      SCOPED_TRACE("D " + std::to_string(D) + ", row " + std::to_string(s.row) + ", span at " +
                   std::to_string(s.start) + " of " + std::to_string(s.length));
      EXPECT_TRUE(at::equal(cut(y), ya)) << "output, rel err " << rel_err(cut(y), ya);
      for (int i = 0; i < 5; ++i) {
        EXPECT_TRUE(at::equal(cut(grads[i]), ga[i]))
            << "gradient of " << kNames[i] << ", rel err " << rel_err(cut(grads[i]), ga[i]);
      }
    }
  }
}

// The KDA layer's gates on their kernels against the ops' ATen forms in
// fp64 on the CPU, f and the gate's logits in fp32 and bf16: outputs and
// every gradient, and the same bits run to run. Some of the decay's
// pre-activations are past softplus's threshold (20), where it is the
// identity; the norm takes head widths of 64, 96 and 128.
TEST(KdaGates, DecayForwardBackward) {
  REQUIRE_GPU();
  const int64_t H = 4, D = 64;
  for (auto t : {at::kFloat, at::kBFloat16}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << t << " seed " << seed);
    const auto opt = at::TensorOptions(at::kCUDA);
    auto f0 = at::randn({3, 70, H * D}, opt) * 3.0;
    f0.view({-1}).narrow(0, 0, 40).fill_(25.0);
    auto f = f0.to(t).requires_grad_(true);
    auto bias = (at::randn({H * D}, opt) - 2.0).requires_grad_(true);
    auto A = (at::rand({H}, opt) * std::log(16.0)).requires_grad_(true);
    auto g = kernels::kda_decay(f, bias, A);
    ASSERT_EQ(g.sizes(), (std::vector<int64_t>{3, 70, H, D}));
    ASSERT_EQ(g.scalar_type(), at::kFloat);
    auto cpu = [](const at::Tensor& x) {
      return x.detach().to(at::kCPU, at::kDouble).requires_grad_(true);
    };
    auto fr = cpu(f), br = cpu(bias), Ar = cpu(A);
    auto gr = ops::kda_decay(fr, br, Ar, ops::KernelOptions{});
    EXPECT_LT(rel_err(g, gr), 1e-5) << "g";
    auto dg = at::randn(g.sizes(), opt);
    g.backward(dg);
    gr.backward(dg.to(at::kCPU, at::kDouble));
    EXPECT_LT(rel_err(f.grad(), fr.grad()), t == at::kFloat ? 1e-5 : 1e-2) << "df";
    EXPECT_LT(rel_err(bias.grad(), br.grad()), 1e-5) << "d dt_bias";
    EXPECT_LT(rel_err(A.grad(), Ar.grad()), 1e-5) << "d A_log";
    auto f2 = f.detach().requires_grad_(true), b2 = bias.detach().requires_grad_(true);
    auto A2 = A.detach().requires_grad_(true);
    auto g2 = kernels::kda_decay(f2, b2, A2);
    g2.backward(dg);
    EXPECT_TRUE(at::equal(g, g2));
    EXPECT_TRUE(at::equal(f.grad(), f2.grad()));
    EXPECT_TRUE(at::equal(bias.grad(), b2.grad()));
    EXPECT_TRUE(at::equal(A.grad(), A2.grad()));
  }
}

TEST(KdaGates, GatedNormForwardBackward) {
  REQUIRE_GPU();
  const double eps = 1e-5;
  for (int64_t D : {64, 96, 128, 256})
  for (auto t : {at::kFloat, at::kBFloat16}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "D " << D << " " << t << " seed " << seed);
    const auto opt = at::TensorOptions(at::kCUDA);
    auto x = (at::randn({2, 37, 5, D}, opt) * 2.0).requires_grad_(true);
    auto gl = (at::randn({2, 37, 5, D}, opt) * 2.0).to(t).requires_grad_(true);
    auto w = (1.0 + 0.1 * at::randn({D}, opt)).requires_grad_(true);
    auto y = kernels::gated_rms_norm(x, gl, w, eps);
    ASSERT_EQ(y.scalar_type(), t);
    auto cpu = [](const at::Tensor& v) {
      return v.detach().to(at::kCPU, at::kDouble).requires_grad_(true);
    };
    auto xr = cpu(x), glr = cpu(gl), wr = cpu(w);
    auto yr = ops::gated_rms_norm(xr, wr, eps, glr, at::kDouble, ops::KernelOptions{});
    const double out_bound = t == at::kFloat ? 1e-5 : 1e-2;
    EXPECT_LT(rel_err(y, yr), out_bound) << "y";
    auto dy = at::randn(y.sizes(), opt).to(t);
    y.backward(dy);
    yr.backward(dy.to(at::kCPU, at::kDouble));
    EXPECT_LT(rel_err(x.grad(), xr.grad()), 1e-5) << "dx";
    EXPECT_LT(rel_err(gl.grad(), glr.grad()), out_bound) << "d logits";
    EXPECT_LT(rel_err(w.grad(), wr.grad()), 1e-5) << "dw";
    auto x2 = x.detach().requires_grad_(true), gl2 = gl.detach().requires_grad_(true);
    auto w2 = w.detach().requires_grad_(true);
    auto y2 = kernels::gated_rms_norm(x2, gl2, w2, eps);
    y2.backward(dy);
    EXPECT_TRUE(at::equal(y, y2));
    EXPECT_TRUE(at::equal(x.grad(), x2.grad()));
    EXPECT_TRUE(at::equal(gl.grad(), gl2.grad()));
    EXPECT_TRUE(at::equal(w.grad(), w2.grad()));
  }
}

// The gated norm on KDA's output hands do on in the chunk layout, and
// every gradient has the bits of the same norm on a copy of o, whose
// gradient goes the token layout's way; with T a multiple of the chunk and
// not (rows past T). See Note [KDA's output gradient in the chunk layout].
TEST(KdaGates, GatedNormOnKdaOutputHandsOnTheChunkLayoutWithTheSameBits) {
  REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const at::Device gpu(at::kCUDA);
  for (const int64_t T : {128, 131}) {
    const int64_t B = 2, H = 3, D = 64;
    const auto in = draw(B, T, H, D, false);
    const auto gl0 = at::randn({B, T, H, D}, at::TensorOptions(gpu).dtype(at::kBFloat16));
    const auto w0 = 1.0 + 0.1 * at::randn({D}, at::TensorOptions(gpu));
    const auto dy = at::randn({B, T, H, D}, at::TensorOptions(gpu).dtype(at::kBFloat16));
    auto run = [&](bool direct) {
      std::vector<at::Tensor> l;
      for (size_t i = 0; i < 5; ++i) l.push_back(in.x[i].to(gpu, at::kFloat).requires_grad_(true));
      auto gl = gl0.detach().requires_grad_(true), w = w0.detach().requires_grad_(true);
      auto o = kernels::kda_chunk(l[0], l[1], l[2], l[3], l[4], {}).first;
      if (!direct) o = o * 1;  // the consumer of a copy: the token layout
      EXPECT_EQ(kernels::kda_output_grad_rows(o) > 0, direct);
      auto y = kernels::gated_rms_norm(o, gl, w, 1e-5);
      y.backward(dy);
      std::vector<at::Tensor> g;
      for (const auto& t : l) g.push_back(t.grad());
      g.push_back(gl.grad());
      g.push_back(w.grad());
      return g;
    };
    const auto a = run(false), b = run(true);
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(at::equal(a[i], b[i])) << "T " << T << ", gradient " << i;
    }
  }
}

}  // namespace
}  // namespace viaduct
