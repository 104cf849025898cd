// Schedules against references: torch's compute and lowered orders (golden
// data from a transcription of torch's generators), the shapes torch refuses,
// validation on a grid, and the bubble closed forms of 1F1B and Interleaved
// 1F1B under unit costs.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "pipeline/schedule/csv.h"
#include "pipeline/schedule/schedule.h"
#include "pipeline/schedule/simulate.h"

namespace viaduct::pipeline {
namespace {

struct GoldenRow {
  const char* schedule;
  int64_t pp, v, m, rank;
  const char* actions;
};

const GoldenRow kTorchOrders[] = {
#include "torch_orders.inc"
};
const GoldenRow kTorchLowered[] = {
#include "torch_lowered.inc"
};

std::string rank_text(const std::vector<Action>& actions) {
  std::string out;
  for (const auto& a : actions) out += (out.empty() ? "" : " ") + to_string(a);
  return out;
}

bool torch_refuses(ScheduleType t, int64_t pp, int64_t m) {
  switch (t) {
    case ScheduleType::k1F1B: return m < pp;
    case ScheduleType::kDualPipeV: return m < 2 * pp;
    case ScheduleType::kInterleaved1F1B:
    case ScheduleType::kInterleavedZeroBubble: return m % std::max<int64_t>(1, m / pp) != 0;
    default: return false;
  }
}

std::vector<int64_t> stages_per_rank_of(ScheduleType t) {
  const auto& tr = schedule_traits(t);
  if (tr.single_stage) return {1};
  if (tr.placement == Placement::kV) return {2};
  return {1, 2, 3, 4};
}

TEST(ScheduleAction, TextRoundTrip) {
  for (const char* text : {"2F0", "3SEND_F1", "0RECV_B12", "7B2", "4I3", "4W3",
                           "1REDUCE_GRAD", "10RECV_F0", "(0F3;7B2)OVERLAP_F_B"}) {
    auto a = parse_action(text);
    ASSERT_TRUE(a.has_value()) << text;
    EXPECT_EQ(to_string(*a), text);
  }
  const Action ov = *parse_action(" (0F3; 7B2)OVERLAP_F_B ");
  ASSERT_EQ(ov.sub_actions.size(), 2u);
  EXPECT_EQ(ov.sub_actions[1], make_action(7, ActionKind::kBackward, 2));
  EXPECT_FALSE(parse_action("  ").has_value());
  for (const char* bad : {"F0", "2X0", "2F", "2F0x", "(0F3;7B2)F", "(0SEND_F1)OVERLAP_F_B"}) {
    EXPECT_THROW(parse_action(bad), Error) << bad;
  }
}

TEST(ScheduleNames, CaseInsensitiveWithClosestSuggestion) {
  EXPECT_EQ(schedule_type_from_name("interleaved1f1b"), ScheduleType::kInterleaved1F1B);
  EXPECT_EQ(schedule_type_from_name("DUALPIPEV"), ScheduleType::kDualPipeV);
  try {
    schedule_type_from_name("Interleaved1F1b_");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("did you mean 'Interleaved1F1B'"), std::string::npos);
  }
  try {
    schedule_type_from_name("ZBV");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("did you mean 'ZBVZeroBubble'"), std::string::npos)
        << "a prefix wins over edit distance: " << e.what();
  }
}

TEST(ScheduleGenerators, MatchTorchComputeOrders) {
  int64_t rows = 0;
  for (const auto& g : kTorchOrders) {
    const Schedule s = generate_schedule(schedule_type_from_name(g.schedule), g.pp, g.v, g.m);
    ASSERT_EQ(rank_text(s.ranks[g.rank]), g.actions)
        << g.schedule << " pp=" << g.pp << " v=" << g.v << " m=" << g.m << " rank " << g.rank;
    ++rows;
  }
  EXPECT_GT(rows, 300);
}

TEST(ScheduleLowering, MatchesTorchSendRecvPlacement) {
  for (const auto& g : kTorchLowered) {
    const Schedule s = lower_schedule(
        generate_schedule(schedule_type_from_name(g.schedule), g.pp, g.v, g.m));
    ASSERT_EQ(rank_text(s.ranks[g.rank]), g.actions)
        << g.schedule << " pp=" << g.pp << " v=" << g.v << " m=" << g.m << " rank " << g.rank;
  }
}

TEST(ScheduleGenerators, NotesFormulaForZBVWarmup) {
  // Notes: rank r starts with 2(pp-r)-1 F0, then r (F1, F0) pairs, then
  // (pp-r) x (F1, I1, W1).
  const int64_t pp = 4, m = 8;
  const Schedule s = generate_schedule(ScheduleType::kZBVZeroBubble, pp, 2, m);
  for (int64_t r = 0; r < pp; ++r) {
    const auto& ops = s.ranks[r];
    size_t i = 0;
    for (int64_t k = 0; k < 2 * (pp - r) - 1; ++k, ++i) {
      EXPECT_EQ(ops[i], make_action(r, ActionKind::kForward, k));
    }
    for (int64_t k = 0; k < r; ++k) {
      EXPECT_EQ(ops[i++], make_action(2 * pp - 1 - r, ActionKind::kForward, k));
      EXPECT_EQ(ops[i++].stage, r);
    }
    EXPECT_EQ(ops[i + 1].kind, ActionKind::kBackwardInput);
    EXPECT_EQ(ops[i + 2].kind, ActionKind::kBackwardWeight);
  }
}

TEST(ScheduleGenerators, RefuseExactlyWhatTorchRefuses) {
  int64_t accepted = 0, refused = 0;
  for (const auto& tr : all_schedule_traits()) {
    for (int64_t pp = 1; pp <= 6; ++pp) {
      for (int64_t v : stages_per_rank_of(tr.type)) {
        for (int64_t m = 1; m <= 3 * pp * v + 2; ++m) {
          const bool refuse = torch_refuses(tr.type, pp, m);
          if (refuse) {
            EXPECT_THROW(generate_schedule(tr.type, pp, v, m), ConfigError)
                << tr.name << " pp=" << pp << " v=" << v << " m=" << m;
            ++refused;
            continue;
          }
          Schedule s;
          ASSERT_NO_THROW(s = generate_schedule(tr.type, pp, v, m))
              << tr.name << " pp=" << pp << " v=" << v << " m=" << m;
          // Validates, lowers and simulates without deadlock.
          EXPECT_EQ(validate_schedule(s), s.stage_to_rank);
          const SimulationResult r = simulate(s);
          EXPECT_GT(r.makespan, 0);
          EXPECT_GE(r.bubble_fraction, 0);
          EXPECT_LT(r.bubble_fraction, 1);
          ++accepted;
        }
      }
    }
  }
  EXPECT_GT(accepted, 500);
  EXPECT_GT(refused, 50);
  EXPECT_THROW(generate_schedule(ScheduleType::k1F1B, 2, 2, 4), ConfigError);
  EXPECT_THROW(generate_schedule(ScheduleType::kZBVZeroBubble, 2, 3, 4), ConfigError);
  try {
    generate_schedule(ScheduleType::kInterleaved1F1B, 4, 2, 9);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("nearby: 8 or 10"), std::string::npos) << e.what();
  }
}

// Under unit costs 1F1B's idle share is (p-1)/(m+p-1) of p * makespan.
TEST(ScheduleSimulator, OneFOneBBubbleClosedForm) {
  for (double b_cost : {1.0, 2.0}) {
    for (int64_t p = 1; p <= 8; ++p) {
      for (int64_t m = p; m <= 4 * p + 3; ++m) {
        CostModel c;
        c.forward = 1;
        c.backward = b_cost;
        const auto r = simulate(generate_schedule(ScheduleType::k1F1B, p, 1, m), c);
        const double reference = double(p - 1) / double(m + p - 1);
        EXPECT_NEAR(r.bubble_fraction, reference, 1e-12) << "p=" << p << " m=" << m;
        EXPECT_NEAR(r.makespan, (m + p - 1) * (1 + b_cost), 1e-9);
        for (int64_t k = 0; k < p; ++k) {
          EXPECT_EQ(r.peak_activations[k], std::min(m, p - k)) << "rank " << k;
        }
        // GPipe: same bubble, every micro-batch alive at once.
        const auto g = simulate(generate_schedule(ScheduleType::kGPipe, p, 1, m), c);
        EXPECT_NEAR(g.bubble_fraction, reference, 1e-12);
        EXPECT_EQ(g.peak_activations[0], m);
      }
    }
  }
}

// Interleaved 1F1B under unit per-stage costs: idle time / busy time =
// (p-1)/(v*m) (Megatron's 1/v of 1F1B), when m is a multiple of p.
TEST(ScheduleSimulator, InterleavedBubbleShrinksWithStagesPerRank) {
  for (int64_t p = 2; p <= 6; ++p) {
    for (int64_t v = 1; v <= 4; ++v) {
      for (int64_t k = 1; k <= 3; ++k) {
        const int64_t m = k * p;
        CostModel c;
        c.forward = 1;
        c.backward = 1;
        const auto r = simulate(generate_schedule(ScheduleType::kInterleaved1F1B, p, v, m), c);
        const double busy = 2.0 * v * m;
        const double idle_over_busy = (r.makespan - busy) / busy;
        EXPECT_NEAR(idle_over_busy, double(p - 1) / double(v * m), 1e-12)
            << "p=" << p << " v=" << v << " m=" << m;
      }
    }
  }
}

TEST(ScheduleSimulator, ZeroBubbleBeatsOneFOneB) {
  CostModel c;  // F = I = W = 1, B = 2
  for (int64_t p = 2; p <= 6; ++p) {
    const int64_t m = 2 * p;
    const double one_f = simulate(generate_schedule(ScheduleType::k1F1B, p, 1, m), c).bubble_fraction;
    const double zbv = simulate(generate_schedule(ScheduleType::kZBVZeroBubble, p, 2, m), c).bubble_fraction;
    const double zb1p = simulate(generate_schedule(ScheduleType::kInterleavedZeroBubble, p, 2, m), c).bubble_fraction;
    EXPECT_LT(zbv, one_f) << p;
    EXPECT_LT(zb1p, one_f) << p;
  }
}

TEST(ScheduleLowering, SendsAndReceivesPairInOneOrder) {
  const Schedule s = lower_schedule(generate_schedule(ScheduleType::kInterleaved1F1B, 4, 2, 8));
  // Per rank pair, the sender's SEND order equals the receiver's RECV order.
  for (int64_t a = 0; a < 4; ++a) {
    for (int64_t b = 0; b < 4; ++b) {
      std::vector<std::string> sends, recvs;
      for (const auto& x : s.ranks[a]) {
        if (x.kind == ActionKind::kSendF && s.stage_to_rank[x.stage + 1] == b)
          sends.push_back(str("F", x.stage, ":", x.microbatch));
        if (x.kind == ActionKind::kSendB && s.stage_to_rank[x.stage - 1] == b)
          sends.push_back(str("B", x.stage, ":", x.microbatch));
      }
      for (const auto& x : s.ranks[b]) {
        if (x.kind == ActionKind::kRecvF && s.stage_to_rank[x.stage - 1] == a)
          recvs.push_back(str("F", x.stage - 1, ":", x.microbatch));
        if (x.kind == ActionKind::kRecvB && s.stage_to_rank[x.stage + 1] == a)
          recvs.push_back(str("B", x.stage + 1, ":", x.microbatch));
      }
      EXPECT_EQ(sends, recvs) << a << "->" << b;
    }
  }
  // V placement: stage pp-1 -> pp stays on one rank, no message.
  const Schedule v = lower_schedule(generate_schedule(ScheduleType::kZBVZeroBubble, 2, 2, 4));
  for (const auto& x : v.ranks[1]) {
    EXPECT_FALSE(x.kind == ActionKind::kSendF && x.stage == 1) << to_string(x);
  }
}

TEST(ScheduleValidation, RefusesMalformedSchedules) {
  auto sched = [](std::vector<std::string> rows, int64_t stages, int64_t m) {
    Schedule s;
    s.name = "test";
    s.pp = static_cast<int64_t>(rows.size());
    s.num_stages = stages;
    s.microbatches = m;
    for (auto& row : rows) {
      s.ranks.emplace_back();
      std::istringstream in(row);
      std::string t;
      while (in >> t) s.ranks.back().push_back(*parse_action(t));
    }
    return s;
  };
  auto refuse = [&](std::vector<std::string> rows, int64_t S, int64_t m,
                    const std::string& needle) {
    try {
      validate_schedule(sched(rows, S, m));
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refuse({"0F0 0B0", "1B0 1F0"}, 2, 1, "backward of stage 1 micro-batch 0 before its forward");
  refuse({"0F0 0I0 0W0", "1F0 1I0"}, 2, 1, "I and W come in pairs");
  refuse({"0F0 0B0 1F0 1B0", "1F0"}, 2, 1, "also runs on rank");
  refuse({"0F0 0W0 0I0", "1F0 1B0"}, 2, 1, "before its input gradient");
  refuse({"0F0 0F0 0B0", "1F0 1B0"}, 2, 1, "second forward");
  refuse({"0F0", "1F0 1B0"}, 2, 1, "expected 1");
  // A valid order whose dependencies form a cycle: lowering refuses it.
  const Schedule cyc = sched({"3F0 0F0 0B0 3B0", "1F0 2F0 2B0 1B0"}, 4, 1);
  EXPECT_NO_THROW(validate_schedule(cyc));
  try {
    lower_schedule(cyc);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 waits at 3F0"), std::string::npos) << e.what();
  }
}

TEST(ScheduleSimulator, DetectsMisorderedAndMissingMessages) {
  // Rank 1 posts its receives in the wrong order.
  const Schedule swapped = schedule_from_csv(
      "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0RECV_B1,0B0,0B1\n"
      "1RECV_F1,1RECV_F0,1F0,1F1,1B0,1SEND_B0,1B1,1SEND_B1\n",
      "swapped.csv");
  EXPECT_TRUE(swapped.with_comms);
  try {
    simulate(swapped);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not in the same order"), std::string::npos) << e.what();
  }
  // Rank 1 never sends gradients back: rank 0 waits forever.
  const Schedule missing = schedule_from_csv(
      "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0\n", "missing.csv");
  try {
    simulate(missing);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("deadlocks"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("0B0"), std::string::npos) << e.what();
  }
  // A compute before its receive is posted.
  const Schedule early = schedule_from_csv(
      "0F0,0SEND_F0,0RECV_B0,0B0\n1F0,1RECV_F0,1B0,1SEND_B0\n", "early.csv");
  EXPECT_THROW(simulate(early), Error);
}

TEST(ScheduleCsv, RoundTripEverySchedule) {
  for (const auto& tr : all_schedule_traits()) {
    for (int64_t pp : {1, 2, 3, 4}) {
      const int64_t v = tr.single_stage ? 1 : 2;
      const int64_t m = 2 * pp * v;
      const Schedule s = generate_schedule(tr.type, pp, v, m);
      const Schedule back = schedule_from_csv(schedule_to_csv(s), "mem.csv", pp, s.num_stages, m);
      EXPECT_EQ(back.ranks, s.ranks) << tr.name;
      EXPECT_EQ(back.stage_to_rank, s.stage_to_rank) << tr.name;
      EXPECT_FALSE(back.with_comms);
      const Schedule low = lower_schedule(s);
      const Schedule low_back = schedule_from_csv(schedule_to_csv(low), "mem.csv");
      EXPECT_EQ(low_back.ranks, low.ranks) << tr.name;
      EXPECT_EQ(low_back.with_comms, pp > 1) << "one rank sends nothing";
      EXPECT_EQ(simulate(low_back).makespan, simulate(low).makespan);
    }
  }
}

TEST(ScheduleCsv, ReadsTorchWrittenFiles) {
  // csv.writer output: CRLF, idle slots as empty cells, OVERLAP_F_B cells.
  const std::string text =
      "0F0,,0F1,0B0,0B1\r\n"
      ",1F0,1B0,\"(1F1;1B1)OVERLAP_F_B\"\r\n";
  const Schedule s = schedule_from_csv(text, "torch.csv");
  EXPECT_EQ(s.pp, 2);
  EXPECT_EQ(s.num_stages, 2);
  EXPECT_EQ(s.microbatches, 2);
  EXPECT_EQ(rank_text(s.ranks[0]), "0F0 0F1 0B0 0B1");
  EXPECT_EQ(rank_text(s.ranks[1]), "1F0 1B0 (1F1;1B1)OVERLAP_F_B");
  EXPECT_EQ(s.stage_to_rank, (std::vector<int64_t>{0, 1}));
  EXPECT_NO_THROW(simulate(s));
  try {
    schedule_from_csv("0F0,0B0\n1F0,1Q0\n", "bad.csv");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.csv: row 1 (rank 1), column 1"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(schedule_from_csv("0F0,0B0\n", "short.csv", 2), Error);
  EXPECT_THROW(load_schedule_csv("/nonexistent/schedule.csv"), FileError);
}

}  // namespace
}  // namespace viaduct::pipeline
