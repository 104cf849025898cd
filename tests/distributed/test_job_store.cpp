// The job store (dist/job_store.h) against c10d::HashStore as the reference:
// the same operations give the same results; blocking gets and waits across
// clients; timeouts that name the key; stray clients (a wrong token, none,
// not a store client at all) refused while a rank's requests go on; and the
// server bound to loopback for a one-host job.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/check.h"
#include "distributed/distributed.h"
#include "distributed/job_store.h"
#include "distributed/launcher.h"

namespace viaduct::distributed {
namespace {

using std::chrono::milliseconds;

constexpr milliseconds kStoreTimeout{10'000};
const std::string kToken = "0123456789abcdef0123456789abcdef";

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

c10::intrusive_ptr<JobStore> client(const JobStoreServer& server,
                                    const std::string& token = kToken,
                                    milliseconds timeout = kStoreTimeout) {
  return c10::make_intrusive<JobStore>(server.address(), server.port(), token, timeout);
}

// One store operation; its result as text, "error" when it throws.
using StoreOp = std::function<std::string(c10d::Store&)>;

std::vector<std::string> run_ops(c10d::Store& store, const std::vector<StoreOp>& ops) {
  std::vector<std::string> results;
  for (const auto& op : ops) {
    try {
      results.push_back(op(store));
    } catch (const std::exception&) {
      results.push_back("error");
    }
  }
  return results;
}

// Every operation of c10d::Store with the cases its semantics distinguish.
std::vector<StoreOp> every_operation() {
  auto set = [](std::string k, std::string v) {
    return StoreOp([=](c10d::Store& s) {
      s.set(k, bytes(v));
      return std::string("set");
    });
  };
  auto get = [](std::string k) {
    return StoreOp([=](c10d::Store& s) { return text(s.get(k)); });
  };
  auto add = [](std::string k, int64_t v) {
    return StoreOp([=](c10d::Store& s) { return std::to_string(s.add(k, v)); });
  };
  auto compare_set = [](std::string k, std::string reference, std::string desired) {
    return StoreOp([=](c10d::Store& s) {
      return text(s.compareSet(k, bytes(reference), bytes(desired)));
    });
  };
  auto remove = [](std::string k) {
    return StoreOp([=](c10d::Store& s) { return std::string(s.deleteKey(k) ? "1" : "0"); });
  };
  auto check = [](std::vector<std::string> keys) {
    return StoreOp([=](c10d::Store& s) { return std::string(s.check(keys) ? "1" : "0"); });
  };
  auto num_keys = StoreOp([](c10d::Store& s) { return std::to_string(s.getNumKeys()); });
  auto wait = [](std::vector<std::string> keys) {
    return StoreOp([=](c10d::Store& s) {
      s.wait(keys, milliseconds(1000));
      return std::string("waited");
    });
  };
  return {
      num_keys,
      set("a", "alpha"),
      get("a"),
      set("a", "again"),  // overwrite
      get("a"),
      set("bin", std::string("\0\1\2\xff", 4)),
      get("bin"),
      set("empty", ""),
      get("empty"),
      add("n", 5),  // a new counter
      add("n", -2),
      add("n", 0),
      get("n"),  // decimal text
      add("empty", 7),  // an empty value counts 0
      add("a", 1),      // not a number
      add("big", INT64_MAX),
      compare_set("cs", "", "first"),     // absent, expected empty: set
      compare_set("cs2", "x", "never"),   // absent, expected given: expected back
      compare_set("cs", "first", "second"),  // present, matching: set
      compare_set("cs", "wrong", "third"),   // present, not matching: current back
      get("cs"),
      check({"a", "n", "cs"}),
      check({"a", "missing"}),
      check({}),
      wait({"a", "n"}),
      num_keys,
      remove("a"),
      remove("a"),  // already gone
      remove("never-set"),
      check({"a"}),
      num_keys,
      set("a", "back"),
      get("a"),
      num_keys,
  };
}

TEST(JobStore, EveryOperationMatchesHashStore) {
  JobStoreServer server("127.0.0.1", 0, kToken);
  auto store = client(server);
  c10d::HashStore reference_store;
  reference_store.setTimeout(kStoreTimeout);
  const auto ops = every_operation();
  const auto reference = run_ops(reference_store, ops);
  const auto got = run_ops(*store, ops);
  ASSERT_EQ(got.size(), reference.size());
  for (size_t i = 0; i < reference.size(); ++i) EXPECT_EQ(got[i], reference[i]) << "operation " << i;
  EXPECT_EQ(reference[13], "7");  // the reference does what the cases say
  EXPECT_EQ(reference[14], "error");
  try {
    store->add("cs", 1);  // "second"
    FAIL() << "add to a key holding text returned";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("add to key 'cs': its value is not a decimal integer"),
              std::string::npos)
        << what;
  }
}

TEST(JobStore, ClientsOfOneServerShareItsKeys) {
  JobStoreServer server("127.0.0.1", 0, kToken);
  auto a = client(server);
  auto b = client(server);
  auto c = a->clone();
  a->set("k", bytes("v"));
  EXPECT_EQ(text(b->get("k")), "v");
  EXPECT_EQ(text(c->get("k")), "v");
  // add is atomic across clients: 3 threads x 200 increments.
  std::vector<std::thread> threads;
  std::vector<c10::intrusive_ptr<c10d::Store>> stores = {a, b, c};
  for (auto& s : stores) {
    threads.emplace_back([s] {
      for (int i = 0; i < 200; ++i) s->add("count", 1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(text(a->get("count")), "600");
  EXPECT_EQ(b->getNumKeys(), 2);
}

TEST(JobStore, GetAndWaitBlockUntilAnotherClientSets) {
  JobStoreServer server("127.0.0.1", 0, kToken);
  auto waiter = client(server);
  auto setter = client(server);
  std::atomic<bool> got{false}, waited{false};
  std::string value;
  std::thread get_thread([&] {
    value = text(waiter->get("late"));
    got = true;
  });
  auto waiter2 = client(server);
  std::thread wait_thread([&] {
    waiter2->wait({"late", "later"});
    waited = true;
  });
  std::this_thread::sleep_for(milliseconds(200));
  EXPECT_FALSE(got);
  setter->set("late", bytes("here"));
  get_thread.join();
  EXPECT_TRUE(got);
  EXPECT_EQ(value, "here");
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_FALSE(waited);  // one of its two keys is still missing
  setter->add("later", 1);
  wait_thread.join();
  EXPECT_TRUE(waited);
}

TEST(JobStore, TimeoutsRaiseAnErrorNamingTheKey) {
  JobStoreServer server("127.0.0.1", 0, kToken);
  auto store = client(server);
  store->setTimeout(milliseconds(200));
  const auto start = std::chrono::steady_clock::now();
  try {
    store->get("absent/key");
    FAIL() << "get of a missing key returned";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'absent/key'"), std::string::npos) << what;
    EXPECT_NE(what.find("200 ms"), std::string::npos) << what;
  }
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(200));
  try {
    store->wait({"x", "y"}, milliseconds(150));
    FAIL() << "wait for missing keys returned";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'x', 'y'"), std::string::npos) << what;
    EXPECT_NE(what.find("150 ms"), std::string::npos) << what;
  }
  // A timeout leaves the connection usable.
  store->set("x", bytes("1"));
  EXPECT_EQ(text(store->get("x")), "1");
  EXPECT_EQ(store->getTimeout(), milliseconds(200));
}

// A raw TCP connection to the server; what it reads back after sending
// `payload`: "" when the server closed the connection.
std::string raw_exchange(int port, const std::string& payload) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  VIADUCT_CHECK(fd >= 0, "socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  VIADUCT_CHECK(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0, "connect");
  (void)!::send(fd, payload.data(), payload.size(), MSG_NOSIGNAL);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string got;
  char buf[256];
  for (ssize_t k; (k = ::recv(fd, buf, sizeof(buf), 0)) > 0;) got.append(buf, k);
  ::close(fd);
  return got;
}

TEST(JobStore, StrayClientsAreRefusedWhileARanksRequestsGoOn) {
  JobStoreServer server("127.0.0.1", 0, kToken);
  auto rank = client(server);
  c10d::HashStore reference_store;
  reference_store.setTimeout(kStoreTimeout);
  const auto ops = every_operation();
  const std::vector<StoreOp> first(ops.begin(), ops.begin() + 15);
  const std::vector<StoreOp> rest(ops.begin() + 15, ops.end());
  auto reference = run_ops(reference_store, first);
  auto got = run_ops(*rank, first);
  EXPECT_EQ(got, reference);

  ::testing::internal::CaptureStderr();
  const auto start = std::chrono::steady_clock::now();
  const std::string wrong = "ffffffffffffffffffffffffffffffff";
  for (const std::string& token : {wrong, std::string()}) {
    try {
      client(server, token);
      ADD_FAILURE() << "a client with token '" << token << "' was served";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("refused"), std::string::npos) << e.what();
    }
  }
  // Refused at once, not after the connect timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(5000));
  // Not a store client at all: an HTTP request.
  EXPECT_EQ(raw_exchange(server.port(), "GET / HTTP/1.0\r\n\r\n"), "");
  // The rank's connection, opened before, goes on as if nothing happened.
  reference = run_ops(reference_store, rest);
  got = run_ops(*rank, rest);
  EXPECT_EQ(got, reference);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("refused a connection from 127.0.0.1:"), std::string::npos) << log;
  EXPECT_NE(log.find("wrong job token"), std::string::npos) << log;
  EXPECT_NE(log.find("sent no job token"), std::string::npos) << log;
  EXPECT_NE(log.find("not a viaduct store client"), std::string::npos) << log;
  EXPECT_EQ(log.find(kToken), std::string::npos) << log;
  EXPECT_EQ(log.find(wrong), std::string::npos) << log;
}

// The local addresses of the LISTEN sockets on `port` in /proc/net/tcp
// ("0100007F" is 127.0.0.1).
std::vector<std::string> listening_on(int port) {
  std::vector<std::string> out;
  std::ifstream in("/proc/net/tcp");
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string slot, local, remote, state;
    fields >> slot >> local >> remote >> state;
    const auto colon = local.find(':');
    if (state == "0A" && std::stoi(local.substr(colon + 1), nullptr, 16) == port) {
      out.push_back(local.substr(0, colon));
    }
  }
  return out;
}

RendezvousInfo two_ranks(int rank, int local_world_size, const std::string& master) {
  RendezvousInfo info;
  info.rank = rank;
  info.world_size = 2;
  info.local_rank = rank % local_world_size;
  info.local_world_size = local_world_size;
  info.master_addr = master;
  info.master_port = find_free_port();
  info.source = "env";
  return info;
}

TEST(JobStore, ListensOnLoopbackForAOneHostJob) {
  const auto info = two_ranks(0, 2, "127.0.0.1");
  auto store = make_store(info, kStoreTimeout);
  EXPECT_EQ(listening_on(info.master_port), std::vector<std::string>{"0100007F"});
  JobStoreServer server(store_address(info), 0, "");
  EXPECT_EQ(server.address(), "127.0.0.1");  // getsockname
  // A one-host job's store is on loopback whatever MASTER_ADDR names.
  EXPECT_EQ(store_address(two_ranks(0, 2, "10.1.2.3")), "127.0.0.1");
  EXPECT_EQ(store_address(two_ranks(0, 1, "localhost")), "127.0.0.1");
  EXPECT_EQ(store_address(two_ranks(0, 1, "127.0.0.1")), "127.0.0.1");
  // Several hosts: the address MASTER_ADDR names, resolved.
  EXPECT_EQ(store_address(two_ranks(0, 1, "10.1.2.3")), "10.1.2.3");
}

TEST(JobStore, TheTokenRule) {
  auto env_with = [](std::optional<std::string> token) {
    return EnvLookup([token](const std::string& name) {
      return name == "VIADUCT_JOB_TOKEN" ? token : std::nullopt;
    });
  };
  // One host may go without; several hosts must export one.
  EXPECT_EQ(job_token(two_ranks(0, 2, "127.0.0.1"), env_with(std::nullopt)), "");
  EXPECT_EQ(job_token(two_ranks(1, 1, "10.1.2.3"), env_with(kToken)), kToken);
  try {
    job_token(two_ranks(1, 1, "10.1.2.3"), env_with(std::string()));
    FAIL() << "a multi-host job without a token was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("export the same VIADUCT_JOB_TOKEN on every node"), std::string::npos)
        << what;
  }
  const std::string a = new_job_token(), b = new_job_token();
  EXPECT_EQ(a.size(), 32u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_NE(a, b);
}

TEST(JobStore, ThreeRanksRendezvousThroughMakeStore) {
  const int port = find_free_port();
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      try {
        RendezvousInfo info;
        info.rank = r;
        info.world_size = info.local_world_size = 3;
        info.local_rank = r;
        info.master_port = port;
        info.source = "env";
        // Rank 0's server starts last: the others retry until it listens.
        if (r == 0) std::this_thread::sleep_for(milliseconds(300));
        auto store = make_store(info, kStoreTimeout);
        store->add("arrived", 1);
        store->set(str("rank", r), bytes(std::to_string(r * r)));
        store->wait({"rank0", "rank1", "rank2"});
        for (int p = 0; p < 3; ++p) {
          VIADUCT_CHECK(text(store->get(str("rank", p))) == std::to_string(p * p), "rank ", r,
                        " read a wrong value of rank ", p);
        }
        // Rank 0's server must outlive the others' last request.
        store->add("done", 1);
        if (r == 0) {
          while (text(store->get("done")) != "3") std::this_thread::sleep_for(milliseconds(10));
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(JobStore, APortInUseNamesThePortAndTheCause) {
  JobStoreServer first("127.0.0.1", 0, kToken);
  try {
    JobStoreServer second("127.0.0.1", first.port(), kToken);
    FAIL() << "two servers on one port";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("port " + std::to_string(first.port())), std::string::npos) << what;
    EXPECT_NE(what.find("Address already in use"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace viaduct::distributed
