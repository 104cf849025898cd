// The data-parallel gradient sum (see Note [Data-parallel sum in a fixed order],
// train/reduce.h) with replicas as threads: against the sum formed on one
// thread in replica order, whole and reduce-scattered, and the clip norm of
// both forms (see Note [Gradient norm in shard pieces]).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/thread_ranks.h"
#include "core/check.h"
#include "train/optimizer.h"
#include "train/reduce.h"

namespace viaduct {
namespace {

using distributed::RendezvousInfo;
using distributed::testing::run_ranks;
using distributed::testing::World;

const std::vector<std::vector<int64_t>> kShapes = {{40, 25}, {300}, {37}, {50, 100}, {20}};
// Three buckets: the last one (20 elements) is shorter than kShardAlign per
// replica, so three of four replicas get an empty range of it.
const std::vector<std::vector<size_t>> kBuckets = {{0, 1, 2}, {3}, {4}};

// Replica r's gradient of parameter i: normal values spread over six orders
// of magnitude, so that the order of the additions shows in the bits.
at::Tensor replica_grad(int r, size_t i) {
  std::mt19937 rng(static_cast<uint32_t>(1000 * r + i));
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> expo(-3.f, 3.f);
  int64_t n = 1;
  for (auto d : kShapes[i]) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = normal(rng) * std::pow(10.f, expo(rng));
  return at::tensor(v).view(kShapes[i]);
}

std::vector<NamedParam> make_params(int r) {
  std::vector<NamedParam> params;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    auto p = at::zeros(kShapes[i]).requires_grad_(true);
    p.mutable_grad() = replica_grad(r, i);
    params.push_back({str("p", i), p, true});
  }
  return params;
}

// ((g_0 + g_1) + g_2) + ...: the order the reduction promises.
at::Tensor sum_in_replica_order(size_t i, int dp) {
  auto s = replica_grad(0, i) + replica_grad(1, i);
  for (int r = 2; r < dp; ++r) s.add_(replica_grad(r, i));
  return s;
}

TEST(GradReduction, SumsInReplicaOrderWholeAndScattered) {
  SKIP_WITHOUT_GLOO();
  const int dp = 4;
  // The order matters for these values: another order gives other bits.
  bool order_shows = false;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    auto reversed = replica_grad(3, i) + replica_grad(2, i);
    reversed.add_(replica_grad(1, i)).add_(replica_grad(0, i));
    order_shows = order_shows || !at::equal(reversed, sum_in_replica_order(i, dp));
  }
  ASSERT_TRUE(order_shows);

  std::vector<double> norm_whole(dp), norm_scattered(dp);
  std::vector<int64_t> bytes_whole(dp), bytes_scattered(dp);
  run_ranks(dp, [&](const RendezvousInfo& info) {
    World w(info);
    const auto r = static_cast<size_t>(info.rank);
    for (const bool whole : {true, false}) {
      auto params = make_params(info.rank);
      GradReduction red(*w.pg, params, kBuckets, {}, whole);
      // Twice: the second step must not see the first one's state.
      for (int step = 0; step < 2; ++step) {
        for (size_t i = 0; i < params.size(); ++i) {
          params[i].param.mutable_grad() = replica_grad(info.rank, i);
        }
        red.finish("test");
      }
      const auto& mine = red.layout();
      for (size_t i = 0; i < params.size(); ++i) {
        const auto reference = sum_in_replica_order(i, dp);
        const auto& got = params[i].param.grad();
        if (whole) {
          VIADUCT_CHECK(at::equal(got, reference), "rank ", r, " parameter ", i, ": whole sum differs");
        }
      }
      int64_t owned = 0, sent = 0;
      for (const auto& per_rank : mine.segments) {
        int64_t n = 0;
        for (const auto& segs : per_rank) n += segment_elements(segs);
        sent += (n - segment_elements(per_rank[r])) * 4;
        for (const auto& s : per_rank[r]) {
          const auto reference = segment_of(sum_in_replica_order(s.param, dp), s);
          VIADUCT_CHECK(at::equal(segment_of(params[s.param].param.grad(), s), reference), "rank ", r,
                        " parameter ", s.param, " [", s.begin, ", ", s.end,
                        "): the range's sum differs");
          owned += s.end - s.begin;
        }
      }
      if (!whole) {
        VIADUCT_CHECK(red.last_step_bytes() == sent, "rank ", r, ": sent ",
                      red.last_step_bytes(), " bytes, expected ", sent);
      }
      // The clip norm: every slot's square in parameter, replica order.
      std::vector<double> slots(params.size() * dp, 0.0);
      const auto pieces = red.norm_pieces();
      std::vector<at::Tensor> grads;
      for (const auto& p : pieces) grads.push_back(p.grad);
      const auto sq = squared_norms(grads);
      for (size_t k = 0; k < pieces.size(); ++k) slots[pieces[k].slot] = sq[k];
      if (!whole) sum_over(w.pg.get(), slots, "test", "norms");
      (whole ? norm_whole : norm_scattered)[r] = total_norm(slots);
      (whole ? bytes_whole : bytes_scattered)[r] = red.last_step_bytes();
    }
  });
  for (int r = 0; r < dp; ++r) {
    EXPECT_EQ(norm_whole[r], norm_scattered[r]) << "rank " << r;
    EXPECT_EQ(norm_whole[r], norm_whole[0]) << "rank " << r;
    // The whole sum adds an all-gather of the ranges to the reduce-scatter.
    EXPECT_GT(bytes_whole[r], bytes_scattered[r]) << "rank " << r;
  }
  // The norm against the whole sum's fp64 norm: the pieces change only
  // the rounding.
  double reference = 0;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    reference += sum_in_replica_order(i, dp).to(at::kDouble).pow(2).sum().item<double>();
  }
  EXPECT_NEAR(norm_whole[0], std::sqrt(reference), 1e-5 * std::sqrt(reference));
}

}  // namespace
}  // namespace viaduct
