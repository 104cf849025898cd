// A central-difference gradient checker for fp64 modules (gradcheck is
// Python-only). The loss is <f(inputs), probe> with a fixed random probe, so
// every output element contributes; a sample of each tensor's entries is
// perturbed.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

namespace viaduct::testing {

struct GradCheckOptions {
  double eps = 1e-6;
  double rtol = 1e-5;
  double atol = 1e-8;
  int64_t samples_per_tensor = 12;
};

// `tensors`: fp64 leaves with requires_grad (parameters and inputs), named.
inline void expect_gradients_match(
    const std::function<at::Tensor()>& f,
    const std::vector<std::pair<std::string, at::Tensor>>& tensors,
    GradCheckOptions opt = {}) {
  torch::manual_seed(1234);
  auto out = f();
  ASSERT_EQ(out.scalar_type(), at::kDouble);
  const auto probe = torch::randn(out.sizes(), out.options());
  auto loss_of = [&] { return (f() * probe).sum(); };
  for (auto& [name, t] : tensors) {
    if (t.grad().defined()) t.grad().zero_();
  }
  (out * probe).sum().backward();
  for (auto& [name, t] : tensors) {
    ASSERT_TRUE(t.grad().defined()) << name << " got no gradient";
    auto analytic = t.grad().clone().reshape({-1});
    auto flat = t.detach().view({-1});  // shares storage with t
    const int64_t n = flat.numel();
    const int64_t stride = std::max<int64_t>(1, n / opt.samples_per_tensor);
    for (int64_t i = 0; i < n; i += stride) {
      const double x0 = flat[i].item<double>();
      double lp, lm;
      {
        torch::NoGradGuard g;
        flat[i].fill_(x0 + opt.eps);
        lp = loss_of().item<double>();
        flat[i].fill_(x0 - opt.eps);
        lm = loss_of().item<double>();
        flat[i].fill_(x0);
      }
      const double numeric = (lp - lm) / (2 * opt.eps);
      const double a = analytic[i].item<double>();
      EXPECT_NEAR(a, numeric, opt.atol + opt.rtol * std::abs(numeric))
          << name << "[" << i << "]";
    }
  }
}

// Every parameter of a module, named by its FQN.
inline std::vector<std::pair<std::string, at::Tensor>> named_params(
    const torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

}  // namespace viaduct::testing
