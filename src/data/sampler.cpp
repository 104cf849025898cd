// TokenSampler, EvalLoader and micro-batching (see Note [Windows and the data
// cursor] in sampler.h).
#include "data/sampler.h"

#include <nlohmann/json.hpp>
#include <numeric>

#include "core/check.h"
#include "core/log.h"

namespace viaduct::data {

namespace {

// splitmix64: a tiny, fully specified generator, so a shuffled epoch is the
// same permutation with every compiler and standard library.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound), unbiased (Lemire's multiply-and-reject).
  uint64_t below(uint64_t bound) {
    __uint128_t m = static_cast<__uint128_t>(next()) * bound;
    auto low = static_cast<uint64_t>(m);
    if (low < bound) {
      uint64_t threshold = (0 - bound) % bound;
      while (low < threshold) {
        m = static_cast<__uint128_t>(next()) * bound;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }
};

void check_options(const SamplerOptions& o, const std::string& what) {
  VIADUCT_CHECK_T(ConfigError, o.batch_size >= 1, what,
                  ": training.local_batch_size must be >= 1, got ",
                  o.batch_size);
  VIADUCT_CHECK_T(ConfigError, o.seq_len >= 1, what,
                  ": training.seq_len must be >= 1, got ", o.seq_len);
  VIADUCT_CHECK(o.dp_size >= 1 && o.dp_rank >= 0 && o.dp_rank < o.dp_size, what,
                ": dp rank ", o.dp_rank, " is not in [0, ", o.dp_size, ")");
}

int64_t windows_in(const TokenStream& tokens, int64_t seq_len) {
  return tokens.size() > 0 ? (tokens.size() - 1) / seq_len : 0;
}

}  // namespace

// ---------------------------------------------------------------- DataCursor

std::string DataCursor::to_json() const {
  nlohmann::json j;
  j["epoch"] = epoch;
  j["position"] = position;
  j["seq_len"] = seq_len;
  j["num_windows"] = num_windows;
  j["shuffle"] = shuffle;
  j["seed"] = seed;
  return j.dump();
}

DataCursor DataCursor::from_json(const std::string& text) {
  DataCursor c;
  try {
    nlohmann::json j = nlohmann::json::parse(text);
    c.epoch = j.at("epoch").get<int64_t>();
    c.position = j.at("position").get<int64_t>();
    c.seq_len = j.at("seq_len").get<int64_t>();
    c.num_windows = j.at("num_windows").get<int64_t>();
    c.shuffle = j.at("shuffle").get<bool>();
    c.seed = j.at("seed").get<uint64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw FileError(str("data cursor '", text, "' is malformed: ", e.what()));
  }
  VIADUCT_CHECK_T(
      FileError,
      c.epoch >= 0 && c.position >= 0 && c.seq_len >= 1 && c.num_windows >= 0,
      "data cursor '", text, "' has out-of-range fields");
  return c;
}

// -------------------------------------------------------------- TokenSampler

TokenSampler::TokenSampler(std::shared_ptr<const TokenStream> tokens,
                           const SamplerOptions& options)
    : tokens_(std::move(tokens)), options_(options) {
  VIADUCT_CHECK(tokens_ != nullptr, "sampler: no token stream");
  check_options(options_, "sampler");
  num_windows_ = windows_in(*tokens_, options_.seq_len);
  const int64_t global = options_.batch_size * options_.dp_size;
  VIADUCT_CHECK_T(ConfigError, num_windows_ >= global, "training data ",
                  tokens_->describe(), " has ", tokens_->size(),
                  " tokens: ", num_windows_, " windows of seq_len ",
                  options_.seq_len, ", fewer than one global batch (",
                  options_.batch_size, " x dp ", options_.dp_size, " = ",
                  global,
                  " windows); lower training.local_batch_size or "
                  "training.seq_len, or prepare more data");
}

int64_t TokenSampler::steps_per_epoch() const {
  return num_windows_ / (options_.batch_size * options_.dp_size);
}

void TokenSampler::load_epoch(int64_t epoch) {
  if (order_epoch_ == epoch) return;
  order_epoch_ = epoch;
  order_.clear();
  if (!options_.shuffle) return;
  order_.resize(static_cast<size_t>(num_windows_));
  std::iota(order_.begin(), order_.end(), int64_t{0});
  // The epoch's stream: seed and epoch mixed through one splitmix64 step.
  SplitMix64 seeder{options_.seed ^
                    (0xD1B54A32D192ED03ULL * static_cast<uint64_t>(epoch + 1))};
  SplitMix64 rng{seeder.next()};
  for (int64_t i = num_windows_ - 1; i > 0; --i) {
    auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i + 1)));
    std::swap(order_[i], order_[j]);
  }
}

int64_t TokenSampler::window_at(int64_t epoch, int64_t index) {
  VIADUCT_ASSERT(index >= 0 && index < num_windows_, "window index ", index);
  load_epoch(epoch);
  return order_.empty() ? index : order_[static_cast<size_t>(index)];
}

TokenBatch TokenSampler::next() {
  const int64_t B = options_.batch_size;
  const int64_t global = B * options_.dp_size;
  if (position_ + global > num_windows_) {
    epoch_ += 1;
    position_ = 0;
    log::debug("sampler: epoch ", epoch_, " begins");
  }
  std::vector<int64_t> ids(static_cast<size_t>(B));
  const int64_t first = position_ + options_.dp_rank * B;
  for (int64_t b = 0; b < B; ++b) {
    ids[static_cast<size_t>(b)] = window_at(epoch_, first + b);
  }
  position_ += global;
  return read_windows(*tokens_, ids, options_.seq_len);
}

DataCursor TokenSampler::cursor() const {
  DataCursor c;
  c.epoch = epoch_;
  c.position = position_;
  c.seq_len = options_.seq_len;
  c.num_windows = num_windows_;
  c.shuffle = options_.shuffle;
  c.seed = options_.seed;
  return c;
}

void TokenSampler::restore(const DataCursor& c) {
  VIADUCT_CHECK(c.seq_len == options_.seq_len,
                "data cursor was saved with "
                "seq_len ",
                c.seq_len, " but training.seq_len is ", options_.seq_len);
  VIADUCT_CHECK(c.num_windows == num_windows_, "data cursor was saved for ",
                c.num_windows, " windows but ", tokens_->describe(), " has ",
                num_windows_, " (the training data changed)");
  VIADUCT_CHECK(c.shuffle == options_.shuffle,
                "data cursor was saved with "
                "data.shuffle = ",
                c.shuffle ? "true" : "false", " but it is now ",
                options_.shuffle ? "true" : "false");
  VIADUCT_CHECK(!c.shuffle || c.seed == options_.seed,
                "data cursor was "
                "saved with seed ",
                c.seed, " but the seed is now ", options_.seed,
                " (the shuffled order would differ)");
  VIADUCT_CHECK(c.epoch >= 0 && c.position >= 0 && c.position <= num_windows_,
                "data cursor (epoch ", c.epoch, ", position ", c.position,
                ") is out of range for ", num_windows_, " windows");
  epoch_ = c.epoch;
  position_ = c.position;
}

// ---------------------------------------------------------------- EvalLoader

EvalLoader::EvalLoader(std::shared_ptr<const TokenStream> tokens,
                       const SamplerOptions& options, int64_t num_batches)
    : tokens_(std::move(tokens)), options_(options) {
  VIADUCT_CHECK(tokens_ != nullptr, "eval: no token stream");
  check_options(options_, "eval");
  VIADUCT_CHECK_T(ConfigError, num_batches >= 1,
                  "data.eval_batches must be >= 1, got ", num_batches);
  const int64_t global = options_.batch_size * options_.dp_size;
  const int64_t fit = windows_in(*tokens_, options_.seq_len) / global;
  VIADUCT_CHECK_T(ConfigError, fit >= 1, "eval data ", tokens_->describe(),
                  " has ", tokens_->size(),
                  " tokens, fewer than one global "
                  "batch of ",
                  global, " windows of seq_len ", options_.seq_len,
                  " (+1 token)");
  if (fit < num_batches) {
    log::warn("eval data ", tokens_->describe(), " holds only ", fit,
              " batches; data.eval_batches = ", num_batches, " lowered to ",
              fit);
  }
  num_batches_ = std::min(num_batches, fit);
}

TokenBatch EvalLoader::batch(int64_t i) const {
  VIADUCT_CHECK(i >= 0 && i < num_batches_, "eval batch ", i, " is not in [0, ",
                num_batches_, ")");
  const int64_t B = options_.batch_size;
  std::vector<int64_t> ids(static_cast<size_t>(B));
  const int64_t first = (i * options_.dp_size + options_.dp_rank) * B;
  std::iota(ids.begin(), ids.end(), first);
  return read_windows(*tokens_, ids, options_.seq_len);
}

std::vector<TokenBatch> EvalLoader::batches() const {
  std::vector<TokenBatch> out;
  out.reserve(static_cast<size_t>(num_batches_));
  for (int64_t i = 0; i < num_batches_; ++i) out.push_back(batch(i));
  return out;
}

// ------------------------------------------------------------------- helpers

TokenBatch read_windows(const TokenStream& tokens,
                        const std::vector<int64_t>& window_ids,
                        int64_t seq_len) {
  const auto B = static_cast<int64_t>(window_ids.size());
  const int64_t T = seq_len;
  // buf: [B, T + 1]; row b = tokens [w T, w T + T] of window w = ids[b].
  at::Tensor buf = at::empty({B, T + 1}, at::TensorOptions().dtype(at::kLong));
  int64_t* p = buf.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    tokens.read(window_ids[static_cast<size_t>(b)] * T, T + 1, p + b * (T + 1));
  }
  TokenBatch batch;
  batch.inputs = buf.narrow(1, 0, T).contiguous();   // [B, T]
  batch.targets = buf.narrow(1, 1, T).contiguous();  // [B, T]
  return batch;
}

std::vector<at::Tensor> split_microbatches(const at::Tensor& batch, int64_t n) {
  VIADUCT_CHECK(batch.dim() >= 1,
                "split_microbatches: the batch has no "
                "dimension to split");
  const int64_t B = batch.size(0);
  VIADUCT_CHECK_T(ConfigError, n >= 1 && B % n == 0,
                  "cannot split a local "
                  "batch of ",
                  B, " rows into ", n,
                  " micro-batches: the "
                  "number of micro-batches must divide "
                  "training.local_batch_size");
  // Each: [B / n, ...], a view of `batch`.
  return batch.split(B / n, 0);
}

std::vector<TokenBatch> split_microbatches(const TokenBatch& batch, int64_t n) {
  std::vector<at::Tensor> in = split_microbatches(batch.inputs, n);
  std::vector<at::Tensor> tg = split_microbatches(batch.targets, n);
  std::vector<TokenBatch> out(in.size());
  for (size_t i = 0; i < in.size(); ++i) out[i] = TokenBatch{in[i], tg[i]};
  return out;
}

}  // namespace viaduct::data
