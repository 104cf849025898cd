// Ranks as threads for tests of collectives: each thread is one rank with
// its own job store client (rank 0 serves) and its own Gloo group on a fresh
// loopback port, so tests are independent and need no processes.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "distributed/distributed.h"
#include "distributed/launcher.h"

namespace viaduct::distributed::testing {

// CPU groups need Gloo, which the PyTorch wheel's LibTorch lacks.
#define SKIP_WITHOUT_GLOO()                                \
  if (!::viaduct::distributed::backend_available(at::kCPU)) {    \
    GTEST_SKIP() << "this build has no Gloo (CPU groups)"; \
  }
inline constexpr std::chrono::milliseconds kTimeout{10'000};

inline RendezvousInfo loopback(int rank, int world, int port) {
  RendezvousInfo info;
  info.rank = rank;
  info.world_size = world;
  info.local_rank = rank;
  info.local_world_size = world;
  info.master_addr = "127.0.0.1";
  info.master_port = port;
  info.source = "env";
  return info;
}

// Runs fn(info) on `world` threads; fails the test with every rank's error.
template <typename Fn>
void run_ranks(int world, Fn fn) {
  const int port = find_free_port();
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(loopback(r, world, port));
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
  }
}

// A one-group world over its own store. The store always gets kTimeout: a
// store client refused by a server that is not listening yet retries after
// a delay, which a short test timeout might not cover.
struct World {
  c10::intrusive_ptr<c10d::Store> store;
  std::unique_ptr<ProcessGroup> pg;
  World(const RendezvousInfo& info, std::chrono::milliseconds timeout = kTimeout)
      : store(make_store(info, kTimeout)),
        pg(std::make_unique<ProcessGroup>(
            make_group_store(store, "test"), info.rank, info.world_size,
            at::kCPU, timeout, "test", std::vector<int>{}, "127.0.0.1")) {}
};

}  // namespace viaduct::distributed::testing
