// The NCCL backend (CUDA tensors), built only when LibTorch has torch_cuda
// (VIADUCT_WITH_CUDA). NCCL's own watchdog enforces the group timeout.
#include "core/check.h"
#include "distributed/backend.h"

#if defined(VIADUCT_WITH_CUDA) && defined(USE_C10D_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#define VIADUCT_HAVE_NCCL 1
#endif

namespace viaduct::distributed::detail {

#ifdef VIADUCT_HAVE_NCCL

bool nccl_available() { return true; }

c10::intrusive_ptr<compat::PgBase> make_nccl(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store_copy = store;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store_copy, rank, size,
                                                     options);
}

// A feature test rather than a version test: shutdown() is newer than 1.13.
// (A template, so that the discarded branch is never compiled.)
template <typename Group>
void shutdown_if_supported(Group& group) {
  if constexpr (requires { group.shutdown(); }) {
    group.shutdown();
  }
}

template <typename Group>
void abort_if_supported(Group& group) {
  if constexpr (requires { group.abort(); }) {
    group.abort();
  } else if constexpr (requires { group.abort(std::nullopt); }) {
    group.abort(std::nullopt);
  } else {
    shutdown_if_supported(group);
  }
}

void shutdown_nccl(compat::PgBase& backend, bool failing) noexcept {
  auto* nccl = dynamic_cast<c10d::ProcessGroupNCCL*>(&backend);
  if (nccl == nullptr) return;
  try {
    if (failing) {
      abort_if_supported(*nccl);
    } else {
      shutdown_if_supported(*nccl);
    }
  } catch (const std::exception&) {
    // Tearing down after a failure: the error was already reported.
  }
}

#else

bool nccl_available() { return false; }

void shutdown_nccl(compat::PgBase&, bool) noexcept {}

c10::intrusive_ptr<compat::PgBase> make_nccl(
    const c10::intrusive_ptr<c10d::Store>&, int, int,
    std::chrono::milliseconds) {
  VIADUCT_CHECK(false,
                "this build of viaduct has no NCCL (LibTorch was found without "
                "torch_cuda), so CUDA process groups are unavailable");
  return {};
}

#endif

}  // namespace viaduct::distributed::detail
