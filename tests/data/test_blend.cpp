// Blends of several token sources (data.paths, data.weights) against plain
// references: each source's tokens carry its index (token = source * kStride
// + position), so every row names its source and window. The blend rule's
// prefix counts, dp layouts, resume, one source against the single-stream
// sampler of earlier versions, refusals and named errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <numeric>
#include <set>

#include "core/check.h"
#include "data/sampler.h"
#include "data/token_file.h"
#include "fixtures.h"
#include "temp_dir.h"

namespace viaduct::data {
namespace {

using testing::TempDir;
using testing::opts;
using testing::write_bytes;

constexpr int64_t kStride = 1'000'000;

// Source s: tokens s * kStride + i, i < n, as one uint32 file.
std::string write_source(const TempDir& dir, int s, int64_t n) {
  std::vector<uint32_t> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(static_cast<uint32_t>(s * kStride + i));
  const std::string path = dir.file("src" + std::to_string(s) + ".u32");
  write_bytes(path, v.data(), v.size() * 4);
  return path;
}

// Sources of `sizes` tokens with `weights`.
std::vector<DataSource> blend(const TempDir& dir, const std::vector<int64_t>& sizes,
                              const std::vector<double>& weights) {
  std::vector<std::string> paths;
  for (size_t s = 0; s < sizes.size(); ++s) {
    paths.push_back(write_source(dir, static_cast<int>(s), sizes[s]));
  }
  return open_data_sources("data.paths", paths, weights, "auto");
}

struct Row {
  int64_t source, window;
  bool operator==(const Row&) const = default;
};

std::vector<Row> rows_of(const TokenBatch& b, int64_t T) {
  std::vector<Row> out;
  for (int64_t r = 0; r < b.inputs.size(0); ++r) {
    const int64_t t = b.inputs[r][0].item<int64_t>();
    out.push_back({t / kStride, (t % kStride) / T});
  }
  return out;
}

bool same_batches(const TokenBatch& a, const TokenBatch& b) {
  return a.inputs.equal(b.inputs) && a.targets.equal(b.targets);
}

// The blend rule written out: slot i goes to the largest
// share * (i + 1) - taken, ties to the lower index.
std::vector<int64_t> reference_owners(const std::vector<double>& weights, int64_t n) {
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<int64_t> taken(weights.size(), 0), out;
  for (int64_t i = 0; i < n; ++i) {
    size_t best = 0;
    for (size_t s = 1; s < weights.size(); ++s) {
      const auto gap = [&](size_t k) {
        return weights[k] / total * static_cast<double>(i + 1) - static_cast<double>(taken[k]);
      };
      if (gap(s) > gap(best)) best = s;
    }
    ++taken[best];
    out.push_back(static_cast<int64_t>(best));
  }
  return out;
}

// The single-stream sampler of earlier versions, written out: a global step
// takes the next B x dp windows of the epoch's order, the epoch ends when
// fewer are left, and the shuffled order is splitmix64 Fisher-Yates from
// (seed, epoch).
struct OldSampler {
  int64_t windows, B, dp, rank;
  bool shuffle;
  uint64_t seed;
  int64_t epoch = 0, position = 0;

  static uint64_t mix(uint64_t& state) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  static uint64_t below(uint64_t& state, uint64_t bound) {
    __uint128_t m = static_cast<__uint128_t>(mix(state)) * bound;
    auto low = static_cast<uint64_t>(m);
    if (low < bound) {
      const uint64_t threshold = (0 - bound) % bound;
      while (low < threshold) {
        m = static_cast<__uint128_t>(mix(state)) * bound;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }
  std::vector<int64_t> order() const {
    std::vector<int64_t> o(static_cast<size_t>(windows));
    std::iota(o.begin(), o.end(), int64_t{0});
    if (!shuffle) return o;
    uint64_t seeder = seed ^ (0xD1B54A32D192ED03ULL * static_cast<uint64_t>(epoch + 1));
    uint64_t rng = mix(seeder);
    for (int64_t i = windows - 1; i > 0; --i) {
      const auto j = static_cast<int64_t>(below(rng, static_cast<uint64_t>(i + 1)));
      std::swap(o[static_cast<size_t>(i)], o[static_cast<size_t>(j)]);
    }
    return o;
  }
  std::vector<int64_t> next() {
    if (position + B * dp > windows) {
      ++epoch;
      position = 0;
    }
    const auto o = order();
    std::vector<int64_t> out;
    for (int64_t b = 0; b < B; ++b) out.push_back(o[static_cast<size_t>(position + rank * B + b)]);
    position += B * dp;
    return out;
  }
};

TEST(Blend, PrefixCountsFollowTheBlendRule) {
  // Two sources: every prefix of n slots takes floor or ceil of share x n.
  for (const auto& weights : std::vector<std::vector<double>>{
           {0.7, 0.3}, {3, 1}, {1, 1}, {0.9, 0.1}, {1, 2}, {0.123, 0.877}}) {
    TempDir dir;
    TokenSampler s(blend(dir, {2001, 2001}, weights), opts(1, 10));
    const double total = weights[0] + weights[1];
    std::vector<int64_t> count(2, 0);
    for (int64_t n = 1; n <= 1000; ++n) {
      ++count[static_cast<size_t>(rows_of(s.next(), 10)[0].source)];
      for (size_t k = 0; k < 2; ++k) {
        const double reference = weights[k] / total * static_cast<double>(n);
        EXPECT_GE(count[k], std::floor(reference + 1e-9)) << "source " << k << " after " << n;
        EXPECT_LE(count[k], std::ceil(reference - 1e-9)) << "source " << k << " after " << n;
      }
    }
  }
  // Three sources: the rule's sequence (pinned by hand for [5, 3, 2]), and
  // no source ever ahead of ceil(share x n).
  TempDir dir;
  TokenSampler s(blend(dir, {1001, 1001, 1001}, {5, 3, 2}), opts(1, 10));
  std::vector<int64_t> first;
  for (int i = 0; i < 10; ++i) first.push_back(rows_of(s.next(), 10)[0].source);
  EXPECT_EQ(first, (std::vector<int64_t>{0, 1, 2, 0, 0, 1, 0, 2, 1, 0}));
  for (const auto& weights : std::vector<std::vector<double>>{
           {5, 3, 2}, {0.05, 0.15, 0.3, 0.5}, {1, 1, 1, 1, 1, 1, 7}}) {
    TempDir d;
    const std::vector<int64_t> sizes(weights.size(), 4001);
    const int64_t B = 4;
    TokenSampler t(blend(d, sizes, weights), opts(B, 10));
    const auto reference = reference_owners(weights, 400 * B);
    const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
    std::vector<int64_t> count(weights.size(), 0);
    for (int64_t step = 0; step < 400; ++step) {
      const auto rows = rows_of(t.next(), 10);
      for (int64_t b = 0; b < B; ++b) {
        const int64_t slot = step * B + b;
        ASSERT_EQ(rows[static_cast<size_t>(b)].source, reference[static_cast<size_t>(slot)])
            << "slot " << slot;
        ++count[static_cast<size_t>(reference[static_cast<size_t>(slot)])];
      }
      for (size_t k = 0; k < weights.size(); ++k) {
        EXPECT_LE(count[k], std::ceil(weights[k] / total * (step + 1) * B - 1e-9));
      }
    }
  }
}

TEST(Blend, EachSourceKeepsItsOwnOrderAndEpochs) {
  // Source 1 (13 windows, share 0.5 of 4 slots a step) repeats every few
  // steps; each epoch of it is a permutation of its windows, and its steps
  // never straddle two epochs.
  TempDir dir;
  for (bool shuffle : {false, true}) {
    TokenSampler s(blend(dir, {4001, 131}, {1, 1}), opts(4, 10, 0, 1, shuffle, 9));
    ASSERT_EQ(s.num_windows(1), 13);
    std::vector<int64_t> stream1, stream0;
    for (int step = 0; step < 30; ++step) {
      for (const Row& r : rows_of(s.next(), 10)) {
        (r.source == 0 ? stream0 : stream1).push_back(r.window);
      }
    }
    // 2 windows of source 1 a step: epochs of 12 (the 13th skipped).
    ASSERT_EQ(stream1.size(), 60u);
    std::vector<std::vector<int64_t>> epochs;
    for (size_t i = 0; i < stream1.size(); i += 12) {
      std::vector<int64_t> e(stream1.begin() + static_cast<long>(i),
                             stream1.begin() + static_cast<long>(std::min(i + 12, stream1.size())));
      std::set<int64_t> unique(e.begin(), e.end());
      EXPECT_EQ(unique.size(), e.size()) << "a repeat inside an epoch";
      epochs.push_back(e);
    }
    if (shuffle) {
      EXPECT_NE(epochs[0], epochs[1]);
    } else {
      EXPECT_EQ(epochs[0], epochs[1]);
      EXPECT_EQ(epochs[0][11], 11);
    }
    // Source 0 is read in its own order, unaffected by source 1's epochs.
    std::vector<int64_t> in_order(stream0.size());
    std::iota(in_order.begin(), in_order.end(), int64_t{0});
    if (!shuffle) EXPECT_EQ(stream0, in_order);
    EXPECT_EQ(s.cursor().sources[1].epoch, 4);
  }
}

TEST(Blend, DpRanksStackToTheSingleRankBatch) {
  TempDir dir;
  auto sources = blend(dir, {3001, 401, 1201}, {0.5, 0.2, 0.3});
  for (bool shuffle : {false, true}) {
    for (int64_t dp : {2, 3, 4}) {
      TokenSampler reference_sampler(sources, opts(12, 10, 0, 1, shuffle, 7));
      std::vector<TokenSampler> ranks;
      for (int64_t r = 0; r < dp; ++r) ranks.emplace_back(sources, opts(12 / dp, 10, r, dp, shuffle, 7));
      // 60 steps: source 1 (40 windows, ~2.4 a step) wraps several times.
      for (int step = 0; step < 60; ++step) {
        std::vector<at::Tensor> in, tg;
        for (auto& r : ranks) {
          TokenBatch b = r.next();
          in.push_back(b.inputs);
          tg.push_back(b.targets);
        }
        TokenBatch reference = reference_sampler.next();
        ASSERT_TRUE(at::cat(in, 0).equal(reference.inputs)) << "dp " << dp << " step " << step;
        ASSERT_TRUE(at::cat(tg, 0).equal(reference.targets)) << "dp " << dp << " step " << step;
      }
      // The cursor does not depend on the layout either.
      EXPECT_EQ(ranks[0].cursor().to_json(), reference_sampler.cursor().to_json());
    }
  }
}

TEST(Blend, ResumeMidEpochContinuesAsTheUninterruptedSampler) {
  TempDir dir;
  auto sources = blend(dir, {3001, 251}, {0.75, 0.25});
  for (bool shuffle : {false, true}) {
    TokenSampler a(sources, opts(3, 10, 1, 2, shuffle, 99));
    std::string saved;
    std::vector<TokenBatch> after;
    for (int i = 0; i < 50; ++i) {
      if (i == 21) saved = a.cursor().to_json();
      TokenBatch b = a.next();
      if (i >= 21) after.push_back(b);
    }
    const DataCursor c = DataCursor::from_json(saved);
    EXPECT_EQ(c.to_json(), saved);
    ASSERT_EQ(c.sources.size(), 2u);
    EXPECT_EQ(c.sources[1].epoch, 1);  // source 1 mid-way through its second epoch
    EXPECT_GT(c.sources[1].position, 0);
    EXPECT_LT(c.sources[1].position, 25);
    // A fresh sampler continues it; so do other dp layouts (the cursor is
    // global).
    TokenSampler b(sources, opts(3, 10, 1, 2, shuffle, 99));
    b.restore(c);
    for (size_t i = 0; i < after.size(); ++i) {
      ASSERT_TRUE(same_batches(b.next(), after[i])) << "batch " << i;
    }
    EXPECT_EQ(a.cursor(), b.cursor());
    TokenSampler one(sources, opts(6, 10, 0, 1, shuffle, 99));
    one.restore(c);
    TokenSampler a2(sources, opts(3, 10, 0, 2, shuffle, 99));
    a2.restore(c);
    TokenSampler a3(sources, opts(3, 10, 1, 2, shuffle, 99));
    a3.restore(c);
    for (int i = 0; i < 10; ++i) {
      EXPECT_TRUE(at::cat({a2.next().inputs, a3.next().inputs}, 0).equal(one.next().inputs));
    }
  }
}

TEST(Blend, OneSourceIsTheSingleStreamSamplerOfEarlierVersions) {
  TempDir dir;
  const std::string path = write_source(dir, 0, 1001);  // 100 windows of 10
  auto stream = open_token_stream(path, "auto");
  for (bool shuffle : {false, true}) {
    for (int64_t dp : {1, 2}) {
      for (int64_t r = 0; r < dp; ++r) {
        TokenSampler by_stream(stream, opts(3, 10, r, dp, shuffle, 1234));
        TokenSampler by_paths(open_data_sources("data.path", {path}, {}, "auto"),
                              opts(3, 10, r, dp, shuffle, 1234));
        OldSampler old{100, 3, dp, r, shuffle, 1234};
        for (int step = 0; step < 80; ++step) {  // several epochs
          TokenBatch a = by_stream.next();
          ASSERT_TRUE(same_batches(a, by_paths.next())) << "step " << step;
          std::vector<int64_t> windows;
          for (const Row& row : rows_of(a, 10)) windows.push_back(row.window);
          ASSERT_EQ(windows, old.next()) << "step " << step << " dp " << dp << " rank " << r;
          EXPECT_EQ(by_stream.cursor().sources[0].epoch, old.epoch);
          EXPECT_EQ(by_stream.cursor().sources[0].position, old.position);
        }
      }
    }
  }
  // The single-stream JSON of earlier versions (no "taken") still loads.
  TokenSampler s(stream, opts(4, 10, 0, 1, true, 5));
  TokenSampler reference(stream, opts(4, 10, 0, 1, true, 5));
  for (int i = 0; i < 37; ++i) reference.next();  // epoch 1, position 48
  s.restore(DataCursor::from_json(R"({"epoch":1,"num_windows":100,"position":48,)"
                                  R"("seed":5,"seq_len":10,"shuffle":true})"));
  for (int i = 0; i < 30; ++i) ASSERT_TRUE(same_batches(s.next(), reference.next())) << i;
  EXPECT_EQ(reference.cursor().to_json(),
            R"({"epoch":2,"num_windows":100,"position":68,"seed":5,"seq_len":10,)"
            R"("shuffle":true,"taken":268})");
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Blend, RestoreRefusesAnotherBlend) {
  TempDir dir;
  auto sources = blend(dir, {3001, 251}, {0.75, 0.25});
  TokenSampler a(sources, opts(2, 10, 0, 1, true, 1));
  for (int i = 0; i < 5; ++i) a.next();
  const DataCursor c = a.cursor();
  const auto restore_into = [&](std::vector<DataSource> s, SamplerOptions o) {
    return error_of([&] { TokenSampler(std::move(s), o).restore(c); });
  };
  // Other weights.
  TempDir d1, d2, d3, d4;
  auto e = restore_into(blend(d1, {3001, 251}, {0.5, 0.5}), opts(2, 10, 0, 1, true, 1));
  EXPECT_NE(e.find("share of 0.75 for data.paths[0]"), std::string::npos) << e;
  EXPECT_NE(e.find("0.5 now"), std::string::npos) << e;
  // Weights that normalise to the same shares are the same blend.
  EXPECT_EQ(restore_into(blend(d2, {3001, 251}, {3, 1}), opts(2, 10, 0, 1, true, 1)),
            "(no error)");
  // Another source size.
  e = restore_into(blend(d3, {3001, 301}, {0.75, 0.25}), opts(2, 10, 0, 1, true, 1));
  EXPECT_NE(e.find("saved for 25 windows but data.paths[1]"), std::string::npos) << e;
  // Another number of sources, and one stream.
  e = restore_into(blend(d4, {3001, 251, 101}, {0.75, 0.2, 0.05}), opts(2, 10, 0, 1, true, 1));
  EXPECT_NE(e.find("a blend of 2 sources"), std::string::npos) << e;
  EXPECT_NE(e.find("a blend of 3 sources"), std::string::npos) << e;
  e = restore_into({sources[0]}, opts(2, 10, 0, 1, true, 1));
  EXPECT_NE(e.find("one token stream"), std::string::npos) << e;
  // seq_len, shuffle and seed.
  EXPECT_NE(restore_into(sources, opts(2, 20, 0, 1, true, 1)).find("seq_len"), std::string::npos);
  EXPECT_NE(restore_into(sources, opts(2, 10, 0, 1, false, 1)).find("data.shuffle"),
            std::string::npos);
  EXPECT_NE(restore_into(sources, opts(2, 10, 0, 1, true, 2)).find("seed"), std::string::npos);
  // A one-stream cursor into a blend.
  TokenSampler single(sources[0].tokens, opts(2, 10, 0, 1, true, 1));
  const DataCursor one = single.cursor();
  e = error_of([&] { TokenSampler(sources, opts(2, 10, 0, 1, true, 1)).restore(one); });
  EXPECT_NE(e.find("saved for one token stream"), std::string::npos) << e;
  // Malformed blend cursors.
  EXPECT_THROW(DataCursor::from_json(R"({"seq_len":10,"shuffle":false,"seed":0,)"
                                     R"("sources":[{"path":"a","num_windows":3}]})"),
               FileError);
  EXPECT_THROW(DataCursor::from_json(R"({"seq_len":10,"shuffle":false,"seed":0,"sources":[]})"),
               FileError);
}

TEST(Blend, BadSourcesAreNamed) {
  TempDir dir;
  const std::string a = write_source(dir, 0, 1001);
  // A glob that matches nothing: the key, its index and the pattern.
  auto e = error_of([&] {
    open_data_sources("data.paths", {a, dir.file("none/*.tok")}, {0.5, 0.5}, "auto");
  });
  EXPECT_NE(e.find("data.paths[1]"), std::string::npos) << e;
  EXPECT_NE(e.find("none/*.tok"), std::string::npos) << e;
  EXPECT_THROW(open_data_sources("data.paths", {a, dir.file("x.u32")}, {1, 1}, "auto"), FileError);
  EXPECT_THROW(open_data_sources("data.paths", {a, a}, {1}, "auto"), ConfigError);
  EXPECT_THROW(open_data_sources("data.paths", {}, {}, "auto"), ConfigError);
  // Weights must be > 0.
  auto sources = open_data_sources("data.paths", {a, a}, {1, 1}, "auto");
  sources[1].weight = 0;
  e = error_of([&] { TokenSampler(sources, opts(2, 10)); });
  EXPECT_NE(e.find("data.weights[1] = 0"), std::string::npos) << e;
  sources[1].weight = -0.5;
  EXPECT_THROW(TokenSampler(sources, opts(2, 10)), ConfigError);
  // A source smaller than its share of one global step: named.
  const std::string tiny = write_source(dir, 1, 31);  // 3 windows of 10
  e = error_of([&] {
    TokenSampler(open_data_sources("data.paths", {a, tiny}, {1, 1}, "auto"), opts(4, 10, 0, 2));
  });
  EXPECT_NE(e.find("data.paths[1]"), std::string::npos) << e;
  EXPECT_NE(e.find("3 windows"), std::string::npos) << e;
  EXPECT_NO_THROW(
      TokenSampler(open_data_sources("data.paths", {a, tiny}, {1, 1}, "auto"), opts(3, 10, 0, 2)));
}

TEST(Blend, DescribeNamesEachSourceWithItsShare) {
  TempDir dir;
  TokenSampler s(blend(dir, {3001, 251}, {0.7, 0.3}), opts(2, 10));
  const std::string d = s.describe();
  EXPECT_NE(d.find("blend of 2 sources"), std::string::npos) << d;
  EXPECT_NE(d.find("src0.u32' 3001 tokens, 300 windows, share 0.7"), std::string::npos) << d;
  EXPECT_NE(d.find("src1.u32' 251 tokens, 25 windows, share 0.3"), std::string::npos) << d;
  EXPECT_DOUBLE_EQ(s.share(0), 0.7);
  EXPECT_EQ(s.steps_per_epoch(1), 41);  // 25 / (0.3 x 2)
}

TEST(Blend, EvalFilesAreThoseOfTheSourcesThatHaveOne) {
  TempDir dir;
  const std::string a = dir.file("a.u32"), b = dir.file("b.u32");
  write_bytes(a, "\0\0\0\0", 4);
  write_bytes(b, "\0\0\0\0", 4);
  EXPECT_TRUE(resolve_val_paths({a, b}, "").empty());
  write_bytes(dir.file("b.val.u32"), "\0\0\0\0", 4);
  EXPECT_EQ(resolve_val_paths({a, b}, ""), std::vector<std::string>{dir.file("b.val.u32")});
  write_bytes(dir.file("a.val.u32"), "\0\0\0\0", 4);
  EXPECT_EQ(resolve_val_paths({a, b}, ""),
            (std::vector<std::string>{dir.file("a.val.u32"), dir.file("b.val.u32")}));
  // data.val_path wins, globs expanded; a glob source has no derived file.
  EXPECT_EQ(resolve_val_paths({a, b}, dir.file("b.val.u32")),
            std::vector<std::string>{dir.file("b.val.u32")});
  EXPECT_EQ(resolve_val_paths({a, b}, dir.file("*.val.u32")),
            (std::vector<std::string>{dir.file("a.val.u32"), dir.file("b.val.u32")}));
  EXPECT_TRUE(resolve_val_paths({dir.file("*.u32")}, "").empty());
}

}  // namespace
}  // namespace viaduct::data
