// ops::kda_chunked, the chunked form of the gated delta rule (ops/kda.h),
// against ops::kda_recurrent, the recurrence step by step, in fp64: outputs,
// every gradient, an initial state, and decays strong enough to overflow an
// unmasked exp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "ops/kda.h"

namespace viaduct {
namespace {

struct KdaInputs {
  at::Tensor q, k, v, g, beta;
};

// Normalised q, k (q scaled), decays in [-decay_max, 0], beta in (0, 1).
KdaInputs random_kda(int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv,
                     double decay_max, uint64_t seed) {
  torch::manual_seed(seed);
  auto o = torch::TensorOptions().dtype(torch::kDouble);
  auto nrm = [](const at::Tensor& x) {
    return x / x.norm(2, -1, /*keepdim=*/true);
  };
  KdaInputs in;
  in.q = nrm(torch::randn({B, T, H, dk}, o)) / std::sqrt(double(dk));
  in.k = nrm(torch::randn({B, T, H, dk}, o));
  in.v = torch::randn({B, T, H, dv}, o);
  in.g = -decay_max * torch::rand({B, T, H, dk}, o);
  in.beta = torch::sigmoid(torch::randn({B, T, H}, o));
  return in;
}

TEST(KdaChunked, MatchesRecurrentFp64) {
  const auto in = random_kda(2, 37, 2, 8, 6, 1.0, 1);
  const auto reference = ops::kda_recurrent(in.q, in.k, in.v, in.g, in.beta);
  ASSERT_EQ(reference.scalar_type(), at::kDouble);
  for (int64_t chunk : {1, 4, 8, 16, 64}) {
    auto out = ops::kda_chunked(in.q, in.k, in.v, in.g, in.beta, chunk);
    EXPECT_EQ(out.sizes(), reference.sizes());
    EXPECT_LT((out - reference).abs().max().item<double>(), 1e-12) << "chunk " << chunk;
  }
}

TEST(KdaChunked, GradientsMatchRecurrentFp64) {
  auto in = random_kda(1, 21, 2, 4, 5, 0.5, 2);
  std::vector<at::Tensor> leaves{in.q, in.k, in.v, in.g, in.beta};
  // Chunks of 8 (one sub-chunk) and of 32 (two sub-chunks of 16, see Note [KDA
  // decayed products in sub-chunks]).
  for (int64_t chunk : {8, 32}) {
  auto grads = [&](bool chunked) {
    std::vector<at::Tensor> xs;
    for (auto& t : leaves) xs.push_back(t.detach().clone().requires_grad_(true));
    auto o = chunked ? ops::kda_chunked(xs[0], xs[1], xs[2], xs[3], xs[4], chunk)
                     : ops::kda_recurrent(xs[0], xs[1], xs[2], xs[3], xs[4]);
    torch::manual_seed(3);
    (o * torch::randn(o.sizes(), o.options())).sum().backward();
    std::vector<at::Tensor> gs;
    for (auto& x : xs) gs.push_back(x.grad());
    return gs;
  };
  auto a = grads(true), b = grads(false);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LT((a[i] - b[i]).abs().max().item<double>(), 1e-11) << "input " << i << " chunk "
                                                               << chunk;
  }
  }
}

// An initial state enters both forms the same way: outputs and every
// gradient, the state's own included, agree in fp64.
TEST(KdaChunked, InitialStateMatchesRecurrentFp64) {
  auto in = random_kda(2, 19, 2, 4, 5, 0.5, 5);
  torch::manual_seed(6);
  auto S0 = torch::randn({2, 2, 4, 5}, torch::TensorOptions().dtype(torch::kDouble));
  std::vector<at::Tensor> leaves{in.q, in.k, in.v, in.g, in.beta, S0};
  for (int64_t chunk : {4, 32}) {
    auto run = [&](bool chunked) {
      std::vector<at::Tensor> xs;
      for (auto& t : leaves) xs.push_back(t.detach().clone().requires_grad_(true));
      auto o = chunked ? ops::kda_chunked(xs[0], xs[1], xs[2], xs[3], xs[4], chunk, xs[5])
                       : ops::kda_recurrent(xs[0], xs[1], xs[2], xs[3], xs[4], xs[5]);
      torch::manual_seed(7);
      (o * torch::randn(o.sizes(), o.options())).sum().backward();
      std::vector<at::Tensor> out{o.detach()};
      for (auto& x : xs) out.push_back(x.grad());
      return out;
    };
    auto a = run(true), b = run(false);
    // The state changes the output: a run from zero differs.
    auto zero = ops::kda_chunked(in.q, in.k, in.v, in.g, in.beta, chunk);
    EXPECT_GT((zero - b[0]).abs().max().item<double>(), 1e-3);
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_LT((a[i] - b[i]).abs().max().item<double>(), 1e-11) << "tensor " << i << " chunk "
                                                                 << chunk;
    }
  }
}

TEST(KdaChunked, StrongDecayStaysFinite) {
  // Cumulative log-decays reach -1900 inside a chunk: exp of the unmasked
  // upper triangle would overflow; masking before exp keeps all finite.
  auto in = random_kda(1, 64, 1, 4, 4, 60.0, 4);
  auto q = in.q.to(at::kFloat).requires_grad_(true);
  auto g = in.g.to(at::kFloat).requires_grad_(true);
  auto o = ops::kda_chunked(q, in.k.to(at::kFloat), in.v.to(at::kFloat), g,
                       in.beta.to(at::kFloat), 64);
  o.sum().backward();
  EXPECT_TRUE(torch::isfinite(o).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(q.grad()).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(g.grad()).all().item<bool>());
  auto reference = ops::kda_recurrent(in.q, in.k, in.v, in.g, in.beta);
  EXPECT_LT((o.to(at::kDouble) - reference).abs().max().item<double>(), 1e-4);
}

}  // namespace
}  // namespace viaduct
