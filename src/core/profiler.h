// One training step under LibTorch's Kineto profiler: every ATen op on the
// host and, in the CUDA build, every kernel on the device, saved as a Chrome
// trace (chrome://tracing, Perfetto). reference/profile_summary.py turns the
// trace into a per-op / per-kernel table.
//
// The profiler is global to the process; only one StepProfiler may be active.
#pragma once

#include <string>

#include <torch/torch.h>

namespace viaduct {

class StepProfiler {
 public:
  // Starts recording: host ops unless `host_ops` is false, device kernels
  // when `device` is CUDA. Throws Error when this LibTorch cannot profile
  // or nothing would be recorded (no host ops on a CPU device).
  StepProfiler(const at::Device& device, bool host_ops);
  // Stops recording if save() was not called (the trace is dropped).
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;
  // Stops recording and writes the trace to `path` (parent folders made),
  // through a temporary file renamed into place.
  void save(const std::string& path);

 private:
  bool active_ = false;
};

}  // namespace viaduct
