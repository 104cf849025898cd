// core/file_io: the atomic replace leaves the new content and no temporary
// file, a dropped AtomicFile leaves the old content, and failures surface as
// FileError naming the path and the system's reason.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

#include "core/check.h"
#include "core/file_io.h"
#include "data/temp_dir.h"

namespace viaduct {
namespace {

namespace fs = std::filesystem;
using data::testing::TempDir;

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& de : fs::directory_iterator(dir)) out.push_back(de.path().filename());
  std::sort(out.begin(), out.end());
  return out;
}

template <typename Fn>
std::string file_error_of(Fn&& fn) {
  try {
    fn();
  } catch (const FileError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a viaduct::FileError";
  return "";
}

TEST(FileIo, AtomicReplaceLeavesTheNewContentAndNoTempFile) {
  TempDir dir;
  const fs::path file = dir.path() / "a.txt";
  atomic_write_file(file, "first");
  EXPECT_EQ(read_text_file(file), "first");
  atomic_write_file(file, "second, longer");
  EXPECT_EQ(read_text_file(file), "second, longer");
  atomic_write_file(file, "");
  EXPECT_EQ(read_text_file(file), "");
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"a.txt"});
}

TEST(FileIo, DroppedAtomicFileKeepsTheOldContent) {
  TempDir dir;
  const fs::path file = dir.path() / "a.txt";
  atomic_write_file(file, "old");
  {
    AtomicFile out(file);
    out.file().write_all("new", 3);
    EXPECT_EQ(out.tmp_path(), fs::path(file.string() + ".tmp"));
    EXPECT_TRUE(fs::exists(out.tmp_path()));
  }
  EXPECT_EQ(read_text_file(file), "old");
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"a.txt"});
}

TEST(FileIo, PositionedWritesAndReadsRoundTrip) {
  TempDir dir;
  const fs::path file = dir.path() / "b.bin";
  AtomicFile out(file);
  out.file().write_at("world", 5, 6);
  out.file().write_at("hello ", 6, 0);
  out.commit();
  EXPECT_TRUE(out.committed());
  File in = File::open_read(file);
  EXPECT_EQ(in.size(), 11u);
  std::string got(5, '\0');
  in.read_at(got.data(), 5, 6);
  EXPECT_EQ(got, "world");
  const auto msg = file_error_of([&] { in.read_at(got.data(), 5, 8); });
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  EXPECT_NE(msg.find(file.string()), std::string::npos) << msg;
}

TEST(FileIo, WriteErrorSurfacesWithPathAndReason) {
  // /dev/full fails every write with ENOSPC.
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  File f = File::create("/dev/full");
  const auto msg = file_error_of([&] { f.write_all("x", 1); });
  EXPECT_NE(msg.find("cannot write /dev/full"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::strerror(ENOSPC)), std::string::npos) << msg;
  UniqueFd fd(::open("/dev/full", O_WRONLY | O_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  errno = 0;
  EXPECT_FALSE(write_fully(fd.get(), "x", 1));
  EXPECT_EQ(errno, ENOSPC);
}

TEST(FileIo, MissingFolderNamesThePath) {
  TempDir dir;
  const fs::path file = dir.path() / "no" / "such" / "a.txt";
  const auto msg = file_error_of([&] { atomic_write_file(file, "x"); });
  EXPECT_NE(msg.find("cannot create " + file.string() + ".tmp"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::strerror(ENOENT)), std::string::npos) << msg;
  const auto rmsg = file_error_of([&] { rename_path(file, dir.path() / "b"); });
  EXPECT_NE(rmsg.find("cannot rename " + file.string()), std::string::npos) << rmsg;
  const auto omsg = file_error_of([&] { File::open_read(file); });
  EXPECT_NE(omsg.find("cannot open " + file.string()), std::string::npos) << omsg;
}

TEST(FileIo, RemoveTreeRemovesNestedFoldersAndDoesNotFollowLinks) {
  TempDir dir;
  const fs::path keep = dir.path() / "keep.txt";
  write_text_file(keep, "outside");
  const fs::path tree = dir.path() / "tree";
  make_dirs(tree / "a" / "b" / "c");
  make_dirs(tree / "empty");
  write_text_file(tree / "top.bin", "1");
  write_text_file(tree / "a" / "b" / "c" / "deep.bin", "2");
  fs::create_symlink(keep, tree / "a" / "link_to_file");
  fs::create_directory_symlink(dir.path(), tree / "a" / "b" / "link_to_parent");
  remove_tree(tree);
  EXPECT_FALSE(fs::exists(tree));
  // The links went, not what they point at.
  EXPECT_EQ(read_text_file(keep), "outside");
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"keep.txt"});
  // A plain file and a missing path.
  remove_tree(keep);
  EXPECT_FALSE(fs::exists(keep));
  EXPECT_NO_THROW(remove_tree(dir.path() / "never-there"));
  EXPECT_EQ(remove_tree_noexcept(dir.path() / "never-there"), "");
}

TEST(FileIo, RemoveTreeFailureNamesThePath) {
  // A path under a regular file cannot be examined (ENOTDIR).
  TempDir dir;
  write_text_file(dir.path() / "f", "x");
  const std::string message = file_error_of([&] { remove_tree(dir.path() / "f" / "sub"); });
  EXPECT_NE(message.find("cannot remove"), std::string::npos) << message;
  EXPECT_NE(message.find((dir.path() / "f" / "sub").string()), std::string::npos) << message;
  EXPECT_NE(message.find(std::strerror(ENOTDIR)), std::string::npos) << message;
}

TEST(FileIo, UniqueFdOwnsAndReleases) {
  TempDir dir;
  const fs::path file = dir.path() / "c";
  int raw = -1;
  {
    UniqueFd fd(::open(file.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
    ASSERT_TRUE(fd.valid());
    raw = fd.get();
    UniqueFd moved(std::move(fd));
    EXPECT_FALSE(fd.valid());
    EXPECT_EQ(moved.get(), raw);
  }
  EXPECT_EQ(::fcntl(raw, F_GETFD), -1) << "closed with its owner";
  UniqueFd fd(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
  const int kept = fd.release();
  EXPECT_FALSE(fd.valid());
  EXPECT_EQ(::close(kept), 0) << "release() hands the descriptor over";
}

}  // namespace
}  // namespace viaduct
