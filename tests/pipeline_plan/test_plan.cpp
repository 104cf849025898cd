// The plan (split + schedule from one spec), CSV-driven plans and the SVG
// timeline.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace viaduct::pipeline
