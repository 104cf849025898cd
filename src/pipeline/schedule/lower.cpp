// Validation of a compute schedule and its lowering to paired sends and
// receives (see Note [Schedule lifecycle] in schedule.h).
#include <map>
#include <set>
#include <unordered_set>

#include "core/check.h"
#include "pipeline/schedule/schedule.h"

namespace viaduct::pipeline {
namespace {

using AK = ActionKind;

std::string where(int64_t rank, size_t step, const Action& a) {
  return str("rank ", rank, ", step ", step, " (", to_string(a), ")");
}

}  // namespace

std::vector<int64_t> validate_schedule(const Schedule& sch) {
  const int64_t S = sch.num_stages, m = sch.microbatches;
  VIADUCT_CHECK(static_cast<int64_t>(sch.ranks.size()) == sch.pp, "schedule ",
                sch.name, " has ", sch.ranks.size(), " ranks, expected ", sch.pp);
  std::vector<int64_t> owner(S, -1);
  // Per stage and kind, which micro-batches ran.
  std::vector<std::map<AK, std::set<int64_t>>> seen(S);
  for (int64_t r = 0; r < sch.pp; ++r) {
    for (size_t step = 0; step < sch.ranks[r].size(); ++step) {
      const Action& top = sch.ranks[r][step];
      if (!is_compute(top.kind)) continue;
      for (const Action& a : leaf_actions(top)) {
        const std::string at = where(r, step, top);
        VIADUCT_CHECK(a.stage >= 0 && a.stage < S, at, ": stage ", a.stage,
                      " outside 0..", S - 1);
        VIADUCT_CHECK(a.microbatch >= 0 && a.microbatch < m, at,
                      ": micro-batch ", a.microbatch, " outside 0..", m - 1);
        VIADUCT_CHECK(owner[a.stage] < 0 || owner[a.stage] == r, at, ": stage ",
                      a.stage, " also runs on rank ", owner[a.stage],
                      "; a stage lives on one rank");
        owner[a.stage] = r;
        auto& st = seen[a.stage];
        const int64_t mb = a.microbatch;
        switch (a.kind) {
          case AK::kForward:
            VIADUCT_CHECK(st[AK::kForward].insert(mb).second, at,
                          ": second forward of stage ", a.stage, " micro-batch ", mb);
            break;
          case AK::kBackward:
          case AK::kBackwardInput:
            VIADUCT_CHECK(st[AK::kForward].count(mb), at, ": backward of stage ",
                          a.stage, " micro-batch ", mb, " before its forward");
            VIADUCT_CHECK(!st[AK::kBackward].count(mb) && !st[AK::kBackwardInput].count(mb),
                          at, ": second backward of stage ", a.stage,
                          " micro-batch ", mb);
            st[a.kind].insert(mb);
            break;
          case AK::kBackwardWeight:
            VIADUCT_CHECK(st[AK::kBackwardInput].count(mb), at,
                          ": weight gradient of stage ", a.stage, " micro-batch ",
                          mb, " before its input gradient (I)");
            VIADUCT_CHECK(st[AK::kBackwardWeight].insert(mb).second, at,
                          ": second W of stage ", a.stage, " micro-batch ", mb);
            break;
          default:
            VIADUCT_CHECK(false, at, ": ", action_kind_name(a.kind),
                          " cannot be a sub-action");
        }
      }
    }
  }
  for (int64_t s = 0; s < S; ++s) {
    auto& st = seen[s];
    const auto nf = static_cast<int64_t>(st[AK::kForward].size());
    const auto nb = static_cast<int64_t>(st[AK::kBackward].size());
    const auto ni = static_cast<int64_t>(st[AK::kBackwardInput].size());
    const auto nw = static_cast<int64_t>(st[AK::kBackwardWeight].size());
    VIADUCT_CHECK(owner[s] >= 0, "schedule ", sch.name, ": stage ", s,
                  " runs on no rank");
    VIADUCT_CHECK(nf == m, "schedule ", sch.name, ": stage ", s, " forwards ",
                  nf, " micro-batches, expected ", m);
    VIADUCT_CHECK(ni == nw, "schedule ", sch.name, ": stage ", s, " has ", ni,
                  " I but ", nw, " W; I and W come in pairs");
    VIADUCT_CHECK(nb + ni == m, "schedule ", sch.name, ": stage ", s,
                  " runs ", nb, " B + ", ni, " I/W backwards, expected ", m);
  }
  if (!sch.stage_to_rank.empty()) {
    for (int64_t s = 0; s < S; ++s) {
      VIADUCT_CHECK(sch.stage_to_rank[s] == owner[s], "schedule ", sch.name,
                    ": stage ", s, " runs on rank ", owner[s],
                    " but the placement puts it on rank ", sch.stage_to_rank[s]);
    }
  }
  return owner;
}

Schedule lower_schedule(const Schedule& compute, const LowerOptions& options) {
  VIADUCT_CHECK(!compute.with_comms, "schedule ", compute.name,
                " already has sends and receives");
  Schedule out = compute;
  out.stage_to_rank = validate_schedule(compute);
  out.with_comms = true;
  const auto& rank_of = out.stage_to_rank;
  const int64_t S = compute.num_stages, pp = compute.pp;

  // Optional REDUCE_GRAD after each stage's m-th B or W.
  std::vector<std::vector<Action>> queues = compute.ranks;
  if (options.reduce_grad) {
    for (auto& q : queues) {
      std::vector<Action> with;
      std::map<int64_t, int64_t> done;
      for (const Action& a : q) {
        with.push_back(a);
        for (const Action& leaf : leaf_actions(a)) {
          if (leaf.kind == AK::kBackward || leaf.kind == AK::kBackwardWeight) {
            if (++done[leaf.stage] == compute.microbatches) {
              with.push_back(make_action(leaf.stage, AK::kReduceGrad, -1));
            }
          }
        }
      }
      q = std::move(with);
    }
  }

  // A forward's output leaves the rank unless stage + 1 is local; a
  // backward's input gradient likewise towards stage - 1.
  auto sends = [&](const Action& a) {
    if (a.kind == AK::kForward) {
      return a.stage != S - 1 && rank_of[a.stage + 1] != rank_of[a.stage];
    }
    if (a.kind == AK::kBackward || a.kind == AK::kBackwardInput) {
      return a.stage != 0 && rank_of[a.stage - 1] != rank_of[a.stage];
    }
    return false;
  };
  std::vector<std::unordered_set<uint64_t>> done(pp);
  auto ready = [&](int64_t r, const Action& a) {
    const auto& d = done[r];
    const int64_t s = a.stage, mb = a.microbatch;
    if (a.kind == AK::kForward && s != 0) {
      return d.count(action_key(s, AK::kRecvF, mb)) ||
             d.count(action_key(s - 1, AK::kForward, mb));
    }
    if ((a.kind == AK::kBackward || a.kind == AK::kBackwardInput) && s != S - 1) {
      return d.count(action_key(s, AK::kRecvB, mb)) ||
             d.count(action_key(s + 1, AK::kBackwardInput, mb)) ||
             d.count(action_key(s + 1, AK::kBackward, mb));
    }
    return true;
  };
  for (auto& r : out.ranks) r.clear();
  std::vector<size_t> head(pp, 0);
  for (;;) {
    bool progress = false, left = false;
    for (int64_t r = 0; r < pp; ++r) {
      if (head[r] >= queues[r].size()) continue;
      left = true;
      const Action& a = queues[r][head[r]];
      const auto leaves = leaf_actions(a);
      bool ok = true;
      for (const auto& l : leaves) ok = ok && ready(r, l);
      if (!ok) continue;
      out.ranks[r].push_back(a);
      for (const auto& l : leaves) {
        done[r].insert(action_key(l));
        if (!sends(l)) continue;
        const bool fwd = l.kind == AK::kForward;
        const Action send = make_action(l.stage, fwd ? AK::kSendF : AK::kSendB, l.microbatch);
        const int64_t peer_stage = fwd ? l.stage + 1 : l.stage - 1;
        const Action recv = make_action(peer_stage, fwd ? AK::kRecvF : AK::kRecvB, l.microbatch);
        const int64_t peer = rank_of[peer_stage];
        out.ranks[r].push_back(send);
        done[r].insert(action_key(send));
        out.ranks[peer].push_back(recv);
        done[peer].insert(action_key(recv));
      }
      ++head[r];
      progress = true;
    }
    if (!left) break;
    if (!progress) {
      std::string heads;
      for (int64_t r = 0; r < pp; ++r) {
        if (head[r] < queues[r].size()) {
          heads += str(" rank ", r, " waits at ", to_string(queues[r][head[r]]), ";");
        }
      }
      throw Error(str("schedule ", compute.name, " (pp = ", pp, ", ", S,
                      " stages, ", compute.microbatches,
                      " micro-batches) cannot be lowered: no rank can place its "
                      "next action, the order deadlocks:", heads));
    }
  }
  return out;
}

Schedule compute_only(const Schedule& schedule) {
  Schedule out = schedule;
  out.with_comms = false;
  for (auto& r : out.ranks) {
    std::vector<Action> kept;
    for (auto& a : r) {
      if (is_compute(a.kind)) kept.push_back(a);
    }
    r = std::move(kept);
  }
  return out;
}

}  // namespace viaduct::pipeline
