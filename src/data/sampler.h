// The training sampler, the eval loader and micro-batching.
//
// Note [Windows and the data cursor]
// The token stream is cut into W = (N - 1) / T contiguous windows of T + 1
// tokens; window w covers tokens [w T, w T + T] (neighbours share one token),
// its first T tokens are the inputs and its last T the targets. An epoch
// visits the windows in order (or, with shuffle, in a permutation drawn from
// (seed, epoch) by our own splitmix64 Fisher-Yates, identical on every
// platform). A global step takes the next B x dp_size windows of that order;
// dp rank r takes the r-th run of B of them, so the ranks' batches are
// disjoint and, stacked in rank order, are exactly the batch of one rank with
// B x dp_size rows. The windows left over at the end of an epoch (fewer than
// one global step) are skipped. The cursor is (epoch, position): position
// counts the windows of the epoch's order already handed out by all ranks,
// so it does not depend on the dp layout, and a restored sampler continues
// the stream exactly.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/token_file.h"

namespace viaduct::data {

struct TokenBatch {
  at::Tensor inputs;   // [B, T] int64, CPU
  at::Tensor targets;  // [B, T] int64, CPU: inputs shifted left by one token
};

// Where the sampler stands, plus what it needs to check a restore against.
struct DataCursor {
  int64_t epoch = 0;
  int64_t position = 0;  // windows of this epoch already taken (all ranks)
  // The sampler that wrote it; a restore into a different one is refused.
  int64_t seq_len = 0;
  int64_t num_windows = 0;
  bool shuffle = false;
  uint64_t seed = 0;

  // One-line JSON object, e.g. {"epoch":0,"position":96,...}.
  std::string to_json() const;
  // Throws FileError on malformed text or missing fields.
  static DataCursor from_json(const std::string& text);
  bool operator==(const DataCursor&) const = default;
};

struct SamplerOptions {
  int64_t batch_size = 1;  // local B, rows per dp rank
  int64_t seq_len = 1;     // T
  int64_t dp_rank = 0;
  int64_t dp_size = 1;
  uint64_t seed = 0;  // used only with shuffle
  bool shuffle = false;
};

class TokenSampler {
 public:
  TokenSampler(std::shared_ptr<const TokenStream> tokens,
               const SamplerOptions& options);

  // This rank's next batch; advances the cursor by one global step (and into
  // the next epoch when the current one has no full step left).
  TokenBatch next();

  // The state before the next call of next(): store it in the checkpoint.
  DataCursor cursor() const;
  // Continue from a stored cursor. Refused (Error) when it was written with a
  // different seq_len, data size, shuffle or seed.
  void restore(const DataCursor& cursor);

  int64_t num_windows() const { return num_windows_; }
  // Global steps in one epoch: num_windows / (B x dp_size).
  int64_t steps_per_epoch() const;
  // The window the epoch's order puts at `index` (0 <= index < num_windows).
  int64_t window_at(int64_t epoch, int64_t index);
  const SamplerOptions& options() const { return options_; }

 private:
  void load_epoch(int64_t epoch);

  std::shared_ptr<const TokenStream> tokens_;
  SamplerOptions options_;
  int64_t num_windows_ = 0;
  int64_t epoch_ = 0;
  int64_t position_ = 0;
  int64_t order_epoch_ = -1;    // the epoch order_ holds
  std::vector<int64_t> order_;  // the epoch's permutation; empty = in order
};

// Held-out batches: always the first num_batches global steps of the eval
// stream, in order, so every eval sees the same tokens. Rank r's batch i is
// windows [(i dp_size + r) B, (i dp_size + r + 1) B). When the stream is too
// short, num_batches is lowered (with a warning) to what fits.
class EvalLoader {
 public:
  // options.shuffle and options.seed are ignored.
  EvalLoader(std::shared_ptr<const TokenStream> tokens,
             const SamplerOptions& options, int64_t num_batches);

  int64_t num_batches() const { return num_batches_; }
  // This rank's eval batch i, 0 <= i < num_batches().
  TokenBatch batch(int64_t i) const;
  std::vector<TokenBatch> batches() const;

 private:
  std::shared_ptr<const TokenStream> tokens_;
  SamplerOptions options_;
  int64_t num_batches_ = 0;
};

// Reads windows into a batch: row b holds window window_ids[b].
TokenBatch read_windows(const TokenStream& tokens,
                        const std::vector<int64_t>& window_ids,
                        int64_t seq_len);

// Splits a [B, ...] tensor into n micro-batches of B / n rows along dim 0
// (views). B must be divisible by n.
std::vector<at::Tensor> split_microbatches(const at::Tensor& batch, int64_t n);
std::vector<TokenBatch> split_microbatches(const TokenBatch& batch, int64_t n);

}  // namespace viaduct::data
