// The training sampler, the eval loader and micro-batching.
//
// Note [Windows and the data cursor]
// A token stream is cut into W = (N - 1) / T contiguous windows of T + 1
// tokens; window w covers tokens [w T, w T + T] (neighbours share one token),
// its first T tokens are the inputs and its last T the targets. An epoch
// visits the windows in order (or, with shuffle, in a permutation drawn from
// (seed, source, epoch) by our own splitmix64 Fisher-Yates, identical on
// every platform).
//
// The sampler reads one or several sources (data.path, or the blend of
// data.paths with data.weights), each a stream with its own windows, its own
// epochs and a normalised weight w_s. The windows it hands out form one
// global sequence of slots; slot i goes to the source with the largest
// w_s (i + 1) - c_s, c_s the slots source s took before i, ties to the lower
// index (Megatron's blend rule). Every prefix of n slots so takes at most
// ceil(w_s n) windows of each source, and with two sources exactly floor or
// ceil. A global step takes the next G = B x dp_size slots; source s serves
// the n_s of them that are its with the next n_s windows of its epoch's
// order, and when its epoch has fewer left it begins its next epoch (the
// leftover is skipped). A source must hold ceil(w_s G) windows; in the rare
// step that asks one more of a source that holds no more, it wraps within
// the step. dp
// rank r takes the r-th run of B slots, so the ranks' batches are disjoint
// and, stacked in rank order, are exactly the batch of one rank with
// B x dp_size rows: the sequence depends on the sources, weights, T, seed,
// shuffle and G, never on the dp layout. One source (weight 1) is the plain
// case: every slot is its, and the windows left at the end of an epoch, fewer
// than one global step, are skipped.
//
// The cursor holds, per source, (epoch, position, taken): position counts
// the windows of the epoch's order already handed out by all ranks, taken
// the source's slots since the start (the blend rule's c_s). With the
// sources' window counts and shares, which a restore checks, it continues
// the sequence exactly. One source writes the single-stream JSON of earlier
// versions plus "taken", and their cursors still load.
//
// Note [Image-text rows]
// An image-text file (image_text_file.h) is a source whose windows are its
// records: window w is record w whatever seq_len is. Its row is the image's
// P placeholder tokens (SamplerOptions::image_tokens of
// SamplerOptions::image_token_id, one per patch of the vision tower) and
// then the caption (its tokens and the end of text), cut at T + 1 tokens;
// inputs are the first T of those and targets the next token at each place,
// with -100 wherever the next token is a placeholder or past the caption, so
// the loss counts the caption's tokens only -- the first of them predicted
// from the image alone. The batch's images come with it, [B, 1, C, S, S]
// uint8, one per row. Epochs, shuffling, the blend rule and the cursor are
// those of token windows. The sources of one sampler are all image-text or
// all tokens: every row of a batch has its image or none has.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/image_text_file.h"
#include "data/token_file.h"

namespace viaduct::data {

struct TokenBatch {
  at::Tensor inputs;   // [B, T] int64, CPU
  at::Tensor targets;  // [B, T] int64, CPU: inputs shifted left by one token
  // [B, 1, C, S, S] uint8, CPU, for image-text data (see Note [Image-text
  // rows]); undefined for token data.
  at::Tensor images;
};

// Where one source of the sampler stands, plus what a restore checks.
struct SourceCursor {
  int64_t epoch = 0;
  int64_t position = 0;  // windows of this epoch already taken (all ranks)
  int64_t taken = 0;     // slots this source has served since the start
  int64_t num_windows = 0;
  double share = 1.0;    // the normalised weight
  std::string path;      // the source's spec, for messages (not checked)
  bool operator==(const SourceCursor&) const = default;
};

// Where the sampler stands, plus what it needs to check a restore against.
struct DataCursor {
  std::vector<SourceCursor> sources;  // one per source, in order
  // The sampler that wrote it; a restore into a different one is refused.
  int64_t seq_len = 0;
  bool shuffle = false;
  uint64_t seed = 0;

  // One-line JSON object. One source: {"epoch":0,"position":96,
  // "num_windows":..,"seq_len":..,"shuffle":..,"seed":..,"taken":..} (the
  // single-stream form; "taken" may be missing). A blend: {"seq_len":..,
  // "shuffle":..,"seed":..,"sources":[{"path":..,"num_windows":..,
  // "share":..,"epoch":..,"position":..,"taken":..},...]}.
  std::string to_json() const;
  // Throws FileError on malformed text or missing fields.
  static DataCursor from_json(const std::string& text);
  bool operator==(const DataCursor&) const = default;
};

// One token source of the sampler and its weight (> 0; the sampler
// normalises the weights of all its sources).
struct DataSource {
  std::string path;  // the spec it was opened from (a file or a glob)
  std::shared_ptr<const TokenStream> tokens;  // token data, or
  double weight = 1.0;
  std::shared_ptr<const ImageTextFile> images;  // image-text data
  // The stream's or the file's description, for messages.
  std::string describe() const;
};

// Opens each spec (a file or a glob: open_token_stream; an image-text file,
// found by its magic, as image-text data) as one source with
// its weight; `weights` empty means 1 each. `key` names the config key
// ("data.paths") in errors: a spec that matches no file or cannot be read
// is a FileError naming key[i] and the spec.
std::vector<DataSource> open_data_sources(const std::string& key,
                                          const std::vector<std::string>& specs,
                                          const std::vector<double>& weights,
                                          const std::string& format);

struct SamplerOptions {
  int64_t batch_size = 1;  // local B, rows per dp rank
  int64_t seq_len = 1;     // T
  int64_t dp_rank = 0;
  int64_t dp_size = 1;
  uint64_t seed = 0;  // used only with shuffle
  bool shuffle = false;
  // Image-text data (see Note [Image-text rows]): placeholders before each
  // caption and their id; 0 for a model without a vision tower, which
  // refuses image-text data.
  int64_t image_tokens = 0;
  int64_t image_token_id = -1;
};

class TokenSampler {
 public:
  // One stream (weight 1).
  TokenSampler(std::shared_ptr<const TokenStream> tokens,
               const SamplerOptions& options);
  // A blend of one or more sources.
  TokenSampler(std::vector<DataSource> sources, const SamplerOptions& options);

  // This rank's next batch; advances the cursor by one global step (each
  // source into its next epoch when the current one cannot serve its slots).
  TokenBatch next();

  // The state before the next call of next(): store it in the checkpoint.
  DataCursor cursor() const;
  // Continue from a stored cursor. Refused (Error) when it was written with a
  // different seq_len, shuffle or seed, other sources (their number or
  // window counts) or other weights.
  void restore(const DataCursor& cursor);

  size_t num_sources() const { return sources_.size(); }
  const DataSource& source(size_t s) const { return sources_.at(s).data; }
  // The normalised weight of source s: its share of the slots.
  double share(size_t s) const { return sources_.at(s).share; }
  int64_t num_windows(size_t s = 0) const { return sources_.at(s).num_windows; }
  // Full global steps in one epoch of source s at its share:
  // floor(num_windows / (share x B x dp_size)); for a blend the mean.
  int64_t steps_per_epoch(size_t s = 0) const;
  // The window the epoch's order of source s puts at `index`
  // (0 <= index < num_windows(s)).
  int64_t window_at(int64_t epoch, int64_t index, size_t s = 0);
  // One line: each source with its tokens, windows and share.
  std::string describe() const;
  const SamplerOptions& options() const { return options_; }

 private:
  struct Source {
    DataSource data;
    double share = 1.0;
    int64_t num_windows = 0;
    int64_t epoch = 0;
    int64_t position = 0;
    int64_t taken = 0;
    int64_t order_epoch = -1;    // the epoch order holds
    std::vector<int64_t> order;  // the epoch's permutation; empty = in order
  };
  void load_epoch(Source& source, size_t index, int64_t epoch);

  std::vector<Source> sources_;
  SamplerOptions options_;
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
  // Image-text data: its records in order (see Note [Image-text rows]).
  EvalLoader(std::shared_ptr<const ImageTextFile> images,
             const SamplerOptions& options, int64_t num_batches);

  int64_t num_batches() const { return num_batches_; }
  // This rank's eval batch i, 0 <= i < num_batches().
  TokenBatch batch(int64_t i) const;
  std::vector<TokenBatch> batches() const;

 private:
  void init(int64_t num_batches);
  DataSource source_;
  SamplerOptions options_;
  int64_t num_batches_ = 0;
};

// Reads windows into a batch: row b holds window window_ids[b].
TokenBatch read_windows(const TokenStream& tokens,
                        const std::vector<int64_t>& window_ids,
                        int64_t seq_len);
// Image-text records into a batch (see Note [Image-text rows]): row b holds
// record ids[b] after `image_tokens` placeholders `image_token_id`.
TokenBatch read_image_rows(const ImageTextFile& file, const std::vector<int64_t>& ids,
                           int64_t seq_len, int64_t image_tokens, int64_t image_token_id);

// Splits a [B, ...] tensor into n micro-batches of B / n rows along dim 0
// (views). B must be divisible by n.
std::vector<at::Tensor> split_microbatches(const at::Tensor& batch, int64_t n);
std::vector<TokenBatch> split_microbatches(const TokenBatch& batch, int64_t n);

}  // namespace viaduct::data
