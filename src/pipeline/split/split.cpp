// The split generator, the stage placements and every refusal of an
// impossible shape (see Note [Split units] in split.h).
#include "pipeline/split/split.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <set>

#include "core/check.h"
#include "core/strings.h"

namespace viaduct::pipeline {
namespace {

constexpr const char* kKeyDegree = "parallelism.pipeline_parallel_degree";
constexpr const char* kKeyLayersPerStage =
    "parallelism.pipeline_parallel_layers_per_stage";
constexpr const char* kKeyStagesPerRank =
    "parallelism.pipeline_parallel_stages_per_rank";
constexpr const char* kKeyFqns = "parallelism.module_fqns_per_model_part";
constexpr const char* kKeyFirstWeight =
    "parallelism.pipeline_parallel_first_stage_less_layers";
constexpr const char* kKeyLastWeight =
    "parallelism.pipeline_parallel_last_stage_less_layers";

// "a, b and c" for messages.
std::string join_values(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) out += (i + 1 == v.size()) ? " or " : ", ";
    out += v[i];
  }
  return out;
}

// Up to two valid values on each side of `wanted`, nearest first.
std::vector<int64_t> nearest_values(int64_t wanted,
                                    const std::vector<int64_t>& valid) {
  std::vector<int64_t> below, above;
  for (int64_t v : valid) {
    if (v < wanted) below.push_back(v);
    if (v > wanted) above.push_back(v);
  }
  std::vector<int64_t> out;
  for (size_t i = 0; i < 2 && i < below.size(); ++i) {
    out.push_back(below[below.size() - 1 - i]);
  }
  for (size_t i = 0; i < 2 && i < above.size(); ++i) out.push_back(above[i]);
  std::sort(out.begin(), out.end());
  return out;
}

int64_t units_of(const SplitSpec& spec) {
  return spec.model.n_layers + spec.first_stage_weight + spec.last_stage_weight;
}

bool rule_allows(const StagesPerRankRule& rule, int64_t v) {
  return v >= rule.min_value && (rule.max_value == 0 || v <= rule.max_value);
}

std::string rule_text(const StagesPerRankRule& rule) {
  if (rule.max_value == rule.min_value) {
    return str("exactly ", rule.min_value);
  }
  if (rule.max_value == 0) return str("at least ", rule.min_value);
  return str(rule.min_value, "..", rule.max_value);
}

// Why (S stages) does not work, or "" when it does.
std::string stage_count_problem(const SplitSpec& spec, int64_t num_stages) {
  if (num_stages < 1) return "a pipeline needs at least one stage";
  if (num_stages % spec.pp != 0) {
    return str(num_stages, " stages is not a multiple of ", kKeyDegree, " = ",
               spec.pp);
  }
  const int64_t v = num_stages / spec.pp;
  if (!rule_allows(spec.rule, v)) {
    return str("schedule ", spec.rule.schedule_name, " runs ",
               rule_text(spec.rule), " stage(s) per rank, not ", v);
  }
  if (num_stages == 1) return "";
  const int64_t units = units_of(spec);
  const int64_t base = units / num_stages;
  if (num_stages > units || base == 0) {
    return str(num_stages, " stages exceed the ", units, " units (",
               spec.model.n_layers, " layers + ", spec.first_stage_weight,
               " + ", spec.last_stage_weight, "): a stage would be empty");
  }
  if (spec.first_stage_weight > base) {
    return str(kKeyFirstWeight, " = ", spec.first_stage_weight,
               " exceeds the smallest stage share (", base, " units) of ",
               num_stages, " stages");
  }
  if (spec.last_stage_weight > base) {
    return str(kKeyLastWeight, " = ", spec.last_stage_weight,
               " exceeds the smallest stage share (", base, " units) of ",
               num_stages, " stages");
  }
  return "";
}

// Valid stages-per-rank values (for the messages), up to the unit count.
std::vector<int64_t> valid_stages_per_rank(const SplitSpec& spec) {
  std::vector<int64_t> out;
  const int64_t limit = std::max<int64_t>(1, units_of(spec) / spec.pp + 1);
  for (int64_t v = 1; v <= limit; ++v) {
    if (stage_count_problem(spec, spec.pp * v).empty()) out.push_back(v);
  }
  return out;
}

std::string suggest_stages_per_rank(const SplitSpec& spec, int64_t wanted) {
  const auto near = nearest_values(wanted, valid_stages_per_rank(spec));
  if (near.empty()) {
    return str("no stages-per-rank value works for ", spec.model.n_layers,
               " layers on ", spec.pp, " ranks with schedule ",
               spec.rule.schedule_name,
               "; lower the pipeline degree or the unit weights");
  }
  std::vector<std::string> parts;
  for (int64_t v : near) {
    parts.push_back(str(kKeyStagesPerRank, " = ", v, " (", v * spec.pp,
                        " stages)"));
  }
  return str("shapes that work: ", join_values(parts));
}

std::string suggest_layers_per_stage(const SplitSpec& spec, int64_t wanted) {
  const int64_t units = units_of(spec);
  std::vector<int64_t> valid;
  std::map<int64_t, int64_t> stages_of;
  for (int64_t k = 1; k <= std::max<int64_t>(units, 1); ++k) {
    const int64_t s = (units + k - 1) / k;
    if (stage_count_problem(spec, s).empty()) {
      valid.push_back(k);
      stages_of[k] = s;
    }
  }
  const auto near = nearest_values(wanted, valid);
  if (near.empty()) {
    return str("no layers-per-stage value works; ",
               suggest_stages_per_rank(spec, 1));
  }
  std::vector<std::string> parts;
  for (int64_t k : near) {
    parts.push_back(str(kKeyLayersPerStage, " = ", k, " (", stages_of[k],
                        " stages)"));
  }
  return str("shapes that work: ", join_values(parts));
}

std::vector<std::string> layer_names(const ModelLayout& model, int64_t first,
                                     int64_t end) {
  std::vector<std::string> out;
  for (int64_t i = first; i < end; ++i) {
    out.push_back(model.layer_prefix + std::to_string(i));
  }
  return out;
}

// Layer index of `fqn`, or -1 when it is not a layer.
int64_t layer_index(const ModelLayout& model, const std::string& fqn) {
  const auto& p = model.layer_prefix;
  if (fqn.size() <= p.size() || fqn.compare(0, p.size(), p) != 0) return -1;
  int64_t v = 0;
  for (size_t i = p.size(); i < fqn.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(fqn[i]))) return -1;
    v = v * 10 + (fqn[i] - '0');
    if (v > (int64_t{1} << 40)) return -1;
  }
  if (fqn.size() > p.size() + 1 && fqn[p.size()] == '0') return -1;
  return v;
}

// Validate and normalise an explicit module_fqns_per_model_part.
std::vector<std::vector<std::string>> check_explicit_lists(
    const SplitSpec& spec, std::vector<std::vector<std::string>> lists) {
  const ModelLayout& model = spec.model;
  const int64_t S = static_cast<int64_t>(lists.size());
  VIADUCT_CHECK_T(ConfigError, S >= 1, kKeyFqns, " is empty");
  const auto all = model.all_modules();
  std::map<std::string, int64_t> order;
  for (size_t i = 0; i < all.size(); ++i) order[all[i]] = static_cast<int64_t>(i);
  std::set<std::string> pinned(model.pinned_first.begin(), model.pinned_first.end());
  pinned.insert(model.pinned_last.begin(), model.pinned_last.end());

  std::map<std::string, int64_t> where;
  for (int64_t s = 0; s < S; ++s) {
    for (const auto& fqn : lists[s]) {
      VIADUCT_CHECK_T(ConfigError, order.count(fqn), kKeyFqns, ": stage ", s,
                      " names unknown module '", fqn, "' (did you mean '",
                      closest_name(fqn, all), "'?)");
      auto [it, fresh] = where.emplace(fqn, s);
      VIADUCT_CHECK_T(ConfigError, fresh, kKeyFqns, ": module '", fqn,
                      "' is listed on stage ", it->second, " and on stage ", s);
    }
  }
  // Pinned modules ride with the first / last stage; add them when absent.
  for (const auto& m : model.pinned_first) {
    if (!where.count(m)) {
      lists.front().push_back(m);
      where[m] = 0;
    }
    VIADUCT_CHECK_T(ConfigError, where[m] == 0, kKeyFqns, ": pinned module '",
                    m, "' must be on stage 0, not stage ", where[m]);
  }
  for (const auto& m : model.pinned_last) {
    if (!where.count(m)) {
      lists.back().push_back(m);
      where[m] = S - 1;
    }
    VIADUCT_CHECK_T(ConfigError, where[m] == S - 1, kKeyFqns,
                    ": pinned module '", m, "' must be on the last stage (",
                    S - 1, "), not stage ", where[m]);
  }
  for (const auto& m : all) {
    VIADUCT_CHECK_T(ConfigError, where.count(m), kKeyFqns, ": module '", m,
                    "' is on no stage; every module must be on exactly one");
  }
  for (const auto& m : model.first_modules) {
    VIADUCT_CHECK_T(ConfigError, where[m] == 0, kKeyFqns, ": '", m,
                    "' must be on stage 0, not stage ", where[m]);
  }
  for (const auto& m : model.last_modules) {
    VIADUCT_CHECK_T(ConfigError, where[m] == S - 1, kKeyFqns, ": '", m,
                    "' must be on the last stage (", S - 1, "), not stage ",
                    where[m]);
  }
  int64_t next_layer = 0;
  for (int64_t s = 0; s < S; ++s) {
    auto& list = lists[s];
    VIADUCT_CHECK_T(ConfigError, !list.empty(), kKeyFqns, ": stage ", s,
                    " has no module");
    std::sort(list.begin(), list.end(), [&](const auto& a, const auto& b) {
      return order[a] < order[b];
    });
    for (const auto& fqn : list) {
      const int64_t li = layer_index(model, fqn);
      if (li < 0) continue;
      VIADUCT_CHECK_T(ConfigError, li == next_layer, kKeyFqns, ": stage ", s,
                      " holds '", fqn, "' but the next layer in order is '",
                      model.layer_prefix, next_layer,
                      "'; layers must be contiguous and in order across stages");
      ++next_layer;
    }
  }
  return lists;
}

void check_placement(const SplitSpec& spec, int64_t S) {
  if (spec.placement == Placement::kV) {
    VIADUCT_CHECK_T(ConfigError, S == 2 * spec.pp, "schedule ",
                    spec.rule.schedule_name,
                    " uses V placement, which needs exactly 2 stages per rank; got ",
                    S, " stages on ", spec.pp, " ranks");
  }
  if (spec.placement == Placement::kCustom) {
    VIADUCT_CHECK_T(ConfigError,
                    static_cast<int64_t>(spec.custom_stage_to_rank.size()) == S,
                    "the schedule places ", spec.custom_stage_to_rank.size(),
                    " stages but the split has ", S);
  }
}

}  // namespace

const char* placement_name(Placement p) {
  switch (p) {
    case Placement::kLoop: return "loop";
    case Placement::kV: return "v";
    case Placement::kCustom: return "custom";
  }
  return "?";
}

std::string closest_name(const std::string& name,
                         const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = ~size_t{0};
  auto lower = [](std::string s) {
    for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return s;
  };
  const std::string lname = lower(name);
  for (const auto& c : candidates) {
    // A candidate that contains the name ("ZBV" in "ZBVZeroBubble") wins.
    size_t d = edit_distance(name, c, /*ignore_case=*/true);
    if (lname.size() >= 2 && lower(c).find(lname) != std::string::npos) d = 0;
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

std::vector<std::string> ModelLayout::all_modules() const {
  std::vector<std::string> out = first_modules;
  out.insert(out.end(), pinned_first.begin(), pinned_first.end());
  auto layers = layer_names(*this, 0, n_layers);
  out.insert(out.end(), layers.begin(), layers.end());
  out.insert(out.end(), last_modules.begin(), last_modules.end());
  out.insert(out.end(), pinned_last.begin(), pinned_last.end());
  return out;
}

ModelLayout model_layout_from_fqns(const std::vector<std::string>& fqns) {
  ModelLayout out;
  out.first_modules.clear();
  out.last_modules.clear();
  size_t i = 0;
  while (i < fqns.size() && layer_index(out, fqns[i]) < 0) {
    (out.first_modules.empty() ? out.first_modules : out.pinned_first)
        .push_back(fqns[i]);
    ++i;
  }
  VIADUCT_CHECK_T(ConfigError, !out.first_modules.empty(),
                  "the model's module list does not start with an embedding "
                  "before 'layers.0'");
  int64_t n = 0;
  while (i < fqns.size() && layer_index(out, fqns[i]) >= 0) {
    VIADUCT_CHECK_T(ConfigError, layer_index(out, fqns[i]) == n,
                    "the model's module list has '", fqns[i],
                    "' where 'layers.", n, "' was expected");
    ++n;
    ++i;
  }
  out.n_layers = n;
  bool after_head = false;
  for (; i < fqns.size(); ++i) {
    VIADUCT_CHECK_T(ConfigError, layer_index(out, fqns[i]) < 0,
                    "the model's module list has layer '", fqns[i],
                    "' after the head");
    (after_head ? out.pinned_last : out.last_modules).push_back(fqns[i]);
    if (fqns[i] == "lm_head") after_head = true;
  }
  VIADUCT_CHECK_T(ConfigError, !out.last_modules.empty(),
                  "the model's module list has no head after its layers");
  return out;
}

bool split_feasible(int64_t n_layers, int64_t num_stages, int64_t first_weight,
                    int64_t last_weight) {
  if (num_stages < 1) return false;
  if (num_stages == 1) return true;
  const int64_t units = n_layers + first_weight + last_weight;
  const int64_t base = units / num_stages;
  return num_stages <= units && base > 0 && first_weight <= base &&
         last_weight <= base;
}

std::vector<std::vector<std::string>> generate_stage_modules(
    const ModelLayout& model, int64_t num_stages, int64_t first_stage_weight,
    int64_t last_stage_weight) {
  VIADUCT_CHECK_T(ConfigError, num_stages >= 1,
                  "a pipeline needs at least one stage, got ", num_stages);
  VIADUCT_CHECK_T(ConfigError, first_stage_weight >= 0 && last_stage_weight >= 0,
                  kKeyFirstWeight, " and ", kKeyLastWeight,
                  " must be >= 0, got ", first_stage_weight, " and ",
                  last_stage_weight);
  const int64_t L = model.n_layers;
  std::vector<std::vector<std::string>> out(num_stages);
  if (num_stages == 1) {
    out[0] = model.all_modules();
    return out;
  }
  VIADUCT_CHECK_T(ConfigError,
                  split_feasible(L, num_stages, first_stage_weight,
                                 last_stage_weight),
                  num_stages, " stages cannot split ", L, " layers with unit ",
                  "weights ", first_stage_weight, " (embedding) and ",
                  last_stage_weight, " (head)");
  const int64_t units = L + first_stage_weight + last_stage_weight;
  const int64_t base = units / num_stages;
  const int64_t extra = units % num_stages;
  int64_t layer = 0;
  for (int64_t s = 0; s < num_stages; ++s) {
    int64_t share = base + (s < extra ? 1 : 0);
    auto& mods = out[s];
    if (s == 0) {
      mods = model.first_modules;
      mods.insert(mods.end(), model.pinned_first.begin(), model.pinned_first.end());
      share -= first_stage_weight;
    } else if (s == num_stages - 1) {
      share -= last_stage_weight;
    }
    auto layers = layer_names(model, layer, layer + share);
    mods.insert(mods.end(), layers.begin(), layers.end());
    layer += share;
    if (s == num_stages - 1) {
      mods.insert(mods.end(), model.last_modules.begin(), model.last_modules.end());
      mods.insert(mods.end(), model.pinned_last.begin(), model.pinned_last.end());
    }
  }
  VIADUCT_CHECK(layer == L, "internal: the split placed ", layer, " of ", L,
                " layers");
  return out;
}

std::vector<int64_t> stage_to_rank_map(Placement placement, int64_t pp,
                                       int64_t num_stages) {
  VIADUCT_CHECK_T(ConfigError, pp >= 1 && num_stages % pp == 0, num_stages,
                  " stages do not divide over ", pp, " ranks");
  std::vector<int64_t> out(num_stages);
  for (int64_t s = 0; s < num_stages; ++s) {
    if (placement == Placement::kV) {
      VIADUCT_CHECK_T(ConfigError, num_stages == 2 * pp,
                      "V placement needs exactly 2 stages per rank, got ",
                      num_stages, " stages on ", pp, " ranks");
      out[s] = s < pp ? s : num_stages - 1 - s;
    } else {
      out[s] = s % pp;
    }
  }
  return out;
}

Split make_split(const SplitSpec& spec) {
  VIADUCT_CHECK_T(ConfigError, spec.pp >= 1, kKeyDegree, " must be >= 1, got ",
                  spec.pp);
  VIADUCT_CHECK_T(ConfigError, spec.model.n_layers >= 0,
                  "model.n_layers must be >= 0, got ", spec.model.n_layers);
  VIADUCT_CHECK_T(ConfigError, spec.first_stage_weight >= 0, kKeyFirstWeight,
                  " must be >= 0, got ", spec.first_stage_weight);
  VIADUCT_CHECK_T(ConfigError, spec.last_stage_weight >= 0, kKeyLastWeight,
                  " must be >= 0, got ", spec.last_stage_weight);
  std::vector<std::string> sources;
  if (spec.layers_per_stage) sources.push_back(kKeyLayersPerStage);
  if (spec.stages_per_rank) sources.push_back(kKeyStagesPerRank);
  if (spec.module_fqns_per_stage) sources.push_back(kKeyFqns);
  VIADUCT_CHECK_T(ConfigError, sources.size() <= 1,
                  "the stage count comes from exactly one of ",
                  kKeyLayersPerStage, ", ", kKeyStagesPerRank, " and ",
                  kKeyFqns, "; the config gives ", join_values(sources));

  Split split;
  split.pp = spec.pp;
  split.n_layers = spec.model.n_layers;
  split.placement = spec.placement;
  int64_t S = 0;
  if (spec.module_fqns_per_stage) {
    S = static_cast<int64_t>(spec.module_fqns_per_stage->size());
    VIADUCT_CHECK_T(ConfigError, S >= 1 && S % spec.pp == 0, kKeyFqns, " lists ",
                    S, " stages, not a multiple of ", kKeyDegree, " = ", spec.pp);
    VIADUCT_CHECK_T(ConfigError, rule_allows(spec.rule, S / spec.pp), kKeyFqns,
                    " lists ", S, " stages = ", S / spec.pp,
                    " per rank, but schedule ", spec.rule.schedule_name, " runs ",
                    rule_text(spec.rule), " stage(s) per rank");
    split.stage_modules = check_explicit_lists(spec, *spec.module_fqns_per_stage);
  } else {
    if (spec.layers_per_stage) {
      const int64_t k = *spec.layers_per_stage;
      VIADUCT_CHECK_T(ConfigError, k >= 1, kKeyLayersPerStage,
                      " must be >= 1, got ", k, "; ",
                      suggest_layers_per_stage(spec, 1));
      S = (units_of(spec) + k - 1) / k;
      const std::string problem = stage_count_problem(spec, S);
      VIADUCT_CHECK_T(ConfigError, problem.empty(), kKeyLayersPerStage, " = ", k,
                      " gives ", S, " stages for ", units_of(spec), " units (",
                      spec.model.n_layers, " layers + ", spec.first_stage_weight,
                      " + ", spec.last_stage_weight, "): ", problem, "; ",
                      suggest_layers_per_stage(spec, k));
    } else {
      const bool given = spec.stages_per_rank.has_value();
      const int64_t v = given ? *spec.stages_per_rank : spec.rule.default_value;
      VIADUCT_CHECK_T(ConfigError, v >= 1, kKeyStagesPerRank,
                      " must be >= 1, got ", v, "; ",
                      suggest_stages_per_rank(spec, 1));
      S = spec.pp * v;
      const std::string problem = stage_count_problem(spec, S);
      VIADUCT_CHECK_T(ConfigError, problem.empty(),
                      given ? str(kKeyStagesPerRank, " = ", v)
                            : str("schedule ", spec.rule.schedule_name,
                                  "'s default of ", v, " stage(s) per rank"),
                      " gives ", S, " stages on ", spec.pp, " ranks: ", problem,
                      "; ", suggest_stages_per_rank(spec, v));
    }
    split.stage_modules = generate_stage_modules(
        spec.model, S, spec.first_stage_weight, spec.last_stage_weight);
  }
  split.num_stages = S;
  split.stages_per_rank = S / spec.pp;
  check_placement(spec, S);
  split.stage_to_rank = spec.placement == Placement::kCustom
                            ? spec.custom_stage_to_rank
                            : stage_to_rank_map(spec.placement, spec.pp, S);
  split.rank_to_stages.assign(spec.pp, {});
  for (int64_t s = 0; s < S; ++s) {
    const int64_t r = split.stage_to_rank[s];
    VIADUCT_CHECK_T(ConfigError, r >= 0 && r < spec.pp, "stage ", s,
                    " is placed on rank ", r, ", outside 0..", spec.pp - 1);
    split.rank_to_stages[r].push_back(s);
  }
  for (int64_t r = 0; r < spec.pp; ++r) {
    VIADUCT_CHECK_T(ConfigError, !split.rank_to_stages[r].empty(), "rank ", r,
                    " holds no stage");
  }
  split.layer_to_stage.assign(spec.model.n_layers, -1);
  for (int64_t s = 0; s < S; ++s) {
    int64_t first = -1, end = -1;
    for (const auto& fqn : split.stage_modules[s]) {
      const int64_t li = layer_index(spec.model, fqn);
      if (li < 0 || li >= spec.model.n_layers) continue;
      split.layer_to_stage[li] = s;
      if (first < 0) first = li;
      end = li + 1;
    }
    if (first < 0) {
      // No layer: an empty range at the position the stream passes through.
      const int64_t at = s == 0 ? 0 : split.stage_layers[s - 1].second;
      split.stage_layers.emplace_back(at, at);
    } else {
      split.stage_layers.emplace_back(first, end);
    }
  }
  for (int64_t l = 0; l < spec.model.n_layers; ++l) {
    VIADUCT_CHECK(split.layer_to_stage[l] >= 0, "internal: layer ", l,
                  " landed on no stage");
  }
  return split;
}

}  // namespace viaduct::pipeline
