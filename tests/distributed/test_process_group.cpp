// Process groups and the mesh with ranks as threads: each thread is one rank
// with its own job store client (rank 0 serves) and its own Gloo group on a
// fresh loopback port, so the tests are independent and need no processes.
#include <gtest/gtest.h>

#include <atomic>
#include <exception>
#include <mutex>
#include <thread>

#include "core/check.h"
#include "distributed/distributed.h"
#include "distributed/launcher.h"
#include "common/thread_ranks.h"

namespace viaduct::distributed {
namespace {

using namespace viaduct::distributed::testing;
using std::chrono::milliseconds;

TEST(ProcessGroup, SendRecvPairs) {
  SKIP_WITHOUT_GLOO();
  run_ranks(2, [](const RendezvousInfo& info) {
    World w(info);
    const int peer = 1 - info.rank;
    // Both directions, two tags each, posted in opposite orders.
    for (int tag : {3, 4}) {
      std::vector<at::Tensor> out = {
          at::arange(6, at::kFloat).view({2, 3}) * (info.rank + 1) + tag};
      std::vector<at::Tensor> in = {at::zeros({2, 3}, at::kFloat)};
      Work sent, got;
      if (info.rank == 0) {
        sent = w.pg->send(out, peer, tag);
        got = w.pg->recv(in, peer, tag);
      } else {
        got = w.pg->recv(in, peer, tag);
        sent = w.pg->send(out, peer, tag);
      }
      got.wait(str("rank ", info.rank, " test RECV tag ", tag));
      sent.wait(str("rank ", info.rank, " test SEND tag ", tag));
      at::Tensor reference =
          at::arange(6, at::kFloat).view({2, 3}) * (peer + 1) + tag;
      VIADUCT_CHECK(at::equal(in[0], reference), "rank ", info.rank, " tag ", tag,
                    " got ", in[0]);
    }
  });
}

TEST(ProcessGroup, AllreduceSumIsClosedForm) {
  SKIP_WITHOUT_GLOO();
  const int world = 4;
  run_ranks(world, [&](const RendezvousInfo& info) {
    World w(info);
    // rank r holds (r + 1) * [1, 2, ..., 5]; the sum is n(n+1)/2 * [1..5].
    std::vector<at::Tensor> t = {at::arange(1, 6, at::kDouble) *
                                 (info.rank + 1)};
    w.pg->allreduce(t).wait("allreduce test");
    at::Tensor reference = at::arange(1, 6, at::kDouble) * (world * (world + 1) / 2);
    VIADUCT_CHECK(at::equal(t[0], reference), "rank ", info.rank, " got ", t[0]);
    std::vector<at::Tensor> m = {at::full({3}, static_cast<double>(info.rank))};
    w.pg->allreduce(m, ReduceOp::kMax).wait("allreduce max test");
    VIADUCT_CHECK(at::equal(m[0], at::full({3}, world - 1.0)), "max: ", m[0]);
  });
}

TEST(ProcessGroup, BroadcastAllgatherBarrier) {
  SKIP_WITHOUT_GLOO();
  const int world = 3;
  run_ranks(world, [&](const RendezvousInfo& info) {
    World w(info);
    std::vector<at::Tensor> b = {at::full({4}, info.rank == 2 ? 7.0f : -1.0f)};
    w.pg->broadcast(b, 2).wait("broadcast test");
    VIADUCT_CHECK(at::equal(b[0], at::full({4}, 7.0f)), "broadcast: ", b[0]);

    std::vector<at::Tensor> in = {
        at::full({2}, static_cast<int64_t>(10 * info.rank))};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < world; ++r) out[0].push_back(at::empty({2}, at::kLong));
    w.pg->allgather(out, in).wait("allgather test");
    for (int r = 0; r < world; ++r) {
      VIADUCT_CHECK(
          at::equal(out[0][r], at::full({2}, static_cast<int64_t>(10 * r))),
          "allgather slot ", r, ": ", out[0][r]);
    }
    w.pg->barrier().wait("barrier test");
  });
}

// Uneven splits, an empty one among them: rank r sends (r + 1) * 10 + d for
// each element bound to rank d; bfloat16 travels too (as half on Gloo).
TEST(ProcessGroup, AlltoallMovesUnevenSplits) {
  SKIP_WITHOUT_GLOO();
  const int world = 3;
  const std::vector<int64_t> share{2, 0, 3};  // elements each rank receives from each
  run_ranks(world, [&](const RendezvousInfo& info) {
    World w(info);
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      std::vector<at::Tensor> parts;
      for (int d = 0; d < world; ++d) {
        parts.push_back(at::full({share[static_cast<size_t>(d)]}, (info.rank + 1) * 10 + d, dtype));
      }
      auto in = at::cat(parts);
      const int64_t mine = share[static_cast<size_t>(info.rank)];
      auto out = at::full({mine * world}, -1, dtype);
      w.pg->alltoall(out, in, std::vector<int64_t>(world, mine), share)
          .wait("alltoall test");
      std::vector<at::Tensor> reference;
      for (int src = 0; src < world; ++src) {
        reference.push_back(at::full({mine}, (src + 1) * 10 + info.rank, dtype));
      }
      VIADUCT_CHECK(at::equal(out, at::cat(reference)), "rank ", info.rank, " ", dtype, " got ", out);
    }
    // Splits that do not tile the tensor are refused before anything is sent.
    auto in = at::zeros({5});
    auto out = at::zeros({4});
    std::string what;
    try {
      w.pg->alltoall(out, in, {2, 2, 1}, {2, 0, 3});
    } catch (const Error& e) {
      what = e.what();
    }
    VIADUCT_CHECK(what.find("output splits add up to 5, the tensor has 4") != std::string::npos,
                  "a bad split was not named: '", what, "'");
  });
}

TEST(ProcessGroup, RefusesBadArgumentsAndWorksAlone) {
  SKIP_WITHOUT_GLOO();
  RendezvousInfo info = loopback(0, 1, 1);
  World w(info);
  std::vector<at::Tensor> t = {at::zeros({2, 3}).t()};  // not contiguous
  EXPECT_THROW(w.pg->send(t, 1, 0), Error);
  std::vector<at::Tensor> ok = {at::zeros({2})};
  EXPECT_THROW(w.pg->send(ok, 0, 0), Error);  // to itself
  std::vector<at::Tensor> none;
  EXPECT_THROW(w.pg->allreduce(none), Error);
  std::vector<at::Tensor> one = {at::ones({2})};
  w.pg->allreduce(one).wait("single-rank allreduce");  // world 1 works alone
  EXPECT_TRUE(at::equal(one[0], at::ones({2})));
}

TEST(ProcessGroup, RecvFromSilentPeerTimesOutWithContext) {
  SKIP_WITHOUT_GLOO();
  std::atomic<bool> done{false};
  std::string message;
  double seconds = -1;
  run_ranks(2, [&](const RendezvousInfo& info) {
    World w(info, milliseconds(1000));
    if (info.rank == 1) {
      // Alive, connected, but never sends.
      while (!done.load()) std::this_thread::sleep_for(milliseconds(10));
      return;
    }
    std::vector<at::Tensor> in = {at::zeros({4})};
    auto start = std::chrono::steady_clock::now();
    try {
      w.pg->recv(in, 1, 0).wait("rank 0 stage 2 microbatch 5 RECV_F");
    } catch (const Error& e) {
      message = e.what();
    }
    seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    done.store(true);
  });
  EXPECT_NE(message.find("rank 0 stage 2 microbatch 5 RECV_F"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("recv from test rank 1"), std::string::npos)
      << message;
  EXPECT_NE(message.find("timed out"), std::string::npos) << message;
  EXPECT_GE(seconds, 0.9);
  EXPECT_LT(seconds, 5.0);
}

TEST(ProcessGroup, PeerThatLeavesFailsAllreduceWithinTimeout) {
  SKIP_WITHOUT_GLOO();
  std::string message;
  double seconds = -1;
  std::atomic<bool> left{false};
  run_ranks(2, [&](const RendezvousInfo& info) {
    auto w = std::make_unique<World>(info, milliseconds(2000));
    // Both groups fully connected first: a peer that left while rank 0 was
    // still connecting would fail the group's creation instead.
    w->pg->barrier().wait("test barrier");
    if (info.rank == 1) {
      w.reset();  // the peer dies: its connections close
      left.store(true);
      return;
    }
    while (!left.load()) std::this_thread::sleep_for(milliseconds(10));
    std::vector<at::Tensor> t = {at::ones({8})};
    auto start = std::chrono::steady_clock::now();
    try {
      w->pg->allreduce(t).wait("rank 0 step 1 grad allreduce");
    } catch (const Error& e) {
      message = e.what();
    }
    seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
  });
  EXPECT_NE(message.find("rank 0 step 1 grad allreduce: allreduce over test"),
            std::string::npos)
      << message;
  EXPECT_GE(seconds, 0.0);
  EXPECT_LT(seconds, 6.0);
}

TEST(Mesh, Pp2Dp2SubGroupsReduceOverTheRightRanks) {
  SKIP_WITHOUT_GLOO();
  run_ranks(4, [](const RendezvousInfo& info) {
    auto mesh = init_mesh(info, /*pp=*/2, /*dp=*/2, at::kCPU, kTimeout);
    const int r = info.rank;
    VIADUCT_CHECK(mesh->pp_rank() == r % 2 && mesh->dp_rank() == r / 2, "rank ",
                  r, " coordinates");
    VIADUCT_CHECK(mesh->pp_group().rank() == mesh->pp_rank() &&
                      mesh->pp_group().size() == 2 &&
                      mesh->dp_group().rank() == mesh->dp_rank() &&
                      mesh->dp_group().size() == 2 && mesh->world().size() == 4,
                  "rank ", r, " group shapes");
    // Sum of global ranks: pp group of replica d = {2d, 2d+1} -> 4d + 1;
    // dp group of stage p = {p, p + 2} -> 2p + 2; world -> 6.
    std::vector<at::Tensor> pp = {at::full({1}, static_cast<double>(r))};
    std::vector<at::Tensor> dp = {at::full({1}, static_cast<double>(r))};
    std::vector<at::Tensor> all = {at::full({1}, static_cast<double>(r))};
    mesh->pp_group().allreduce(pp).wait("pp");
    mesh->dp_group().allreduce(dp).wait("dp");
    mesh->world().allreduce(all).wait("world");
    VIADUCT_CHECK(pp[0].item<double>() == 4 * (r / 2) + 1, "rank ", r,
                  " pp sum ", pp[0]);
    VIADUCT_CHECK(dp[0].item<double>() == 2 * (r % 2) + 2, "rank ", r,
                  " dp sum ", dp[0]);
    VIADUCT_CHECK(all[0].item<double>() == 6, "rank ", r, " world sum ",
                  all[0]);
    // Pipeline neighbours talk over the pp group in group ranks.
    std::vector<at::Tensor> msg = {at::full({2}, static_cast<float>(r))};
    if (mesh->pp_rank() == 0) {
      mesh->pp_group().send(msg, 1, 9).wait("SEND_F");
    } else {
      mesh->pp_group().recv(msg, 0, 9).wait("RECV_F");
      VIADUCT_CHECK(msg[0][0].item<float>() == r - 1, "rank ", r, " got ",
                    msg[0]);
    }
    VIADUCT_CHECK(mesh->pp_group().global_rank(1) == 2 * mesh->dp_rank() + 1,
                  "global rank map");
    mesh->world().barrier().wait("end");
  });
}

}  // namespace
}  // namespace viaduct::distributed
