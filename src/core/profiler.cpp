#include "core/profiler.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include <torch/csrc/autograd/profiler_kineto.h>

#include "core/check.h"

namespace viaduct {

namespace prof = torch::profiler::impl;

namespace {

// KinetoEvent's clock accessors are in microseconds in 1.13 and nanoseconds
// in 2.x; pick whichever this LibTorch has.
template <typename E>
double start_us(const E& e) {
  if constexpr (requires { e.startNs(); }) {
    return static_cast<double>(e.startNs()) / 1000.0;
  } else {
    return static_cast<double>(e.startUs());
  }
}
template <typename E>
double duration_us(const E& e) {
  if constexpr (requires { e.durationNs(); }) {
    return static_cast<double>(e.durationNs()) / 1000.0;
  } else {
    return static_cast<double>(e.durationUs());
  }
}

// A Chrome trace of the host ops from the recorded events, for LibTorch
// builds without Kineto (Debian's), whose ProfilerResult::save refuses.
void write_host_trace(const torch::autograd::profiler::ProfilerResult& r,
                      const std::string& path) {
  nlohmann::json events = nlohmann::json::array();
  for (const auto& e : r.events()) {
    events.push_back({{"ph", "X"},
                      {"cat", e.deviceType() == c10::DeviceType::CPU ? "cpu_op" : "kernel"},
                      {"name", e.name()},
                      {"pid", 0},
                      {"tid", e.startThreadId()},
                      {"ts", start_us(e)},
                      {"dur", duration_us(e)}});
  }
  std::ofstream out(path);
  out << nlohmann::json{{"traceEvents", events}}.dump() << "\n";
  VIADUCT_CHECK_T(FileError, out.good(), "cannot write the profile to ", path);
}

}  // namespace

StepProfiler::StepProfiler(const at::Device& device, bool host_ops) {
  VIADUCT_CHECK(host_ops || device.is_cuda(),
                "metrics.profile_host_ops = false records device kernels only, and the device is ",
                device);
  std::set<prof::ActivityType> activities;
  if (host_ops) activities.insert(prof::ActivityType::CPU);
  if (device.is_cuda()) activities.insert(prof::ActivityType::CUDA);
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO,
                                    /*report_input_shapes=*/true);
  try {
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
  } catch (const c10::Error& e) {
    VIADUCT_CHECK(false, "metrics.profile_step: this LibTorch cannot profile (",
                  e.what_without_backtrace(), ")");
  }
  active_ = true;
}

StepProfiler::~StepProfiler() {
  if (!active_) return;
  try {
    torch::autograd::profiler::disableProfiler();
  } catch (...) {  // NOLINT(bugprone-empty-catch): nothing to save on unwind
  }
}

void StepProfiler::save(const std::string& path) {
  VIADUCT_CHECK(active_, "StepProfiler::save called twice");
  active_ = false;
  auto result = torch::autograd::profiler::disableProfiler();
  const std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  const auto tmp = p.string() + ".tmp";
  try {
    result->save(tmp);
  } catch (const c10::Error&) {
    write_host_trace(*result, tmp);  // no Kineto: host ops only
  }
  std::error_code ec;
  std::filesystem::rename(tmp, p, ec);
  VIADUCT_CHECK_T(FileError, !ec, "cannot move the profile to ", p.string(), ": ",
                  ec.message());
}

}  // namespace viaduct
