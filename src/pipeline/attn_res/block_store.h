// RankBlockStore: one per rank, shared by the rank's AttnRes stages. Holds
// the stack entries (see Note [AttnRes stack entries] in block_layout.h) a later
// stage of the rank reads, per micro-batch, and the gradient deposits those
// readers leave for the entry's owner.
//
// Note [Rank block store lifetimes]
// A block is put by the stage that received or committed it and read by each
// later stage of the rank; it is released right after the rank's last stage
// forward of that micro-batch (no forward reads it after that, and the
// backward never does: its gradient travels through the deposits). A
// gradient slot lives from the first deposit until the owner collects it
// before its own backward; collect checks the count the tables predict. The
// step-end sweep reports whatever is left. Every stored block is detached,
// so offloading it (pinned host memory, copies on the current stream, which
// orders them after the producer and before the reader) changes no value.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "pipeline/attn_res/block_layout.h"

namespace viaduct::pipeline {

class RankBlockStore {
 public:
  RankBlockStore(int64_t rank, const BlockLayoutTables& tables, bool offload);

  int64_t rank() const { return rank_; }
  bool offload() const { return offload_; }

  // Keeps `block` ([B, T, D], detached here) for (mb, entry). `stage`: the
  // putting stage, for messages.
  void put(int64_t stage, int64_t mb, int64_t entry, const at::Tensor& block);
  // The block on `device`; an Error naming stage, micro-batch and entry when
  // it is not held.
  at::Tensor get(int64_t stage, int64_t mb, int64_t entry, at::Device device) const;
  // Drops the micro-batch's blocks (gradient slots stay).
  void release(int64_t mb);

  // A reader's gradient contribution for (mb, entry).
  void deposit(int64_t stage, int64_t mb, int64_t entry, const at::Tensor& grad);
  // The owner's collection: the deposits summed in arrival order. Throws when
  // their count differs from the tables' expected_deposits(rank, entry).
  at::Tensor collect(int64_t stage, int64_t mb, int64_t entry);

  // Step end: throws naming every block or slot still held, then empties.
  void sweep(const std::string& what);
  void clear();

  // Bytes held now and the peak since reset_peak() (blocks + slots), and the
  // part of the peak that sat on an accelerator.
  int64_t bytes() const { return bytes_; }
  int64_t peak_bytes() const { return peak_bytes_; }
  int64_t peak_device_bytes() const { return peak_device_bytes_; }
  void reset_peak() {
    peak_bytes_ = bytes_;
    peak_device_bytes_ = device_bytes_;
  }

 private:
  using Key = std::pair<int64_t, int64_t>;  // (micro-batch, entry)
  struct Slot {
    std::vector<at::Tensor> grads;
  };
  void account(const at::Tensor& t, int sign);

  int64_t rank_;
  const BlockLayoutTables& tables_;
  bool offload_;
  std::map<Key, at::Tensor> blocks_;
  std::map<Key, Slot> slots_;
  int64_t bytes_ = 0, device_bytes_ = 0;
  int64_t peak_bytes_ = 0, peak_device_bytes_ = 0;
};

}  // namespace viaduct::pipeline
