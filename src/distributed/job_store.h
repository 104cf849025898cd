// The job's rendezvous store: a c10d::Store whose server, run by rank 0 on
// background threads, listens on one address only and serves a connection
// only after it proves the job's token. LibTorch's TCPStore listens on every
// interface and serves anyone who connects, so on a shared machine any user
// could write into a running job's rendezvous; this store cannot be reached
// from outside a one-host job (loopback) and refuses a stray client of a
// multi-host one (see Note [Job store]).
//
// Note [Job store]
// Where it listens: 127.0.0.1 when the whole job is on one host or
// MASTER_ADDR is a loopback name, else the address MASTER_ADDR resolves to
// on rank 0 (the interface that address belongs to); every rank connects to
// the same address. Who it serves: a connection first sends a fixed magic,
// the protocol version and the token (VIADUCT_JOB_TOKEN, which `viaduct
// launch` sets on one node; several nodes export one themselves). The
// server compares the token in constant time and closes a connection whose
// handshake is wrong, missing or late, with one warning naming the peer's
// address and never the token; the job goes on. After the handshake the
// connection carries requests, one at a time, each answered before the next:
// set, get (blocking up to the client's timeout), add, compareSet,
// deleteKey, check, getNumKeys and wait, with TCPStore's semantics (add keeps
// a decimal text counter; a get or wait that times out is an error naming
// the key and the timeout; a timeout of 0 waits forever).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/torch_compat.h"
#include "distributed/distributed.h"

namespace viaduct::distributed {

// Bumped whenever the wire format changes: a client of another version is
// refused by name instead of misreading requests.
constexpr uint32_t kJobStoreProtocolVersion = 1;

// Serves the store's keys at address:port on background threads until it is
// destroyed. Binds and listens in the constructor: a port in use or an
// address this host does not own throws viaduct::Error naming the port,
// the address and the cause.
class JobStoreServer {
 public:
  // address: a numeric IPv4 or IPv6 address (store_address gives one);
  // port 0 lets the system pick one (tests); token: what every client must
  // send ("" accepts only clients that send none).
  JobStoreServer(const std::string& address, int port, std::string token);
  ~JobStoreServer();
  JobStoreServer(const JobStoreServer&) = delete;
  JobStoreServer& operator=(const JobStoreServer&) = delete;

  // The address and port the listening socket is bound to (getsockname).
  const std::string& address() const;
  int port() const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

// A client of a JobStoreServer. Every call is one request and its answer
// under the client's lock, so one JobStore may be used from several threads
// (NCCL's watchdog checks keys beside the main thread); clone() opens a
// second connection.
class JobStore : public c10d::Store {
 public:
  // Connects to address:port and sends the token, retrying a refused or
  // unreachable connection until `timeout` (rank 0's server may start after
  // the other ranks). A server that closes the handshake (a wrong token)
  // throws at once. `server`: rank 0's server, kept alive by this store and
  // its clones.
  JobStore(std::string address, int port, std::string token,
           std::chrono::milliseconds timeout,
           std::shared_ptr<JobStoreServer> server = nullptr);
  ~JobStore() override;

  // A new connection to the same server, sharing it. (LibTorch 2.x declares
  // this pure in c10d::Store; 1.13 has no such method, hence no `override`.)
  c10::intrusive_ptr<c10d::Store> clone();

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key,
                                  const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // "127.0.0.1:29500"
  std::string endpoint() const;

  struct Connection;

 private:
  std::string address_;
  int port_;
  std::string token_;
  std::shared_ptr<JobStoreServer> server_;
  std::unique_ptr<Connection> conn_;
};

// Whether every rank of the job runs on this host.
bool job_on_one_host(const RendezvousInfo& info);

// The numeric address the store of `info`'s job listens on and its ranks
// connect to (see Note [Job store]): "127.0.0.1" for a job on one host or a
// loopback MASTER_ADDR ("localhost", 127.x), else MASTER_ADDR resolved with
// getaddrinfo. Throws viaduct::Error naming MASTER_ADDR when it does not
// resolve, or when a multi-host job's MASTER_ADDR resolves to loopback here.
std::string store_address(const RendezvousInfo& info);

// The job token from VIADUCT_JOB_TOKEN. A job on one host may run without
// one (its store is on loopback); a multi-host job without one is refused
// with the line that says how to set one.
std::string job_token(const RendezvousInfo& info, const EnvLookup& env);

// A fresh token: 16 bytes of /dev/urandom as 32 hex characters.
std::string new_job_token();

}  // namespace viaduct::distributed
