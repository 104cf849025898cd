// What every kernel file shares on the host (kernels/common.h): the device
// check and the norms' partial-sum count.
#include <cuda_runtime.h>

#include <mutex>
#include <vector>

#include "kernels/common.h"

namespace viaduct::cuda {

bool device_supported(int device) {
  static std::mutex mu;
  static std::vector<int> cached;  // -1 unknown, 0 no, 1 yes
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0) return false;
  if (static_cast<size_t>(device) >= cached.size()) cached.resize(device + 1, -1);
  if (cached[device] < 0) {
    int major = 0, minor = 0;
    const bool ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess;
    cached[device] = ok && major == 9 && minor == 0 ? 1 : 0;
  }
  return cached[device] == 1;
}

int64_t norm_backward_parts(int64_t rows) {
  const int64_t parts = (rows + 7) / 8;
  return parts < 1 ? 1 : (parts > 4096 ? 4096 : parts);
}

}  // namespace viaduct::cuda
