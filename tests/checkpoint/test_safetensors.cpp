// The safetensors writer and reader against the format spec: a file built
// byte by byte from the spec is read back; our writer's bytes are taken apart
// by hand; every dtype round-trips bitwise; every kind of damage is refused
// with the tensor and the file named.
#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "test_util.h"

namespace viaduct::checkpoint {
namespace {

using testing::bitwise_equal;
using testing::expect_file_error;
using testing::flip_byte;
using testing::read_bytes;
using testing::write_bytes;
using Safetensors = testing::ScratchDir;

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return s;
}

// A file straight from the spec: length, JSON header, raw bytes.
std::string spec_file(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

// Random bytes viewed as `dtype`: every bit pattern, NaN payloads included.
at::Tensor random_bits(at::ScalarType dtype, std::vector<int64_t> shape) {
  if (dtype == at::kBool) return at::randint(0, 2, shape, at::kBool);
  int64_t numel = 1;
  for (auto d : shape) numel *= d;
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  at::Tensor bytes = at::randint(0, 256, {numel * elem}, at::kByte);
  return bytes.view(dtype).reshape(shape);
}

TEST_F(Safetensors, ReadsAFileBuiltByteByByteFromTheSpec) {
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"I16","shape":[1,2],"data_offsets":[8,12]},)"
      R"("__metadata__":{"format":"pt"}}  )";  // trailing spaces are allowed
  // 1.5f = 0x3FC00000, -2.0f = 0xC0000000, int16 7 and -1, little-endian.
  const std::string data("\x00\x00\xC0\x3F\x00\x00\x00\xC0\x07\x00\xFF\xFF", 12);
  write_bytes(dir_ / "spec.safetensors", spec_file(header, data));

  SafetensorsFile f(dir_ / "spec.safetensors");
  ASSERT_EQ(f.entries().size(), 2u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  at::Tensor a = f.read("a");
  at::Tensor b = f.read("b");
  EXPECT_TRUE(torch::equal(a, torch::tensor({1.5f, -2.0f})));
  EXPECT_EQ(b.scalar_type(), at::kShort);
  EXPECT_EQ(b.sizes(), at::IntArrayRef({1, 2}));
  EXPECT_TRUE(torch::equal(b, torch::tensor({{7, -1}}, at::kShort)));
  EXPECT_FALSE(f.entry("a").crc32.has_value());  // not written by viaduct
}

TEST_F(Safetensors, WriterBytesFollowTheSpec) {
  at::Tensor x = torch::tensor({1.0f, 2.0f, 3.0f});
  at::Tensor y = torch::arange(5, at::kByte);
  at::Tensor z = torch::tensor({0.25}, at::kDouble);
  const auto path = dir_ / "w.safetensors";
  FileDigest d =
      write_safetensors(path, {{"x", x}, {"y", y}, {"z", z}}, {{"k", "v"}});

  const std::string bytes = read_bytes(path);
  ASSERT_EQ(d.bytes, bytes.size());
  EXPECT_EQ(d.crc32, crc32(bytes.data(), bytes.size()));
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[i])) << (8 * i);
  ASSERT_LE(8 + n, bytes.size());
  EXPECT_EQ((8 + n) % 8, 0u) << "the byte buffer starts 8-byte aligned";
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  const size_t close = header.find_last_of('}');
  EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos)
      << "only spaces pad the header";
  auto j = nlohmann::json::parse(header);
  // Largest elements first: z (F64), x (F32), y (U8).
  EXPECT_EQ(j["z"]["dtype"], "F64");
  EXPECT_EQ(j["z"]["shape"], nlohmann::json({1}));
  EXPECT_EQ(j["z"]["data_offsets"], nlohmann::json({0, 8}));
  EXPECT_EQ(j["x"]["dtype"], "F32");
  EXPECT_EQ(j["x"]["data_offsets"], nlohmann::json({8, 20}));
  EXPECT_EQ(j["y"]["dtype"], "U8");
  EXPECT_EQ(j["y"]["shape"], nlohmann::json({5}));
  EXPECT_EQ(j["y"]["data_offsets"], nlohmann::json({20, 25}));
  EXPECT_EQ(j["__metadata__"]["k"], "v");
  EXPECT_TRUE(j["__metadata__"].contains(kTensorCrcKey));
  ASSERT_EQ(bytes.size(), 8 + n + 25);
  const std::string data = bytes.substr(8 + n);
  EXPECT_EQ(std::memcmp(data.data(), z.data_ptr(), 8), 0);
  EXPECT_EQ(std::memcmp(data.data() + 8, x.data_ptr(), 12), 0);
  EXPECT_EQ(std::memcmp(data.data() + 20, y.data_ptr(), 5), 0);

  SafetensorsFile f(path);
  EXPECT_EQ(f.metadata().size(), 1u) << "the crc key is not user metadata";
}

TEST_F(Safetensors, EveryDtypeRoundTripsBitwise) {
  torch::manual_seed(7);
  const std::vector<at::ScalarType> dtypes = {
      at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong,
      at::kInt,    at::kShort, at::kChar, at::kByte,     at::kBool};
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (auto dt : dtypes) {
    const std::string n = dtype_name(dt);
    tensors.emplace_back("t." + n, random_bits(dt, {3, 5}));
    tensors.emplace_back("scalar." + n, random_bits(dt, {}));
    tensors.emplace_back("empty." + n, random_bits(dt, {0, 4}));
  }
  // Non-contiguous input is saved from a contiguous copy.
  tensors.emplace_back("transposed", torch::randn({4, 6}).t());
  tensors.emplace_back("bf16.values",
                       torch::randn({64}).to(at::kBFloat16) * 1e-3);
  const auto path = dir_ / "all.safetensors";
  write_safetensors(path, tensors);

  SafetensorsFile f(path);
  ASSERT_EQ(f.entries().size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    at::Tensor back = f.read(name);
    EXPECT_TRUE(bitwise_equal(back, t)) << name;
    if (t.scalar_type() != at::kBool && !at::isFloatingType(t.scalar_type())) {
      EXPECT_TRUE(torch::equal(back, t)) << name;
    }
  }
  EXPECT_TRUE(torch::equal(f.read("bf16.values"), tensors.back().second));
}

TEST_F(Safetensors, WriterRefusesDuplicateAndReservedNames) {
  at::Tensor t = torch::zeros({2});
  EXPECT_THROW(write_safetensors(dir_ / "d.safetensors", {{"a", t}, {"a", t}}),
               Error);
  EXPECT_THROW(write_safetensors(dir_ / "m.safetensors", {{"__metadata__", t}}),
               Error);
}

// Two tensors, "layers.0.w" [4, 3] then "layers.1.w" [2], both F32.
std::filesystem::path write_pair(const std::filesystem::path& dir) {
  const auto path = dir / "pair.safetensors";
  write_safetensors(path, {{"layers.0.w", torch::randn({4, 3})},
                           {"layers.1.w", torch::randn({2})}});
  return path;
}

TEST_F(Safetensors, TruncatedFileNamesTheTensorAndFile) {
  const auto path = write_pair(dir_);
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 4);
  expect_file_error([&] { SafetensorsFile f(path); },
                    {"layers.1.w", "pair.safetensors", "truncated"});

  std::filesystem::resize_file(path, 20);  // into the header
  expect_file_error([&] { SafetensorsFile f(path); },
                    {"pair.safetensors", "header length"});
  std::filesystem::resize_file(path, 5);
  expect_file_error([&] { SafetensorsFile f(path); },
                    {"pair.safetensors", "truncated"});
}

TEST_F(Safetensors, FlippedHeaderByteIsRefused) {
  const auto path = write_pair(dir_);
  const std::string bytes = read_bytes(path);
  // A digit of layers.0.w's shape: the header still parses, the size does not.
  const size_t entry = bytes.find("\"layers.0.w\"");
  const size_t shape = bytes.find("\"shape\":[4,3]", entry);
  ASSERT_NE(shape, std::string::npos);
  std::string b = bytes;
  b[shape + std::strlen("\"shape\":[4,")] = '7';
  write_bytes(path, b);
  expect_file_error([&] { SafetensorsFile f(path); },
                    {"layers.0.w", "pair.safetensors", "[4, 7]"});

  // The dtype: F32 → F31, unknown.
  b = bytes;
  b[bytes.find("\"F32\"", entry) + 3] = '1';
  write_bytes(path, b);
  expect_file_error([&] { SafetensorsFile f(path); },
                    {"layers.0.w", "pair.safetensors", "F31"});

  // The opening brace: not JSON any more.
  write_bytes(path, bytes);
  flip_byte(path, 8);
  expect_file_error([&] { SafetensorsFile f(path); }, {"pair.safetensors"});

  // The header length itself.
  write_bytes(path, bytes);
  flip_byte(path, 7);
  expect_file_error([&] { SafetensorsFile f(path); },
                    {"pair.safetensors", "header length"});
}

TEST_F(Safetensors, FlippedDataByteFailsTheTensorChecksum) {
  const auto path = write_pair(dir_);
  SafetensorsFile clean(path);
  const uint64_t n = std::filesystem::file_size(path);
  flip_byte(path, n - 1);  // the last byte of layers.1.w
  SafetensorsFile f(path);
  EXPECT_NO_THROW(f.read("layers.0.w"));
  expect_file_error([&] { f.read("layers.1.w"); },
                    {"layers.1.w", "pair.safetensors", "checksum"});
  EXPECT_EQ(f.damaged_tensors(), std::vector<std::string>{"layers.1.w"});
  EXPECT_NO_THROW(f.read("layers.1.w", /*verify_checksum=*/false));
}

TEST_F(Safetensors, InvalidHeadersFromTheSpecAreRefused) {
  const std::string data(16, '\0');
  struct Case {
    std::string header;
    std::vector<std::string> pieces;
  };
  const std::vector<Case> cases = {
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},)"
       R"("c":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})",
       {"'a'", "'b'", "overlap"}},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})",
       {"'b'", "belong to no tensor"}},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       {"8 bytes after tensor 'a'"}},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})",
       {"'a'", "[3]", "12 bytes"}},
      {R"({"a":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})",
       {"'a'", "non-negative"}},
      {R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,32]}})",
       {"'a'"}},
      {R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[16,0]}})",
       {"'a'", "backwards"}},
      {R"({"a":{"dtype":"F32","shape":[4]}})", {"'a'", "data_offsets"}},
      {R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16],"x":1}})",
       {"'a'", "'x'"}},
      {R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
       R"("__metadata__":{"n":3}})",
       {"__metadata__", "'n'"}},
      {R"([1,2,3])", {"not start with '{'"}},
      {R"({"a":)", {"not valid JSON"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto path = dir_ / ("case" + std::to_string(i) + ".safetensors");
    write_bytes(path, spec_file(cases[i].header, data));
    SCOPED_TRACE(cases[i].header);
    auto pieces = cases[i].pieces;
    pieces.push_back(path.filename().string());
    expect_file_error([&] { SafetensorsFile f(path); }, pieces);
  }
}

TEST(SafetensorsDtype, NamesRoundTrip) {
  for (const char* n : {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8",
                        "U8", "BOOL"}) {
    auto dt = dtype_from_name(n);
    ASSERT_TRUE(dt.has_value()) << n;
    EXPECT_EQ(dtype_name(*dt), n);
  }
  EXPECT_FALSE(dtype_from_name("F31").has_value());
  EXPECT_FALSE(dtype_from_name("f32").has_value());
}

TEST(Crc32, MatchesTheStandardCheckValue) {
  // The CRC-32 check value of "123456789" (zlib, IEEE 802.3).
  EXPECT_EQ(crc32("123456789", 9), 0xCBF43926u);
  // Chunked equals whole, across the 8-byte fast path.
  std::string s(1000, 'x');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 31 + 7);
  uint32_t c = crc32_update(0, s.data(), 13);
  c = crc32_update(c, s.data() + 13, s.size() - 13);
  EXPECT_EQ(c, crc32(s.data(), s.size()));
  for (size_t cut : {size_t{0}, size_t{1}, size_t{13}, size_t{999}, s.size()}) {
    EXPECT_EQ(crc32_combine(crc32(s.data(), cut),
                            crc32(s.data() + cut, s.size() - cut),
                            s.size() - cut),
              crc32(s.data(), s.size()))
        << cut;
  }
  EXPECT_THROW(parse_crc32_hex("xyz", "t"), FileError);
  EXPECT_EQ(parse_crc32_hex("cbf43926", "t"), 0xCBF43926u);
}

}  // namespace
}  // namespace viaduct::checkpoint
