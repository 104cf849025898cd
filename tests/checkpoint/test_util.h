// Helpers shared by the checkpoint tests: a scratch folder per test, raw byte
// file edits, bitwise tensor comparison.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/file_io.h"

namespace viaduct::checkpoint::testing {

namespace fs = std::filesystem;

class ScratchDir : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           (std::string("viaduct-ckpt-") + info->test_suite_name() + "-" +
            info->name() + "-" + std::to_string(::getpid()));
    viaduct::remove_tree(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { viaduct::remove_tree(dir_); }
  fs::path dir_;
};

inline std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline void flip_byte(const fs::path& p, size_t offset) {
  std::string b = read_bytes(p);
  ASSERT_LT(offset, b.size());
  b[offset] = static_cast<char>(b[offset] ^ 0x5A);
  write_bytes(p, b);
}

// Same dtype, shape and bytes (NaN payloads included).
inline bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  at::Tensor ca = a.cpu().contiguous();
  at::Tensor cb = b.cpu().contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(),
                     static_cast<size_t>(ca.nbytes())) == 0;
}

// Runs `fn`, expects a FileError whose message contains every piece.
template <typename Fn>
void expect_file_error(Fn&& fn, const std::vector<std::string>& pieces) {
  try {
    fn();
    ADD_FAILURE() << "expected a viaduct::FileError";
  } catch (const FileError& e) {
    const std::string msg = e.what();
    for (const auto& piece : pieces) {
      EXPECT_NE(msg.find(piece), std::string::npos)
          << "message lacks '" << piece << "': " << msg;
    }
  }
}

}  // namespace viaduct::checkpoint::testing
