// The MoE's routing kernels (kernels/moe_route.h) against their ATen forms
// on the CPU, exactly: the top-k choice against a stable descending sort of
// the same sums, with many ties; the dispatch into padded groups against
// the sort-and-count form, over one and many of the kernels' blocks.
//
// The permute and combine kernels of the grouped path and the router's
// kernels against their ATen forms on a GPU.
//
// The MoE's routed experts through grouped GEMMs (ops/moe.h) against the
// per-expert loop (the same layer with model.cuda_kernels off) on a GPU in
// bf16: outputs, every gradient and the expert loads; and two grouped runs
// give the same bits. Built only in the CUDA build; skipped without a GPU
// the kernels were compiled for or a LibTorch without grouped GEMMs.
//
// Bound: relative Frobenius error 2e-2 (bf16 activations; the two forms
// round the expert products at different points: the grouped backward
// writes the weight gradients in fp32).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "core/torch_compat.h"
#include "kernels/fused.h"
#include "model/moe.h"
#include "ops/moe.h"
#include "common/cuda_test.h"

namespace viaduct {
namespace {

using testing_cuda::fresh_seed;
using testing_cuda::rel_err;

struct Run {
  at::Tensor y, dx, loads;
  std::vector<std::pair<std::string, at::Tensor>> grads;
};

Run run_experts(const MoeOptions& o, bool grouped, const at::Tensor& x, const at::Tensor& dy) {
  Moe m(o);
  m->init_weights(11, "moe.", 0.05, 0.05);
  m->to(at::kCUDA);
  // As a rank's model runs: the GEMM forms this build takes on the device,
  // probed (the grouped GEMM writes its fp32 weight gradients itself, or its
  // bf16 product is cast).
  ops::KernelOptions k;
  k.fused = grouped;
  k.capabilities = ops::probe_capabilities(x.device());
  ops::set_kernel_options(*m, k);
  auto xi = x.detach().requires_grad_(true);
  Run r;
  r.y = m->forward(xi);
  r.y.backward(dy);
  r.dx = xi.grad();
  r.loads = m->tokens_per_expert.clone();
  for (const auto& p : m->named_parameters()) r.grads.emplace_back(p.key(), p.value().grad());
  return r;
}

std::vector<int64_t> longs(const at::Tensor& t) {
  auto c = t.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// Scores on a coarse grid, so that many sums tie (ties go to the lower
// expert id) and some experts' bias lifts them over the rest.
TEST(MoeRouting, TopkKernelChoosesAsAStableSort) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const auto& [E, K] : std::vector<std::pair<int64_t, int64_t>>{
           {8, 2}, {16, 2}, {64, 8}, {128, 8}, {200, 5}, {256, 1}, {33, 33}}) {
    SCOPED_TRACE("E " + std::to_string(E) + " k " + std::to_string(K));
    auto scores = (at::randint(1, 9, {1000, E}, at::kFloat) / 8).to(at::kCUDA);
    auto bias = (at::randint(-2, 3, {E}, at::kFloat) / 64).to(at::kCUDA);
    ASSERT_TRUE(kernels::moe_topk_usable(scores, K));
    auto got = kernels::moe_topk(scores, bias, K);
    auto sums = scores.cpu() + bias.cpu();
    auto reference = std::get<1>(at::sort(sums, /*stable=*/true, -1, /*descending=*/true))
                    .narrow(-1, 0, K);
    ASSERT_EQ(got.sizes(), reference.sizes());
    EXPECT_EQ(longs(got), longs(reference));
    // The model's entry point takes the kernel under the kernel options.
    EXPECT_EQ(longs(ops::top_experts(scores, bias, K, ops::KernelOptions{})), longs(reference));
  }
}

TEST(MoeRouting, DispatchKernelsPlaceAsTheSortForm) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // Slot counts below, at and over one block of the count pass (1024), and
  // many blocks; expert 1 never chosen where E > 2.
  for (const int64_t S : {1, 37, 1024, 1025, 5000, 70001}) {
    for (const int64_t E : {2, 8, 128, 1000}) {
      SCOPED_TRACE("S " + std::to_string(S) + " E " + std::to_string(E));
      auto ids = at::randint(0, E, {S}, at::kLong);
      if (E > 2) ids.masked_fill_(ids == 1, 0);
      auto reference = ops::dispatch_experts(ids, E, {});  // on the CPU: the sort form
      auto got = ops::dispatch_experts(ids.to(at::kCUDA), E, {});
      // The sort form on the GPU too, where the options turn the kernels off.
      auto sorted = ops::dispatch_experts(ids.to(at::kCUDA), E, {.fused = false});
      EXPECT_EQ(longs(sorted.pos), longs(reference.pos));
      ASSERT_TRUE(got.pos.is_cuda());
      EXPECT_EQ(got.rows, reference.rows);
      EXPECT_EQ(longs(got.counts), longs(reference.counts));
      EXPECT_EQ(longs(got.offs), longs(reference.offs));
      EXPECT_EQ(got.offs.scalar_type(), at::kInt);
      EXPECT_EQ(longs(got.pos), longs(reference.pos));
      // pos's inverse, written by the placement: each row's slot, -1 where
      // none (every row of the buffer, padding past the last group too).
      ASSERT_TRUE(got.row_slot.defined());
      EXPECT_FALSE(sorted.row_slot.defined());
      auto inverse = at::full({reference.rows}, -1, at::kLong)
                         .index_copy_(0, reference.pos, at::arange(S, at::kLong));
      EXPECT_EQ(longs(got.row_slot), longs(inverse));
    }
  }
}

class MoeGrouped : public testing::TestWithParam<std::pair<int64_t, int64_t>> {};

TEST_P(MoeGrouped, MatchesThePerExpertLoop) {
  REQUIRE_GPU();
  if (!compat::kGroupedMm) GTEST_SKIP() << "no grouped GEMM in this LibTorch";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  MoeOptions o;
  o.dim = 256;
  o.n_routed_experts = GetParam().first;
  o.n_activated_experts = GetParam().second;
  o.hidden_dim = 128;
  o.n_shared_experts = 1;
  const auto opt = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
  auto x = at::randn({2, 157, o.dim}, opt);
  auto dy = at::randn({2, 157, o.dim}, opt);
  ASSERT_TRUE(ops::grouped_experts_run(x, o.hidden_dim, ops::KernelOptions{}));
  auto g = run_experts(o, true, x, dy);
  auto l = run_experts(o, false, x, dy);
  EXPECT_TRUE(at::equal(g.loads, l.loads));
  EXPECT_LT(rel_err(g.y, l.y), 2e-2);
  EXPECT_LT(rel_err(g.dx, l.dx), 2e-2);
  ASSERT_EQ(g.grads.size(), l.grads.size());
  for (size_t i = 0; i < g.grads.size(); ++i) {
    ASSERT_TRUE(g.grads[i].second.defined()) << g.grads[i].first;
    EXPECT_EQ(g.grads[i].second.scalar_type(), at::kFloat) << g.grads[i].first;
    EXPECT_LT(rel_err(g.grads[i].second, l.grads[i].second), 2e-2) << g.grads[i].first;
  }
  // Run to run: the same bits.
  auto g2 = run_experts(o, true, x, dy);
  EXPECT_TRUE(at::equal(g.y, g2.y));
  EXPECT_TRUE(at::equal(g.dx, g2.dx));
  for (size_t i = 0; i < g.grads.size(); ++i) {
    EXPECT_TRUE(at::equal(g.grads[i].second, g2.grads[i].second)) << g.grads[i].first;
  }
}

// The one-pass moves of the grouped path (see Note [MoE rows moved in one
// pass]) against their ATen forms on the same device: the permuted rows and
// the combined sum bit for bit (copies; rounded products added in ascending
// j), dx and dys bit
// for bit, each gate's gradient (a fixed-order sum over D
// where ATen reduces in its own order) against fp64 sums of the same bf16
// products; and two runs give the same bits.
TEST(MoeRouting, PermuteAndCombineKernelsMatchTheirAtenForms) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto bf = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
  for (const auto& [N, K, E, D] : std::vector<std::array<int64_t, 4>>{
           {1, 1, 4, 8}, {157, 2, 16, 256}, {300, 8, 64, 2048}, {64, 3, 5, 24}}) {
    SCOPED_TRACE("N " + std::to_string(N) + " K " + std::to_string(K) + " E " +
                 std::to_string(E) + " D " + std::to_string(D));
    auto ids = at::randint(0, E, {N, K}, at::TensorOptions(at::kCUDA).dtype(at::kLong));
    auto d = ops::dispatch_experts(ids, E, {});
    auto row_slot = at::full({d.rows}, -1, d.pos.options())
                        .index_copy_(0, d.pos, at::arange(N * K, d.pos.options()));
    auto x = at::randn({N, D}, bf).requires_grad_(true);
    auto xr = x.detach().clone().requires_grad_(true);
    auto xs = kernels::moe_permute(x, d.pos, row_slot, K);
    auto xs_ref = at::zeros({d.rows, D}, bf).index_copy(
        0, d.pos, xr.unsqueeze(1).expand({N, K, D}).reshape({N * K, D}));
    EXPECT_TRUE(at::equal(xs, xs_ref));
    auto dxs = at::randn({d.rows, D}, bf);
    xs.backward(dxs);
    xs_ref.backward(dxs);
    EXPECT_TRUE(K > 2 || at::equal(x.grad(), xr.grad()));  // K > 2: ATen's order of K terms
    EXPECT_LT(rel_err(x.grad(), xr.grad()), 1e-2);
    auto ys = at::randn({d.rows, D}, bf).requires_grad_(true);
    auto ysr = ys.detach().clone().requires_grad_(true);
    auto gates = at::rand({N, K}, at::TensorOptions(at::kCUDA)).requires_grad_(true);
    auto gr = gates.detach().clone().requires_grad_(true);
    auto out = kernels::moe_combine(ys, gates, d.pos, row_slot);
    auto y_ref = ysr.index_select(0, d.pos).view({N, K, D});
    auto out_ref = ops::combine_experts(y_ref, gr);
    EXPECT_TRUE(K > 2 || at::equal(out, out_ref));
    EXPECT_LT(rel_err(out, out_ref), 1e-2);
    auto dout = at::randn({N, D}, bf);
    out.backward(dout);
    out_ref.backward(dout);
    EXPECT_TRUE(at::equal(ys.grad(), ysr.grad()));
    // The gates' gradient: sum_d bf16(dout * y) per slot, in fp64.
    auto prods = (dout.unsqueeze(1) * y_ref.detach()).to(at::kDouble).sum(-1);
    EXPECT_EQ(gates.grad().scalar_type(), at::kFloat);
    EXPECT_LT(rel_err(gates.grad(), prods), 1e-2);
    EXPECT_LT(rel_err(gates.grad(), gr.grad()), 2e-2);
    // Run to run.
    auto out2 = kernels::moe_combine(ys.detach(), gates.detach().requires_grad_(true), d.pos,
                                     row_slot);
    EXPECT_TRUE(at::equal(out, out2));
    // With a base added in the same pass (the shared experts' output): the
    // bits of the combine followed by the add, and the base's gradient is
    // the output's; ys' and the gates' gradients those of the plain combine.
    auto base = at::randn({N, D}, bf).requires_grad_(true);
    auto ys3 = ys.detach().clone().requires_grad_(true);
    auto g3 = gates.detach().clone().requires_grad_(true);
    auto out3 = kernels::moe_combine(ys3, g3, d.pos, row_slot, base);
    EXPECT_TRUE(at::equal(out3, out2 + base.detach()));
    out3.backward(dout);
    EXPECT_TRUE(at::equal(base.grad(), dout));
    EXPECT_TRUE(at::equal(ys3.grad(), ys.grad()));
    EXPECT_TRUE(at::equal(g3.grad(), gates.grad()));
  }
}

// The router's logits from bf16 tokens (see Note [Router logits from bf16
// tokens]) against ATen's form, the tokens cast to fp32 times the fp32
// weight, and an fp64 reference: logits and both gradients (the order of
// the fp32 sums is the kernels' own), and two runs give the same bits.
// The router's kernels sum in fixed orders (see Note [Router logits from
// bf16 tokens]), whatever tokens share a load of the weights: the same
// fp32 arithmetic replayed on the CPU with single-rounding fmas gives their
// bits. logits: lane l's fma chain over the 8-column chunks l, l + 32, ...
// (columns in order within a chunk), then the warp's butterfly sum; dx:
// each element's chain over the experts in order, rounded once to bf16;
// dw: each part's chain over its 256 rows in order, the parts added by
// ATen's sum as the kernel path adds them.
TEST(MoeRouting, RouterKernelsSumInTheirFixedOrder) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto bf = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
  const auto f32 = at::TensorOptions(at::kCUDA).dtype(at::kFloat);
  constexpr int64_t kChunk = 8, kLanes = 32, kPart = 256;
  for (const auto& [N, D, E] : std::vector<std::array<int64_t, 3>>{
           {1, 8, 1}, {7, 264, 8}, {157, 256, 8}, {515, 2048, 8}, {300, 1024, 64},
           {64, 72, 13}}) {
    SCOPED_TRACE("N " + std::to_string(N) + " D " + std::to_string(D) + " E " +
                 std::to_string(E));
    auto x = at::randn({N, D}, bf).requires_grad_(true);
    auto w = (0.05 * at::randn({E, D}, f32)).requires_grad_(true);
    auto dl = at::randn({N, E}, f32);
    auto logits = kernels::moe_router(x, w, 0)[0];
    logits.backward(dl);
    const auto xc = x.detach().to(at::kCPU, at::kFloat).contiguous();
    const auto wc = w.detach().to(at::kCPU).contiguous();
    const auto dc = dl.to(at::kCPU).contiguous();
    const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>(),
                *dp = dc.data_ptr<float>();
    const int64_t vecs = D / kChunk, parts = (N + kPart - 1) / kPart;
    auto want_logits = at::empty({N, E}, at::kFloat);
    auto want_dx = at::empty({N, D}, at::kFloat);
    auto want_part = at::empty({parts, E, D}, at::kFloat);
    float *lp = want_logits.data_ptr<float>(), *xg = want_dx.data_ptr<float>(),
          *pp = want_part.data_ptr<float>();
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t e = 0; e < E; ++e) {
        float lane[kLanes];
        for (int64_t l = 0; l < kLanes; ++l) {
          float acc = 0.f;
          for (int64_t c = l; c < vecs; c += kLanes) {
            for (int64_t k = 0; k < kChunk; ++k) {
              const int64_t d = c * kChunk + k;
              acc = std::fma(xp[n * D + d], wp[e * D + d], acc);
            }
          }
          lane[l] = acc;
        }
        for (int64_t o = kLanes / 2; o > 0; o /= 2) {
          float next[kLanes];
          for (int64_t l = 0; l < kLanes; ++l) next[l] = lane[l] + lane[l ^ o];
          std::copy(next, next + kLanes, lane);
        }
        lp[n * E + e] = lane[0];
      }
      for (int64_t d = 0; d < D; ++d) {
        float acc = 0.f;
        for (int64_t e = 0; e < E; ++e) acc = std::fma(dp[n * E + e], wp[e * D + d], acc);
        xg[n * D + d] = acc;
      }
    }
    for (int64_t p = 0; p < parts; ++p) {
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t d = 0; d < D; ++d) {
          float acc = 0.f;
          for (int64_t n = p * kPart; n < std::min(N, (p + 1) * kPart); ++n) {
            acc = std::fma(dp[n * E + e], xp[n * D + d], acc);
          }
          pp[(p * E + e) * D + d] = acc;
        }
      }
    }
    EXPECT_TRUE(at::equal(logits.detach().cpu(), want_logits));
    EXPECT_TRUE(at::equal(x.grad().cpu(), want_dx.to(at::kBFloat16)));
    EXPECT_TRUE(at::equal(w.grad(), want_part.to(at::kCUDA).sum(0)));
  }
}

TEST(MoeRouting, RouterKernelsMatchTheFp32Linear) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto bf = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
  const auto f32 = at::TensorOptions(at::kCUDA).dtype(at::kFloat);
  for (const auto& [N, D, E] : std::vector<std::array<int64_t, 3>>{
           {1, 8, 1}, {157, 256, 8}, {4099, 2048, 8}, {300, 1024, 64}, {64, 72, 13}}) {
    SCOPED_TRACE("N " + std::to_string(N) + " D " + std::to_string(D) + " E " +
                 std::to_string(E));
    auto x = at::randn({N, D}, bf).requires_grad_(true);
    auto w = (0.05 * at::randn({E, D}, f32)).requires_grad_(true);
    auto xr = x.detach().to(at::kCPU, at::kDouble).requires_grad_(true);
    auto wr = w.detach().to(at::kCPU, at::kDouble).requires_grad_(true);
    ASSERT_TRUE(kernels::moe_router_usable(x, w));
    auto logits = kernels::moe_router(x, w, 0)[0];
    ASSERT_EQ(logits.scalar_type(), at::kFloat);
    auto ref = at::matmul(xr, wr.t());
    EXPECT_LT(rel_err(logits, ref), 1e-5);
    auto aten = at::matmul(x.detach().to(at::kFloat), w.detach().t());
    EXPECT_LT(rel_err(logits, aten), 1e-5);
    auto dl = at::randn({N, E}, f32);
    logits.backward(dl);
    ref.backward(dl.to(at::kCPU, at::kDouble));
    EXPECT_EQ(x.grad().scalar_type(), at::kBFloat16);
    EXPECT_LT(rel_err(x.grad(), xr.grad()), 1e-2);  // rounded once to bf16
    EXPECT_LT(rel_err(w.grad(), wr.grad()), 1e-5);
    auto x2 = x.detach().requires_grad_(true), w2 = w.detach().requires_grad_(true);
    auto again = kernels::moe_router(x2, w2, 0)[0];
    again.backward(dl);
    EXPECT_TRUE(at::equal(logits, again));
    EXPECT_TRUE(at::equal(x.grad(), x2.grad()));
    EXPECT_TRUE(at::equal(w.grad(), w2.grad()));
  }
}

// The router's handles of x (see Note [The router's backward sums x's
// gradient]): x's gradient with one or two other consumers is the bits of
// autograd's adds in the engine's order for the MoE layer, the consumers'
// gradients a + b rounded, then the router's own dx added; the handles are
// x's values, and the logits and w's gradient are those of the router alone.
TEST(MoeRouting, RouterBackwardAddsTheOtherConsumersGradients) {
  REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto bf = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
  const auto f32 = at::TensorOptions(at::kCUDA).dtype(at::kFloat);
  for (const auto& [N, D, E] : std::vector<std::array<int64_t, 3>>{
           {1, 8, 1}, {157, 256, 8}, {515, 2048, 8}, {64, 72, 13}}) {
    for (int64_t uses = 1; uses <= 2; ++uses) {
      SCOPED_TRACE("N " + std::to_string(N) + " D " + std::to_string(D) + " E " +
                   std::to_string(E) + " uses " + std::to_string(uses));
      auto x = at::randn({N, D}, bf).requires_grad_(true);
      auto w = (0.05 * at::randn({E, D}, f32)).requires_grad_(true);
      auto dl = at::randn({N, E}, f32);
      const auto ga = at::randn({N, D}, bf), gb = at::randn({N, D}, bf);
      auto out = kernels::moe_router(x, w, uses);
      ASSERT_EQ(static_cast<int64_t>(out.size()), 1 + uses);
      for (int64_t i = 1; i <= uses; ++i) EXPECT_TRUE(at::equal(out[i], x));
      // The consumers: handle 1 scaled by ga, handle 2 by gb (its gradient
      // is that tensor).
      auto loss = (out[0] * dl).sum() + (out[1].to(at::kFloat) * ga.to(at::kFloat)).sum();
      if (uses == 2) loss = loss + (out[2].to(at::kFloat) * gb.to(at::kFloat)).sum();
      loss.backward();
      // The router alone, then the sums in the stated order as bf16 adds.
      auto x0 = x.detach().requires_grad_(true), w0 = w.detach().requires_grad_(true);
      auto alone = kernels::moe_router(x0, w0, 0)[0];
      alone.backward(dl);
      const auto others = uses == 2 ? ga + gb : ga;
      EXPECT_TRUE(at::equal(out[0], alone));
      EXPECT_TRUE(at::equal(x.grad(), others + x0.grad()));
      EXPECT_TRUE(at::equal(w.grad(), w0.grad()));
    }
  }
  // No gradient wanted: the handles are x itself.
  auto x = at::randn({16, 64}, bf);
  auto w = at::randn({4, 64}, f32);
  auto out = kernels::moe_router(x, w, 2);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_TRUE(out[1].is_same(x) && out[2].is_same(x));
}

INSTANTIATE_TEST_SUITE_P(Experts, MoeGrouped,
                         testing::Values(std::make_pair(16, 2), std::make_pair(64, 2),
                                         std::make_pair(128, 8)),
                         [](const testing::TestParamInfo<std::pair<int64_t, int64_t>>& i) {
                           return "E" + std::to_string(i.param.first) + "Top" +
                                  std::to_string(i.param.second);
                         });

}  // namespace
}  // namespace viaduct
