// The device energy meter (core/energy.h): no counter on the CPU; on a GPU
// with NVML, the counter's joules over a busy span against a second source,
// the driver's power readings sampled and integrated over the same span.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "core/energy.h"

namespace viaduct {
namespace {

TEST(EnergyMeter, CpuHasNoCounter) {
  EnergyMeter meter(at::Device(at::kCPU));
  EXPECT_FALSE(meter.available());
  EXPECT_FALSE(meter.joules_since_last().has_value());
  EXPECT_FALSE(device_power_watts(at::Device(at::kCPU)).has_value());
}

TEST(EnergyMeter, CounterMatchesIntegratedPower) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  const at::Device gpu(at::kCUDA, 0);
  EnergyMeter meter(gpu);
  if (!meter.available()) GTEST_SKIP() << "no NVML energy counter on this machine";
  auto a = at::randn({8192, 8192}, at::TensorOptions(gpu).dtype(at::kBFloat16));
  // Power readings every 20 ms, integrated by the trapezoid rule, from the
  // counter's first reading to its last: 3 s of matmuls, then 1.5 s idle so
  // that the driver's averaging window has caught up with the drop.
  using clock = std::chrono::steady_clock;
  std::atomic<bool> stop{false};
  double integrated = 0;
  (void)meter.joules_since_last();
  std::thread sampler([&] {
    auto t_prev = clock::now();
    double w_prev = device_power_watts(gpu).value_or(0.0);
    while (!stop.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      const auto t = clock::now();
      const double w = device_power_watts(gpu).value_or(0.0);
      integrated += 0.5 * (w + w_prev) * std::chrono::duration<double>(t - t_prev).count();
      t_prev = t;
      w_prev = w;
    }
  });
  const auto t0 = clock::now();
  while (clock::now() - t0 < std::chrono::seconds(3)) {
    for (int i = 0; i < 20; ++i) a = at::matmul(a, a).div_(90.5);
    torch::cuda::synchronize();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const auto joules = meter.joules_since_last();
  stop = true;
  sampler.join();
  ASSERT_TRUE(joules.has_value());
  const double seconds = std::chrono::duration<double>(clock::now() - t0).count();
  // Busy matmuls on a data-centre GPU draw well over 100 W on average.
  EXPECT_GT(*joules, 100.0 * 3.0) << "over " << seconds << " s";
  EXPECT_NEAR(*joules, integrated, 0.15 * integrated) << "over " << seconds << " s";
}

}  // namespace
}  // namespace viaduct
