// The plan (split + schedule from one spec), CSV-driven plans and the SVG
// timeline.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

#include "core/check.h"
#include "pipeline/schedule/csv.h"
#include "pipeline/schedule/plan.h"
#include "pipeline/schedule/timeline_svg.h"

namespace viaduct::pipeline {
namespace {

std::string write_temp(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

PlanSpec spec_for(int64_t layers, int64_t pp, const std::string& schedule) {
  PlanSpec spec;
  spec.split.model.n_layers = layers;
  spec.split.pp = pp;
  spec.schedule = schedule;
  return spec;
}

size_t count(const std::string& s, const std::string& needle) {
  size_t n = 0;
  for (size_t p = s.find(needle); p != std::string::npos; p = s.find(needle, p + 1)) ++n;
  return n;
}

TEST(PipelinePlan, ScheduleDecidesStagesPerRankAndPlacement) {
  const auto one = make_pipeline_plan(spec_for(16, 4, "1F1B"));
  EXPECT_EQ(one.split.num_stages, 4);
  EXPECT_EQ(one.compute.microbatches, 4);  // default pp * stages per rank
  const auto zbv = make_pipeline_plan(spec_for(16, 4, "zbvzerobubble"));
  EXPECT_EQ(zbv.split.placement, Placement::kV);
  EXPECT_EQ(zbv.split.stage_to_rank, zbv.compute.stage_to_rank);
  EXPECT_EQ(zbv.compute.microbatches, 8);
  auto spec = spec_for(16, 4, "Interleaved1F1B");
  spec.microbatches = 12;
  spec.split.stages_per_rank = 3;
  const auto il = make_pipeline_plan(spec);
  EXPECT_EQ(il.split.num_stages, 12);
  EXPECT_EQ(il.lowered.ranks.size(), 4u);
  EXPECT_GT(il.simulation.makespan, 0);
  spec.microbatches = 2;  // 1F1B-like refusal does not apply; rounds = 1
  EXPECT_NO_THROW(make_pipeline_plan(spec));
  auto bad = spec_for(16, 4, "1F1B");
  bad.microbatches = 3;
  EXPECT_THROW(make_pipeline_plan(bad), ConfigError);
  EXPECT_THROW(make_pipeline_plan(spec_for(16, 4, "OneFOneB")), ConfigError);
}

TEST(PipelinePlan, FlopWeightedBubbleMatchesTheFlowShopClosedForm) {
  // See Note [Bubble weighted by FLOPs]. GPipe on p ranks, one stage each, stage
  // costs c_s (F = c_s, B = 2 c_s), m micro-batches, free messages: the
  // forwards are a flow shop of identical jobs, done at sum(c) + (m - 1)
  // max(c); the backwards run the same shop in reverse at twice the cost,
  // so makespan = 3 (sum(c) + (m - 1) max(c)) and the bubble is
  // 1 - m sum(c) / (p (sum(c) + (m - 1) max(c))).
  auto spec = spec_for(6, 3, "GPipe");
  spec.microbatches = 5;
  spec.module_flops = {{"layers.0", 1}, {"layers.1", 1}, {"layers.2", 4},
                       {"layers.3", 1}, {"layers.4", 2}, {"layers.5", 2},
                       {"lm_head", 3}, {"not.a.module", 100}};
  const auto plan = make_pipeline_plan(spec);
  ASSERT_TRUE(plan.simulation_flops.has_value());
  ASSERT_EQ(plan.stage_flops.size(), 3u);
  double sum = 0, mx = 0;
  for (double c : plan.stage_flops) {
    sum += c;
    mx = std::max(mx, c);
  }
  EXPECT_DOUBLE_EQ(sum, 14.0);  // every real module once, the stray name never
  EXPECT_GT(mx, sum / 3);       // uneven, or the test proves nothing
  const double m = 5, p = 3;
  EXPECT_NEAR(plan.simulation_flops->bubble_fraction, 1 - m * sum / (p * (sum + (m - 1) * mx)),
              1e-12);
  EXPECT_GT(plan.simulation_flops->bubble_fraction, plan.simulation.bubble_fraction);
  // Equal stage FLOPs: the unit simulation's bubble, (p - 1) / (m + p - 1).
  // 7 layers + embedding + head = 9 split units, 3 a stage.
  auto even = spec_for(7, 3, "GPipe");
  even.microbatches = 5;
  even.module_flops = {{"tok_embeddings", 2.5}, {"lm_head", 2.5}};
  for (int i = 0; i < 7; ++i) even.module_flops["layers." + std::to_string(i)] = 2.5;
  const auto ep = make_pipeline_plan(even);
  ASSERT_TRUE(ep.simulation_flops.has_value());
  ASSERT_EQ(ep.stage_flops, std::vector<double>(3, 7.5)) << "the split is not 3 units a stage";
  EXPECT_NEAR(ep.simulation_flops->bubble_fraction, 2.0 / 7, 1e-12);
  EXPECT_FALSE(make_pipeline_plan(spec_for(6, 3, "GPipe")).simulation_flops.has_value());
}

TEST(PipelinePlan, BalancedSplitMinimisesTheSlowestStage) {
  // See Note [Split balanced by FLOPs]. 8 layers of 1 FLOP, a head of 3, GPipe
  // on 2 ranks: torchtitan's rule (weights 1, 1) gives stages of 4 and 4 + 3;
  // the best split of layers (k, 8 - k) has max(k, 11 - k) = 6 (k = 5 or 6),
  // and GPipe's makespan 3 (sum + (m - 1) max) makes that the optimum.
  auto spec = spec_for(8, 2, "GPipe");
  spec.microbatches = 4;
  spec.module_flops = {{"lm_head", 3}};
  for (int i = 0; i < 8; ++i) spec.module_flops["layers." + std::to_string(i)] = 1;
  const auto plain = make_pipeline_plan(spec);
  ASSERT_EQ(plain.stage_flops, (std::vector<double>{4, 7}));
  ASSERT_TRUE(plain.balanced_weights.has_value());  // the hint is there
  spec.balance_flops = true;
  const auto bal = make_pipeline_plan(spec);
  ASSERT_TRUE(bal.balanced_weights.has_value());
  ASSERT_EQ(bal.stage_flops.size(), 2u);
  EXPECT_DOUBLE_EQ(std::max(bal.stage_flops[0], bal.stage_flops[1]), 6.0);
  const double m = 4, p = 2, sum = 11;
  EXPECT_NEAR(bal.simulation_flops->bubble_fraction, 1 - m * sum / (p * (sum + (m - 1) * 6)),
              1e-12);
  EXPECT_DOUBLE_EQ(bal.balanced_bubble_flops, bal.simulation_flops->bubble_fraction);
  EXPECT_DOUBLE_EQ(plain.balanced_bubble_flops, bal.simulation_flops->bubble_fraction);
  EXPECT_LT(bal.simulation_flops->bubble_fraction, plain.simulation_flops->bubble_fraction);
  // One FLOP unit for every candidate: makespans compare even where the
  // weights change the stage count (layers per stage).
  EXPECT_LT(bal.simulation_flops->makespan, plain.simulation_flops->makespan);
  // Interleaved, 3 units a stage: weights (1, 1) give 4 stages, (4, 4) 6.
  auto per_stage = spec_for(8, 2, "Interleaved1F1B");
  per_stage.microbatches = 4;
  per_stage.module_flops = spec.module_flops;
  per_stage.split.layers_per_stage = 3;
  const auto ps_plain = make_pipeline_plan(per_stage);
  per_stage.balance_flops = true;
  const auto ps_bal = make_pipeline_plan(per_stage);
  EXPECT_LE(ps_bal.simulation_flops->makespan, ps_plain.simulation_flops->makespan);
  // Where it cannot choose: no FLOPs, an explicit split, a CSV schedule.
  auto none = spec_for(8, 2, "GPipe");
  none.balance_flops = true;
  EXPECT_THROW(make_pipeline_plan(none), ConfigError);
  auto fixed = spec;
  fixed.split.module_fqns_per_stage = std::vector<std::vector<std::string>>{
      {"tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"},
      {"layers.4", "layers.5", "layers.6", "layers.7", "norm", "lm_head"}};
  EXPECT_THROW(make_pipeline_plan(fixed), ConfigError);
  auto csv = spec_for(8, 2, "ignored");
  csv.module_flops = spec.module_flops;
  csv.schedule_csv_path =
      write_temp("balanced.csv", schedule_to_csv(generate_schedule(ScheduleType::kGPipe, 2, 1, 4)));
  EXPECT_NO_THROW(make_pipeline_plan(csv));
  csv.balance_flops = true;
  EXPECT_THROW(make_pipeline_plan(csv), ConfigError);
  std::remove(csv.schedule_csv_path.c_str());
}

TEST(PipelinePlan, CsvScheduleDecidesStageCountAndPlacement) {
  for (auto type : {ScheduleType::kInterleaved1F1B, ScheduleType::kDualPipeV}) {
    const Schedule s = generate_schedule(type, 2, 2, 6);
    auto spec = spec_for(10, 2, "ignored");
    spec.schedule_csv_path = write_temp("plan.csv", schedule_to_csv(s));
    const auto plan = make_pipeline_plan(spec);
    EXPECT_EQ(plan.split.num_stages, 4);
    EXPECT_EQ(plan.compute.ranks, s.ranks);
    EXPECT_EQ(plan.split.stage_to_rank, s.stage_to_rank);
    EXPECT_EQ(plan.split.placement, schedule_traits(type).placement);
    spec.split.stages_per_rank = 3;
    EXPECT_THROW(make_pipeline_plan(spec), ConfigError) << "6 stages vs the CSV's 4";
    std::remove(spec.schedule_csv_path.c_str());
  }
}

TEST(TimelineSvg, OneBoxPerComputeActionAndTheBubbleNamed) {
  const Schedule s = lower_schedule(generate_schedule(ScheduleType::kDualPipeV, 2, 2, 4));
  const SimulationResult sim = simulate(s);
  const std::string svg = timeline_svg(s, sim, "DualPipeV <test>");
  size_t leaves = 0;
  for (const auto& r : sim.timeline) leaves += r.size();
  EXPECT_EQ(count(svg, "<title>"), leaves);
  size_t scheduled = 0;
  for (const auto& r : s.ranks) {
    for (const auto& a : r) {
      if (is_compute(a.kind)) scheduled += leaf_actions(a).size();
    }
  }
  EXPECT_EQ(leaves, scheduled);
  EXPECT_GT(leaves, 2u * 4u * 4u) << "DualPipeV splits some backwards into I + W";
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("DualPipeV &lt;test&gt;"), std::string::npos);
  EXPECT_NE(svg.find("idle (bubble)"), std::string::npos);
  EXPECT_EQ(count(svg, "rank 0"), 1u);
}

// One rank, one stage, one micro-batch: the counts in the singular, and a
// picture at least as wide as its caption and legend at their fonts' widest
// glyphs, whatever the plot's width (the report's test measures the drawn text).
TEST(TimelineSvg, OneRankReadsInTheSingularAndTheTextSetsTheWidth) {
  const Schedule s = lower_schedule(generate_schedule(ScheduleType::k1F1B, 1, 1, 1));
  const SimulationResult sim = simulate(s);
  const std::string svg = timeline_svg(s, sim, "1F1B: pp 1, 1 stage per rank, 1 micro-batch");
  EXPECT_NE(svg.find(">1 rank, 1 stage, 1 micro-batch; makespan "), std::string::npos) << svg;
  const std::string width = "width=\"";
  const double w = std::stod(svg.substr(svg.find(width) + width.size()));
  const std::string key =
      "colour = micro-batch; label = stage, kind, micro-batch (torch's text form)";
  EXPECT_GE(w, 70 + key.size() * 11 * 0.6) << svg;
  const Schedule two = lower_schedule(generate_schedule(ScheduleType::k1F1B, 2, 1, 4));
  const std::string svg2 = timeline_svg(two, simulate(two), "two");
  EXPECT_NE(svg2.find(">2 ranks, 2 stages, 4 micro-batches; makespan "), std::string::npos);
}

}  // namespace
}  // namespace viaduct::pipeline
