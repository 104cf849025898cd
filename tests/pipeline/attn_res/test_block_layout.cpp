// BlockLayoutTables: entry counts for uneven splits and boundaries inside a
// block, the rank cache's delta rule, deposits, the two cache backwards and
// the refusals. Pure.
#include <gtest/gtest.h>

#include <set>

#include "core/check.h"
#include "pipeline/attn_res/block_layout.h"
#include "pipeline/schedule/plan.h"

namespace viaduct::pipeline {
namespace {

using V = std::vector<int64_t>;

Split loop_split(int64_t L, int64_t pp, int64_t v) {
  SplitSpec spec;
  spec.model.n_layers = L;
  spec.pp = pp;
  spec.stages_per_rank = v;
  spec.rule = {"test", 1, 1, 0};
  return make_split(spec);
}

TEST(BlockLayout, Debugmodel24Pp2x2) {
  // 26 units over 4 stages: layers [0,6) [6,13) [13,19) [19,24); blocks of 12,
  // so stage 1 crosses a block boundary and rank 0 meets entry 0 twice.
  const auto sp = loop_split(24, 2, 2);
  const auto c = make_block_layout_tables(sp, 12, AttnResTransport::kRankCache);
  EXPECT_EQ(c.n_entries, 2);
  EXPECT_EQ(c.stage(0).committed, (V{0}));
  EXPECT_EQ(c.stage(0).stored, (V{0}));
  EXPECT_EQ(c.stage(1).received, (V{0}));
  EXPECT_EQ(c.stage(1).committed, (V{1}));
  EXPECT_EQ(c.stage(1).stored, (V{0, 1}));
  EXPECT_EQ(c.stage(2).read, (V{0}));
  EXPECT_EQ(c.stage(2).received, (V{1}));
  EXPECT_TRUE(c.stage(2).releases);
  EXPECT_EQ(c.stage(3).read, (V{0, 1}));
  EXPECT_EQ(c.stage(3).received, (V{}));
  EXPECT_EQ(c.hop_tensors(0), 2);
  EXPECT_EQ(c.hop_tensors(1), 2);
  EXPECT_EQ(c.hop_tensors(2), 1);
  EXPECT_EQ(c.expected_deposits(0, 0), 1);
  EXPECT_EQ(c.expected_deposits(1, 0), 1);
  EXPECT_EQ(c.expected_deposits(1, 1), 1);
  EXPECT_EQ(c.expected_deposits(0, 1), 0);

  const auto w = make_block_layout_tables(sp, 12, AttnResTransport::kWholeStack);
  EXPECT_EQ(w.hop_tensors(0), 2);
  EXPECT_EQ(w.hop_tensors(1), 3);
  EXPECT_EQ(w.hop_tensors(2), 3);
  for (const auto& l : w.stages) {
    EXPECT_TRUE(l.read.empty());
    EXPECT_TRUE(l.stored.empty());
  }
  EXPECT_TRUE(w.deposits.empty());
  EXPECT_EQ(w.backward, AttnResCacheBackward::kWholeStack);

  // Deposit (default): gradients go back for the received columns only.
  EXPECT_EQ(c.backward, AttnResCacheBackward::kDeposit);
  EXPECT_EQ(c.stage(2).returned, (V{1}));
  EXPECT_EQ(c.stage(2).deposited, (V{0}));
  EXPECT_EQ(c.stage(1).collected, (V{0, 1}));
  for (int64_t s = 0; s < 3; ++s) EXPECT_EQ(c.grad_hop_tensors(s), c.hop_tensors(s));

  // Whole-stack backward: the cache's forward, the whole stack's backward,
  // no deposits.
  const auto cw = make_block_layout_tables(sp, 12, AttnResTransport::kRankCache,
                                           AttnResCacheBackward::kWholeStack);
  EXPECT_EQ(cw.backward, AttnResCacheBackward::kWholeStack);
  EXPECT_TRUE(cw.deposits.empty());
  for (int64_t s = 0; s < 3; ++s) {
    EXPECT_EQ(cw.hop_tensors(s), c.hop_tensors(s)) << "hop " << s;
    EXPECT_EQ(cw.grad_hop_tensors(s), w.grad_hop_tensors(s)) << "hop " << s;
  }
  EXPECT_EQ(cw.stage(3).read, (V{0, 1}));
  EXPECT_EQ(cw.stage(3).returned, (V{0, 1}));
  EXPECT_EQ(cw.stage(1).stored, (V{0, 1}));  // the forward still stores
  for (const auto& l : cw.stages) {
    EXPECT_TRUE(l.deposited.empty());
    EXPECT_TRUE(l.collected.empty());
  }
}

TEST(BlockLayout, Exact16UnevenSplitOpensBlocksAfterFirstLayer) {
  // 8 stages on 4 ranks, stages start one layer after a block boundary.
  const std::vector<std::pair<int64_t, int64_t>> layers{
      {0, 1}, {1, 5}, {5, 9}, {9, 13}, {13, 14}, {14, 15}, {15, 16}, {16, 16}};
  const V ranks{0, 1, 2, 3, 0, 1, 2, 3};
  const auto c = make_block_layout_tables(layers, ranks, 4, 4, 16,
                                          AttnResTransport::kRankCache);
  EXPECT_EQ(c.stage(1).entries_in, 1);
  EXPECT_EQ(c.stage(1).committed, (V{1}));
  EXPECT_EQ(c.stage(4).read, (V{0}));
  EXPECT_EQ(c.stage(4).received, (V{1, 2, 3}));  // completed by stages 1-3
  EXPECT_EQ(c.stage(7).read, (V{0, 1, 2, 3}));
  EXPECT_EQ(c.stage(7).received, (V{}));
}

// Properties over many shapes: a stage's stack is exactly read + received;
// with the cache a hop after the rank's first stage carries the entries
// committed by the stages in between (at most pp - 1 when none commits more
// than one); deposits count the later stages of the rank.
TEST(BlockLayout, PropertiesOverShapes) {
  int checked = 0;
  for (int64_t L : {5, 9, 16, 24, 33, 40}) {
    for (int64_t K : {1, 2, 4, 5, 12}) {
      for (int64_t pp : {1, 2, 3, 4}) {
        for (int64_t v : {1, 2, 3, 4}) {
          if (!split_feasible(L, pp * v, 1, 1)) continue;
          const auto sp = loop_split(L, pp, v);
          for (auto tr : {AttnResTransport::kRankCache, AttnResTransport::kWholeStack}) {
            const auto t = make_block_layout_tables(sp, K, tr);
            for (const auto& l : t.stages) {
              V stack = l.read;
              stack.insert(stack.end(), l.received.begin(), l.received.end());
              V reference;
              for (int64_t n = 0; n < l.entries_in; ++n) reference.push_back(n);
              ASSERT_EQ(stack, reference) << "stage " << l.stage_id;
              if (tr == AttnResTransport::kWholeStack || l.stage_id < pp) continue;
              std::set<int64_t> between;
              bool single = true;
              for (int64_t s = l.stage_id - pp + 1; s < l.stage_id; ++s) {
                for (int64_t n : t.stage(s).committed) between.insert(n);
                single &= t.stage(s).committed.size() <= 1;
              }
              EXPECT_EQ(l.received, V(between.begin(), between.end()));
              if (single) EXPECT_LE(static_cast<int64_t>(l.received.size()), pp - 1);
              for (int64_t n : l.stored) {
                EXPECT_EQ(t.expected_deposits(l.rank, n), v - 1 - l.stage_id / pp);
              }
            }
            if (tr == AttnResTransport::kRankCache) {
              // The whole-stack backward: the cache's forward routing and the
              // whole stack's gradient hops.
              const auto cw =
                  make_block_layout_tables(sp, K, tr, AttnResCacheBackward::kWholeStack);
              const auto w = make_block_layout_tables(sp, K, AttnResTransport::kWholeStack);
              EXPECT_TRUE(cw.deposits.empty());
              for (int64_t s = 0; s < static_cast<int64_t>(t.stages.size()); ++s) {
                const auto& a = t.stage(s);
                const auto& b = cw.stage(s);
                EXPECT_EQ(b.received, a.received);
                EXPECT_EQ(b.read, a.read);
                EXPECT_EQ(b.stored, a.stored);
                EXPECT_EQ(b.returned, w.stage(s).received);
                EXPECT_TRUE(b.deposited.empty() && b.collected.empty());
                EXPECT_EQ(a.returned, a.received);
                EXPECT_EQ(a.deposited, a.read);
                EXPECT_EQ(a.collected, a.stored);
              }
            }
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 100);
}

TEST(BlockLayout, RefusesVPlacementAndNonContiguousSplits) {
  PlanSpec spec;
  spec.split.model.n_layers = 16;
  spec.split.pp = 2;
  spec.schedule = "ZBVZeroBubble";
  const auto plan = make_pipeline_plan(spec);
  try {
    make_block_layout_tables(plan.split, 4, AttnResTransport::kRankCache);
    FAIL() << "V placement accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("attn_res_cache"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(make_block_layout_tables(plan.split, 4, AttnResTransport::kWholeStack));
  // The whole-stack backward keeps the cache's forward, so its placement rule.
  EXPECT_THROW(make_block_layout_tables(plan.split, 4, AttnResTransport::kRankCache,
                                        AttnResCacheBackward::kWholeStack),
               ConfigError);
  EXPECT_EQ(cache_backward_from_name("deposit"), AttnResCacheBackward::kDeposit);
  EXPECT_EQ(cache_backward_from_name("whole_stack"), AttnResCacheBackward::kWholeStack);
  try {
    cache_backward_from_name("chain");
    FAIL() << "an unknown backward accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("parallelism.attn_res_cache_backward"),
              std::string::npos) << e.what();
  }
  EXPECT_THROW(make_block_layout_tables({{0, 4}, {5, 8}}, {0, 1}, 2, 4, 8,
                                        AttnResTransport::kRankCache),
               ConfigError);
  EXPECT_THROW(make_block_layout_tables({{0, 4}, {4, 8}}, {1, 0}, 2, 4, 8,
                                        AttnResTransport::kRankCache),
               ConfigError);
}

TEST(BlockLayout, StorePeakFollowsTheSchedule) {
  PlanSpec spec;
  spec.split.model.n_layers = 24;
  spec.split.pp = 2;
  spec.split.stages_per_rank = 2;
  spec.schedule = "Interleaved1F1B";
  const auto plan = make_pipeline_plan(spec);
  const auto c = make_block_layout_tables(plan.split, 12, AttnResTransport::kRankCache);
  const auto w = make_block_layout_tables(plan.split, 12, AttnResTransport::kWholeStack);
  const auto cw = make_block_layout_tables(plan.split, 12, AttnResTransport::kRankCache,
                                           AttnResCacheBackward::kWholeStack);
  for (int64_t r = 0; r < 2; ++r) {
    EXPECT_GT(predict_store_peak(c, plan.compute, r).total, 0);
    EXPECT_EQ(predict_store_peak(w, plan.compute, r).total, 0);
    // The whole-stack backward keeps the blocks but no gradient slots.
    const auto p = predict_store_peak(cw, plan.compute, r);
    EXPECT_GT(p.blocks, 0);
    EXPECT_EQ(p.grad_slots, 0);
    EXPECT_LE(p.total, predict_store_peak(c, plan.compute, r).total);
  }
}

}  // namespace
}  // namespace viaduct::pipeline
