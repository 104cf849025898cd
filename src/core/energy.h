// The energy a GPU uses, for the step metrics: NVML's total-energy counter
// (millijoules since the driver loaded, Volta and later), read through
// libnvidia-ml.so.1 loaded at run time, so neither build links NVML and a
// machine without the driver library simply has no energy figures.
//
// Note [Energy per step]
// Each rank's meter reads its device's counter once per step, before the
// host waits for the step's device work, and the step's energy is the
// difference from the previous reading: consecutive steps' energies
// telescope, so a sum over any run of steps is the counter's exact
// difference over that span, whatever the device still had queued at a
// reading. The step's figure is the sum over every rank's device (ranks
// that share a GPU count it once each); it is absent when any rank has no
// counter (CPU, or no NVML).
//
// Note [Energy read while the device works]
// NVML's counter read is a driver call of its own; made after the host has
// waited for the device, it runs while the device has nothing queued, and
// the device idles through it. The trainer reads the counter before it
// waits, with the step's work still queued (StepGather::read_energy): the
// steps' readings are as far apart as before, so their energies still
// telescope.
#pragma once

#include <torch/torch.h>

#include <optional>

namespace viaduct {

class EnergyMeter {
 public:
  // Starts counting now; no counter for a CPU device or without NVML.
  explicit EnergyMeter(const at::Device& device);
  bool available() const { return handle_ != nullptr; }
  // Joules the device used since the previous call (the first call: since
  // construction); nullopt without a counter or when a read fails.
  std::optional<double> joules_since_last();

 private:
  void* handle_ = nullptr;  // nvmlDevice_t
  unsigned long long last_mj_ = 0;
};

// The device's power draw now in watts (NVML's power usage, averaged by the
// driver over a short window); nullopt without a counter. For checks of the
// energy counter against a second source.
std::optional<double> device_power_watts(const at::Device& device);

}  // namespace viaduct
