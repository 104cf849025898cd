// Which AttnRes stack entries each pipeline stage receives, reads from its
// rank's store, commits, and whose gradient deposits it collects: a pure
// function of the split, the stage->rank map and the block size.
//
// Note [AttnRes stack entries]
// The stack a Kimi-K3 layer reads is [e_0 = embedding, e_1, ...]; entry n is
// pushed by the first layer of block n (layer n K), so a stage with layers
// [f, e) receives ceil(f / K) entries and hands on ceil(e / K). It "commits"
// the entries it pushes, [ceil(f / K), ceil(e / K)). The stream `hidden`
// always travels as well: it is the open block's partial sum, or the block
// just completed when the next layer opens one (the receiver pushes it).
//
// Note [AttnRes transports]
// Whole stack: every hop carries every entry; nothing is stored.
// Rank cache: rank r keeps, per micro-batch, every entry it received or
// committed that a later stage of r reads. A hop to stage s carries only the
// entries the rank of s does not hold yet: [ceil(e_p / K), ceil(f_s / K)) where
// e_p ends the rank's previous stage -- after the rank's first stage, the
// blocks completed since then. A stage reads the held entries from the store
// and deposits their gradients there; the stage that put an entry in the
// store (its owner on the rank) collects one deposit per later stage of the
// rank before its own backward. The cache needs contiguous splits and loop
// placement; both are checked.
//
// Note [AttnRes cache backward]
// The rank cache's forward routing leaves two ways to run its backward.
// Deposit (default): as above; a block's gradient contributions from the
// stages of one rank are summed in the store before they join the running
// sum, so the additions are grouped by rank and on real floats the last bits
// can differ from one process. Whole stack: no deposits; the gradient hop
// into stage s carries hidden's gradient and the running sum of every entry
// of s's stack, [0, entries_in), exactly as the whole-stack transport does,
// so each block's contributions are added stage by stage in reverse stage
// order -- one process's order and bits. The forward still ships only the
// delta: routing a gradient needs no block values, and every stage already
// holds each entry of its stack as an autograd leaf (from the store or the
// hop) and hands it on as an output (see Note [Kimi-K3 part activations]), so
// a running sum can pass through a stage whichever way its forward value
// arrived. The cost is the whole stack's bytes on the backward hops; the
// store then holds blocks only, no gradient slots.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "pipeline/schedule/schedule.h"
#include "pipeline/split/split.h"

namespace viaduct::pipeline {

enum class AttnResTransport { kRankCache, kWholeStack };
const char* transport_name(AttnResTransport t);
// parallelism.attn_res_cache_backward (see Note [AttnRes cache backward]).
enum class AttnResCacheBackward { kDeposit, kWholeStack };
const char* cache_backward_name(AttnResCacheBackward b);  // "deposit", "whole_stack"
// The config value's enum; ConfigError naming the key for anything else.
AttnResCacheBackward cache_backward_from_name(const std::string& name);

struct StageBlockLayout {
  int64_t stage_id = 0;
  int64_t rank = 0;
  int64_t first_layer = 0, end_layer = 0;  // [first, end)
  int64_t entries_in = 0;   // stack entries its first layer expects
  int64_t entries_out = 0;  // stack entries it hands on
  // Entries, ascending.
  std::vector<int64_t> received;   // arrive with the hop (after `hidden`)
  std::vector<int64_t> read;       // come from the rank store
  std::vector<int64_t> committed;  // pushed by this stage's layers
  std::vector<int64_t> stored;     // put in the rank store (received or
                                   // committed, read by a later stage here);
                                   // this stage collects their deposits
  bool releases = false;  // the rank's last stage: frees the micro-batch's
                          // blocks right after its forward
  // Backward (see Note [AttnRes cache backward]).
  std::vector<int64_t> returned;   // entries whose gradients go back over the
                                   // hop into this stage (after hidden's):
                                   // `received`, or [0, entries_in) with the
                                   // whole-stack backward
  std::vector<int64_t> deposited;  // read entries whose gradients it deposits
  std::vector<int64_t> collected;  // stored entries whose deposits it collects
  // Tensors in the hop that arrives at this stage: hidden + received.
  int64_t hop_tensors() const {
    return stage_id == 0 ? 0 : 1 + static_cast<int64_t>(received.size());
  }
  // Tensors its backward sends back over that hop: hidden + returned.
  int64_t grad_hop_tensors() const {
    return stage_id == 0 ? 0 : 1 + static_cast<int64_t>(returned.size());
  }
};

struct BlockLayoutTables {
  AttnResTransport transport = AttnResTransport::kRankCache;
  // The whole-stack transport's backward is always kWholeStack.
  AttnResCacheBackward backward = AttnResCacheBackward::kDeposit;
  int64_t block_size = 0;
  int64_t n_layers = 0;
  int64_t n_entries = 0;  // ceil(n_layers / K): entries the head reads
  std::vector<StageBlockLayout> stages;  // by stage id
  // (rank, entry) -> gradient deposits its owner collects per micro-batch.
  std::map<std::pair<int64_t, int64_t>, int64_t> deposits;

  const StageBlockLayout& stage(int64_t s) const { return stages.at(static_cast<size_t>(s)); }
  int64_t expected_deposits(int64_t rank, int64_t entry) const;
  // Tensors (hidden + entries) on the hop s -> s + 1, forward and backward.
  int64_t hop_tensors(int64_t s) const { return stage(s + 1).hop_tensors(); }
  int64_t grad_hop_tensors(int64_t s) const { return stage(s + 1).grad_hop_tensors(); }
};

// `stage_layers[s]`: stage s's layers [first, end); `stage_to_rank[s]` its
// rank. Throws ConfigError (naming parallelism.attn_res_cache) for a
// non-contiguous split or a non-loop placement with the cache. `backward`
// applies to the rank cache; the whole stack ignores it.
BlockLayoutTables make_block_layout_tables(
    const std::vector<std::pair<int64_t, int64_t>>& stage_layers,
    const std::vector<int64_t>& stage_to_rank, int64_t pp, int64_t block_size,
    int64_t n_layers, AttnResTransport transport,
    AttnResCacheBackward backward = AttnResCacheBackward::kDeposit);
BlockLayoutTables make_block_layout_tables(
    const Split& split, int64_t block_size, AttnResTransport transport,
    AttnResCacheBackward backward = AttnResCacheBackward::kDeposit);

// The store's peak occupancy on `rank`, in entries of one micro-batch
// ([B/M, T, D] each), walking the rank's compute actions in order: blocks
// from their store to the release after the rank's last stage forward,
// gradient slots from a reader's B/I to its owner's B/I.
struct StorePeak {
  int64_t blocks = 0;       // at the moment of the total's peak
  int64_t grad_slots = 0;
  int64_t total = 0;
};
StorePeak predict_store_peak(const BlockLayoutTables& tables,
                             const Schedule& compute, int64_t rank);

// Multi-line summary (for `viaduct plan` and error messages).
std::string describe(const BlockLayoutTables& tables);

}  // namespace viaduct::pipeline
