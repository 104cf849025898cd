// The action IR every schedule is written in, and torch's text form of it.
//
// An action is (stage, kind, micro-batch): `2F0` is stage 2's forward of
// micro-batch 0, `3SEND_F1` stage 3 sending micro-batch 1's activations,
// `(0F3;7B2)OVERLAP_F_B` one forward and one backward meant to overlap. The
// text matches torch.distributed.pipelining, so schedules move both ways.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace viaduct::pipeline {

enum class ActionKind : uint8_t {
  kForward,         // F
  kBackward,        // B: input and weight gradients together
  kBackwardInput,   // I: input gradient only (zero-bubble split)
  kBackwardWeight,  // W: weight gradient of an earlier I
  kSendF,           // SEND_F: send activations to stage + 1
  kRecvF,           // RECV_F: post the receive of activations from stage - 1
  kSendB,           // SEND_B: send input gradients to stage - 1
  kRecvB,           // RECV_B: post the receive of gradients from stage + 1
  kOverlapFB,       // OVERLAP_F_B: sub-actions (a F and a B) run together
  kReduceGrad,      // REDUCE_GRAD: the stage's gradients are final (DP sync)
};

const char* action_kind_name(ActionKind kind);
bool is_compute(ActionKind kind);  // F, B, I, W, OVERLAP_F_B
bool is_comm(ActionKind kind);     // SEND_*, RECV_*

struct Action {
  int64_t stage = -1;  // -1 for OVERLAP_F_B (its sub-actions carry stages)
  ActionKind kind = ActionKind::kForward;
  int64_t microbatch = -1;           // -1: none (REDUCE_GRAD, OVERLAP_F_B)
  std::vector<Action> sub_actions;  // only OVERLAP_F_B

  bool operator==(const Action& o) const {
    return stage == o.stage && kind == o.kind && microbatch == o.microbatch &&
           sub_actions == o.sub_actions;
  }
  bool operator!=(const Action& o) const { return !(*this == o); }
};

inline Action make_action(int64_t stage, ActionKind kind, int64_t mb) {
  Action a;
  a.stage = stage;
  a.kind = kind;
  a.microbatch = mb;
  return a;
}
Action make_overlap(Action forward, Action backward);

// torch's text form: "2F0", "3SEND_F1", "1REDUCE_GRAD", "(0F3;7B2)OVERLAP_F_B".
std::string to_string(const Action& a);
// Inverse of to_string; empty (after trimming) gives nullopt (an idle slot).
// Throws Error naming the text.
std::optional<Action> parse_action(std::string_view text);

// The leaf actions of `a`: its sub-actions for OVERLAP_F_B, else {a}.
std::vector<Action> leaf_actions(const Action& a);

// A compact key of a leaf action, for sets and maps.
inline uint64_t action_key(int64_t stage, ActionKind kind, int64_t mb) {
  return (static_cast<uint64_t>(stage + 1) << 40) |
         (static_cast<uint64_t>(kind) << 32) |
         static_cast<uint64_t>(static_cast<uint32_t>(mb + 1));
}
inline uint64_t action_key(const Action& a) {
  return action_key(a.stage, a.kind, a.microbatch);
}

}  // namespace viaduct::pipeline
