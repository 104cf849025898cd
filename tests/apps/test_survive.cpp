// Runs that survive: each failure a user met -- a full disk under the
// metrics log or a checkpoint, a second trainer on the same folder, a
// folder given as --config, a resume with another model, signals, a dead
// rank, a model too large for the machine, a port in use, a stray client of
// the rendezvous store -- reproduced
// against `viaduct` processes, with the behaviour each must get.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/process_runs.h"
#include "core/check.h"
#include "data/temp_dir.h"
#include "distributed/job_store.h"
#include "distributed/launcher.h"
#include "survive_util.h"

namespace viaduct::testing {
namespace {
namespace fs = std::filesystem;
using data::testing::TempDir;

class Survive : public ::testing::Test {
 protected:
  void SetUp() override { write_random_corpus(dir_.file("corpus.tok"), 7, 6000); }
  TempDir dir_;
};

// ---- full disks -------------------------------------------------------------

TEST_F(Survive, MetricsLogOnAFullDiskFailsTheRunNamingTheFile) {
  fs::create_directories(dir_.file("run"));
  fs::create_symlink("/dev/full", dir_.file("run/metrics.jsonl"));
  const auto r = shell(kBin + job(dir_, "run", 3));
  EXPECT_NE(r.exit_code, 0) << r.output;
  expect_has(r.output, "metrics.jsonl");
  expect_has(r.output, "No space left on device");
}

// The shell's file size limit (ulimit -f, in KiB) stands in for a full disk:
// writes past it fail with EFBIG, and SIGXFSZ is ignored so they return.
std::string with_file_limit(int kib, const std::string& cmd) {
  return "(ulimit -f " + std::to_string(kib) + "; trap '' XFSZ; " + cmd + ")";
}

TEST_F(Survive, ResumeOnAFullDiskKeepsTheHistoryUpToTheCheckpoint) {
  // A run killed at step 5 after a checkpoint at step 3 ...
  const std::string run = job(dir_, "run", 6) + " --checkpoint.enable=true --checkpoint.interval=3";
  auto r = shell("VIADUCT_FAULT_KILL=0:5 " + kBin + run);
  ASSERT_EQ(r.exit_code, 128 + SIGKILL) << r.output;
  const fs::path log = dir_.file("run/metrics.jsonl");
  const auto before = lines_of(log);
  ASSERT_EQ(before.size(), 4u);
  // ... with a torn last line, as a crash mid-write leaves it ...
  { std::ofstream(log, std::ios::app) << "{\"step\": 5, \"lo"; }
  // ... resumed where no byte can be written: the run fails, and the log
  // holds exactly the steps up to the checkpoint, as they were.
  r = shell(with_file_limit(0, kBin + run));
  EXPECT_NE(r.exit_code, 0) << r.output;
  const auto after = lines_of(log);
  ASSERT_EQ(after.size(), 3u) << read_file(log);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(after[i], before[i]);
  // With space again, the run completes into one uninterrupted log.
  r = shell(kBin + run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto steps = step_metrics(dir_.file("run"));
  ASSERT_EQ(steps.size(), 6u);
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i]["step"], i + 1);
}

TEST_F(Survive, AFailedSaveRemovesItsTemporaryFolderAndSaysWhatItNeeded) {
  // Model files of the two-layer debug model are ~1 MiB: 64 KiB holds the
  // metrics log but not a checkpoint.
  const std::string run = job(dir_, "run", 2) + " --checkpoint.enable=true --checkpoint.interval=1";
  // Twice (a retry must not add a folder), then with the background writer,
  // whose failure surfaces when the run waits for it.
  for (const std::string extra : {"", "", " --checkpoint.async_mode=async"}) {
    const auto r = shell(with_file_limit(64, kBin + run + extra));
    EXPECT_NE(r.exit_code, 0) << r.output;
    expect_has(r.output, "checkpoint step 1 could not be saved");
    expect_has(r.output, "was removed");
    expect_has(r.output, "needs about");
    EXPECT_EQ(tmp_folders(dir_.file("run/checkpoint")), std::vector<std::string>{});
  }
}

// ---- one trainer per folder ---------------------------------------------------

TEST_F(Survive, ASecondTrainerOnTheSameFolderIsRefusedNamingTheFirst) {
  Background first(job(dir_, "run", 1000000), dir_.file("first.log"));
  const fs::path lock = dir_.file("run/viaduct.lock");
  ASSERT_TRUE(wait_until([&] { return !read_file(lock).empty(); })) << first.output();
  auto r = shell(kBin + job(dir_, "run", 2));
  EXPECT_NE(r.exit_code, 0) << r.output;
  expect_has(r.output, "is in use by another viaduct process");
  expect_has(r.output, "pid " + std::to_string(first.pid()));
  // The first one dies without releasing anything: its lock is taken over.
  first.signal(SIGKILL);
  EXPECT_EQ(first.wait(), 128 + SIGKILL);
  r = shell(kBin + job(dir_, "run", 2));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  expect_has(r.output, "taking over");
  // A clean end names no holder: the next run takes the lock silently.
  EXPECT_EQ(read_file(lock), "");
}

// ---- config and resume -------------------------------------------------------

TEST_F(Survive, AFolderAsConfigIsAnError) {
  const auto r = shell(kBin + " train --config " + dir_.path().string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "is a folder");
}

TEST_F(Survive, AKeyTwiceOnTheCommandLineIsSaidAndTheLastOneKept) {
  const auto r = shell(kBin + " train --training.steps=3 --training.steps=5 --print-config");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  expect_has(r.output, "'--training.steps' twice ('3', then '5'); using the last, '5'");
  expect_has(r.output, "steps = 5\n");
}

TEST_F(Survive, ResumingWithFewerLayersIsRefusedNamingTheDifference) {
  auto r = shell(kBin + job(dir_, "run", 2) + " --checkpoint.enable=true");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = shell(kBin + job(dir_, "run", 4, /*layers=*/1) + " --checkpoint.enable=true");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "model.n_layers = 2 in the checkpoint, 1 now");
  expect_has(r.output, "layers.1.");
}

// ---- signals -----------------------------------------------------------------

TEST_F(Survive, SigtermFinishesTheStepSavesAndExitsWith75) {
  const std::string run =
      job(dir_, "run", 1000000) + " --checkpoint.enable=true --checkpoint.interval=100000";
  Background train(run, dir_.file("train.log"));
  const fs::path log = dir_.file("run/metrics.jsonl");
  ASSERT_TRUE(wait_until([&] { return lines_of(log).size() >= 3; })) << train.output();
  train.signal(SIGTERM);
  EXPECT_EQ(train.wait(), 75) << train.output();
  // Nothing lost: the checkpoint is the last logged step.
  const auto steps = step_metrics(dir_.file("run"));
  ASSERT_FALSE(steps.empty());
  const int64_t last = steps.back()["step"];
  EXPECT_TRUE(fs::exists(dir_.file("run/checkpoint/step-" + std::to_string(last) +
                                   "/metadata.json")))
      << train.output();
  expect_has(train.output(), "stopped at step " + std::to_string(last));
  // And the next run resumes there.
  const auto r = shell(kBin + job(dir_, "run", static_cast<int>(last) + 1) +
                       " --checkpoint.enable=true --checkpoint.interval=100000");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  expect_has(r.output, "at step " + std::to_string(last));
}

TEST_F(Survive, WithoutCheckpointsASignalStopsAfterTheStepWith128PlusIt) {
  Background train(job(dir_, "run", 1000000), dir_.file("train.log"));
  const fs::path log = dir_.file("run/metrics.jsonl");
  ASSERT_TRUE(wait_until([&] { return lines_of(log).size() >= 1; })) << train.output();
  train.signal(SIGUSR1);
  EXPECT_EQ(train.wait(), 128 + SIGUSR1) << train.output();
  expect_has(train.output(), "nothing is saved");
  EXPECT_FALSE(fs::exists(dir_.file("run/checkpoint")));
}

TEST_F(Survive, ASecondSignalAbortsAtOnce) {
  Background train(job(dir_, "run", 1000000) + " --checkpoint.enable=true",
                   dir_.file("train.log"));
  const fs::path log = dir_.file("run/metrics.jsonl");
  ASSERT_TRUE(wait_until([&] { return lines_of(log).size() >= 1; })) << train.output();
  // Two different signals, so the kernel cannot merge them into one.
  train.signal(SIGTERM);
  train.signal(SIGUSR1);
  const int code = train.wait();
  EXPECT_TRUE(code == 128 + SIGTERM || code == 128 + SIGUSR1) << code << "\n" << train.output();
  expect_has(train.output(), "second signal");
}

TEST_F(Survive, LaunchForwardsSigtermAndEveryRankSavesTogether) {
  const std::string run = " launch --nproc-per-node 2 -- " + kBin + job(dir_, "run", 1000000) +
                          " --parallelism.pipeline_parallel_degree=2"
                          " --checkpoint.enable=true --checkpoint.interval=100000";
  Background launch(run, dir_.file("launch.log"));
  const fs::path log = dir_.file("run/metrics.jsonl");
  ASSERT_TRUE(wait_until([&] { return lines_of(log).size() >= 2; })) << launch.output();
  launch.signal(SIGTERM);
  EXPECT_EQ(launch.wait(), 75) << launch.output();
  const int64_t last = step_metrics(dir_.file("run")).back()["step"];
  EXPECT_TRUE(fs::exists(dir_.file("run/checkpoint/step-" + std::to_string(last) +
                                   "/metadata.json")))
      << launch.output();
}

// ---- restarts ----------------------------------------------------------------

TEST_F(Survive, LaunchRestartsEveryRankFromTheLatestCheckpoint) {
  const std::string args = " launch --nproc-per-node 2 --max-restarts 1 -- " + kBin +
                           job(dir_, "run", 6) +
                           " --parallelism.pipeline_parallel_degree=2"
                           " --checkpoint.enable=true --checkpoint.interval=2";
  const auto r = shell("VIADUCT_FAULT_KILL=1:4 " + kBin + args);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  expect_has(r.output, "restart 1 of 1");
  expect_has(r.output, "at step 2");
  const auto steps = step_metrics(dir_.file("run"));
  ASSERT_EQ(steps.size(), 6u) << r.output;
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i]["step"], i + 1);
}

// ---- asynchronous checkpoints ------------------------------------------------

TEST_F(Survive, AsyncCheckpointsHoldTheSameBitsAsSyncOnes) {
  // Two micro-batches everywhere: one process then has the pipeline's bits.
  const std::string ck = " --checkpoint.enable=true --checkpoint.interval=2"
                         " --parallelism.pipeline_parallel_microbatches=2";
  auto r = shell(kBin + job(dir_, "sync", 4) + ck);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = shell(kBin + job(dir_, "async", 4) + ck + " --checkpoint.async_mode=async");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_has(r.output, "checkpoint step 2: state copied to host memory in ");
  expect_has(r.output, " s, writing it in the background");
  // Two pipeline ranks whose writers meet through the store.
  r = shell(kBin + " launch --nproc-per-node 2 -- " + kBin + job(dir_, "async_pp2", 4) + ck +
            " --checkpoint.async_mode=async --parallelism.pipeline_parallel_degree=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const auto* run : {"async", "async_pp2"}) {
    EXPECT_EQ(step_losses(dir_.file("sync")), step_losses(dir_.file(run))) << run;
    for (int step : {2, 4}) {
      const auto a = dir_.file(std::string("sync/checkpoint/step-") + std::to_string(step));
      const auto b = dir_.file(std::string(run) + "/checkpoint/step-" + std::to_string(step));
      const auto c = shell(kBin + " checkpoint compare " + a + " " + b);
      EXPECT_EQ(c.exit_code, 0) << run << " step " << step << "\n" << c.output;
    }
  }
}

TEST_F(Survive, ASaveThatWaitsForThePreviousWriteSaysHowLong) {
  // Every write held back 3 s, longer than a step of this model: the save
  // one step later must wait for it.
  const auto r = shell("VIADUCT_FAULT_SLOW_SAVE_MS=3000 " + kBin + job(dir_, "run", 3) +
                       " --checkpoint.enable=true --checkpoint.interval=1"
                       " --checkpoint.async_mode=async");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_has(r.output, "checkpoint step 2: waited ");
  expect_has(r.output, "checkpoint step 3: waited ");
  expect_has(r.output, " s for the previous checkpoint's write to finish");
  expect_has(r.output, "saved checkpoint " + dir_.file("run/checkpoint/step-3") + " in ");
  // Without the hold-up nothing waits that long.
  const auto quick = shell(kBin + job(dir_, "quick", 3) +
                           " --checkpoint.enable=true --checkpoint.interval=1"
                           " --checkpoint.async_mode=async");
  ASSERT_EQ(quick.exit_code, 0) << quick.output;
  EXPECT_EQ(quick.output.find("for the previous checkpoint's write"), std::string::npos)
      << quick.output;
}

// ---- crashes -------------------------------------------------------------------

TEST_F(Survive, AFatalSignalLeavesItsNameAndTheNativeStackInTheLog) {
  Background train(job(dir_, "run", 1000000), dir_.file("train.log"));
  const fs::path log = dir_.file("run/metrics.jsonl");
  ASSERT_TRUE(wait_until([&] { return lines_of(log).size() >= 1; })) << train.output();
  // A fault is delivered to the thread that faults; one sent to the process
  // may land on a worker thread, whose stack holds no main. The training
  // loop's thread is the main one.
  train.signal_main_thread(SIGSEGV);
  EXPECT_EQ(train.wait(), 128 + SIGSEGV) << train.output();
  expect_has(train.output(), "viaduct: fatal signal SIGSEGV; native stack:");
  // The frames name viaduct's own functions (the executable exports them).
  expect_has(train.output(), "main+0x");
}

// ---- memory and rendezvous ----------------------------------------------------

TEST_F(Survive, AModelThatCannotFitStopsAtOnceWithTheFigures) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = shell(kBin + job(dir_, "run", 2, /*layers=*/2000) +
                       " --model.flavor=8B --training.device=cpu");
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.exit_code, 2) << r.output;
  expect_has(r.output, "this run cannot fit");
  expect_has(r.output, "GiB");
  expect_has(r.output, "parallelism.pipeline_parallel_degree");
  EXPECT_LT(secs, 30) << r.output;
}

TEST_F(Survive, APortInUseIsOneLineNamingPortAndCause) {
  const int sock = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(sock, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  ASSERT_EQ(::bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(sock, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(sock, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  const auto r = shell("RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1"
                       " MASTER_PORT=" + std::to_string(port) + " " + kBin +
                       job(dir_, "run", 2) + " --parallelism.pipeline_parallel_degree=2");
  ::close(sock);
  EXPECT_NE(r.exit_code, 0) << r.output;
  expect_has(r.output, "port " + std::to_string(port));
  expect_has(r.output, "Address already in use");
  EXPECT_EQ(r.output.find("socket.cpp"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("300000"), std::string::npos) << r.output;
}

// ---- the rendezvous store ---------------------------------------------------

// `root` and every process below it (by parent pid, from /proc/<pid>/stat).
std::vector<pid_t> process_tree(pid_t root) {
  std::vector<std::pair<pid_t, pid_t>> parent_of;  // (pid, ppid)
  std::error_code ec;
  for (const auto& de : fs::directory_iterator("/proc", ec)) {
    const std::string name = de.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = read_file(de.path() / "stat");
    const auto close = stat.rfind(')');  // the command may hold spaces and parentheses
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    parent_of.emplace_back(std::stoi(name), ppid);
  }
  std::vector<pid_t> tree{root};
  for (size_t i = 0; i < tree.size(); ++i) {
    for (const auto& [pid, ppid] : parent_of) {
      if (ppid == tree[i]) tree.push_back(pid);
    }
  }
  return tree;
}

// The socket inodes ("12345") a process holds open.
std::set<std::string> socket_inodes(pid_t pid) {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    const std::string target = fs::read_symlink(de.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0) out.insert(target.substr(8, target.size() - 9));
  }
  return out;
}

// One LISTEN socket: its local address as /proc/net/tcp{,6} prints it (the
// address's 32-bit words in host order, in hex) and its port.
struct ListenSocket {
  std::string address;
  bool v6 = false;
  int port = 0;
};

std::vector<ListenSocket> listen_sockets(const std::set<std::string>& inodes) {
  std::vector<ListenSocket> out;
  for (const bool v6 : {false, true}) {
    std::istringstream table(read_file(v6 ? "/proc/net/tcp6" : "/proc/net/tcp"));
    std::string line;
    std::getline(table, line);  // the header
    while (std::getline(table, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      f >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >>
          inode;
      if (state != "0A" || inodes.count(inode) == 0) continue;
      const auto colon = local.find(':');
      out.push_back({local.substr(0, colon), v6, std::stoi(local.substr(colon + 1), nullptr, 16)});
    }
  }
  return out;
}

// 127.0.0.0/8, ::1 or ::ffff:127.x. In host (little-endian) order 127.a.b.c
// prints as "cba7F" with 7F last; ::1's last word prints as 01000000.
bool is_loopback(const ListenSocket& s) {
  if (!s.v6) return s.address.size() == 8 && s.address.substr(6, 2) == "7F";
  if (s.address.size() != 32 || s.address.substr(0, 16) != std::string(16, '0')) return false;
  const std::string w2 = s.address.substr(16, 8), w3 = s.address.substr(24, 8);
  return (w2 == "00000000" && w3 == "01000000") ||
         (w2 == "FFFF0000" && w3.substr(6, 2) == "7F");
}

TEST_F(Survive, AOneNodeJobListensOnLoopbackOnlyAndRefusesAStrayStoreClient) {
  const int port = distributed::find_free_port();
  const std::string train = job(dir_, "stray", 4) + " --parallelism.pipeline_parallel_degree=2";
  Background launch(" launch --nproc-per-node 2 --master-port " + std::to_string(port) + " -- " +
                        kBin + train,
                    dir_.file("launch.log"));
  // A client that knows the port but not the token, started the moment the
  // store is seen listening.
  std::string stray_error;
  const std::string wrong_token = "00112233445566778899aabbccddeeff";
  std::thread stray;
  // Every LISTEN socket the job's processes hold, sampled until it ends.
  std::vector<std::string> outside;
  std::set<int> ports;
  std::set<std::string> tokens;
  while (launch.running()) {
    for (const pid_t pid : process_tree(launch.pid())) {
      for (const auto& s : listen_sockets(socket_inodes(pid))) {
        ports.insert(s.port);
        if (!is_loopback(s)) {
          outside.push_back(str(s.address, ":", s.port, " (pid ", pid, ")"));
        }
      }
      std::istringstream env(read_file("/proc/" + std::to_string(pid) + "/environ"));
      for (std::string var; std::getline(env, var, '\0');) {
        if (var.rfind("VIADUCT_JOB_TOKEN=", 0) == 0) tokens.insert(var.substr(18));
      }
    }
    if (ports.count(port) == 1 && !stray.joinable()) {
      stray = std::thread([&] {
        try {
          c10::make_intrusive<distributed::JobStore>("127.0.0.1", port, wrong_token,
                                              std::chrono::milliseconds(10'000));
          stray_error = "served";
        } catch (const std::exception& e) {
          stray_error = e.what();
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(stray.joinable()) << "the store's port was never seen listening\n"
                                << launch.output();
  stray.join();
  const int code = launch.wait();
  const std::string output = launch.output();
  ASSERT_EQ(code, 0) << output;
  EXPECT_EQ(outside, std::vector<std::string>{}) << output;
  // The stray client was refused, by name in the server's log, and no token
  // was printed.
  expect_has(stray_error, "refused");
  expect_has(output, "refused a connection from 127.0.0.1:");
  expect_has(output, "wrong job token");
  EXPECT_EQ(output.find(wrong_token), std::string::npos) << output;
  ASSERT_EQ(tokens.size(), 1u) << "every rank carries the launch's one token";
  EXPECT_EQ(tokens.begin()->size(), 32u);
  EXPECT_EQ(output.find(*tokens.begin()), std::string::npos) << output;
  // The job went on as if no one had called.
  run_viaduct_ok(2, job(dir_, "plain", 4) + " --parallelism.pipeline_parallel_degree=2");
  EXPECT_EQ(step_losses(dir_.file("stray")), step_losses(dir_.file("plain")));
  EXPECT_EQ(step_losses(dir_.file("stray")).size(), 4u);
}

}  // namespace
}  // namespace viaduct::testing
