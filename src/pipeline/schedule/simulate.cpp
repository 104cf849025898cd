// The schedule simulator (see simulate.h).
#include "pipeline/schedule/simulate.h"

#include <algorithm>
#include <map>
#include <optional>
#include <unordered_map>

#include "core/check.h"

namespace viaduct::pipeline {
namespace {

using AK = ActionKind;

// A message is named by its sender: (kind F or B, sending stage, mb).
uint64_t message_id(bool forward, int64_t sender_stage, int64_t mb) {
  return action_key(sender_stage, forward ? AK::kSendF : AK::kSendB, mb);
}

}  // namespace

double CostModel::cost(const Action& a) const {
  double c = 0;
  switch (a.kind) {
    case AK::kForward: c = forward; break;
    case AK::kBackward: c = backward; break;
    case AK::kBackwardInput: c = backward_input; break;
    case AK::kBackwardWeight: c = backward_weight; break;
    default: return 0;
  }
  if (a.stage >= 0 && a.stage < static_cast<int64_t>(stage_scale.size())) {
    c *= stage_scale[a.stage];
  }
  return c;
}

SimulationResult simulate(const Schedule& input, const CostModel& costs) {
  const Schedule sch = input.with_comms ? input : lower_schedule(input);
  const int64_t pp = sch.pp, S = sch.num_stages;
  std::vector<int64_t> rank_of = sch.stage_to_rank;
  if (rank_of.empty()) rank_of = validate_schedule(compute_only(sch));

  std::unordered_map<uint64_t, double> done_at;   // leaf compute -> end time
  std::unordered_map<uint64_t, double> sent_at;   // message -> send time
  std::unordered_map<uint64_t, double> posted_at; // message -> recv post time
  std::map<std::pair<int64_t, int64_t>, std::vector<uint64_t>> chan_send, chan_recv;

  SimulationResult res;
  res.busy.assign(pp, 0);
  res.peak_activations.assign(pp, 0);
  res.timeline.assign(pp, {});
  std::vector<double> now(pp, 0);
  std::vector<int64_t> live(pp, 0);
  std::vector<size_t> head(pp, 0);

  auto rank_name = [&](int64_t r, const Action& a) {
    return str("rank ", r, ", step ", head[r], " (", to_string(a), ")");
  };
  // Leaves of the OVERLAP_F_B being placed: (key, end), in order.
  std::vector<std::pair<uint64_t, double>> pending;
  // The time `leaf` on rank r may start from its inputs' side; nullopt while
  // an input is not produced yet. Throws on a malformed list.
  auto input_ready = [&](int64_t r, const Action& top,
                         const Action& a) -> std::optional<double> {
    const int64_t s = a.stage, mb = a.microbatch;
    auto local = [&](uint64_t key) -> std::optional<double> {
      for (const auto& [k, t] : pending) {
        if (k == key) return t;
      }
      auto it = done_at.find(key);
      if (it == done_at.end()) return std::nullopt;
      return it->second;
    };
    auto remote = [&](bool forward, int64_t sender) -> std::optional<double> {
      const uint64_t id = message_id(forward, sender, mb);
      auto post = posted_at.find(id);
      VIADUCT_CHECK(post != posted_at.end(), rank_name(r, top), ": computes before ",
                    "posting the receive of ", forward ? "activations" : "gradients",
                    " from stage ", sender, " micro-batch ", mb);
      auto sent = sent_at.find(id);
      if (sent == sent_at.end()) return std::nullopt;
      return std::max(sent->second, post->second) + costs.p2p;
    };
    switch (a.kind) {
      case AK::kForward:
        if (s == 0) return 0.0;
        if (rank_of[s - 1] == r) return local(action_key(s - 1, AK::kForward, mb));
        return remote(true, s - 1);
      case AK::kBackward:
      case AK::kBackwardInput: {
        auto f = local(action_key(s, AK::kForward, mb));
        VIADUCT_CHECK(f.has_value(), rank_name(r, top),
                      ": backward before its forward");
        if (s == S - 1) return *f;
        std::optional<double> g;
        if (rank_of[s + 1] == r) {
          g = local(action_key(s + 1, AK::kBackward, mb));
          if (!g) g = local(action_key(s + 1, AK::kBackwardInput, mb));
        } else {
          g = remote(false, s + 1);
        }
        if (!g) return std::nullopt;
        return std::max(*f, *g);
      }
      case AK::kBackwardWeight:
        return local(action_key(s, AK::kBackwardInput, mb));
      default:
        return 0.0;
    }
  };

  // Run rank r's head action if it can run now; false when it waits.
  auto step = [&](int64_t r) -> bool {
    const Action& a = sch.ranks[r][head[r]];
    const int64_t s = a.stage, mb = a.microbatch;
    switch (a.kind) {
      case AK::kSendF:
      case AK::kSendB: {
        const bool fwd = a.kind == AK::kSendF;
        const bool produced =
            fwd ? done_at.count(action_key(s, AK::kForward, mb)) > 0
                : done_at.count(action_key(s, AK::kBackward, mb)) > 0 ||
                      done_at.count(action_key(s, AK::kBackwardInput, mb)) > 0;
        VIADUCT_CHECK(produced, rank_name(r, a), ": sends before computing");
        const int64_t peer_stage = fwd ? s + 1 : s - 1;
        VIADUCT_CHECK(peer_stage >= 0 && peer_stage < S, rank_name(r, a),
                      ": no stage to send to");
        const uint64_t id = message_id(fwd, s, mb);
        VIADUCT_CHECK(sent_at.emplace(id, now[r]).second, rank_name(r, a),
                      ": sent twice");
        chan_send[{r, rank_of[peer_stage]}].push_back(id);
        ++res.messages;
        break;
      }
      case AK::kRecvF:
      case AK::kRecvB: {
        const bool fwd = a.kind == AK::kRecvF;
        const int64_t sender = fwd ? s - 1 : s + 1;
        VIADUCT_CHECK(sender >= 0 && sender < S, rank_name(r, a),
                      ": no stage to receive from");
        const uint64_t id = message_id(fwd, sender, mb);
        VIADUCT_CHECK(posted_at.emplace(id, now[r]).second, rank_name(r, a),
                      ": received twice");
        chan_recv[{rank_of[sender], r}].push_back(id);
        break;
      }
      case AK::kReduceGrad:
        break;
      default: {
        // Sub-actions run one after the other; a later one may use an
        // earlier one's output.
        const auto leaves = leaf_actions(a);
        pending.clear();
        std::vector<double> starts;
        double t = now[r];
        for (const auto& l : leaves) {
          auto ready = input_ready(r, a, l);
          if (!ready) {
            pending.clear();
            return false;
          }
          starts.push_back(std::max(t, *ready));
          t = starts.back() + costs.cost(l);
          pending.emplace_back(action_key(l), t);
        }
        pending.clear();
        for (size_t i = 0; i < leaves.size(); ++i) {
          const Action& l = leaves[i];
          t = starts[i];
          const double end = t + costs.cost(l);
          res.timeline[r].push_back({l, t, end});
          done_at[action_key(l)] = end;
          res.busy[r] += end - t;
          if (l.kind == AK::kForward) {
            res.peak_activations[r] = std::max(res.peak_activations[r], ++live[r]);
          } else if (l.kind == AK::kBackward || l.kind == AK::kBackwardWeight) {
            --live[r];
          }
          t = end;
        }
        now[r] = t;
      }
    }
    ++head[r];
    return true;
  };

  for (;;) {
    bool progress = false, left = false;
    for (int64_t r = 0; r < pp; ++r) {
      while (head[r] < sch.ranks[r].size() && step(r)) progress = true;
      left = left || head[r] < sch.ranks[r].size();
    }
    if (!left) break;
    if (!progress) {
      std::string heads;
      for (int64_t r = 0; r < pp; ++r) {
        if (head[r] < sch.ranks[r].size()) {
          heads += str(" ", rank_name(r, sch.ranks[r][head[r]]), " waits;");
        }
      }
      throw Error(str("schedule ", sch.name, " deadlocks: every unfinished rank ",
                      "waits for an input no rank will produce:", heads));
    }
  }
  for (const auto& [chan, sends] : chan_send) {
    const auto& recvs = chan_recv[chan];
    VIADUCT_CHECK(sends == recvs, "schedule ", sch.name, ": rank ", chan.first,
                  " sends ", sends.size(), " messages to rank ", chan.second,
                  " which posts ", recvs.size(),
                  " receives, not in the same order; the pair would hang or "
                  "swap tensors");
  }
  for (const auto& [chan, recvs] : chan_recv) {
    VIADUCT_CHECK(chan_send.count(chan) || recvs.empty(), "schedule ", sch.name,
                  ": rank ", chan.second, " waits for ", recvs.size(),
                  " messages rank ", chan.first, " never sends");
  }
  res.makespan = *std::max_element(now.begin(), now.end());
  double busy = 0;
  for (double b : res.busy) busy += b;
  res.bubble_fraction =
      res.makespan > 0 ? 1.0 - busy / (static_cast<double>(pp) * res.makespan) : 0;
  return res;
}

}  // namespace viaduct::pipeline
