// The NCCL backend (CUDA tensors), built only when LibTorch has torch_cuda
// (VIADUCT_WITH_CUDA). NCCL's own watchdog enforces the group timeout.
#include "core/check.h"
#include "dist/backend.h"

#if defined(VIADUCT_WITH_CUDA) && defined(USE_C10D_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#define VIADUCT_HAVE_NCCL 1
#endif

namespace viaduct::dist::detail {

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

#else

bool nccl_available() { return false; }

c10::intrusive_ptr<compat::PgBase> make_nccl(
    const c10::intrusive_ptr<c10d::Store>&, int, int,
    std::chrono::milliseconds) {
  VIADUCT_CHECK(false,
                "this build of viaduct has no NCCL (LibTorch was found without "
                "torch_cuda), so CUDA process groups are unavailable");
  return {};
}

#endif

}  // namespace viaduct::dist::detail
