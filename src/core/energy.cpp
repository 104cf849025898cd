#include "core/energy.h"

#include <dlfcn.h>

#include <array>
#include <mutex>

#ifdef VIADUCT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace viaduct {
namespace {

// The few NVML entry points the meter uses, by their C signatures (NVML's
// types are opaque handles and unsigned integers; 0 is NVML_SUCCESS).
struct Nvml {
  using Device = void*;
  int (*init)() = nullptr;
  int (*by_pci_bus_id)(const char*, Device*) = nullptr;
  int (*total_energy)(Device, unsigned long long*) = nullptr;
  int (*power_usage)(Device, unsigned int*) = nullptr;
  bool ok = false;
};

// Loaded and initialised once per process; never unloaded (NVML's own
// shutdown is left to process exit, as the CUDA runtime leaves its own).
const Nvml& nvml() {
  static const Nvml lib = [] {
    Nvml n;
    void* so = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (so == nullptr) return n;
    n.init = reinterpret_cast<int (*)()>(dlsym(so, "nvmlInit_v2"));
    n.by_pci_bus_id =
        reinterpret_cast<int (*)(const char*, Nvml::Device*)>(
            dlsym(so, "nvmlDeviceGetHandleByPciBusId_v2"));
    n.total_energy = reinterpret_cast<int (*)(Nvml::Device, unsigned long long*)>(
        dlsym(so, "nvmlDeviceGetTotalEnergyConsumption"));
    n.power_usage = reinterpret_cast<int (*)(Nvml::Device, unsigned int*)>(
        dlsym(so, "nvmlDeviceGetPowerUsage"));
    n.ok = n.init != nullptr && n.by_pci_bus_id != nullptr && n.total_energy != nullptr &&
           n.power_usage != nullptr && n.init() == 0;
    return n;
  }();
  return lib;
}

// The NVML handle of a CUDA device, found by its PCI bus id (CUDA's device
// order need not be NVML's); nullptr when there is none.
void* nvml_handle(const at::Device& device) {
#ifdef VIADUCT_WITH_CUDA
  if (!device.is_cuda()) return nullptr;
  const auto& n = nvml();
  if (!n.ok) return nullptr;
  std::array<char, 32> bus{};
  if (cudaDeviceGetPCIBusId(bus.data(), static_cast<int>(bus.size()), device.index()) !=
      cudaSuccess) {
    return nullptr;
  }
  Nvml::Device handle = nullptr;
  if (n.by_pci_bus_id(bus.data(), &handle) != 0) return nullptr;
  return handle;
#else
  (void)device;
  return nullptr;
#endif
}

}  // namespace

EnergyMeter::EnergyMeter(const at::Device& device) : handle_(nvml_handle(device)) {
  // A device whose counter cannot be read (pre-Volta, or a virtual GPU that
  // hides it) has no meter.
  if (handle_ != nullptr && nvml().total_energy(handle_, &last_mj_) != 0) handle_ = nullptr;
}

std::optional<double> EnergyMeter::joules_since_last() {
  if (handle_ == nullptr) return std::nullopt;
  unsigned long long mj = 0;
  if (nvml().total_energy(handle_, &mj) != 0) return std::nullopt;
  const double joules = static_cast<double>(mj - last_mj_) / 1e3;
  last_mj_ = mj;
  return joules;
}

std::optional<double> device_power_watts(const at::Device& device) {
  void* handle = nvml_handle(device);
  if (handle == nullptr) return std::nullopt;
  unsigned int mw = 0;
  if (nvml().power_usage(handle, &mw) != 0) return std::nullopt;
  return mw / 1e3;
}

}  // namespace viaduct
