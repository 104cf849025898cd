// Image-text files and their rows in the sampler (see Note [Image-text rows],
// data/sampler.h), against hand-built files whose record r has image bytes
// and caption tokens that name r: a row's placeholders, caption, targets and
// image are checked against the row built here by hand; resumed cursors
// and data-parallel shards against the uninterrupted one-rank run.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/check.h"
#include "data/image_text_file.h"
#include "data/sampler.h"
#include "fixtures.h"
#include "temp_dir.h"

namespace viaduct::data {
namespace {

using testing::TempDir;
using testing::opts;

constexpr int64_t kC = 3, kS = 4;  // 3 x 4 x 4 images

// Record r: every pixel of channel c is (r * 7 + c) % 256; caption r % 4 + 1
// tokens 10 r + j, then the end of text 256.
std::vector<uint8_t> image_of(int64_t r) {
  std::vector<uint8_t> img(static_cast<size_t>(kC * kS * kS));
  for (int64_t c = 0; c < kC; ++c) {
    std::fill_n(img.begin() + c * kS * kS, kS * kS, static_cast<uint8_t>((r * 7 + c) % 256));
  }
  return img;
}
std::vector<int64_t> caption_of(int64_t r) {
  std::vector<int64_t> c;
  for (int64_t j = 0; j < r % 4 + 1; ++j) c.push_back((10 * r + j) % 256);
  c.push_back(256);
  return c;
}

std::string write_records(const TempDir& dir, const std::string& name, int64_t n) {
  const auto path = dir.file(name);
  ImageTextWriter w(path, kC, kS, 320, "byte");
  for (int64_t r = 0; r < n; ++r) w.append(image_of(r).data(), caption_of(r));
  w.finish();
  return path;
}

SamplerOptions image_opts(int64_t B, int64_t T, int64_t P, int64_t rank = 0, int64_t dp = 1,
                          bool shuffle = false) {
  auto o = opts(B, T, rank, dp, shuffle, 77);
  o.image_tokens = P;
  o.image_token_id = 319;
  return o;
}

DataSource image_source(const std::string& path) {
  DataSource s;
  s.path = path;
  s.images = std::make_shared<const ImageTextFile>(path);
  return s;
}

// The record a row holds, from its image's first byte.
int64_t record_of(const TokenBatch& b, int64_t row, int64_t n) {
  const int64_t v = b.images[row][0][0][0][0].item<uint8_t>();
  for (int64_t r = 0; r < n; ++r) {
    if ((r * 7) % 256 == v) return r;
  }
  return -1;
}

TEST(ImageTextFile, RoundTripsEveryRecord) {
  TempDir dir;
  const auto path = write_records(dir, "a.img", 9);
  ImageTextFile f(path);
  EXPECT_TRUE(is_image_text_file(path));
  EXPECT_EQ(f.size(), 9);
  EXPECT_EQ(f.channels(), kC);
  EXPECT_EQ(f.image_size(), kS);
  EXPECT_EQ(f.vocab_size(), 320);
  EXPECT_EQ(f.tokenizer(), "byte");
  int64_t tokens = 0;
  for (int64_t r = 0; r < 9; ++r) {
    const auto img = image_of(r);
    EXPECT_TRUE(std::equal(img.begin(), img.end(), f.image(r))) << r;
    EXPECT_EQ(f.caption(r), caption_of(r)) << r;
    tokens += static_cast<int64_t>(caption_of(r).size());
  }
  EXPECT_EQ(f.caption_tokens(), tokens);
  EXPECT_EQ(f.max_caption_length(), 5);
  EXPECT_EQ(f.max_token(), 256);
}

TEST(ImageTextFile, RefusesTruncatedAndForeignFiles) {
  TempDir dir;
  const auto path = write_records(dir, "a.img", 4);
  const auto size = std::filesystem::file_size(path);
  std::filesystem::resize_file(path, size - 3);
  try {
    ImageTextFile f(path);
    FAIL() << "a truncated file opened";
  } catch (const FileError& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  testing::write_phrase_corpus(dir.file("t.tok"), 100);
  EXPECT_FALSE(is_image_text_file(dir.file("t.tok")));
  EXPECT_THROW(ImageTextFile(dir.file("t.tok")), FileError);
}

TEST(ImageTextFile, WriterDroppedUnfinishedLeavesNothing) {
  TempDir dir;
  {
    ImageTextWriter w(dir.file("x.img"), kC, kS, 320, "byte");
    w.append(image_of(0).data(), caption_of(0));
    EXPECT_THROW(w.append(image_of(1).data(), {400}), Error);  // outside the vocab
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(ImageTextSampler, RowsArePlaceholdersThenTheCaptionWithLossOnTheCaptionOnly) {
  TempDir dir;
  const auto path = write_records(dir, "a.img", 6);
  const int64_t T = 7, P = 3;
  TokenSampler s({image_source(path)}, image_opts(3, T, P));
  for (int step = 0; step < 2; ++step) {
    const auto b = s.next();
    ASSERT_TRUE(b.images.defined());
    EXPECT_EQ(b.images.sizes(), (std::vector<int64_t>{3, 1, kC, kS, kS}));
    EXPECT_EQ(b.images.scalar_type(), at::kByte);
    for (int64_t row = 0; row < 3; ++row) {
      const int64_t r = step * 3 + row;  // in order without shuffle
      // The reference row: P placeholders, the caption, cut at T + 1.
      std::vector<int64_t> seq(P, 319);
      for (int64_t t : caption_of(r)) seq.push_back(t);
      std::vector<int64_t> in(T, 0), tgt(T, -100);
      for (int64_t t = 0; t < T && t < static_cast<int64_t>(seq.size()); ++t) in[t] = seq[t];
      for (int64_t t = P - 1; t + 1 < static_cast<int64_t>(seq.size()) && t < T; ++t) {
        tgt[t] = seq[t + 1];
      }
      for (int64_t t = 0; t < T; ++t) {
        EXPECT_EQ(b.inputs[row][t].item<int64_t>(), in[t]) << "record " << r << " t " << t;
        EXPECT_EQ(b.targets[row][t].item<int64_t>(), tgt[t]) << "record " << r << " t " << t;
      }
      const auto img = image_of(r);
      EXPECT_TRUE(std::equal(img.begin(), img.end(), b.images[row].contiguous().data_ptr<uint8_t>()))
          << r;
    }
  }
  // Record 3 has 4 + 1 caption tokens: P + 5 = 8 = T + 1, all of them
  // targets; the first is predicted at the last placeholder.
  TokenSampler again({image_source(path)}, image_opts(1, T, P));
  for (int i = 0; i < 3; ++i) again.next();
  const auto b = again.next();
  EXPECT_EQ(b.targets[0][P - 1].item<int64_t>(), 30);
  EXPECT_EQ((b.targets[0] != -100).sum().item<int64_t>(), 5);
}

TEST(ImageTextSampler, CaptionHoldingThePlaceholderIdIsRefused) {
  // A caption token equal to the placeholder id would take a patch in the
  // merge; the row builder refuses it, naming the record and the file.
  TempDir dir;
  const auto path = dir.file("p.img");
  {
    ImageTextWriter w(path, kC, kS, 320, "byte");
    w.append(image_of(0).data(), caption_of(0));
    w.append(image_of(1).data(), {5, 319, 256});
    w.finish();
  }
  TokenSampler s({image_source(path)}, image_opts(1, 8, 2));
  EXPECT_NO_THROW(s.next());
  try {
    s.next();
    FAIL() << "a caption holding the placeholder id was taken";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("record 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("319"), std::string::npos) << msg;
  }
}

TEST(ImageTextSampler, ResumedCursorContinuesBitwiseAndDpRanksStackToOneRank) {
  TempDir dir;
  const auto path = write_records(dir, "a.img", 23);
  const int64_t T = 8, P = 2;
  TokenSampler whole({image_source(path)}, image_opts(4, T, P, 0, 1, true));
  std::vector<TokenBatch> reference;
  DataCursor at3;
  for (int i = 0; i < 12; ++i) {  // 23 records, 5 steps an epoch: crosses two epochs
    if (i == 3) at3 = whole.cursor();
    reference.push_back(whole.next());
  }
  // Not vacuous: shuffled, and epoch 1 is another order than epoch 0.
  std::vector<int64_t> order0, order1;
  for (int i = 0; i < 5; ++i) {
    for (int64_t r = 0; r < 4; ++r) {
      (i < 5 ? order0 : order1).push_back(record_of(reference[i], r, 23));
    }
  }
  for (int i = 5; i < 10; ++i) {
    for (int64_t r = 0; r < 4; ++r) order1.push_back(record_of(reference[i], r, 23));
  }
  EXPECT_NE(order0, order1);
  std::vector<int64_t> sorted0 = order0;
  std::sort(sorted0.begin(), sorted0.end());
  EXPECT_NE(order0, sorted0);
  // A restore into a fresh sampler.
  TokenSampler resumed({image_source(path)}, image_opts(4, T, P, 0, 1, true));
  resumed.restore(DataCursor::from_json(at3.to_json()));
  for (int i = 3; i < 12; ++i) {
    const auto b = resumed.next();
    EXPECT_TRUE(torch::equal(b.inputs, reference[i].inputs)) << i;
    EXPECT_TRUE(torch::equal(b.targets, reference[i].targets)) << i;
    EXPECT_TRUE(torch::equal(b.images, reference[i].images)) << i;
  }
  // Two data-parallel ranks of 2 rows each: stacked, the one-rank batch.
  TokenSampler r0({image_source(path)}, image_opts(2, T, P, 0, 2, true));
  TokenSampler r1({image_source(path)}, image_opts(2, T, P, 1, 2, true));
  for (int i = 0; i < 12; ++i) {
    const auto a = r0.next(), b = r1.next();
    EXPECT_TRUE(torch::equal(at::cat({a.images, b.images}), reference[i].images)) << i;
    EXPECT_TRUE(torch::equal(at::cat({a.targets, b.targets}), reference[i].targets)) << i;
  }
}

TEST(ImageTextSampler, MicroBatchesAndEvalCarryTheImages) {
  TempDir dir;
  const auto path = write_records(dir, "a.img", 8);
  TokenSampler s({image_source(path)}, image_opts(4, 8, 2));
  const auto b = s.next();
  const auto mbs = split_microbatches(b, 2);
  ASSERT_EQ(mbs.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(torch::equal(mbs[i].images, b.images.narrow(0, 2 * i, 2)));
    EXPECT_TRUE(torch::equal(mbs[i].inputs, b.inputs.narrow(0, 2 * i, 2)));
  }
  // Eval: the first records in order, as the sampler's first batches.
  EvalLoader eval(std::make_shared<const ImageTextFile>(path), image_opts(4, 8, 2), 5);
  EXPECT_EQ(eval.num_batches(), 2);  // 8 records, 4 a batch
  EXPECT_TRUE(torch::equal(eval.batch(0).images, b.images));
  EXPECT_TRUE(torch::equal(eval.batch(0).targets, b.targets));
}

TEST(ImageTextSampler, RefusesAModelWithoutTowerShortRowsAndMixedBlends) {
  TempDir dir;
  const auto path = write_records(dir, "a.img", 8);
  try {
    TokenSampler s({image_source(path)}, opts(2, 8));
    FAIL() << "image-text data without a tower";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("model.vision"), std::string::npos) << e.what();
  }
  EXPECT_THROW(TokenSampler({image_source(path)}, image_opts(2, 4, 4)), ConfigError);
  testing::write_phrase_corpus(dir.file("t.tok"), 1000);
  auto sources = open_data_sources("data.paths", {path, dir.file("t.tok")}, {}, "auto");
  ASSERT_TRUE(sources[0].images);
  ASSERT_TRUE(sources[1].tokens);
  try {
    TokenSampler s(sources, image_opts(2, 8, 2));
    FAIL() << "a blend of image-text and token data";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("mixes"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace viaduct::data
