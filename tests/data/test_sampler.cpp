// The sampler against the plain reference: a stream whose token i is i, so
// every row names its window. Determinism, dp shards, epochs, resume, eval
// and micro-batching.
#include <gtest/gtest.h>

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

// Tokens 0..n-1 as one uint32 file (or split over several files).
std::shared_ptr<const TokenStream> iota_stream(const TempDir& dir, int64_t n,
                                               int shards = 1) {
  std::vector<std::string> paths;
  int64_t begin = 0;
  for (int k = 0; k < shards; ++k) {
    int64_t end = n * (k + 1) / shards;
    std::vector<uint32_t> v;
    for (int64_t i = begin; i < end; ++i) v.push_back(static_cast<uint32_t>(i));
    paths.push_back(dir.file("iota_" + std::to_string(k) + ".u32"));
    write_bytes(paths.back(), v.data(), v.size() * 4);
    begin = end;
  }
  return open_token_stream(paths, "auto");
}

// The window of each row (token i == i, so row starts at window * T).
std::vector<int64_t> windows_of(const TokenBatch& b, int64_t T) {
  std::vector<int64_t> w;
  for (int64_t r = 0; r < b.inputs.size(0); ++r) {
    w.push_back(b.inputs[r][0].item<int64_t>() / T);
  }
  return w;
}

bool same(const TokenBatch& a, const TokenBatch& b) {
  return a.inputs.equal(b.inputs) && a.targets.equal(b.targets);
}

TEST(TokenSampler, TargetsAreShiftedInputsAndWindowsAreContiguous) {
  TempDir dir;
  const int64_t T = 10;
  TokenSampler s(iota_stream(dir, 1001), opts(4, T));
  EXPECT_EQ(s.num_windows(), 100);
  EXPECT_EQ(s.steps_per_epoch(), 25);
  for (int step = 0; step < 3; ++step) {
    TokenBatch b = s.next();
    ASSERT_EQ(b.inputs.sizes(), (std::vector<int64_t>{4, T}));
    ASSERT_EQ(b.targets.sizes(), (std::vector<int64_t>{4, T}));
    EXPECT_EQ(b.inputs.scalar_type(), at::kLong);
    EXPECT_TRUE(
        b.inputs.narrow(1, 1, T - 1).equal(b.targets.narrow(1, 0, T - 1)));
    // Row r is window step * 4 + r: tokens [w T, w T + T].
    at::Tensor w = at::arange(4, at::kLong).add(step * 4).unsqueeze(1);
    at::Tensor t = at::arange(T, at::kLong).unsqueeze(0);
    EXPECT_TRUE(b.inputs.equal(w * T + t));
    EXPECT_TRUE(b.targets.equal(w * T + t + 1));
  }
}

TEST(TokenSampler, WindowsMayCrossShardBoundaries) {
  TempDir dir;
  TokenSampler one(iota_stream(dir, 503), opts(5, 7));
  TempDir dir2;
  TokenSampler three(iota_stream(dir2, 503, 3), opts(5, 7));
  for (int i = 0; i < 20; ++i) EXPECT_TRUE(same(one.next(), three.next()));
}

TEST(TokenSampler, IsDeterministic) {
  TempDir dir;
  auto stream = iota_stream(dir, 2000);
  for (bool shuffle : {false, true}) {
    TokenSampler a(stream, opts(3, 16, 0, 1, shuffle, 42));
    TokenSampler b(stream, opts(3, 16, 0, 1, shuffle, 42));
    for (int i = 0; i < 100; ++i) ASSERT_TRUE(same(a.next(), b.next()));
  }
  // Another seed draws another order.
  TokenSampler c(stream, opts(3, 16, 0, 1, true, 42));
  TokenSampler d(stream, opts(3, 16, 0, 1, true, 43));
  EXPECT_FALSE(same(c.next(), d.next()));
}

TEST(TokenSampler, ShuffledOrderIsPinned) {
  // The permutation is our own splitmix64 Fisher-Yates: the same on every
  // compiler and standard library. These values pin it (checked against an
  // independent Python transcription of the same algorithm).
  TempDir dir;
  TokenSampler s(iota_stream(dir, 1001), opts(1, 10, 0, 1, true, 1234));
  std::vector<int64_t> first;
  for (int i = 0; i < 6; ++i) first.push_back(s.window_at(0, i));
  EXPECT_EQ(first, (std::vector<int64_t>{47, 23, 66, 98, 32, 49}));
}

TEST(TokenSampler, DpShardsAreDisjointAndStackToTheSingleRankBatch) {
  TempDir dir;
  auto stream = iota_stream(dir, 1001);
  const int64_t T = 10;
  for (bool shuffle : {false, true}) {
    const int64_t dp = 4;
    TokenSampler single(stream, opts(8, T, 0, 1, shuffle, 7));
    std::vector<TokenSampler> ranks;
    for (int64_t r = 0; r < dp; ++r) {
      ranks.emplace_back(stream, opts(2, T, r, dp, shuffle, 7));
    }
    EXPECT_EQ(single.steps_per_epoch(), ranks[0].steps_per_epoch());
    // Two epochs: 12 steps each (96 of 100 windows).
    for (int64_t step = 0; step < 24; ++step) {
      std::vector<at::Tensor> in, tg;
      std::set<int64_t> windows;
      for (auto& r : ranks) {
        TokenBatch b = r.next();
        in.push_back(b.inputs);
        tg.push_back(b.targets);
        for (int64_t w : windows_of(b, T)) windows.insert(w);
      }
      EXPECT_EQ(windows.size(), 8u) << "ranks overlap at step " << step;
      TokenBatch reference = single.next();
      EXPECT_TRUE(at::cat(in, 0).equal(reference.inputs)) << "step " << step;
      EXPECT_TRUE(at::cat(tg, 0).equal(reference.targets)) << "step " << step;
    }
  }
}

TEST(TokenSampler, EpochsWrapAndShuffleVisitsEveryWindowOnce) {
  TempDir dir;
  auto stream = iota_stream(dir, 1001);  // 100 windows of 10
  TokenSampler plain(stream, opts(10, 10));
  std::vector<int64_t> first_epoch;
  for (int i = 0; i < 10; ++i) {
    for (int64_t w : windows_of(plain.next(), 10)) first_epoch.push_back(w);
  }
  EXPECT_EQ(plain.cursor().sources[0].epoch, 0);
  EXPECT_EQ(plain.cursor().sources[0].position, 100);
  EXPECT_EQ(
      windows_of(plain.next(), 10),
      std::vector<int64_t>(first_epoch.begin(), first_epoch.begin() + 10));
  EXPECT_EQ(plain.cursor().sources[0].epoch, 1);
  EXPECT_EQ(plain.cursor().sources[0].position, 10);

  TokenSampler shuffled(stream, opts(10, 10, 0, 1, true, 5));
  std::vector<std::vector<int64_t>> epochs(2);
  for (int e = 0; e < 2; ++e) {
    for (int i = 0; i < 10; ++i) {
      for (int64_t w : windows_of(shuffled.next(), 10)) epochs[e].push_back(w);
    }
    std::set<int64_t> set(epochs[e].begin(), epochs[e].end());
    EXPECT_EQ(set.size(), 100u);
    EXPECT_EQ(*set.rbegin(), 99);
  }
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_NE(epochs[0], first_epoch);
}

TEST(TokenSampler, ResumeReproducesTheContinuation) {
  TempDir dir;
  auto stream = iota_stream(dir, 1001);
  for (bool shuffle : {false, true}) {
    TokenSampler a(stream, opts(3, 10, 1, 2, shuffle, 99));  // 16 steps/epoch
    std::string saved;
    std::vector<TokenBatch> after;
    for (int i = 0; i < 40; ++i) {
      if (i == 13) saved = a.cursor().to_json();
      TokenBatch b = a.next();
      if (i >= 13) after.push_back(b);
    }
    TokenSampler b(stream, opts(3, 10, 1, 2, shuffle, 99));
    DataCursor c = DataCursor::from_json(saved);
    EXPECT_EQ(c.to_json(), saved);
    b.restore(c);
    for (size_t i = 0; i < after.size(); ++i) {
      ASSERT_TRUE(same(b.next(), after[i])) << "batch " << i;
    }
    EXPECT_EQ(a.cursor(), b.cursor());
  }
}

TEST(TokenSampler, CursorIsIndependentOfTheDpLayout) {
  TempDir dir;
  auto stream = iota_stream(dir, 1001);
  TokenSampler single(stream, opts(6, 10, 0, 1, true, 3));
  for (int i = 0; i < 20; ++i) single.next();
  const std::string saved = single.cursor().to_json();
  TokenSampler r0(stream, opts(3, 10, 0, 2, true, 3));
  TokenSampler r1(stream, opts(3, 10, 1, 2, true, 3));
  r0.restore(DataCursor::from_json(saved));
  r1.restore(DataCursor::from_json(saved));
  for (int i = 0; i < 20; ++i) {
    TokenBatch reference = single.next();
    EXPECT_TRUE(
        at::cat({r0.next().inputs, r1.next().inputs}, 0).equal(reference.inputs));
  }
}

TEST(TokenSampler, RestoreRefusesAnotherSampler) {
  TempDir dir;
  auto stream = iota_stream(dir, 1001);
  TokenSampler s(stream, opts(2, 10, 0, 1, true, 1));
  s.next();
  DataCursor c = s.cursor();
  EXPECT_THROW(TokenSampler(stream, opts(2, 20, 0, 1, true, 1)).restore(c),
               Error);
  EXPECT_THROW(TokenSampler(stream, opts(2, 10, 0, 1, false, 1)).restore(c),
               Error);
  EXPECT_THROW(TokenSampler(stream, opts(2, 10, 0, 1, true, 2)).restore(c),
               Error);
  TempDir other;
  EXPECT_THROW(TokenSampler(iota_stream(other, 901), opts(2, 10, 0, 1, true, 1))
                   .restore(c),
               Error);
  EXPECT_THROW(DataCursor::from_json("{\"epoch\": 1}"), FileError);
  EXPECT_THROW(DataCursor::from_json("not json"), FileError);
  EXPECT_THROW(
      DataCursor::from_json(R"({"epoch":-1,"position":0,"seq_len":10,)"
                            R"("num_windows":100,"shuffle":false,"seed":0})"),
      FileError);
}

TEST(TokenSampler, RefusesTooLittleDataAndBadOptions) {
  TempDir dir;
  auto stream = iota_stream(dir, 100);  // 9 windows of 11
  EXPECT_THROW(TokenSampler(stream, opts(5, 11, 0, 2)), ConfigError);
  EXPECT_NO_THROW(TokenSampler(stream, opts(9, 11)));
  EXPECT_THROW(TokenSampler(stream, opts(0, 11)), ConfigError);
  EXPECT_THROW(TokenSampler(stream, opts(1, 0)), ConfigError);
  EXPECT_THROW(TokenSampler(stream, opts(1, 11, 2, 2)), Error);
}

TEST(EvalLoader, AlwaysTheFirstBatchesAndShardedByRank) {
  TempDir dir;
  auto stream = iota_stream(dir, 1001);
  EvalLoader single(stream, opts(4, 10), 3);
  EvalLoader r0(stream, opts(2, 10, 0, 2), 3);
  EvalLoader r1(stream, opts(2, 10, 1, 2), 3);
  ASSERT_EQ(single.num_batches(), 3);
  for (int64_t i = 0; i < 3; ++i) {
    TokenBatch reference = single.batch(i);
    EXPECT_EQ(windows_of(reference, 10),
              (std::vector<int64_t>{4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3}));
    EXPECT_TRUE(
        at::cat({r0.batch(i).inputs, r1.batch(i).inputs}, 0).equal(reference.inputs));
    EXPECT_TRUE(same(single.batch(i), reference));  // no hidden state
  }
  EXPECT_EQ(single.batches().size(), 3u);
  EXPECT_THROW(single.batch(3), Error);
  // 100 windows hold 6 batches of 16: asked for 10, it serves 6.
  EXPECT_EQ(EvalLoader(stream, opts(16, 10), 10).num_batches(), 6);
  EXPECT_THROW(EvalLoader(stream, opts(101, 10), 1), ConfigError);
}

TEST(Microbatches, SplitAlongTheBatchDimension) {
  at::Tensor x = at::arange(8 * 5, at::kLong).reshape({8, 5});
  std::vector<at::Tensor> parts = split_microbatches(x, 4);
  ASSERT_EQ(parts.size(), 4u);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(parts[i].sizes(), (std::vector<int64_t>{2, 5}));
    EXPECT_TRUE(parts[i].equal(x.narrow(0, 2 * i, 2)));
    EXPECT_TRUE(parts[i].is_contiguous());
  }
  TokenBatch b{x, x + 1};
  std::vector<TokenBatch> mb = split_microbatches(b, 8);
  ASSERT_EQ(mb.size(), 8u);
  EXPECT_TRUE(mb[7].targets.equal(x.narrow(0, 7, 1) + 1));
  EXPECT_EQ(split_microbatches(x, 1).size(), 1u);
  try {
    split_microbatches(x, 3);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("8 rows into 3 micro-batches"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(split_microbatches(x, 0), ConfigError);
}

}  // namespace
}  // namespace viaduct::data
