// The built-in schedule generators. Each gives, per rank, the compute actions
// in the order torch.distributed.pipelining runs them (its pipeline_order
// with the idle slots dropped), and refuses the shapes torch refuses.
#include <algorithm>
#include <cctype>
#include <deque>
#include <functional>
#include <map>

#include "core/check.h"
#include "pipeline/schedule/schedule.h"

namespace viaduct::pipeline {
namespace {

constexpr const char* kKeyMicrobatches = "parallelism.pipeline_parallel_microbatches";

using Ops = std::vector<Action>;
using AK = ActionKind;

const std::vector<ScheduleTraits> kTraits = {
    {ScheduleType::kGPipe, "GPipe", true, Placement::kLoop, 1, 1, 1, false},
    {ScheduleType::k1F1B, "1F1B", true, Placement::kLoop, 1, 1, 1, false},
    {ScheduleType::kInterleaved1F1B, "Interleaved1F1B", false, Placement::kLoop, 2, 0, 2, false},
    {ScheduleType::kLoopedBFS, "LoopedBFS", false, Placement::kLoop, 2, 0, 2, false},
    {ScheduleType::kInterleavedZeroBubble, "InterleavedZeroBubble", false, Placement::kLoop, 2, 0, 2, true},
    {ScheduleType::kZBVZeroBubble, "ZBVZeroBubble", false, Placement::kV, 2, 2, 2, true},
    {ScheduleType::kDualPipeV, "DualPipeV", false, Placement::kV, 2, 2, 2, true},
};

// Per-stage micro-batch counters for one kind.
struct Counter {
  std::map<int64_t, int64_t> next;
  int64_t take(int64_t stage) { return next[stage]++; }
  int64_t peek(int64_t stage) { return next[stage]; }
};

Ops gpipe(int64_t r, int64_t m) {
  Ops ops;
  for (int64_t i = 0; i < m; ++i) ops.push_back(make_action(r, AK::kForward, i));
  for (int64_t i = 0; i < m; ++i) ops.push_back(make_action(r, AK::kBackward, i));
  return ops;
}

Ops one_f_one_b(int64_t r, int64_t pp, int64_t m) {
  Ops ops;
  const int64_t warmup = std::min(m, pp - r);
  int64_t f = 0, b = 0;
  while (f < warmup) ops.push_back(make_action(r, AK::kForward, f++));
  while (b < m) {
    ops.push_back(make_action(r, AK::kBackward, b++));
    if (f < m) ops.push_back(make_action(r, AK::kForward, f++));
  }
  return ops;
}

Ops looped_bfs(int64_t r, int64_t pp, int64_t v, int64_t m) {
  Ops ops;
  for (int64_t l = 0; l < v; ++l) {
    for (int64_t i = 0; i < m; ++i) ops.push_back(make_action(l * pp + r, AK::kForward, i));
  }
  for (int64_t l = v - 1; l >= 0; --l) {
    for (int64_t i = m - 1; i >= 0; --i) {
      ops.push_back(make_action(l * pp + r, AK::kBackward, i));
    }
  }
  return ops;
}

// Interleaved 1F1B (zero_bubble = false) and ZB1P (true): torch's
// _get_1f1b_rank_ops with its warm-up count and stage rotation.
Ops interleaved(int64_t r, int64_t pp, int64_t v, int64_t m, bool zero_bubble) {
  const int64_t rounds = std::max<int64_t>(1, m / pp);
  const int64_t per_round = m / rounds;
  const int64_t factor = zero_bubble ? 1 : 2;
  const int64_t warmup =
      std::min((v - 1) * per_round + factor * (pp - 1 - r), m * v);
  const int64_t total = m * v;  // forwards (and backwards) of this rank
  auto fwd_stage = [&](int64_t op) { return ((op / per_round) % v) * pp + r; };
  auto bwd_stage = [&](int64_t op) {
    return (v - 1 - ((op - warmup) / per_round) % v) * pp + r;
  };
  const AK bwd_kind = zero_bubble ? AK::kBackwardInput : AK::kBackward;
  Counter fwd, bwd, wgt;
  std::vector<int64_t> bwd_ops;  // op ids of emitted backwards, FIFO for W
  size_t next_w = 0;
  Ops ops;
  auto emit_backward = [&](int64_t op) {
    const int64_t s = bwd_stage(op);
    ops.push_back(make_action(s, bwd_kind, bwd.take(s)));
    bwd_ops.push_back(op);
    // ZB1P: after `r` steady steps, each I is followed by the oldest W.
    if (zero_bubble && op - warmup >= r) {
      const int64_t ws = bwd_stage(bwd_ops[next_w++]);
      ops.push_back(make_action(ws, AK::kBackwardWeight, wgt.take(ws)));
    }
  };
  for (int64_t op = 0; op < total + warmup; ++op) {
    if (op < total) {
      const int64_t s = fwd_stage(op);
      ops.push_back(make_action(s, AK::kForward, fwd.take(s)));
    }
    if (op >= warmup) emit_backward(op);
  }
  while (zero_bubble && next_w < bwd_ops.size()) {
    const int64_t ws = bwd_stage(bwd_ops[next_w++]);
    ops.push_back(make_action(ws, AK::kBackwardWeight, wgt.take(ws)));
  }
  return ops;
}

Ops zbv(int64_t r, int64_t pp, int64_t m) {
  const int64_t n = std::max(2 * pp - 1, m);
  const int64_t S = 2 * pp;
  const int64_t c0 = r, c1 = S - 1 - r;
  int64_t f0 = 0, f1 = 0, b0 = 0, b1 = 0;
  Ops ops;
  auto add = [&](int64_t s, AK k, int64_t mb) { ops.push_back(make_action(s, k, mb)); };
  for (int64_t i = 0; i < 2 * (pp - r) - 1; ++i) add(c0, AK::kForward, f0++);
  for (int64_t i = 0; i < r; ++i) {
    add(c1, AK::kForward, f1++);
    add(c0, AK::kForward, f0++);
  }
  for (int64_t i = 0; i < pp - r; ++i) {
    add(c1, AK::kForward, f1++);
    add(c1, AK::kBackwardInput, b1);
    add(c1, AK::kBackwardWeight, b1++);
  }
  while (f1 < f0 || f0 < n) {
    if (f0 < n) add(c0, AK::kForward, f0++);
    add(c0, AK::kBackwardInput, b0);
    add(c0, AK::kBackwardWeight, b0++);
    add(c1, AK::kForward, f1++);
    add(c1, AK::kBackwardInput, b1);
    add(c1, AK::kBackwardWeight, b1++);
  }
  int64_t w0 = b0, w1 = b1;
  for (int64_t i = 0; i < r; ++i) {
    add(c0, AK::kBackwardInput, b0++);
    add(c1, AK::kBackwardInput, b1++);
  }
  for (int64_t i = 0; i < pp - r; ++i) {
    add(c0, AK::kBackwardInput, b0++);
    add(c0, AK::kBackwardWeight, w0++);
  }
  while (w1 < b1) add(c1, AK::kBackwardWeight, w1++);
  while (w0 < b0) add(c0, AK::kBackwardWeight, w0++);
  VIADUCT_CHECK(w0 == b0 && b0 == f0 && w1 == b1 && b1 == f1,
                "internal: ZBV counts differ on rank ", r);
  // n may exceed m: the micro-batches beyond m are torch's idle slots.
  Ops kept;
  for (auto& a : ops) {
    if (a.microbatch < m) kept.push_back(std::move(a));
  }
  return kept;
}

Ops dual_pipe_v(int64_t r, int64_t pp, int64_t m) {
  const int64_t s0 = r, s1 = 2 * pp - 1 - r;
  Counter fwd, inp;
  std::deque<std::pair<int64_t, int64_t>> pending_w;  // (stage, mb)
  Ops ops;
  auto forward = [&](int64_t s) { return make_action(s, AK::kForward, fwd.take(s)); };
  auto full_backward = [&](int64_t s) {
    return make_action(s, AK::kBackward, inp.take(s));
  };
  auto input_backward = [&](int64_t s) {
    const int64_t mb = inp.take(s);
    pending_w.emplace_back(s, mb);
    return make_action(s, AK::kBackwardInput, mb);
  };
  auto backward = [&](int64_t s, bool zb) {
    ops.push_back(zb ? input_backward(s) : full_backward(s));
  };
  auto weight_if_pending = [&] {
    if (pending_w.empty()) return;
    auto [s, mb] = pending_w.front();
    pending_w.pop_front();
    ops.push_back(make_action(s, AK::kBackwardWeight, mb));
  };
  auto overlap = [&](int64_t fs, int64_t bs) {
    Action f = forward(fs);
    Action b = full_backward(bs);
    ops.push_back(make_overlap(std::move(f), std::move(b)));
  };
  for (int64_t i = 0; i < 2 * (pp - r - 1); ++i) ops.push_back(forward(s0));
  for (int64_t i = 0; i < r + 1; ++i) {
    ops.push_back(forward(s0));
    ops.push_back(forward(s1));
  }
  for (int64_t i = 0; i < pp - r - 1; ++i) {
    ops.push_back(input_backward(s1));
    weight_if_pending();
    ops.push_back(forward(s1));
  }
  const int64_t main_steps = m - 2 * pp + r + 1;
  for (int64_t i = 0; i < main_steps; ++i) {
    if (i == 0 && r == pp - 1) {
      // The last rank does not overlap its first pair (smaller bubble).
      ops.push_back(forward(s0));
      ops.push_back(full_backward(s1));
    } else {
      overlap(s0, s1);
    }
    overlap(s1, s0);
  }
  for (int64_t i = 0; i < pp - r - 1; ++i) {
    ops.push_back(full_backward(s1));
    overlap(s1, s0);
  }
  const int64_t tail = r + 1;
  bool zb = false;
  for (int64_t i = 0; i < tail; ++i) {
    // The second half of the tail splits its backwards (odd ranks switch one
    // action earlier than even ranks).
    if (i == tail / 2 && r % 2 == 1) zb = true;
    backward(s1, zb);
    if (i == tail / 2 && r % 2 == 0) zb = true;
    backward(s0, zb);
  }
  for (int64_t i = 0; i < pp - r - 1; ++i) {
    weight_if_pending();
    backward(s0, zb);
  }
  for (int64_t i = 0; i < r + 1; ++i) weight_if_pending();
  return ops;
}

// The micro-batch counts near `m` that `ok` accepts, for messages.
std::string nearest_microbatches(int64_t m, const std::function<bool(int64_t)>& ok) {
  int64_t below = -1, above = -1;
  for (int64_t x = m - 1; x >= 1; --x) {
    if (ok(x)) {
      below = x;
      break;
    }
  }
  for (int64_t x = m + 1; x <= 4 * m + 64; ++x) {
    if (ok(x)) {
      above = x;
      break;
    }
  }
  std::string out = "micro-batch counts that work nearby: ";
  if (below > 0) out += std::to_string(below);
  if (below > 0 && above > 0) out += " or ";
  if (above > 0) out += std::to_string(above);
  return out;
}

bool interleaved_ok(int64_t pp, int64_t m) {
  const int64_t rounds = std::max<int64_t>(1, m / pp);
  return m % rounds == 0;
}

}  // namespace

const std::vector<ScheduleTraits>& all_schedule_traits() { return kTraits; }

const ScheduleTraits& schedule_traits(ScheduleType type) {
  for (const auto& t : kTraits) {
    if (t.type == type) return t;
  }
  throw Error("internal: unknown schedule type");
}

ScheduleType schedule_type_from_name(const std::string& name) {
  std::string lower = name;
  for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::vector<std::string> names;
  for (const auto& t : kTraits) {
    std::string tl = t.name;
    for (auto& c : tl) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (tl == lower) return t.type;
    names.push_back(t.name);
  }
  std::string all;
  for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
  throw ConfigError(str("unknown pipeline schedule '", name, "' (did you mean '",
                        closest_name(name, names), "'?); the schedules are ", all,
                        ", or a CSV file through "
                        "parallelism.pipeline_parallel_schedule_csv"));
}

StagesPerRankRule stages_per_rank_rule(ScheduleType type) {
  const auto& t = schedule_traits(type);
  return {t.name, t.default_stages_per_rank, t.min_stages_per_rank,
          t.max_stages_per_rank};
}

Schedule generate_schedule(ScheduleType type, int64_t pp, int64_t v, int64_t m) {
  const auto& tr = schedule_traits(type);
  VIADUCT_CHECK_T(ConfigError, pp >= 1, "parallelism.pipeline_parallel_degree must be >= 1, got ", pp);
  VIADUCT_CHECK_T(ConfigError, v >= 1, "stages per rank must be >= 1, got ", v);
  VIADUCT_CHECK_T(ConfigError, m >= 1, kKeyMicrobatches, " must be >= 1, got ", m);
  if (tr.single_stage) {
    VIADUCT_CHECK_T(ConfigError, v == 1, "schedule ", tr.name,
                    " runs one stage per rank, got ", v,
                    "; use Interleaved1F1B, LoopedBFS or InterleavedZeroBubble "
                    "for several");
  }
  if (tr.placement == Placement::kV) {
    VIADUCT_CHECK_T(ConfigError, v == 2, "schedule ", tr.name,
                    " requires exactly 2 stages per rank, got ", v);
  }
  Schedule sch;
  sch.name = tr.name;
  sch.pp = pp;
  sch.num_stages = pp * v;
  sch.microbatches = m;
  sch.stage_to_rank = stage_to_rank_map(tr.placement, pp, pp * v);
  const int64_t S = sch.num_stages;
  switch (type) {
    case ScheduleType::k1F1B:
      VIADUCT_CHECK_T(ConfigError, m >= S, "schedule 1F1B needs at least as many ",
                      "micro-batches as stages: ", kKeyMicrobatches, " = ", m,
                      " < ", S, " stages; use ", S,
                      " or more micro-batches, or GPipe");
      break;
    case ScheduleType::kDualPipeV:
      VIADUCT_CHECK_T(ConfigError, m >= S, "schedule DualPipeV needs at least as ",
                      "many micro-batches as stages: ", kKeyMicrobatches, " = ", m,
                      " < ", S, " stages; use ", S, " or more micro-batches");
      break;
    case ScheduleType::kInterleaved1F1B:
    case ScheduleType::kInterleavedZeroBubble: {
      const int64_t rounds = std::max<int64_t>(1, m / pp);
      VIADUCT_CHECK_T(ConfigError, interleaved_ok(pp, m), "schedule ", tr.name,
                      " needs the micro-batch count to be a multiple of the ",
                      "number of rounds (max(1, m / pp) = ", rounds, "): ",
                      kKeyMicrobatches, " = ", m, " on pp = ", pp, "; ",
                      nearest_microbatches(m, [&](int64_t x) { return interleaved_ok(pp, x); }));
      break;
    }
    default:
      break;
  }
  for (int64_t r = 0; r < pp; ++r) {
    switch (type) {
      case ScheduleType::kGPipe: sch.ranks.push_back(gpipe(r, m)); break;
      case ScheduleType::k1F1B: sch.ranks.push_back(one_f_one_b(r, pp, m)); break;
      case ScheduleType::kLoopedBFS: sch.ranks.push_back(looped_bfs(r, pp, v, m)); break;
      case ScheduleType::kInterleaved1F1B:
        sch.ranks.push_back(interleaved(r, pp, v, m, false));
        break;
      case ScheduleType::kInterleavedZeroBubble:
        sch.ranks.push_back(interleaved(r, pp, v, m, true));
        break;
      case ScheduleType::kZBVZeroBubble: sch.ranks.push_back(zbv(r, pp, m)); break;
      case ScheduleType::kDualPipeV: sch.ranks.push_back(dual_pipe_v(r, pp, m)); break;
    }
  }
  return sch;
}

std::string schedule_to_text(const Schedule& schedule) {
  std::string out;
  for (size_t r = 0; r < schedule.ranks.size(); ++r) {
    out += "rank ";
    out += std::to_string(r);
    out += ":";
    for (const auto& a : schedule.ranks[r]) {
      out += ' ';
      out += to_string(a);
    }
    out += "\n";
  }
  return out;
}

}  // namespace viaduct::pipeline
