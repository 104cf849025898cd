// NCCL groups with ranks as threads, one GPU per rank. Compiled everywhere;
// skipped without CUDA (and the multi-rank tests without two GPUs).
#include <gtest/gtest.h>

#include <thread>

#include "core/check.h"
#include "distributed/distributed.h"
#include "distributed/launcher.h"

namespace viaduct::distributed {
namespace {

using std::chrono::milliseconds;
constexpr milliseconds kNcclTimeout{30'000};

int cuda_devices() {
  if (!backend_available(at::kCUDA) || !torch::cuda::is_available()) return 0;
  return static_cast<int>(torch::cuda::device_count());
}

RendezvousInfo loopback(int rank, int world, int port) {
  RendezvousInfo info;
  info.rank = rank;
  info.world_size = world;
  info.local_rank = rank;
  info.local_world_size = world;
  info.master_port = port;
  info.source = "env";
  return info;
}

TEST(Nccl, SingleRankCollectives) {
  if (cuda_devices() < 1) GTEST_SKIP() << "no CUDA device / NCCL";
  RendezvousInfo info = loopback(0, 1, 1);
  auto mesh = init_mesh(info, 1, 1, at::Device(at::kCUDA, 0), kNcclTimeout);
  EXPECT_EQ(mesh->world().backend_kind(), BackendKind::kNccl);
  std::vector<at::Tensor> t = {at::arange(
      4, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, 0))};
  mesh->world().allreduce(t).wait("nccl allreduce");
  mesh->world().broadcast(t, 0).wait("nccl broadcast");
  mesh->world().barrier().wait("nccl barrier");
  EXPECT_TRUE(at::equal(t[0].cpu(), at::arange(4, at::kFloat)));
  std::vector<at::Tensor> cpu = {at::ones({2})};
  EXPECT_THROW(mesh->world().allreduce(cpu), Error);  // wrong device
}

TEST(Nccl, TwoRanksSendRecvAndAllreduce) {
  if (cuda_devices() < 2) GTEST_SKIP() << "needs two CUDA devices";
  const int port = find_free_port();
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        at::Device device(at::kCUDA, static_cast<at::DeviceIndex>(r));
        auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
        auto mesh = init_mesh(loopback(r, 2, port), 2, 1, device, kNcclTimeout);
        std::vector<at::Tensor> t = {at::full({5}, r + 1.0, opts)};
        mesh->world().allreduce(t).wait("nccl allreduce");
        VIADUCT_CHECK(at::equal(t[0].cpu(), at::full({5}, 3.0f)), "sum ", t[0]);
        std::vector<at::Tensor> m = {at::full({3}, 10.0f * r, opts)};
        if (r == 0) {
          mesh->pp_group().send(m, 1, 0).wait("SEND_F");
        } else {
          mesh->pp_group().recv(m, 0, 0).wait("RECV_F");
          VIADUCT_CHECK(at::equal(m[0].cpu(), at::zeros({3})), "recv ", m[0]);
        }
        mesh->world().barrier().wait("end");
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

}  // namespace
}  // namespace viaduct::distributed
