// The Gloo backend (CPU tensors). Compiled to a stub when the Gloo headers
// are missing, as in the PyTorch wheel's LibTorch.
#include <cstdlib>

#include "core/check.h"
#include "distributed/backend.h"

#if __has_include(<gloo/algorithm.h>) && defined(USE_C10D_GLOO)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#define VIADUCT_HAVE_GLOO 1
#endif

namespace viaduct::distributed::detail {

#ifdef VIADUCT_HAVE_GLOO

bool gloo_available() { return true; }

c10::intrusive_ptr<compat::PgBase> make_gloo(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& hostname) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  try {
    const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
    if (ifname != nullptr && *ifname != '\0') {
      options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else if (!hostname.empty()) {
      options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
    } else {
      options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
  } catch (const std::exception& e) {
    VIADUCT_CHECK(false, "Gloo: cannot open a network device (hostname '",
                  hostname, "', GLOO_SOCKET_IFNAME set to '",
                  std::getenv("GLOO_SOCKET_IFNAME") != nullptr
                      ? std::getenv("GLOO_SOCKET_IFNAME")
                      : "",
                  "'): ", e.what());
  }
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size,
                                                     options);
}

#else

bool gloo_available() { return false; }

c10::intrusive_ptr<compat::PgBase> make_gloo(
    const c10::intrusive_ptr<c10d::Store>&, int, int, std::chrono::milliseconds,
    const std::string&) {
  VIADUCT_CHECK(
      false,
      "this build of viaduct has no Gloo (LibTorch was found without "
      "gloo/*.h headers), so CPU process groups are unavailable; "
      "use CUDA devices (NCCL) or build against a LibTorch with Gloo");
  return {};
}

#endif

}  // namespace viaduct::distributed::detail
