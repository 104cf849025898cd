// TokenSampler, EvalLoader and micro-batching (see Note [Windows and the data
// cursor] in sampler.h).
#include "data/sampler.h"

#include <nlohmann/json.hpp>
#include <algorithm>
#include <cmath>
#include <iomanip>
#include <numeric>
#include <sstream>
#include <cstring>

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

// Windows of a source: the token stream's, or an image-text file's records.
int64_t windows_of(const DataSource& source, int64_t seq_len) {
  return source.images ? source.images->size() : windows_in(*source.tokens, seq_len);
}

// See Note [Image-text rows]: row b is record rows[b].second of *rows[b].first.
TokenBatch image_rows(const std::vector<std::pair<const ImageTextFile*, int64_t>>& rows,
                      int64_t T, int64_t P, int64_t image_token_id) {
  VIADUCT_CHECK_T(ConfigError, P > 0,
                  "image-text data needs a model with a vision tower (model.vision = true)");
  VIADUCT_CHECK_T(ConfigError, T > P, "image-text data: training.seq_len (", T,
                  ") must exceed the ", P, " image placeholder tokens");
  const auto B = static_cast<int64_t>(rows.size());
  const ImageTextFile& first = *rows.front().first;
  const int64_t C = first.channels(), S = first.image_size(), bytes = first.image_bytes();
  auto inputs = at::zeros({B, T}, at::kLong);
  auto targets = at::full({B, T}, -100, at::kLong);
  auto images = at::empty({B, 1, C, S, S}, at::kByte);
  std::vector<int64_t> seq(static_cast<size_t>(T + 1));
  for (int64_t b = 0; b < B; ++b) {
    const ImageTextFile& f = *rows[static_cast<size_t>(b)].first;
    const int64_t id = rows[static_cast<size_t>(b)].second;
    VIADUCT_CHECK(f.image_bytes() == bytes, "image-text files of one batch differ in image "
                  "shape: '", f.path(), "' and '", first.path(), "'");
    // seq: P placeholders, then the caption, cut at T + 1 tokens.
    std::fill_n(seq.begin(), P, image_token_id);
    const int64_t n = f.read_caption(id, seq.data() + P, T + 1 - P);
    // The tower's merge puts patches at the placeholders, so a caption token
    // equal to the placeholder id would shift every patch after it. Checked
    // here, on the host, so that the model need not read a device flag.
    VIADUCT_CHECK_T(ConfigError,
                    std::find(seq.begin() + P, seq.begin() + P + n, image_token_id) ==
                        seq.begin() + P + n,
                    "record ", id, " of '", f.path(), "' has a caption token equal to the image "
                    "placeholder id ", image_token_id, " (model.image_token_id); pick an id the "
                    "tokenizer never gives");
    int64_t* in = inputs.data_ptr<int64_t>() + b * T;
    int64_t* tg = targets.data_ptr<int64_t>() + b * T;
    for (int64_t t = 0; t < std::min(T, P + n); ++t) in[t] = seq[static_cast<size_t>(t)];
    // Targets: the caption's tokens at the places before them (P - 1 ...).
    for (int64_t t = P - 1; t < P + n - 1; ++t) tg[t] = seq[static_cast<size_t>(t + 1)];
    std::memcpy(images.data_ptr<uint8_t>() + b * bytes, f.image(id), static_cast<size_t>(bytes));
  }
  return TokenBatch{inputs, targets, images};
}

// Reads rows into a batch: row b holds window ids[b] of *sources[b] (all
// token streams or all image-text files).
TokenBatch read_rows(const std::vector<const DataSource*>& sources,
                     const std::vector<int64_t>& ids, const SamplerOptions& o) {
  const auto B = static_cast<int64_t>(ids.size());
  const int64_t T = o.seq_len;
  if (B > 0 && sources.front()->images) {
    std::vector<std::pair<const ImageTextFile*, int64_t>> rows;
    for (int64_t b = 0; b < B; ++b) {
      const auto i = static_cast<size_t>(b);
      rows.emplace_back(sources[i]->images.get(), ids[i]);
    }
    return image_rows(rows, T, o.image_tokens, o.image_token_id);
  }
  // buf: [B, T + 1]; row b = tokens [w T, w T + T] of window w = ids[b].
  at::Tensor buf = at::empty({B, T + 1}, at::TensorOptions().dtype(at::kLong));
  int64_t* p = buf.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const auto i = static_cast<size_t>(b);
    sources[i]->tokens->read(ids[i] * T, T + 1, p + b * (T + 1));
  }
  TokenBatch batch;
  batch.inputs = buf.narrow(1, 0, T).contiguous();   // [B, T]
  batch.targets = buf.narrow(1, 1, T).contiguous();  // [B, T]
  return batch;
}

// A share for messages: 0.7, 0.3333.
std::string share_text(double share) {
  std::ostringstream os;
  os << std::setprecision(4) << share;
  return os.str();
}

}  // namespace

// ---------------------------------------------------------------- DataCursor

std::string DataCursor::to_json() const {
  VIADUCT_ASSERT(!sources.empty(), "data cursor without a source");
  nlohmann::json j;
  j["seq_len"] = seq_len;
  j["shuffle"] = shuffle;
  j["seed"] = seed;
  if (sources.size() == 1) {
    // The single-stream form (earlier versions wrote it without "taken").
    const SourceCursor& s = sources.front();
    j["epoch"] = s.epoch;
    j["position"] = s.position;
    j["num_windows"] = s.num_windows;
    j["taken"] = s.taken;
    return j.dump();
  }
  nlohmann::json list = nlohmann::json::array();
  for (const SourceCursor& s : sources) {
    list.push_back({{"path", s.path},
                    {"num_windows", s.num_windows},
                    {"share", s.share},
                    {"epoch", s.epoch},
                    {"position", s.position},
                    {"taken", s.taken}});
  }
  j["sources"] = std::move(list);
  return j.dump();
}

DataCursor DataCursor::from_json(const std::string& text) {
  DataCursor c;
  try {
    nlohmann::json j = nlohmann::json::parse(text);
    c.seq_len = j.at("seq_len").get<int64_t>();
    c.shuffle = j.at("shuffle").get<bool>();
    c.seed = j.at("seed").get<uint64_t>();
    if (j.contains("sources")) {
      for (const auto& e : j.at("sources")) {
        SourceCursor s;
        s.path = e.at("path").get<std::string>();
        s.num_windows = e.at("num_windows").get<int64_t>();
        s.share = e.at("share").get<double>();
        s.epoch = e.at("epoch").get<int64_t>();
        s.position = e.at("position").get<int64_t>();
        s.taken = e.at("taken").get<int64_t>();
        c.sources.push_back(std::move(s));
      }
    } else {
      SourceCursor s;
      s.epoch = j.at("epoch").get<int64_t>();
      s.position = j.at("position").get<int64_t>();
      s.num_windows = j.at("num_windows").get<int64_t>();
      s.taken = j.value("taken", int64_t{0});
      c.sources.push_back(std::move(s));
    }
  } catch (const nlohmann::json::exception& e) {
    throw FileError(str("data cursor '", text, "' is malformed: ", e.what()));
  }
  bool in_range = c.seq_len >= 1 && !c.sources.empty();
  for (const SourceCursor& s : c.sources) {
    in_range = in_range && s.epoch >= 0 && s.position >= 0 && s.taken >= 0 &&
               s.num_windows >= 0 && s.share > 0 && s.share <= 1;
  }
  VIADUCT_CHECK_T(FileError, in_range, "data cursor '", text,
                  "' has out-of-range fields");
  return c;
}

// ------------------------------------------------------------------ sources

std::string DataSource::describe() const {
  return images ? str(images->path(), " (image-text)") : tokens->describe();
}

std::vector<DataSource> open_data_sources(const std::string& key,
                                          const std::vector<std::string>& specs,
                                          const std::vector<double>& weights,
                                          const std::string& format) {
  VIADUCT_CHECK_T(ConfigError, !specs.empty(), key, " names no token source");
  VIADUCT_CHECK_T(ConfigError, weights.empty() || weights.size() == specs.size(),
                  key, " has ", specs.size(), " sources but data.weights has ",
                  weights.size(), " weights");
  std::vector<DataSource> out;
  for (size_t i = 0; i < specs.size(); ++i) {
    const std::string label =
        specs.size() == 1 ? key : str(key, "[", i, "]");
    DataSource s;
    s.path = specs[i];
    s.weight = weights.empty() ? 1.0 : weights[i];
    try {
      if (is_image_text_file(specs[i])) {
        s.images = std::make_shared<const ImageTextFile>(specs[i]);
      } else {
        s.tokens = open_token_stream(specs[i], format);
      }
    } catch (const FileError& e) {
      throw FileError(str(label, ": ", e.what()));
    }
    out.push_back(std::move(s));
  }
  return out;
}

// -------------------------------------------------------------- TokenSampler

TokenSampler::TokenSampler(std::shared_ptr<const TokenStream> tokens,
                           const SamplerOptions& options)
    : TokenSampler(
          [&] {
            VIADUCT_CHECK(tokens != nullptr, "sampler: no token stream");
            return std::vector<DataSource>{
                DataSource{tokens->describe(), std::move(tokens), 1.0, nullptr}};
          }(),
          options) {}

TokenSampler::TokenSampler(std::vector<DataSource> sources,
                           const SamplerOptions& options)
    : options_(options) {
  VIADUCT_CHECK(!sources.empty(), "sampler: no token source");
  check_options(options_, "sampler");
  double total = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    VIADUCT_CHECK((sources[i].tokens != nullptr) != (sources[i].images != nullptr),
                  "sampler: source ", i, " has no token stream or image-text file");
    VIADUCT_CHECK_T(ConfigError, (sources[i].images != nullptr) == (sources[0].images != nullptr),
                    "data.paths mixes image-text data ('",
                    (sources[i].images ? sources[i] : sources[0]).path, "') with token data ('",
                    (sources[i].images ? sources[0] : sources[i]).path,
                    "'): a batch's rows have an image each or none has");
    if (sources[i].images) {
      VIADUCT_CHECK_T(ConfigError, options_.image_tokens > 0, "the training data '",
                      sources[i].path, "' is image-text data: it needs a model with a vision "
                      "tower (model.vision = true)");
      VIADUCT_CHECK_T(ConfigError, options_.seq_len > options_.image_tokens,
                      "training.seq_len (", options_.seq_len, ") must exceed the ",
                      options_.image_tokens, " image placeholder tokens of '", sources[i].path,
                      "' by the caption's length");
      const int64_t room = options_.seq_len + 1 - options_.image_tokens;
      const int64_t longest = sources[i].images->max_caption_length();
      if (longest > room) {
        log::warn("the image-text data '", sources[i].path, "' has captions of up to ", longest,
                  " tokens; training.seq_len = ", options_.seq_len, " after ",
                  options_.image_tokens, " placeholders keeps the first ", room,
                  " of each (seq_len = ", options_.image_tokens + longest - 1, " keeps them all)");
      }
    }
    VIADUCT_CHECK_T(ConfigError,
                    std::isfinite(sources[i].weight) && sources[i].weight > 0,
                    "data.weights[", i, "] = ", sources[i].weight, " (for '",
                    sources[i].path, "') must be a number > 0");
    total += sources[i].weight;
  }
  const int64_t global = options_.batch_size * options_.dp_size;
  for (size_t i = 0; i < sources.size(); ++i) {
    Source s;
    s.share = sources[i].weight / total;
    s.num_windows = windows_of(sources[i], options_.seq_len);
    s.data = std::move(sources[i]);
    // A source holds at least its share of one global step (one source:
    // the whole step).
    const auto need = static_cast<int64_t>(
        std::ceil(s.share * static_cast<double>(global) - 1e-9));
    VIADUCT_CHECK_T(
        ConfigError, s.num_windows >= std::max<int64_t>(need, 1),
        sources.size() == 1 ? std::string("training data ")
                            : str("data.paths[", i, "] "),
        s.data.describe(), " has ",
        s.data.images ? str(s.num_windows, " records") :
        str(s.data.tokens->size(), " tokens: ", s.num_windows,
        " windows of seq_len ", options_.seq_len),
        sources.size() == 1 ? str(", fewer than one global batch (")
                            : str(", fewer than its share ", share_text(s.share),
                                  " of one global batch (", need, " of "),
        options_.batch_size, " x dp ", options_.dp_size, " = ", global,
        " windows); lower training.local_batch_size or training.seq_len",
        sources.size() == 1 ? "" : ", lower its weight", ", or prepare more data");
    sources_.push_back(std::move(s));
  }
}

int64_t TokenSampler::steps_per_epoch(size_t s) const {
  const Source& src = sources_.at(s);
  const double per_step = src.share * static_cast<double>(
                                          options_.batch_size * options_.dp_size);
  return static_cast<int64_t>(static_cast<double>(src.num_windows) / per_step);
}

void TokenSampler::load_epoch(Source& src, size_t index, int64_t epoch) {
  if (src.order_epoch == epoch) return;
  src.order_epoch = epoch;
  src.order.clear();
  if (!options_.shuffle) return;
  src.order.resize(static_cast<size_t>(src.num_windows));
  std::iota(src.order.begin(), src.order.end(), int64_t{0});
  // The epoch's stream: seed, epoch and source mixed through one splitmix64
  // step (source 0 adds nothing: a single stream's order).
  SplitMix64 seeder{options_.seed ^
                    (0xD1B54A32D192ED03ULL * static_cast<uint64_t>(epoch + 1)) ^
                    (0xA0761D6478BD642FULL * static_cast<uint64_t>(index))};
  SplitMix64 rng{seeder.next()};
  for (int64_t i = src.num_windows - 1; i > 0; --i) {
    auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i + 1)));
    std::swap(src.order[static_cast<size_t>(i)], src.order[static_cast<size_t>(j)]);
  }
}

int64_t TokenSampler::window_at(int64_t epoch, int64_t index, size_t s) {
  Source& src = sources_.at(s);
  VIADUCT_ASSERT(index >= 0 && index < src.num_windows, "window index ", index,
                 " of source ", s);
  load_epoch(src, s, epoch);
  return src.order.empty() ? index : src.order[static_cast<size_t>(index)];
}

TokenBatch TokenSampler::next() {
  const int64_t B = options_.batch_size;
  const int64_t global = B * options_.dp_size;
  const size_t k = sources_.size();
  // The step's slots and the source each goes to: the blend rule of Note
  // [Windows and the data cursor] from the first slot of the step on.
  int64_t first_slot = 0;
  for (const Source& src : sources_) first_slot += src.taken;
  std::vector<size_t> owner(static_cast<size_t>(global));
  std::vector<int64_t> count(k, 0);
  for (int64_t j = 0; j < global; ++j) {
    const auto slots = static_cast<double>(first_slot + j + 1);
    size_t best = 0;
    double best_gap = 0;
    for (size_t s = 0; s < k; ++s) {
      const double gap =
          sources_[s].share * slots - static_cast<double>(sources_[s].taken + count[s]);
      if (s == 0 || gap > best_gap) {
        best = s;
        best_gap = gap;
      }
    }
    owner[static_cast<size_t>(j)] = best;
    ++count[best];
  }
  // A source whose epoch cannot serve its slots of the step begins the next.
  for (size_t s = 0; s < k; ++s) {
    Source& src = sources_[s];
    if (src.position > 0 && src.position + count[s] > src.num_windows) {
      src.epoch += 1;
      src.position = 0;
      log::debug("sampler: epoch ", src.epoch, " of ", src.data.path, " begins");
    }
  }
  // Serve every slot in order; this rank's rows are slots [r B, r B + B).
  std::vector<const DataSource*> streams;
  std::vector<int64_t> ids;
  streams.reserve(static_cast<size_t>(B));
  ids.reserve(static_cast<size_t>(B));
  const int64_t mine = options_.dp_rank * B;
  for (int64_t j = 0; j < global; ++j) {
    const size_t s = owner[static_cast<size_t>(j)];
    Source& src = sources_[s];
    if (src.position == src.num_windows) {  // smaller than its slots of a step
      src.epoch += 1;
      src.position = 0;
    }
    if (j >= mine && j < mine + B) {
      streams.push_back(&src.data);
      ids.push_back(window_at(src.epoch, src.position, s));
    }
    src.position += 1;
    src.taken += 1;
  }
  return read_rows(streams, ids, options_);
}

DataCursor TokenSampler::cursor() const {
  DataCursor c;
  c.seq_len = options_.seq_len;
  c.shuffle = options_.shuffle;
  c.seed = options_.seed;
  for (const Source& src : sources_) {
    SourceCursor s;
    s.epoch = src.epoch;
    s.position = src.position;
    s.taken = src.taken;
    s.num_windows = src.num_windows;
    s.share = src.share;
    s.path = src.data.path;
    c.sources.push_back(std::move(s));
  }
  return c;
}

void TokenSampler::restore(const DataCursor& c) {
  VIADUCT_CHECK(c.seq_len == options_.seq_len,
                "data cursor was saved with "
                "seq_len ",
                c.seq_len, " but training.seq_len is ", options_.seq_len);
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
  const auto layout = [](size_t n) {
    return n == 1 ? std::string("one token stream (data.path or one data.paths entry)")
                  : str("a blend of ", n, " sources (data.paths)");
  };
  VIADUCT_CHECK(c.sources.size() == sources_.size(),
                "data cursor was saved for ", layout(c.sources.size()),
                " but this run reads ", layout(sources_.size()),
                " (the training data changed)");
  const size_t k = sources_.size();
  for (size_t s = 0; s < k; ++s) {
    const SourceCursor& saved = c.sources[s];
    const Source& src = sources_[s];
    const std::string name = k == 1 ? src.data.describe()
                                    : str("data.paths[", s, "] '", src.data.path, "'");
    VIADUCT_CHECK(saved.num_windows == src.num_windows,
                  "data cursor was saved for ", saved.num_windows,
                  " windows but ", name, " has ", src.num_windows,
                  " (the training data changed)");
    VIADUCT_CHECK(k == 1 || saved.share == src.share, "data cursor was saved with a share of ",
                  share_text(saved.share), " for ", name, " but data.weights give it ",
                  share_text(src.share), " now (the blend would differ)");
    VIADUCT_CHECK(saved.position <= src.num_windows,
                  "data cursor (epoch ", saved.epoch, ", position ", saved.position,
                  ") is out of range for ", src.num_windows, " windows of ", name);
    if (k > 1 && saved.path != src.data.path) {
      log::warn("data cursor: data.paths[", s, "] was '", saved.path, "' when saved and is '",
                src.data.path, "' now; same windows and share, so the run continues");
    }
  }
  for (size_t s = 0; s < k; ++s) {
    Source& src = sources_[s];
    src.epoch = c.sources[s].epoch;
    src.position = c.sources[s].position;
    src.taken = c.sources[s].taken;
  }
}

std::string TokenSampler::describe() const {
  const int64_t T = options_.seq_len;
  if (sources_.size() == 1) {
    const auto& data = sources_.front().data;
    if (data.images) {
      return str(data.describe(), ": ", data.images->size(), " images of ",
                 data.images->channels(), "x", data.images->image_size(), "x",
                 data.images->image_size(), ", ", data.images->caption_tokens(),
                 " caption tokens (the longest ", data.images->max_caption_length(), "), ",
                 options_.image_tokens, " placeholders each, rows of ", T);
    }
    const auto& tokens = *data.tokens;
    return str(tokens.describe(), ": ", tokens.size(), " tokens, ",
               sources_.front().num_windows, " windows of ", T);
  }
  const double global = static_cast<double>(options_.batch_size * options_.dp_size);
  std::string out = str("blend of ", sources_.size(), " sources, windows of ", T, ":");
  for (size_t s = 0; s < sources_.size(); ++s) {
    const Source& src = sources_[s];
    std::ostringstream epoch;
    epoch << std::setprecision(3)
          << static_cast<double>(src.num_windows) / (src.share * global);
    out += str(s ? "; " : " ", "[", s, "] ", src.data.describe(), " ",
               src.data.images ? src.data.images->caption_tokens() : src.data.tokens->size(),
               " tokens, ", src.num_windows, " windows, share ",
               share_text(src.share), " (an epoch every ", epoch.str(), " steps)");
  }
  return out;
}

// ---------------------------------------------------------------- EvalLoader

EvalLoader::EvalLoader(std::shared_ptr<const TokenStream> tokens,
                       const SamplerOptions& options, int64_t num_batches)
    : options_(options) {
  VIADUCT_CHECK(tokens != nullptr, "eval: no token stream");
  source_.path = tokens->describe();
  source_.tokens = std::move(tokens);
  init(num_batches);
}

EvalLoader::EvalLoader(std::shared_ptr<const ImageTextFile> images,
                       const SamplerOptions& options, int64_t num_batches)
    : options_(options) {
  VIADUCT_CHECK(images != nullptr, "eval: no image-text file");
  source_.path = images->path();
  source_.images = std::move(images);
  init(num_batches);
}

void EvalLoader::init(int64_t num_batches) {
  check_options(options_, "eval");
  VIADUCT_CHECK_T(ConfigError, num_batches >= 1,
                  "data.eval_batches must be >= 1, got ", num_batches);
  const int64_t global = options_.batch_size * options_.dp_size;
  const int64_t fit = windows_of(source_, options_.seq_len) / global;
  VIADUCT_CHECK_T(ConfigError, fit >= 1, "eval data ", source_.describe(), " has ",
                  source_.images ? str(source_.images->size(), " records")
                                 : str(source_.tokens->size(), " tokens"),
                  ", fewer than one global batch of ", global, " windows of seq_len ",
                  options_.seq_len, source_.images ? "" : " (+1 token)");
  if (fit < num_batches) {
    log::warn("eval data ", source_.describe(), " holds only ", fit,
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
  return read_rows(std::vector<const DataSource*>(ids.size(), &source_), ids, options_);
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
  DataSource source;
  source.tokens = std::shared_ptr<const TokenStream>(&tokens, [](const TokenStream*) {});
  SamplerOptions o;
  o.seq_len = seq_len;
  return read_rows(std::vector<const DataSource*>(window_ids.size(), &source), window_ids, o);
}

TokenBatch read_image_rows(const ImageTextFile& file, const std::vector<int64_t>& ids,
                           int64_t seq_len, int64_t image_tokens, int64_t image_token_id) {
  std::vector<std::pair<const ImageTextFile*, int64_t>> rows;
  for (int64_t id : ids) rows.emplace_back(&file, id);
  return image_rows(rows, seq_len, image_tokens, image_token_id);
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
  std::vector<at::Tensor> im;
  if (batch.images.defined()) im = split_microbatches(batch.images, n);
  std::vector<TokenBatch> out(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    out[i] = TokenBatch{in[i], tg[i], im.empty() ? at::Tensor() : im[i]};
  }
  return out;
}

}  // namespace viaduct::data
