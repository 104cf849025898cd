// BlockLayoutTables (see Note [AttnRes stack entries], see Note [AttnRes transports]).
#include "pipeline/attn_res/block_layout.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "core/check.h"

namespace viaduct::pipeline {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::vector<int64_t> range(int64_t begin, int64_t end) {
  std::vector<int64_t> out;
  for (int64_t n = begin; n < end; ++n) out.push_back(n);
  return out;
}

std::string join(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? " " : "") << v[i];
  os << "]";
  return os.str();
}

}  // namespace

const char* transport_name(AttnResTransport t) {
  return t == AttnResTransport::kRankCache ? "rank cache" : "whole stack";
}

const char* cache_backward_name(AttnResCacheBackward b) {
  return b == AttnResCacheBackward::kDeposit ? "deposit" : "whole_stack";
}

AttnResCacheBackward cache_backward_from_name(const std::string& name) {
  if (name == "deposit") return AttnResCacheBackward::kDeposit;
  if (name == "whole_stack") return AttnResCacheBackward::kWholeStack;
  throw ConfigError(str("parallelism.attn_res_cache_backward must be \"deposit\" (gradients "
                        "of stored blocks summed per rank in the store) or \"whole_stack\" "
                        "(every backward hop carries the whole stack's gradients: one "
                        "process's bits), got '", name, "'"));
}

int64_t BlockLayoutTables::expected_deposits(int64_t rank, int64_t entry) const {
  auto it = deposits.find({rank, entry});
  return it == deposits.end() ? 0 : it->second;
}

BlockLayoutTables make_block_layout_tables(
    const std::vector<std::pair<int64_t, int64_t>>& stage_layers,
    const std::vector<int64_t>& stage_to_rank, int64_t pp, int64_t block_size,
    int64_t n_layers, AttnResTransport transport, AttnResCacheBackward backward) {
  const bool cache = transport == AttnResTransport::kRankCache;
  const bool deposit = cache && backward == AttnResCacheBackward::kDeposit;
  const int64_t S = static_cast<int64_t>(stage_layers.size());
  VIADUCT_CHECK_T(ConfigError, block_size > 0,
                  "model.attn_res_block_size must be > 0, got ", block_size);
  VIADUCT_CHECK_T(ConfigError, S >= 1 && stage_to_rank.size() == stage_layers.size(),
                  "AttnRes block layout: ", S, " stages but ", stage_to_rank.size(),
                  " stage->rank entries");
  // The stack arriving at a stage is a function of its first layer only when
  // the stages cover the layers in order.
  int64_t expect = 0;
  for (int64_t s = 0; s < S; ++s) {
    const auto [f, e] = stage_layers[static_cast<size_t>(s)];
    VIADUCT_CHECK_T(ConfigError, f == expect && e >= f,
                    "the AttnRes pipeline needs a contiguous split: stage ", s,
                    " holds layers [", f, ", ", e, ") but the previous stage ends at layer ",
                    expect, " (parallelism.module_fqns_per_model_part must list the "
                    "layers in order, each stage continuing where the last stopped)");
    expect = e;
  }
  VIADUCT_CHECK_T(ConfigError, expect == n_layers, "the AttnRes pipeline's split covers ",
                  expect, " of the model's ", n_layers, " layers");
  if (cache) {
    for (int64_t s = 0; s < S; ++s) {
      VIADUCT_CHECK_T(ConfigError, stage_to_rank[static_cast<size_t>(s)] == s % pp,
                      "parallelism.attn_res_cache = true needs loop placement (rank r "
                      "holds stages r, r + pp, ...), but stage ", s, " runs on rank ",
                      stage_to_rank[static_cast<size_t>(s)],
                      " (a V schedule such as ZBVZeroBubble / DualPipeV, or a CSV "
                      "placement); use a looped schedule (Interleaved1F1B, "
                      "LoopedBFS, InterleavedZeroBubble) or set "
                      "parallelism.attn_res_cache = false (whole stack on every hop)");
    }
  }

  BlockLayoutTables t;
  t.transport = transport;
  t.backward = deposit ? AttnResCacheBackward::kDeposit : AttnResCacheBackward::kWholeStack;
  t.block_size = block_size;
  t.n_layers = n_layers;
  t.n_entries = ceil_div(n_layers, block_size);
  std::map<int64_t, int64_t> held_end;  // rank -> entries held so far
  std::map<int64_t, int64_t> last_stage;  // rank -> its last stage
  std::map<int64_t, int64_t> stages_left;  // rank -> stages after the current
  for (int64_t s = 0; s < S; ++s) {
    const auto r = stage_to_rank[static_cast<size_t>(s)];
    last_stage[r] = s;
    ++stages_left[r];
  }
  for (int64_t s = 0; s < S; ++s) {
    StageBlockLayout l;
    l.stage_id = s;
    l.rank = stage_to_rank[static_cast<size_t>(s)];
    l.first_layer = stage_layers[static_cast<size_t>(s)].first;
    l.end_layer = stage_layers[static_cast<size_t>(s)].second;
    l.entries_in = ceil_div(l.first_layer, block_size);
    l.entries_out = ceil_div(l.end_layer, block_size);
    l.committed = range(l.entries_in, l.entries_out);
    l.releases = last_stage[l.rank] == s;
    --stages_left[l.rank];
    if (!cache) {
      if (s > 0) l.received = range(0, l.entries_in);
    } else {
      const int64_t held = std::min(held_end[l.rank], l.entries_in);
      l.read = range(0, held);
      if (s > 0) l.received = range(held, l.entries_in);
      if (stages_left[l.rank] > 0) {
        l.stored = l.received;
        l.stored.insert(l.stored.end(), l.committed.begin(), l.committed.end());
      }
      held_end[l.rank] = l.entries_out;
    }
    // See Note [AttnRes cache backward].
    if (deposit) {
      l.returned = l.received;
      l.deposited = l.read;
      l.collected = l.stored;
      for (int64_t n : l.collected) t.deposits[{l.rank, n}] = stages_left[l.rank];
    } else if (s > 0) {
      l.returned = range(0, l.entries_in);
    }
    t.stages.push_back(std::move(l));
  }
  return t;
}

BlockLayoutTables make_block_layout_tables(const Split& split, int64_t block_size,
                                           AttnResTransport transport,
                                           AttnResCacheBackward backward) {
  if (transport == AttnResTransport::kRankCache) {
    VIADUCT_CHECK_T(ConfigError, split.placement != Placement::kV,
                    "parallelism.attn_res_cache = true needs loop placement, but the "
                    "schedule places stages in a V (rank r holds r and S-1-r); use a "
                    "looped schedule or set parallelism.attn_res_cache = false");
  }
  return make_block_layout_tables(split.stage_layers, split.stage_to_rank, split.pp,
                                  block_size, split.n_layers, transport, backward);
}

StorePeak predict_store_peak(const BlockLayoutTables& t, const Schedule& compute,
                             int64_t rank) {
  // (mb) -> stored blocks; (mb, entry) -> deposits waiting.
  std::map<int64_t, int64_t> blocks;
  std::map<std::pair<int64_t, int64_t>, int64_t> slots;
  StorePeak peak;
  auto total = [&] {
    int64_t b = 0, g = 0;
    for (const auto& [mb, n] : blocks) b += n;
    for (const auto& [k, n] : slots) g += n;
    if (b + g > peak.total) peak = StorePeak{b, g, b + g};
  };
  for (const auto& a : compute.ranks.at(static_cast<size_t>(rank))) {
    for (const auto& leaf : leaf_actions(a)) {
      const auto& l = t.stage(leaf.stage);
      const int64_t mb = leaf.microbatch;
      if (leaf.kind == ActionKind::kForward) {
        blocks[mb] += static_cast<int64_t>(l.stored.size());
        total();
        if (l.releases) blocks.erase(mb);
      } else if (leaf.kind == ActionKind::kBackward ||
                 leaf.kind == ActionKind::kBackwardInput) {
        for (int64_t n : l.collected) slots.erase({mb, n});
        for (int64_t n : l.deposited) ++slots[{mb, n}];
        total();
      }
    }
  }
  return peak;
}

std::string describe(const BlockLayoutTables& t) {
  std::ostringstream os;
  os << "AttnRes " << transport_name(t.transport);
  if (t.transport == AttnResTransport::kRankCache) {
    os << " (backward: " << cache_backward_name(t.backward) << ")";
  }
  os << ": " << t.n_layers << " layers, blocks of " << t.block_size << ", " << t.n_entries
     << " stack entries before the head\n";
  for (const auto& l : t.stages) {
    os << "  stage " << l.stage_id << " (rank " << l.rank << ", layers [" << l.first_layer
       << ", " << l.end_layer << ")): receives " << join(l.received) << ", reads "
       << join(l.read) << ", commits " << join(l.committed) << ", stores "
       << join(l.stored) << (l.releases ? ", releases" : "") << "; gradients back "
       << join(l.returned) << ", deposits " << join(l.deposited) << ", collects "
       << join(l.collected) << "\n";
  }
  return os.str();
}

}  // namespace viaduct::pipeline
