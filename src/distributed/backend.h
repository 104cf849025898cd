// Internal to dist/: constructors of the concrete c10d backends, each in its
// own translation unit so that a LibTorch without Gloo headers (the wheel) or
// without CUDA (Debian) still builds the rest.
#pragma once

#include <chrono>
#include <string>

#include "core/torch_compat.h"

namespace viaduct::distributed::detail {

bool gloo_available();
bool nccl_available();

// `hostname`: the address Gloo binds to; "" picks GLOO_SOCKET_IFNAME when set,
// else the host's own name (falling back to loopback).
c10::intrusive_ptr<compat::PgBase> make_gloo(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& hostname);

c10::intrusive_ptr<compat::PgBase> make_nccl(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout);

// Ends an NCCL group (2.x warns when a group is destroyed without); never
// throws: shutdown() (waits for its work) normally, abort()
// (does not wait for peers) when `failing`: after an error this rank's peers
// may be stuck in an operation it will never join, and a graceful shutdown
// can then wait forever instead of letting the process exit.
void shutdown_nccl(compat::PgBase& backend, bool failing) noexcept;

}  // namespace viaduct::distributed::detail
