// Text form of the action IR (see action.h).
#include "pipeline/schedule/action.h"

#include <cctype>

#include "core/check.h"

namespace viaduct::pipeline {
namespace {

struct KindName {
  ActionKind kind;
  const char* name;
};
// Longest names first so that a prefix never shadows a longer name.
constexpr KindName kKindNames[] = {
    {ActionKind::kReduceGrad, "REDUCE_GRAD"},
    {ActionKind::kOverlapFB, "OVERLAP_F_B"},
    {ActionKind::kSendF, "SEND_F"},     {ActionKind::kRecvF, "RECV_F"},
    {ActionKind::kSendB, "SEND_B"},     {ActionKind::kRecvB, "RECV_B"},
    {ActionKind::kForward, "F"},        {ActionKind::kBackward, "B"},
    {ActionKind::kBackwardInput, "I"},  {ActionKind::kBackwardWeight, "W"},
};

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

[[noreturn]] void bad_action(std::string_view text, const std::string& why) {
  throw Error(str("invalid action '", text, "': ", why,
                  " (expected [stage][kind][micro-batch] such as 2F0, 3SEND_F1 "
                  "or (0F3;7B2)OVERLAP_F_B)"));
}

}  // namespace

const char* action_kind_name(ActionKind kind) {
  for (const auto& kn : kKindNames) {
    if (kn.kind == kind) return kn.name;
  }
  return "?";
}

bool is_compute(ActionKind k) {
  return k == ActionKind::kForward || k == ActionKind::kBackward ||
         k == ActionKind::kBackwardInput || k == ActionKind::kBackwardWeight ||
         k == ActionKind::kOverlapFB;
}

bool is_comm(ActionKind k) {
  return k == ActionKind::kSendF || k == ActionKind::kRecvF ||
         k == ActionKind::kSendB || k == ActionKind::kRecvB;
}

Action make_overlap(Action forward, Action backward) {
  Action a;
  a.kind = ActionKind::kOverlapFB;
  a.sub_actions = {std::move(forward), std::move(backward)};
  return a;
}

std::string to_string(const Action& a) {
  if (a.kind == ActionKind::kOverlapFB) {
    std::string out = "(";
    for (size_t i = 0; i < a.sub_actions.size(); ++i) {
      if (i > 0) out += ";";
      out += to_string(a.sub_actions[i]);
    }
    return out + ")" + action_kind_name(a.kind);
  }
  std::string out = std::to_string(a.stage) + action_kind_name(a.kind);
  if (a.microbatch >= 0) out += std::to_string(a.microbatch);
  return out;
}

std::optional<Action> parse_action(std::string_view text) {
  const std::string_view t = trim(text);
  if (t.empty()) return std::nullopt;
  if (t.front() == '(') {
    const size_t close = t.find(')');
    if (close == std::string_view::npos) bad_action(text, "no ')'");
    const std::string_view kind = trim(t.substr(close + 1));
    if (kind != "OVERLAP_F_B") {
      bad_action(text, "only OVERLAP_F_B takes sub-actions");
    }
    Action a;
    a.kind = ActionKind::kOverlapFB;
    std::string_view rest = t.substr(1, close - 1);
    while (!rest.empty()) {
      const size_t semi = rest.find(';');
      const std::string_view part = rest.substr(0, semi);
      if (auto sub = parse_action(part)) {
        if (!is_compute(sub->kind) || sub->kind == ActionKind::kOverlapFB) {
          bad_action(text, "sub-actions must be F, B, I or W");
        }
        a.sub_actions.push_back(*sub);
      }
      if (semi == std::string_view::npos) break;
      rest.remove_prefix(semi + 1);
    }
    if (a.sub_actions.empty()) bad_action(text, "no sub-actions");
    return a;
  }
  size_t i = 0;
  int64_t stage = 0;
  while (i < t.size() && std::isdigit(static_cast<unsigned char>(t[i]))) {
    stage = stage * 10 + (t[i] - '0');
    if (stage > (int64_t{1} << 30)) bad_action(text, "stage out of range");
    ++i;
  }
  if (i == 0) bad_action(text, "no stage number");
  const std::string_view after = t.substr(i);
  for (const auto& kn : kKindNames) {
    const std::string_view name = kn.name;
    if (kn.kind == ActionKind::kOverlapFB) continue;
    if (after.substr(0, name.size()) != name) continue;
    std::string_view digits = after.substr(name.size());
    int64_t mb = -1;
    if (!digits.empty()) {
      mb = 0;
      for (char c : digits) {
        if (!std::isdigit(static_cast<unsigned char>(c))) {
          bad_action(text, str("unexpected '", c, "'"));
        }
        mb = mb * 10 + (c - '0');
        if (mb > (int64_t{1} << 30)) bad_action(text, "micro-batch out of range");
      }
    }
    if (mb < 0 && kn.kind != ActionKind::kReduceGrad) {
      bad_action(text, "no micro-batch number");
    }
    return make_action(stage, kn.kind, mb);
  }
  bad_action(text, "unknown kind");
}

std::vector<Action> leaf_actions(const Action& a) {
  if (a.kind == ActionKind::kOverlapFB) return a.sub_actions;
  return {a};
}

}  // namespace viaduct::pipeline
