// Token file formats against hand-written reference bytes: each format reads
// back what was written, and truncated or corrupt files are refused with the
// file named in the message.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "core/check.h"
#include "data/token_file.h"
#include "temp_dir.h"

namespace viaduct::data {
namespace {

using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;

// Runs `fn`, expects a FileError whose message holds every one of `parts`.
template <typename Fn>
void expect_file_error(Fn fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected a FileError";
  } catch (const FileError& e) {
    for (const auto& p : parts) {
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "message '" << e.what() << "' lacks '" << p << "'";
    }
  }
}

std::vector<int64_t> ramp(int64_t n, int64_t mod) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = (i * 7919) % mod;
  return v;
}

std::vector<int64_t> read_all(const TokenFile& f) {
  std::vector<int64_t> out(static_cast<size_t>(f.size()));
  f.read(0, f.size(), out.data());
  return out;
}

// A viaduct header built byte by byte, as the format is documented.
std::vector<uint8_t> viaduct_header(uint32_t version, uint32_t bpt,
                                    uint64_t count, uint64_t vocab,
                                    const std::string& tokenizer,
                                    uint64_t marker_token = 0, uint8_t marker_kind = 0) {
  std::vector<uint8_t> h(128, 0);
  std::memcpy(h.data(), "VIADTOK", 8);  // with its NUL
  std::memcpy(h.data() + 8, &version, 4);
  std::memcpy(h.data() + 12, &bpt, 4);
  std::memcpy(h.data() + 16, &count, 8);
  std::memcpy(h.data() + 24, &vocab, 8);
  std::memcpy(h.data() + 32, tokenizer.data(), tokenizer.size());
  std::memcpy(h.data() + 96, &marker_token, 8);
  h[104] = marker_kind;
  return h;
}

std::vector<uint8_t> llmc_file(int32_t magic, int32_t version, int32_t count,
                               const std::vector<int64_t>& tokens, int bpt) {
  std::vector<int32_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  std::vector<uint8_t> bytes(1024);
  std::memcpy(bytes.data(), header.data(), 1024);
  for (int64_t t : tokens) {
    if (bpt == 2) {
      auto v = static_cast<uint16_t>(t);
      bytes.insert(bytes.end(), reinterpret_cast<uint8_t*>(&v),
                   reinterpret_cast<uint8_t*>(&v) + 2);
    } else {
      auto v = static_cast<uint32_t>(t);
      bytes.insert(bytes.end(), reinterpret_cast<uint8_t*>(&v),
                   reinterpret_cast<uint8_t*>(&v) + 4);
    }
  }
  return bytes;
}

TEST(TokenFile, ViaductWriterMatchesDocumentedLayout) {
  TempDir dir;
  const std::string path = dir.file("a.tok");
  std::vector<int64_t> tokens = ramp(1000, 257);
  TokenFileWriter w(path, 257, "byte");
  w.append(tokens.data(), 600);
  w.append(tokens.data() + 600, 400);
  EXPECT_EQ(w.finish(), 128 + 2 * 1000);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  std::vector<uint8_t> expect = viaduct_header(2, 2, 1000, 257, "byte");
  for (int64_t t : tokens) {
    auto v = static_cast<uint16_t>(t);
    expect.push_back(static_cast<uint8_t>(v & 0xff));
    expect.push_back(static_cast<uint8_t>(v >> 8));
  }
  EXPECT_EQ(read_bytes(path), expect);

  TokenFile f = open_token_file(path, "auto");
  EXPECT_EQ(f.format(), TokenFormat::kViaduct);
  EXPECT_EQ(f.size(), 1000);
  EXPECT_EQ(f.vocab_size(), 257);
  EXPECT_EQ(f.tokenizer(), "byte");
  EXPECT_EQ(f.bytes_per_token(), 2);
  EXPECT_EQ(read_all(f), tokens);
  EXPECT_EQ(f.token(999), tokens[999]);
  EXPECT_EQ(f.max_token(), 256);
  EXPECT_FALSE(f.document_marker().recorded());
}

TEST(TokenFile, DocumentMarkerRoundTripsAtItsDocumentedBytes) {
  TempDir dir;
  for (const auto kind : {DocumentMarker::Kind::kStarts, DocumentMarker::Kind::kEnds}) {
    const std::string path = dir.file("m.tok");
    const DocumentMarker marker{256, kind};
    TokenFileWriter w(path, 257, "byte", marker);
    w.append(ramp(10, 257));
    w.finish();
    auto expect = viaduct_header(2, 2, 10, 257, "byte", 256, static_cast<uint8_t>(kind));
    auto bytes = read_bytes(path);
    bytes.resize(128);
    EXPECT_EQ(bytes, expect);
    TokenFile f = open_token_file(path, "auto");
    EXPECT_EQ(f.document_marker(), marker);
    EXPECT_EQ(f.size(), 10);
  }
  // A version-1 file (reserved bytes zero) reads as recording none.
  const std::string old = dir.file("v1.tok");
  auto v1 = viaduct_header(1, 2, 2, 257, "byte");
  v1.resize(v1.size() + 4, 0);
  write_bytes(old, v1.data(), v1.size());
  EXPECT_FALSE(open_token_file(old, "viaduct").document_marker().recorded());
  // A marker outside the vocab is refused when written.
  EXPECT_THROW(TokenFileWriter(dir.file("x.tok"), 257, "byte",
                               DocumentMarker{257, DocumentMarker::Kind::kStarts}),
               Error);
}

TEST(TokenFile, StreamOfFilesThatMarkDocumentsDifferentlyIsRefused) {
  TempDir dir;
  auto write = [&](const std::string& name, DocumentMarker m) {
    TokenFileWriter w(dir.file(name), 257, "byte", m);
    w.append(ramp(8, 257));
    w.finish();
    return dir.file(name);
  };
  const auto a = write("a.tok", {256, DocumentMarker::Kind::kStarts});
  const auto b = write("b.tok", {256, DocumentMarker::Kind::kStarts});
  const auto c = write("c.tok", {0, DocumentMarker::Kind::kEnds});
  auto same = open_token_stream(std::vector<std::string>{a, b}, "auto");
  EXPECT_EQ(same->document_marker(), (DocumentMarker{256, DocumentMarker::Kind::kStarts}));
  expect_file_error([&] { open_token_stream(std::vector<std::string>{a, c}, "auto"); },
                    {a, c, "mark documents differently", "token 256 starts",
                     "token 0 ends"});
}

TEST(TokenFile, ViaductUint32RoundTrip) {
  TempDir dir;
  const std::string path = dir.file("big.tok");
  std::vector<int64_t> tokens = ramp(3000, 200000);
  tokens.push_back(199999);
  {
    TokenFileWriter w(path, 200000, "some-bpe");
    w.append(tokens);
    w.finish();
  }
  TokenFile f = open_token_file(path, "viaduct");
  EXPECT_EQ(f.bytes_per_token(), 4);
  EXPECT_EQ(f.vocab_size(), 200000);
  EXPECT_EQ(f.tokenizer(), "some-bpe");
  EXPECT_EQ(read_all(f), tokens);
  EXPECT_EQ(f.max_token(), 199999);
}

TEST(TokenFile, WriterWithoutFinishLeavesNothing) {
  TempDir dir;
  const std::string path = dir.file("x.tok");
  {
    TokenFileWriter w(path, 257, "byte");
    w.append(ramp(10, 257));
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(TokenFile, WriterRefusesTokensOutsideVocab) {
  TempDir dir;
  TokenFileWriter w(dir.file("x.tok"), 257, "byte");
  EXPECT_THROW(w.append(std::vector<int64_t>{1, 257}), Error);
  EXPECT_THROW(w.append(std::vector<int64_t>{-1}), Error);
}

TEST(TokenFile, ViaductTruncatedIsRefused) {
  TempDir dir;
  const std::string path = dir.file("t.tok");
  {
    TokenFileWriter w(path, 257, "byte");
    w.append(ramp(100, 257));
    w.finish();
  }
  std::filesystem::resize_file(path, 128 + 2 * 100 - 1);
  expect_file_error([&] { open_token_file(path, "auto"); },
                    {path, "truncated", "100 tokens"});
  std::filesystem::resize_file(path, 60);
  expect_file_error([&] { open_token_file(path, "viaduct"); },
                    {path, "truncated header"});
}

TEST(TokenFile, ViaductTrailingBytesAreRefused) {
  TempDir dir;
  const std::string path = dir.file("t.tok");
  std::vector<uint8_t> bytes = viaduct_header(1, 2, 3, 257, "byte");
  bytes.resize(bytes.size() + 7, 1);
  write_bytes(path, bytes.data(), bytes.size());
  expect_file_error([&] { open_token_file(path, "viaduct"); },
                    {path, "trailing bytes"});
}

TEST(TokenFile, ViaductCorruptHeaderFieldsAreRefused) {
  TempDir dir;
  const std::string path = dir.file("c.tok");
  auto write_and_expect = [&](std::vector<uint8_t> bytes,
                              const std::string& what) {
    bytes.resize(bytes.size() + 4, 0);  // 2 uint16 tokens
    write_bytes(path, bytes.data(), bytes.size());
    expect_file_error([&] { open_token_file(path, "viaduct"); }, {path, what});
  };
  std::vector<uint8_t> bad_magic = viaduct_header(1, 2, 2, 257, "byte");
  bad_magic[0] = 'X';
  write_and_expect(bad_magic, "bad magic");
  write_and_expect(viaduct_header(3, 2, 2, 257, "byte"), "version 3");
  write_and_expect(viaduct_header(1, 3, 2, 257, "byte"), "dtype");
  write_and_expect(viaduct_header(1, 2, 2, 0, "byte"), "vocab size 0");
  write_and_expect(viaduct_header(1, 2, 2, 70000, "byte"), "vocab size 70000");
  std::vector<uint8_t> reserved = viaduct_header(1, 2, 2, 257, "byte");
  reserved[100] = 1;
  write_and_expect(reserved, "reserved");
  std::vector<uint8_t> reserved2 = viaduct_header(2, 2, 2, 257, "byte");
  reserved2[110] = 1;
  write_and_expect(reserved2, "reserved");
  write_and_expect(viaduct_header(2, 2, 2, 257, "byte", 5, 3), "document marker kind 3");
  write_and_expect(viaduct_header(2, 2, 2, 257, "byte", 5, 0), "without a kind");
  write_and_expect(viaduct_header(2, 2, 2, 257, "byte", 300, 1), "outside the vocab");
  std::vector<uint8_t> unterminated = viaduct_header(1, 2, 2, 257, "");
  std::memset(unterminated.data() + 32, 'a', 64);
  write_and_expect(unterminated, "tokenizer name");
}

TEST(TokenFile, LlmcReadsReferenceBytes) {
  TempDir dir;
  const std::string path = dir.file("shard_000.bin");
  std::vector<int64_t> tokens = ramp(777, 50257);
  std::vector<uint8_t> bytes = llmc_file(20240520, 1, 777, tokens, 2);
  write_bytes(path, bytes.data(), bytes.size());
  for (const char* fmt : {"auto", "llmc"}) {
    TokenFile f = open_token_file(path, fmt);
    EXPECT_EQ(f.format(), TokenFormat::kLlmc);
    EXPECT_EQ(f.size(), 777);
    EXPECT_EQ(f.vocab_size(), 0);
    EXPECT_EQ(read_all(f), tokens);
  }
}

TEST(TokenFile, LlmcLlama3VariantHoldsUint32) {
  TempDir dir;
  const std::string path = dir.file("llama.bin");
  std::vector<int64_t> tokens = ramp(100, 128256);
  std::vector<uint8_t> bytes = llmc_file(20240801, 7, 100, tokens, 4);
  write_bytes(path, bytes.data(), bytes.size());
  TokenFile f = open_token_file(path, "auto");
  EXPECT_EQ(f.bytes_per_token(), 4);
  EXPECT_EQ(read_all(f), tokens);
}

TEST(TokenFile, LlmcCorruptOrTruncatedIsRefused) {
  TempDir dir;
  const std::string path = dir.file("bad.bin");
  std::vector<int64_t> tokens = ramp(50, 50257);
  std::vector<uint8_t> ok = llmc_file(20240520, 1, 50, tokens, 2);

  std::vector<uint8_t> truncated(ok.begin(), ok.end() - 2);
  write_bytes(path, truncated.data(), truncated.size());
  expect_file_error([&] { open_token_file(path, "auto"); },
                    {path, "truncated", "50 tokens"});

  std::vector<uint8_t> bad_version = llmc_file(20240520, 2, 50, tokens, 2);
  write_bytes(path, bad_version.data(), bad_version.size());
  expect_file_error([&] { open_token_file(path, "llmc"); },
                    {path, "version 2"});

  std::vector<uint8_t> bad_magic = llmc_file(12345, 1, 50, tokens, 2);
  write_bytes(path, bad_magic.data(), bad_magic.size());
  expect_file_error([&] { open_token_file(path, "llmc"); },
                    {path, "bad magic 12345"});
  // With "auto" an unknown magic and a .bin name is no format at all.
  expect_file_error([&] { open_token_file(path, "auto"); },
                    {path, "unrecognised format"});

  std::vector<uint8_t> header_only(ok.begin(), ok.begin() + 100);
  write_bytes(path, header_only.data(), header_only.size());
  expect_file_error([&] { open_token_file(path, "llmc"); },
                    {path, "truncated header"});

  std::vector<uint8_t> negative = llmc_file(20240520, 1, -5, {}, 2);
  write_bytes(path, negative.data(), negative.size());
  expect_file_error([&] { open_token_file(path, "llmc"); },
                    {path, "negative token count"});
}

TEST(TokenFile, RawArraysByExtensionAndByName) {
  TempDir dir;
  std::vector<uint16_t> u16 = {0, 1, 65535, 300, 7};
  std::vector<uint32_t> u32 = {0, 1, 4000000000u, 300, 7, 9};
  write_bytes(dir.file("a.u16"), u16.data(), u16.size() * 2);
  write_bytes(dir.file("a.u32"), u32.data(), u32.size() * 4);
  write_bytes(dir.file("a.raw"), u16.data(), u16.size() * 2);

  TokenFile a = open_token_file(dir.file("a.u16"), "auto");
  EXPECT_EQ(a.format(), TokenFormat::kUint16);
  EXPECT_EQ(read_all(a), (std::vector<int64_t>{0, 1, 65535, 300, 7}));
  TokenFile b = open_token_file(dir.file("a.u32"), "auto");
  EXPECT_EQ(b.format(), TokenFormat::kUint32);
  EXPECT_EQ(read_all(b), (std::vector<int64_t>{0, 1, 4000000000LL, 300, 7, 9}));
  TokenFile c = open_token_file(dir.file("a.raw"), "uint16");
  EXPECT_EQ(read_all(c), read_all(a));
  // The same bytes as uint32: pairs of uint16 (little-endian).
  write_bytes(dir.file("b.raw"), u16.data(), 4 * 2);
  TokenFile d = open_token_file(dir.file("b.raw"), "uint32");
  EXPECT_EQ(read_all(d),
            (std::vector<int64_t>{0 | (1 << 16), 65535 | (300LL << 16)}));

  expect_file_error([&] { open_token_file(dir.file("a.raw"), "auto"); },
                    {dir.file("a.raw"), "unrecognised format", "data.format"});
  write_bytes(dir.file("odd.u32"), u16.data(), 6);
  expect_file_error([&] { open_token_file(dir.file("odd.u32"), "auto"); },
                    {dir.file("odd.u32"), "multiple of 4"});
  write_bytes(dir.file("empty.u16"), u16.data(), 0);
  EXPECT_EQ(open_token_file(dir.file("empty.u16"), "auto").size(), 0);
}

TEST(TokenFile, MissingFileAndUnknownFormat) {
  TempDir dir;
  expect_file_error([&] { open_token_file(dir.file("nope.tok"), "auto"); },
                    {dir.file("nope.tok"), "cannot open"});
  write_bytes(dir.file("a.u16"), "ab", 2);
  EXPECT_THROW(open_token_file(dir.file("a.u16"), "parquet"), ConfigError);
  expect_file_error([&] { open_token_file(dir.path().string(), "auto"); },
                    {"not a regular file"});
}

TEST(TokenStream, GlobOfShardsIsOneStream) {
  TempDir dir;
  std::vector<int64_t> all;
  for (int k = 0; k < 3; ++k) {
    std::vector<int64_t> tokens = ramp(100 + 10 * k, 1000);
    for (auto& t : tokens) t = (t + k) % 1000;
    std::vector<uint8_t> bytes =
        llmc_file(20240520, 1, static_cast<int32_t>(tokens.size()), tokens, 2);
    // Written out of order: the glob sorts.
    write_bytes(dir.file("train_00" + std::to_string(2 - k) + ".bin"),
                bytes.data(), bytes.size());
  }
  std::vector<std::vector<int64_t>> shards(3);
  for (int k = 0; k < 3; ++k) {
    TokenFile f = open_token_file(
        dir.file("train_00" + std::to_string(k) + ".bin"), "llmc");
    shards[k] = read_all(f);
    all.insert(all.end(), shards[k].begin(), shards[k].end());
  }
  auto stream = open_token_stream(dir.file("train_*.bin"), "auto");
  ASSERT_EQ(stream->files().size(), 3u);
  EXPECT_EQ(stream->size(), static_cast<int64_t>(all.size()));
  std::vector<int64_t> got(all.size());
  stream->read(0, stream->size(), got.data());
  EXPECT_EQ(got, all);
  // A range across both boundaries.
  std::vector<int64_t> mid(150);
  stream->read(100, 150, mid.data());
  EXPECT_EQ(mid, std::vector<int64_t>(all.begin() + 100, all.begin() + 250));
  EXPECT_EQ(stream->token(119), all[119]);
  EXPECT_THROW(stream->read(all.size() - 1, 2, got.data()), Error);

  expect_file_error([&] { open_token_stream(dir.file("val_*.bin"), "auto"); },
                    {"no token file matches", "val_*.bin"});
}

TEST(TokenStream, ValPathDerivation) {
  EXPECT_EQ(val_path_for("data/fortunes.tok"), "data/fortunes.val.tok");
  EXPECT_EQ(val_path_for("x.bin"), "x.val.bin");
  EXPECT_EQ(val_path_for("dir/plain"), "dir/plain.val");
  TempDir dir;
  const std::string train = dir.file("c.tok");
  EXPECT_EQ(resolve_val_path(train, ""), "");
  EXPECT_EQ(resolve_val_path(train, "explicit.tok"), "explicit.tok");
  write_bytes(dir.file("c.val.tok"), "x", 1);
  EXPECT_EQ(resolve_val_path(train, ""), dir.file("c.val.tok"));
  EXPECT_EQ(resolve_val_path(dir.file("*.tok"), ""), "");
}

}  // namespace
}  // namespace viaduct::data
