#include "core/device.h"

#include <fstream>
#include <sstream>

#include "core/check.h"
#include "core/torch_compat.h"

#ifdef VIADUCT_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

namespace viaduct {

at::Device resolve_device(const std::string& requested, int local_rank) {
  if (requested == "cpu") return at::Device(at::kCPU);
  const bool have_cuda = torch::cuda::is_available();
  VIADUCT_CHECK_T(ConfigError, have_cuda || requested != "cuda",
                  "training.device = cuda, but no CUDA device is available "
                  "(or this build has no CUDA)");
  if (!have_cuda) return at::Device(at::kCPU);
  const auto index = static_cast<c10::DeviceIndex>(
      local_rank % static_cast<int>(torch::cuda::device_count()));
#ifdef VIADUCT_WITH_CUDA
  c10::cuda::set_device(index);
#endif
  return at::Device(at::kCUDA, index);
}

std::string device_name(const at::Device& device) {
#ifdef VIADUCT_WITH_CUDA
  if (device.is_cuda()) {
    return at::cuda::getDeviceProperties(device.index())->name;
  }
#endif
  return "cpu";
}

std::optional<double> peak_flops(const at::Device& device,
                                 at::ScalarType dtype) {
  if (!device.is_cuda()) return std::nullopt;
  const auto name = device_name(device);
  // Dense (no sparsity) tensor-core peaks, bf16/fp16, SXM parts.
  struct Row {
    const char* key;
    double bf16;
  };
  static const Row kTable[] = {
      {"H200", 989.4e12}, {"H100", 989.4e12}, {"H800", 989.4e12},
      {"A100", 312e12},   {"A800", 312e12},   {"L40S", 362e12},
      {"B200", 2250e12},
  };
  for (const auto& r : kTable) {
    if (name.find(r.key) != std::string::npos) {
      // fp32 runs through TF32 tensor cores at half the bf16 rate.
      return dtype == at::kFloat ? r.bf16 / 2 : r.bf16;
    }
  }
  return std::nullopt;
}

double peak_memory_bytes(const at::Device& device) {
#ifdef VIADUCT_WITH_CUDA
  if (device.is_cuda()) {
    return compat::cuda_peak_allocated_bytes(device.index());
  }
#endif
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream ss(line.substr(6));
      double kb = 0;
      ss >> kb;
      return kb * 1024.0;
    }
  }
  return 0.0;
}

std::optional<double> device_memory_bytes(const at::Device& device) {
#ifdef VIADUCT_WITH_CUDA
  if (device.is_cuda()) {
    // Free, not total: another process on the GPU, or this one's CUDA
    // context, holds the rest.
    c10::cuda::CUDAGuard guard(device);
    size_t free_bytes = 0, total_bytes = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return static_cast<double>(free_bytes);
  }
#endif
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream ss(line.substr(13));
      double kb = 0;
      ss >> kb;
      return kb * 1024.0;
    }
  }
  return std::nullopt;
}

void reset_peak_memory(const at::Device& device) {
#ifdef VIADUCT_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
  }
#endif
}

void synchronize(const at::Device& device) {
#ifdef VIADUCT_WITH_CUDA
  if (device.is_cuda()) {
    at::cuda::device_synchronize();
  }
#endif
}

at::Tensor to_device_async(const at::Tensor& t, const at::Device& device) {
  if (device.is_cuda() && t.device().is_cpu()) {
    return t.pin_memory().to(device, /*non_blocking=*/true);
  }
  return t.to(device);
}

}  // namespace viaduct
