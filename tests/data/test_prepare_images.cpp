// prepare-images against independent encoders and hand-built inputs: images
// written by Pillow (python3-pil) and ImageMagick decode back to the pixels
// the encoders were given (PNG, lossless WebP) or within JPEG's tolerance;
// WebDataset shards built with Python's tarfile, a JSONL list and IDX files
// hold every bad case, each reported with its file and key and skipped, or,
// with --strict, stopping the run with nothing written. The fixtures come
// from tests/data/make_image_fixtures.py.
#include <gtest/gtest.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "data/image_decode.h"
#include "data/image_text_file.h"
#include "data/prepare_images.h"
#include "temp_dir.h"

namespace viaduct::data {
namespace {

using testing::TempDir;
namespace fs = std::filesystem;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The fixtures, written once for the binary.
const std::string& fixtures() {
  static TempDir* dir = [] {
    auto* d = new TempDir();
    const std::string cmd = std::string("/usr/bin/python3 ") + VIADUCT_SOURCE_DIR +
                            "/tests/data/make_image_fixtures.py " + d->path().string();
    // python3-pil and imagemagick (scripts/setup.sh's test packages).
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    return d;
  }();
  static const std::string path = dir->path().string();
  return path;
}
std::string fx(const std::string& name) { return fixtures() + "/" + name; }

RgbImage decode_file(const std::string& path) {
  const auto bytes = slurp(path);
  return decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

RgbImage raw_rgb(const std::string& path, int64_t w, int64_t h, bool grey = false) {
  const auto bytes = slurp(path);
  RgbImage im;
  im.width = w;
  im.height = h;
  for (unsigned char b : bytes) {
    for (int k = 0; k < (grey ? 3 : 1); ++k) im.pixels.push_back(b);
  }
  EXPECT_EQ(static_cast<int64_t>(im.pixels.size()), w * h * 3) << path;
  return im;
}

void expect_same_pixels(const RgbImage& got, const RgbImage& ref, const std::string& what) {
  ASSERT_EQ(got.width, ref.width) << what;
  ASSERT_EQ(got.height, ref.height) << what;
  EXPECT_EQ(got.pixels, ref.pixels) << what;
}

TEST(ImageDecode, PngAndLosslessWebpGiveTheEncodersPixelsExactly) {
  expect_same_pixels(decode_file(fx("rgb.png")), raw_rgb(fx("rgb.raw"), 37, 23), "RGB PNG (Pillow)");
  expect_same_pixels(decode_file(fx("grey.png")), raw_rgb(fx("grey.raw"), 37, 23, true),
                     "grey PNG (Pillow)");
  expect_same_pixels(decode_file(fx("palette.png")), raw_rgb(fx("palette.raw"), 37, 23),
                     "palette PNG (Pillow)");
  expect_same_pixels(decode_file(fx("magick.png")), raw_rgb(fx("magick.raw"), 19, 11),
                     "PNG (ImageMagick)");
  expect_same_pixels(decode_file(fx("rgb.webp")), raw_rgb(fx("rgb.raw"), 37, 23),
                     "lossless WebP (Pillow)");
}

TEST(ImageDecode, JpegIsWithinItsTolerance) {
  const auto got = decode_file(fx("smooth.jpg"));
  const auto ref = raw_rgb(fx("smooth.raw"), 40, 32);
  ASSERT_EQ(got.width, 40);
  ASSERT_EQ(got.height, 32);
  double sum = 0;
  int worst = 0;
  for (size_t i = 0; i < ref.pixels.size(); ++i) {
    const int d = std::abs(int{got.pixels[i]} - int{ref.pixels[i]});
    sum += d;
    worst = std::max(worst, d);
  }
  // Quality 95 on a smooth gradient: a pixel or two off on average.
  EXPECT_LT(sum / static_cast<double>(ref.pixels.size()), 2.0);
  EXPECT_LE(worst, 24);
}

TEST(ImageDecode, BadBytesAreImageErrorsSayingWhy) {
  auto expect_error = [](const std::string& bytes, const std::string& why) {
    try {
      decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ADD_FAILURE() << "decoded: " << why;
    } catch (const ImageError& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  expect_error("", "zero bytes");
  expect_error("plain text, no image", "not an image");
  const auto png = slurp(fx("rgb.png")), jpg = slurp(fx("smooth.jpg"));
  expect_error(png.substr(0, png.size() / 2), "PNG");
  expect_error(jpg.substr(0, jpg.size() / 2), "JPEG");
  // Cut in its last scan: libjpeg only warns ("Premature end of JPEG file")
  // and fills grey; viaduct refuses it.
  expect_error(jpg.substr(0, jpg.size() - 40), "JPEG");
  expect_error(slurp(fx("rgb.webp")).substr(0, 40), "WebP");
}

TEST(ImageFit, SameSizeIsExactCropTakesTheMiddlePadIsBlack) {
  const auto ref = raw_rgb(fx("rgb.raw"), 37, 23);
  ASSERT_EQ(ref.pixels.size(), 37u * 23u * 3u) << "the fixture rgb.raw is missing or short";
  // Same size: every pixel, channel-major.
  RgbImage square;
  square.width = square.height = 23;
  for (int64_t y = 0; y < 23; ++y) {
    for (int64_t x = 0; x < 23; ++x) {
      for (int64_t c = 0; c < 3; ++c) square.pixels.push_back(ref.pixels[(y * 37 + x) * 3 + c]);
    }
  }
  const auto same = fit_image(square, 23, ImageFit::kCrop);
  for (int64_t c = 0; c < 3; ++c) {
    for (int64_t y = 0; y < 23; ++y) {
      for (int64_t x = 0; x < 23; ++x) {
        ASSERT_EQ(same[(c * 23 + y) * 23 + x], square.pixels[(y * 23 + x) * 3 + c]);
      }
    }
  }
  // Crop of a 37 x 23 image to 23: no scaling, the middle 23 columns (7..29).
  const auto crop = fit_image(ref, 23, ImageFit::kCrop);
  for (int64_t y = 0; y < 23; ++y) {
    for (int64_t x = 0; x < 23; ++x) {
      ASSERT_EQ(crop[(0 * 23 + y) * 23 + x], ref.pixels[(y * 37 + x + 7) * 3 + 0]) << y << " " << x;
    }
  }
  // Pad of a constant 40 x 20 image to 10: 10 x 5 of the colour, 2-3 rows of black.
  RgbImage wide;
  wide.width = 40;
  wide.height = 20;
  wide.pixels.assign(40 * 20 * 3, 0);
  for (size_t i = 0; i < wide.pixels.size(); i += 3) {
    wide.pixels[i] = 200;
    wide.pixels[i + 1] = 100;
    wide.pixels[i + 2] = 50;
  }
  const auto pad = fit_image(wide, 10, ImageFit::kPad);
  for (int64_t y = 0; y < 10; ++y) {
    const bool inside = y >= 2 && y < 7;  // (10 - 5) / 2 = 2
    for (int64_t x = 0; x < 10; ++x) {
      EXPECT_EQ(pad[(0 * 10 + y) * 10 + x], inside ? 200 : 0) << y << " " << x;
      EXPECT_EQ(pad[(2 * 10 + y) * 10 + x], inside ? 50 : 0) << y << " " << x;
    }
  }
}

TEST(ImageFit, HalvingIsTheTriangleFilterClosedForm) {
  // 1-D along x: a row 0, 255, 0, 255, ... halved. Output i's taps are
  // source 2i - 1 .. 2i + 2 with weights 1, 3, 3, 1 (/ 8), cut and
  // renormalised at the edges.
  RgbImage im;
  im.width = 8;
  im.height = 8;
  for (int64_t y = 0; y < 8; ++y) {
    for (int64_t x = 0; x < 8; ++x) {
      for (int c = 0; c < 3; ++c) im.pixels.push_back(x % 2 ? 255 : 0);
    }
  }
  const auto half = fit_image(im, 4, ImageFit::kCrop);
  auto src = [](int64_t x) { return x % 2 ? 255.0 : 0.0; };
  for (int64_t i = 0; i < 4; ++i) {
    double sum = 0, wsum = 0;
    const double w[4] = {1, 3, 3, 1};
    for (int k = 0; k < 4; ++k) {
      const int64_t x = 2 * i - 1 + k;
      if (x < 0 || x >= 8) continue;
      sum += w[k] * src(x);
      wsum += w[k];
    }
    const int expected = static_cast<int>(std::lround(sum / wsum));
    for (int64_t y = 0; y < 4; ++y) EXPECT_EQ(half[y * 4 + i], expected) << i;
  }
}

PrepareImagesOptions opts16() {
  PrepareImagesOptions o;
  o.image_size = 16;
  o.threads = 3;
  return o;
}

std::vector<int64_t> byte_caption(const std::string& text) {
  std::vector<int64_t> c;
  for (unsigned char ch : text) c.push_back(ch);
  c.push_back(256);
  return c;
}

TEST(PrepareImages, ShardSkipsEveryBadSampleNamingItsFileAndKey) {
  TempDir dir;
  const auto out = dir.file("mixed.img");
  const auto stats = prepare_images({{ImageInput::Kind::kTar, fx("mixed.tar"), ""}}, out, opts16());
  EXPECT_EQ(stats.records, 3);
  EXPECT_EQ(stats.skipped, 8);
  const std::vector<std::pair<std::string, std::string>> expected{
      {"s/003", "no caption"},  {"s/004", "no image"},   {"s/005", "zero bytes"},
      {"s/006", "PNG"},         {"s/007", "not an image"}, {"s/008", "\"caption\""},
      {"s/009", "JPEG"},        {"s/010", "empty caption"}};
  ASSERT_EQ(stats.problems.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(stats.problems[i].file, fx("mixed.tar"));
    EXPECT_EQ(stats.problems[i].key, expected[i].first);
    EXPECT_NE(stats.problems[i].reason.find(expected[i].second), std::string::npos)
        << expected[i].first << ": " << stats.problems[i].reason;
  }
  // The kept samples, in shard order, each the fitted image of its decode
  // (PNG and lossless WebP: of the encoder's own pixels).
  ImageTextFile f(out);
  ASSERT_EQ(f.size(), 3);
  EXPECT_EQ(f.image_size(), 16);
  EXPECT_EQ(f.caption(0), byte_caption("a smooth gradient"));
  EXPECT_EQ(f.caption(1), byte_caption("noise"));
  EXPECT_EQ(f.caption(2), byte_caption("lossless noise"));
  const auto noise = fit_image(raw_rgb(fx("rgb.raw"), 37, 23), 16, ImageFit::kCrop);
  EXPECT_TRUE(std::equal(noise.begin(), noise.end(), f.image(1)));
  EXPECT_TRUE(std::equal(noise.begin(), noise.end(), f.image(2)));
  const auto smooth = fit_image(decode_file(fx("smooth.jpg")), 16, ImageFit::kCrop);
  EXPECT_TRUE(std::equal(smooth.begin(), smooth.end(), f.image(0)));
  // The manifest: counts, the skipped samples, the source's size and CRC-32
  // (Python's zlib.crc32).
  const auto m = nlohmann::json::parse(slurp(out + ".json"));
  EXPECT_EQ(m["records"], 3);
  EXPECT_EQ(m["skipped"], 8);
  EXPECT_EQ(m["image_size"], 16);
  EXPECT_EQ(m["skipped_samples"].size(), 8u);
  EXPECT_EQ(m["skipped_samples"][0]["key"], "s/003");
  ASSERT_EQ(m["sources"].size(), 1u);
  EXPECT_EQ(m["sources"][0]["crc32"], slurp(fx("mixed.tar.crc")));
  EXPECT_EQ(m["sources"][0]["bytes"], static_cast<int64_t>(fs::file_size(fx("mixed.tar"))));
}

TEST(PrepareImages, StrictStopsAtTheFirstBadSampleAndWritesNothing) {
  TempDir dir;
  const auto out = dir.file("mixed.img");
  auto o = opts16();
  o.strict = true;
  try {
    prepare_images({{ImageInput::Kind::kTar, fx("mixed.tar"), ""}}, out, o);
    FAIL() << "--strict went past a bad sample";
  } catch (const FileError& e) {
    EXPECT_NE(std::string(e.what()).find("s/003"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(fx("mixed.tar")), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_empty(dir.path()));
  // A clean shard passes --strict.
  const auto stats = prepare_images({{ImageInput::Kind::kTar, fx("good.tar"), ""}}, out, o);
  EXPECT_EQ(stats.records, 3);
  EXPECT_EQ(stats.skipped, 0);
}

TEST(PrepareImages, TruncatedShardKeepsWhatPrecedesTheCut) {
  TempDir dir;
  const auto stats = prepare_images({{ImageInput::Kind::kTar, fx("truncated.tar"), ""}},
                                    dir.file("t.img"), opts16());
  EXPECT_EQ(stats.records, 1);
  ASSERT_EQ(stats.problems.size(), 1u);
  EXPECT_EQ(stats.problems[0].key, "s/001");
  EXPECT_NE(stats.problems[0].reason.find("truncated"), std::string::npos)
      << stats.problems[0].reason;
  // Not a tar at all: refused, whatever its size.
  for (const std::string name : {"list.jsonl", "rgb.png"}) {
    try {
      prepare_images({{ImageInput::Kind::kTar, fx(name), ""}}, dir.file("u.img"), opts16());
      ADD_FAILURE() << name << " read as a tar";
    } catch (const FileError& e) {
      EXPECT_NE(std::string(e.what()).find("not a tar file"), std::string::npos) << e.what();
    }
  }
  EXPECT_FALSE(fs::exists(dir.file("u.img")));
}

// pax extended headers (Python's default format, GNU tar's --format=pax) and
// GNU long-name entries name entries past ustar's 100 bytes: read by their
// full names, the samples are the ustar shard's, and a bad one is reported
// under its full key. Two of the names differ only after byte 100, so a
// reader of the ustar fields alone would pair the wrong images and captions.
TEST(PrepareImages, LongAndNonAsciiNamesFromPaxAndGnuHeaders) {
  const std::string long_dir = "d/" + std::string(120, 'x') + "/";
  const auto noise = fit_image(raw_rgb(fx("rgb.raw"), 37, 23), 16, ImageFit::kCrop);
  const auto smooth = fit_image(decode_file(fx("smooth.jpg")), 16, ImageFit::kCrop);
  for (const std::string shard : {"pax.tar", "gnu.tar"}) {
    SCOPED_TRACE(shard);
    TempDir dir;
    const auto out = dir.file("long.img");
    const auto stats = prepare_images({{ImageInput::Kind::kTar, fx(shard), ""}}, out, opts16());
    EXPECT_EQ(stats.records, 3);
    ASSERT_EQ(stats.problems.size(), 1u);
    EXPECT_EQ(stats.problems[0].key, long_dir + "003");
    EXPECT_NE(stats.problems[0].reason.find("no caption"), std::string::npos);
    ImageTextFile f(out);
    ASSERT_EQ(f.size(), 3);
    EXPECT_EQ(f.caption(0), byte_caption("a smooth gradient"));
    EXPECT_EQ(f.caption(1), byte_caption("noise"));
    EXPECT_EQ(f.caption(2), byte_caption("lossless noise"));
    EXPECT_TRUE(std::equal(smooth.begin(), smooth.end(), f.image(0)));
    EXPECT_TRUE(std::equal(noise.begin(), noise.end(), f.image(1)));
    EXPECT_TRUE(std::equal(noise.begin(), noise.end(), f.image(2)));
  }
}

// A gzipped shard gives the samples of the same shard plain; a gzip stream
// cut short is refused naming the file, with nothing written.
TEST(PrepareImages, GzippedShardIsThePlainShard) {
  TempDir dir;
  const auto plain = dir.file("plain.img"), gz = dir.file("gz.img");
  prepare_images({{ImageInput::Kind::kTar, fx("good.tar"), ""}}, plain, opts16());
  const auto stats =
      prepare_images({{ImageInput::Kind::kTar, fx("good.tar.gz"), ""}}, gz, opts16());
  EXPECT_EQ(stats.records, 3);
  EXPECT_EQ(stats.skipped, 0);
  // The same records, byte for byte (the manifests differ in the source).
  EXPECT_EQ(slurp(plain), slurp(gz));
  try {
    prepare_images({{ImageInput::Kind::kTar, fx("good.tgz"), ""}}, dir.file("cut.img"),
                   opts16());
    ADD_FAILURE() << "a truncated .tgz was read";
  } catch (const FileError& e) {
    EXPECT_NE(std::string(e.what()).find(fx("good.tgz")), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir.file("cut.img")));
}

// An entry's size from a pax `size` record (over a ustar field of 0) and from
// GNU's base-256 size field; a pax size that is not a number is refused.
TEST(PrepareImages, SizesFromPaxRecordsAndBase256Fields) {
  TempDir dir;
  const auto out = dir.file("sizes.img");
  const auto stats = prepare_images({{ImageInput::Kind::kTar, fx("sizes.tar"), ""}}, out, opts16());
  EXPECT_EQ(stats.records, 2);
  EXPECT_EQ(stats.skipped, 0);
  ImageTextFile f(out);
  ASSERT_EQ(f.size(), 2);
  EXPECT_EQ(f.caption(0), byte_caption("noise"));
  EXPECT_EQ(f.caption(1), byte_caption("lossless noise"));
  const auto noise = fit_image(raw_rgb(fx("rgb.raw"), 37, 23), 16, ImageFit::kCrop);
  EXPECT_TRUE(std::equal(noise.begin(), noise.end(), f.image(0)));
  EXPECT_TRUE(std::equal(noise.begin(), noise.end(), f.image(1)));
  try {
    prepare_images({{ImageInput::Kind::kTar, fx("badpax.tar"), ""}}, dir.file("bad.img"),
                   opts16());
    ADD_FAILURE() << "a pax size that is not a number was read";
  } catch (const FileError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("pax size \"x\""), std::string::npos) << what;
    EXPECT_NE(what.find(fx("badpax.tar")), std::string::npos) << what;
  }
  EXPECT_FALSE(fs::exists(dir.file("bad.img")));
}

TEST(PrepareImages, JsonlListReadsPathsBesideItAndReportsBadLines) {
  TempDir dir;
  const auto stats = prepare_images({{ImageInput::Kind::kJsonl, fx("list.jsonl"), ""}},
                                    dir.file("l.img"), opts16());
  EXPECT_EQ(stats.records, 2);
  ASSERT_EQ(stats.problems.size(), 3u);
  EXPECT_NE(stats.problems[0].key.find("line 2"), std::string::npos);
  EXPECT_NE(stats.problems[0].reason.find("missing.png"), std::string::npos)
      << stats.problems[0].reason;
  EXPECT_NE(stats.problems[1].key.find("line 3"), std::string::npos);
  EXPECT_NE(stats.problems[1].reason.find("no caption"), std::string::npos);
  EXPECT_NE(stats.problems[2].key.find("line 4"), std::string::npos);
  ImageTextFile f(dir.file("l.img"));
  EXPECT_EQ(f.caption(1), byte_caption("grey noise"));
  const auto grey = fit_image(raw_rgb(fx("grey.raw"), 37, 23, true), 16, ImageFit::kCrop);
  EXPECT_TRUE(std::equal(grey.begin(), grey.end(), f.image(1)));
}

TEST(PrepareImages, IdxFilesWithACaptionTemplate) {
  TempDir dir;
  auto o = opts16();
  o.image_size = 4;  // 4 x 5 images: the middle rows, columns as they are
  o.caption_template = "a photo of a {label}";
  o.labels = {"cat", "dog", "bird"};
  for (const std::string ext : {"", ".gz"}) {
    const auto out = dir.file("idx" + ext + ".img");
    const auto stats = prepare_images(
        {{ImageInput::Kind::kIdx, fx("idx-images" + ext), fx("idx-labels" + ext)}}, out, o);
    EXPECT_EQ(stats.records, 3);
    ImageTextFile f(out);
    EXPECT_EQ(f.caption(0), byte_caption("a photo of a bird"));  // labels 2, 0, 1
    EXPECT_EQ(f.caption(1), byte_caption("a photo of a cat"));
    EXPECT_EQ(f.caption(2), byte_caption("a photo of a dog"));
    // Grey in every channel; 5 rows of 4 cropped to rows 0..3 (the middle
    // starts at (5 - 4) / 2 = 0).
    const auto px = slurp(fx("idx-pixels.raw"));
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t c = 0; c < 3; ++c) {
        for (int64_t y = 0; y < 4; ++y) {
          for (int64_t x = 0; x < 4; ++x) {
            ASSERT_EQ(f.image(i)[(c * 4 + y) * 4 + x],
                      static_cast<uint8_t>(px[static_cast<size_t>(i * 20 + y * 4 + x)]))
                << i << " " << c << " " << y << " " << x;
          }
        }
      }
    }
  }
  // A label without a name: that sample is skipped, naming it.
  const auto stats = prepare_images(
      {{ImageInput::Kind::kIdx, fx("idx-images"), fx("idx-labels-bad")}}, dir.file("b.img"), o);
  EXPECT_EQ(stats.records, 2);
  ASSERT_EQ(stats.problems.size(), 1u);
  EXPECT_EQ(stats.problems[0].key, "image 2");
  EXPECT_NE(stats.problems[0].reason.find("label 7"), std::string::npos);
}

}  // namespace
}  // namespace viaduct::data
