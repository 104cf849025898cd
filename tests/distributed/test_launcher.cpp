// The launcher with /bin/sh -c children: the environment each rank gets, the
// "[rank N] " prefix, the first failure ending the other ranks quickly, the
// SIGKILL after the grace period, the job timeout, and the flag parser.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <mutex>

#include "core/check.h"
#include "distributed/launcher.h"

namespace viaduct::distributed {
namespace {

struct Captured {
  std::vector<std::string> out;  // "[rank N] line"
  std::vector<std::string> err;
  LineSink sink() {
    return [this](int rank, bool is_stderr, const std::string& line) {
      (is_stderr ? err : out).push_back(str("[rank ", rank, "] ", line));
    };
  }
  bool has_out(const std::string& line) const {
    return std::find(out.begin(), out.end(), line) != out.end();
  }
  bool has_err(const std::string& line) const {
    return std::find(err.begin(), err.end(), line) != err.end();
  }
};

LaunchOptions sh(int nproc, const std::string& script) {
  LaunchOptions options;
  options.nproc_per_node = nproc;
  options.command = {"/bin/sh", "-c", script};
  options.grace = std::chrono::milliseconds(2000);
  return options;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

TEST(Launcher, PrefixesLinesAndSetsTheEnvironment) {
  LaunchOptions options =
      sh(2,
         "echo env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK "
         "$MASTER_ADDR; echo port=$MASTER_PORT; printf 'a\\nb\\n'; "
         "echo oops >&2; printf 'no newline'");
  options.master_port = 23456;
  Captured cap;
  LaunchResult result = launch(options, cap.sink());
  EXPECT_EQ(result.exit_code, 0) << result.message;
  EXPECT_EQ(result.failed_rank, -1);
  for (int r = 0; r < 2; ++r) {
    std::string p = str("[rank ", r, "] ");
    EXPECT_TRUE(cap.has_out(p + str("env ", r, " 2 ", r, " 2 0 127.0.0.1")));
    EXPECT_TRUE(cap.has_out(p + "port=23456"));
    EXPECT_TRUE(cap.has_out(p + "a"));
    EXPECT_TRUE(cap.has_out(p + "b"));
    EXPECT_TRUE(cap.has_out(p + "no newline"));
    EXPECT_TRUE(cap.has_err(p + "oops"));
  }
  EXPECT_EQ(cap.out.size(), 10u);
}

TEST(Launcher, SecondNodeNumbersItsRanks) {
  LaunchOptions options = sh(2, "echo $RANK/$WORLD_SIZE $GROUP_RANK");
  options.nnodes = 3;
  options.node_rank = 2;
  options.master_addr = "10.1.2.3";
  Captured cap;
  EXPECT_EQ(launch(options, cap.sink()).exit_code, 0);
  EXPECT_TRUE(cap.has_out("[rank 4] 4/6 2"));
  EXPECT_TRUE(cap.has_out("[rank 5] 5/6 2"));
}

TEST(Launcher, FailureEndsTheOtherRanksQuickly) {
  LaunchOptions options =
      sh(3,
         "if [ \"$RANK\" = 1 ]; then sleep 0.2; echo failing; exit 3; fi; "
         "sleep 30; echo survived");
  Captured cap;
  auto start = std::chrono::steady_clock::now();
  LaunchResult result = launch(options, cap.sink());
  double took = seconds_since(start);
  EXPECT_EQ(result.exit_code, 3);
  EXPECT_EQ(result.failed_rank, 1);
  EXPECT_NE(result.message.find("rank 1 exited with status 3"),
            std::string::npos)
      << result.message;
  EXPECT_TRUE(cap.has_out("[rank 1] failing"));
  EXPECT_FALSE(cap.has_out("[rank 0] survived"));
  EXPECT_LT(took, 5.0);
}

TEST(Launcher, RankKilledBySignalIsNamed) {
  Captured cap;
  LaunchResult result = launch(
      sh(2, "if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; sleep 30"), cap.sink());
  EXPECT_EQ(result.exit_code, 128 + 9);
  EXPECT_EQ(result.failed_rank, 0);
  EXPECT_NE(result.message.find("rank 0 was killed by SIGKILL"),
            std::string::npos)
      << result.message;
}

TEST(Launcher, RankIgnoringSigtermIsKilledAfterGrace) {
  LaunchOptions options =
      sh(2, "if [ \"$RANK\" = 1 ]; then exit 1; fi; trap '' TERM; sleep 30");
  options.grace = std::chrono::milliseconds(500);
  Captured cap;
  auto start = std::chrono::steady_clock::now();
  LaunchResult result = launch(options, cap.sink());
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_EQ(result.failed_rank, 1);
  EXPECT_LT(seconds_since(start), 4.0);
}

TEST(Launcher, JobTimeoutEndsEveryRank) {
  LaunchOptions options = sh(2, "sleep 30");
  options.timeout = std::chrono::milliseconds(500);
  Captured cap;
  auto start = std::chrono::steady_clock::now();
  LaunchResult result = launch(options, cap.sink());
  EXPECT_EQ(result.exit_code, 124);
  EXPECT_NE(result.message.find("--timeout"), std::string::npos);
  EXPECT_LT(seconds_since(start), 4.0);
}

TEST(Launcher, MissingProgramExits127) {
  LaunchOptions options;
  options.nproc_per_node = 1;
  options.command = {"/nonexistent/viaduct-test-program"};
  Captured cap;
  LaunchResult result = launch(options, cap.sink());
  EXPECT_EQ(result.exit_code, 127);
  ASSERT_FALSE(cap.err.empty());
  EXPECT_NE(cap.err[0].find("cannot execute"), std::string::npos) << cap.err[0];
}

LaunchOptions parse(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return parse_launch_args(static_cast<int>(argv.size()), argv.data());
}

TEST(Launcher, ParsesFlags) {
  LaunchOptions o =
      parse({"launch", "--nproc-per-node", "4", "--nnodes=2", "--node_rank",
             "1", "--master-addr", "n0", "--master-port", "1234", "--timeout",
             "1.5", "--", "prog", "--flag", "x"});
  EXPECT_EQ(o.nproc_per_node, 4);
  EXPECT_EQ(o.nnodes, 2);
  EXPECT_EQ(o.node_rank, 1);
  EXPECT_EQ(o.master_addr, "n0");
  EXPECT_EQ(o.master_port, 1234);
  EXPECT_EQ(o.timeout.count(), 1500);
  EXPECT_EQ(o.command, (std::vector<std::string>{"prog", "--flag", "x"}));
  EXPECT_THROW(parse({"launch", "--", "prog"}), Error);  // no --nproc-per-node
  EXPECT_THROW(parse({"launch", "--nproc-per-node", "0", "--", "p"}), Error);
  EXPECT_THROW(parse({"launch", "--nproc-per-node", "2"}),
               Error);  // no command
  EXPECT_THROW(
      parse({"launch", "--nproc-per-node", "2", "--nnodes", "2", "--", "p"}),
      Error);  // several nodes need --master-addr
  EXPECT_THROW(
      parse({"launch", "--nproc-per-node", "2", "--bogus", "1", "--", "p"}),
      Error);
}

}  // namespace
}  // namespace viaduct::distributed

// ------------------------------------------------ ranks as real processes
// The launcher runs this binary again, filtered to RankProcess.Main, with
// VIADUCT_DIST_TEST_MODE set: each child is one rank that reads its place from
// the environment the launcher set and builds a pp2 × dp1 mesh over the job store.

#include <unistd.h>

#include <csignal>
#include <cstdlib>

#include "distributed/distributed.h"

namespace viaduct::distributed {
namespace {

TEST(RankProcess, Main) {
  const char* mode = std::getenv("VIADUCT_DIST_TEST_MODE");
  if (mode == nullptr) GTEST_SKIP() << "only as a child of the launcher tests";
  if (!backend_available(at::kCPU)) GTEST_SKIP() << "no Gloo in this build";
  RendezvousInfo info = rendezvous_from_env();
  ASSERT_EQ(info.source, "env");
  auto mesh = init_mesh(info, 2, 1, at::kCPU, std::chrono::milliseconds(5000));
  if (std::string(mode) == "die" && info.rank == 1) {
    std::raise(SIGKILL);  // killed mid-step, before the collective
  }
  std::vector<at::Tensor> t = {
      at::full({3}, static_cast<float>(info.rank + 1))};
  mesh->world().allreduce(t).wait(str("rank ", info.rank, " step 0 allreduce"));
  ASSERT_TRUE(at::equal(t[0], at::full({3}, 3.0f)));
  std::cout << "rank " << info.rank << " sum " << t[0][0].item<float>()
            << std::endl;
}

LaunchOptions self_ranks(int nproc) {
  LaunchOptions options;
  options.nproc_per_node = nproc;
  options.command = {"/proc/self/exe", "--gtest_filter=RankProcess.Main"};
  options.grace = std::chrono::milliseconds(2000);
  options.timeout = std::chrono::milliseconds(30000);
  return options;
}

TEST(LauncherWithRanks, TwoProcessesAllreduce) {
  if (!backend_available(at::kCPU)) GTEST_SKIP() << "no Gloo in this build";
  ASSERT_EQ(::setenv("VIADUCT_DIST_TEST_MODE", "ok", 1), 0);
  Captured cap;
  LaunchResult result = launch(self_ranks(2), cap.sink());
  ::unsetenv("VIADUCT_DIST_TEST_MODE");
  EXPECT_EQ(result.exit_code, 0) << result.message;
  EXPECT_TRUE(cap.has_out("[rank 0] rank 0 sum 3"));
  EXPECT_TRUE(cap.has_out("[rank 1] rank 1 sum 3"));
}

TEST(LauncherWithRanks, KilledRankFailsTheJobWithItsName) {
  if (!backend_available(at::kCPU)) GTEST_SKIP() << "no Gloo in this build";
  ASSERT_EQ(::setenv("VIADUCT_DIST_TEST_MODE", "die", 1), 0);
  Captured cap;
  auto start = std::chrono::steady_clock::now();
  LaunchResult result = launch(self_ranks(2), cap.sink());
  ::unsetenv("VIADUCT_DIST_TEST_MODE");
  EXPECT_NE(result.exit_code, 0);
  EXPECT_EQ(result.failed_rank, 1) << result.message;
  EXPECT_NE(result.message.find("rank 1 was killed by SIGKILL"),
            std::string::npos)
      << result.message;
  EXPECT_LT(seconds_since(start), 15.0);
}

}  // namespace
}  // namespace viaduct::distributed
