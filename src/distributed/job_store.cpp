// The job store's server, client and wire format (see Note [Job store],
// job_store.h). The server takes one thread per connection: a job has a few
// connections per rank, and a thread that blocks in a get or wait is then
// the simplest correct form of a blocking request.
//
// Wire format, integers little-endian:
//   handshake  client: "VDSTORE\n" (8 bytes), u32 version, u32 n, n token bytes
//              server: u8 1, u32 version (or it closes the connection)
//   request    u8 op, then per op: strings and byte strings as u32 n + n bytes,
//              counts as u32, numbers and timeouts (ms, 0 = none) as i64
//   reply      u8 status (0 ok, 1 timed out, 2 error + string), then per op
#include "distributed/job_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "core/check.h"
#include "core/file_io.h"
#include "core/log.h"

namespace viaduct::distributed {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr char kMagic[8] = {'V', 'D', 'S', 'T', 'O', 'R', 'E', '\n'};
// A connection that has not finished its handshake by then is closed.
constexpr milliseconds kHandshakeTimeout{10'000};
constexpr uint32_t kMaxTokenBytes = 4096;
constexpr uint32_t kMaxKeyBytes = 1u << 20;
constexpr uint32_t kMaxValueBytes = 1u << 30;
constexpr uint32_t kMaxKeys = 1u << 20;
// How much longer than a request's own timeout a client waits for the
// reply before it calls the connection lost.
constexpr milliseconds kReplySlack{30'000};

enum class Op : uint8_t {
  kSet = 1,
  kGet,
  kAdd,
  kCompareSet,
  kDeleteKey,
  kCheck,
  kNumKeys,
  kWait,
};

enum class Status : uint8_t { kOk = 0, kTimedOut = 1, kError = 2 };

// ------------------------------------------------------------ socket I/O

// All n bytes, retrying short sends and EINTR; false when the peer is gone.
bool send_all(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

enum class ReadResult { kOk, kClosed, kTimedOut };

// Exactly n bytes, waiting until `deadline` (none: forever). A reset or
// failed connection reads as closed.
ReadResult recv_all(int fd, void* data, size_t n, std::optional<Clock::time_point> deadline) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    int wait_ms = -1;
    if (deadline) {
      const auto left =
          std::chrono::duration_cast<milliseconds>(*deadline - Clock::now()).count();
      if (left <= 0) return ReadResult::kTimedOut;
      wait_ms = static_cast<int>(std::min<long long>(left, 1 << 30));
    }
    pollfd pfd{fd, POLLIN, 0};
    const int ready = ::poll(&pfd, 1, wait_ms);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return ReadResult::kClosed;
    if (ready == 0) continue;  // the deadline check above ends it
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0) return ReadResult::kClosed;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return ReadResult::kOk;
}

// A message being built.
class Writer {
 public:
  Writer& u8(uint8_t v) {
    bytes_.push_back(static_cast<char>(v));
    return *this;
  }
  Writer& u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) bytes_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return *this;
  }
  Writer& i64(int64_t v) {
    const auto u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) bytes_.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
    return *this;
  }
  Writer& bytes(const void* data, size_t n) {
    u32(static_cast<uint32_t>(n));
    bytes_.append(static_cast<const char*>(data), n);
    return *this;
  }
  Writer& text(const std::string& s) { return bytes(s.data(), s.size()); }
  Writer& blob(const std::vector<uint8_t>& v) { return bytes(v.data(), v.size()); }
  Writer& raw(const void* data, size_t n) {
    bytes_.append(static_cast<const char*>(data), n);
    return *this;
  }
  bool send(int fd) const { return send_all(fd, bytes_.data(), bytes_.size()); }

 private:
  std::string bytes_;
};

// Reads fields off a socket; the first failure sticks (ok() turns false,
// later reads return zeros) so a message is read in one straight line and
// checked once.
class Reader {
 public:
  Reader(int fd, std::optional<Clock::time_point> deadline) : fd_(fd), deadline_(deadline) {}

  uint8_t u8() {
    uint8_t v = 0;
    read(&v, 1);
    return v;
  }
  uint32_t u32() {
    unsigned char b[4] = {};
    read(b, 4);
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(b[i]) << (8 * i);
    return v;
  }
  int64_t i64() {
    unsigned char b[8] = {};
    read(b, 8);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(b[i]) << (8 * i);
    return static_cast<int64_t>(v);
  }
  std::string text(uint32_t max) {
    std::string s(length(max), '\0');
    read(s.data(), s.size());
    return s;
  }
  std::vector<uint8_t> blob(uint32_t max) {
    std::vector<uint8_t> v(length(max));
    read(v.data(), v.size());
    return v;
  }
  void raw(void* data, size_t n) { read(data, n); }

  bool ok() const { return result_ == ReadResult::kOk && !too_long_; }
  ReadResult result() const { return result_; }
  bool too_long() const { return too_long_; }

 private:
  uint32_t length(uint32_t max) {
    const uint32_t n = u32();
    if (n > max) {
      too_long_ = true;
      return 0;
    }
    return n;
  }
  void read(void* data, size_t n) {
    if (!ok() || n == 0) return;
    result_ = recv_all(fd_, data, n, deadline_);
    if (result_ != ReadResult::kOk) std::memset(data, 0, n);
  }

  int fd_;
  std::optional<Clock::time_point> deadline_;
  ReadResult result_ = ReadResult::kOk;
  bool too_long_ = false;
};

void set_no_delay(int fd) {
  // Requests and replies are small and strictly alternate: without this,
  // Nagle's algorithm and delayed acks hold each for tens of milliseconds.
  const int one = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// A numeric address and port as a socket address.
struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  int family = AF_INET;
};

SocketAddress numeric_address(const std::string& address, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(address.c_str(), service.c_str(), &hints, &found);
  VIADUCT_CHECK(rc == 0 && found != nullptr, "the rendezvous store address '", address,
                "' is not a numeric IP address: ", ::gai_strerror(rc));
  SocketAddress out;
  std::memcpy(&out.storage, found->ai_addr, found->ai_addrlen);
  out.length = found->ai_addrlen;
  out.family = found->ai_family;
  ::freeaddrinfo(found);
  return out;
}

// "127.0.0.1:5000", "[::1]:5000"
std::string describe(const sockaddr* addr) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (addr->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(addr);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
    return str(host, ":", port);
  }
  if (addr->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(addr);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
  }
  return str("[", host, "]:", port);
}

std::string numeric_host(const sockaddr* addr) {
  char host[INET6_ADDRSTRLEN] = "";
  if (addr->sa_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(addr)->sin_addr, host,
                sizeof(host));
  } else if (addr->sa_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr, host,
                sizeof(host));
  }
  return host;
}

// Equal strings, in time that depends only on the longer one's length.
bool same_token(const std::string& a, const std::string& b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned>(x ^ y);
  }
  return diff == 0;
}

// A counter's value read as c10d's stores read it (std::stoll): an empty
// value counts 0 (HashStore), leading digits count and what follows them is
// ignored; no digits, or a number past int64, is no counter.
std::optional<int64_t> parse_counter(const std::vector<uint8_t>& value) {
  if (value.empty()) return 0;
  const std::string s(value.begin(), value.end());
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno == ERANGE || end == s.c_str()) return std::nullopt;
  return v;
}

}  // namespace

// ---------------------------------------------------------------- server

struct JobStoreServer::State {
  std::string address;
  int port = 0;
  std::string token;
  std::string endpoint;  // "127.0.0.1:29500", for messages
  UniqueFd listen_fd;
  UniqueFd wake_read, wake_write;  // a byte on it ends the accept loop

  std::mutex mu;  // guards data and stopping
  std::condition_variable changed;
  std::unordered_map<std::string, std::vector<uint8_t>> data;
  bool stopping = false;

  struct Peer {
    UniqueFd fd;
    std::string name;  // "10.0.0.2:53122"
    std::thread thread;
    std::atomic<bool> done{false};
  };
  std::mutex peers_mu;  // guards peers
  std::list<std::unique_ptr<Peer>> peers;
  std::thread acceptor;

  void accept_loop();
  void serve(Peer& peer);
  bool handshake(Peer& peer);
  // Answers one request; false when the connection should close.
  bool answer(int fd, Op op, Reader& in);
  // Waits until every key exists, the deadline passes or the server stops.
  bool wait_for(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                int64_t timeout_ms);
  void reap_finished();
};

void JobStoreServer::State::reap_finished() {
  std::lock_guard<std::mutex> lock(peers_mu);
  for (auto it = peers.begin(); it != peers.end();) {
    if ((*it)->done) {
      (*it)->thread.join();
      it = peers.erase(it);
    } else {
      ++it;
    }
  }
}

void JobStoreServer::State::accept_loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd.get(), POLLIN, 0}, {wake_read.get(), POLLIN, 0}};
    const int ready = ::poll(fds, 2, -1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0 || (fds[1].revents & POLLIN) != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    sockaddr_storage from{};
    socklen_t from_len = sizeof(from);
    const int fd = ::accept4(listen_fd.get(), reinterpret_cast<sockaddr*>(&from), &from_len,
                             SOCK_CLOEXEC);
    if (fd < 0) {
      // The peer gave up before we took it; or no descriptors are left, which
      // waiting may cure (a closed connection frees one).
      if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(milliseconds(100));
      continue;
    }
    set_no_delay(fd);
    reap_finished();
    auto peer = std::make_unique<Peer>();
    peer->fd = UniqueFd(fd);
    peer->name = describe(reinterpret_cast<const sockaddr*>(&from));
    Peer& p = *peer;
    std::lock_guard<std::mutex> lock(peers_mu);
    peers.push_back(std::move(peer));
    p.thread = std::thread([this, &p] {
      serve(p);
      p.done = true;
    });
  }
}

bool JobStoreServer::State::handshake(Peer& peer) {
  Reader in(peer.fd.get(), Clock::now() + kHandshakeTimeout);
  char magic[sizeof(kMagic)] = {};
  in.raw(magic, sizeof(magic));
  if (in.ok() && std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
    log::warn("rendezvous store at ", endpoint, ": refused a connection from ", peer.name,
              ": not a viaduct store client");
    return false;
  }
  const uint32_t version = in.u32();
  if (in.ok() && version != kJobStoreProtocolVersion) {
    log::warn("rendezvous store at ", endpoint, ": refused a connection from ", peer.name,
              ": store protocol version ", version, ", this store speaks ",
              kJobStoreProtocolVersion, " (ranks of different viaduct builds)");
    return false;
  }
  const std::string offered = in.text(kMaxTokenBytes);
  if (in.too_long()) {
    log::warn("rendezvous store at ", endpoint, ": refused a connection from ", peer.name,
              ": wrong job token (every rank must have the launch's VIADUCT_JOB_TOKEN)");
    return false;
  }
  if (!in.ok()) {
    bool stopped;
    {
      std::lock_guard<std::mutex> lock(mu);
      stopped = stopping;
    }
    if (!stopped) {
      log::warn("rendezvous store at ", endpoint, ": refused a connection from ", peer.name,
                in.result() == ReadResult::kTimedOut
                    ? str(": no complete handshake within ", kHandshakeTimeout.count() / 1000, " s")
                    : std::string(": the connection ended before its handshake did"));
    }
    return false;
  }
  if (!same_token(offered, token)) {
    log::warn("rendezvous store at ", endpoint, ": refused a connection from ", peer.name,
              offered.empty() ? ": it sent no job token" : ": wrong job token",
              " (every rank must have the launch's VIADUCT_JOB_TOKEN)");
    return false;
  }
  return Writer().u8(1).u32(kJobStoreProtocolVersion).send(peer.fd.get());
}

void JobStoreServer::State::serve(Peer& peer) {
  if (!handshake(peer)) {
    ::shutdown(peer.fd.get(), SHUT_RDWR);
    return;
  }
  for (;;) {
    Reader in(peer.fd.get(), std::nullopt);
    const auto op = static_cast<Op>(in.u8());
    if (!in.ok()) return;  // the client closed its connection, or the server stops
    if (!answer(peer.fd.get(), op, in)) {
      ::shutdown(peer.fd.get(), SHUT_RDWR);
      return;
    }
  }
}

bool JobStoreServer::State::wait_for(std::unique_lock<std::mutex>& lock,
                                     const std::vector<std::string>& keys,
                                     int64_t timeout_ms) {
  auto ready = [&] {
    if (stopping) return true;
    for (const auto& k : keys) {
      if (data.find(k) == data.end()) return false;
    }
    return true;
  };
  if (timeout_ms <= 0) {
    changed.wait(lock, ready);
  } else {
    changed.wait_for(lock, milliseconds(timeout_ms), ready);
  }
  if (stopping) return false;
  for (const auto& k : keys) {
    if (data.find(k) == data.end()) return false;
  }
  return true;
}

bool JobStoreServer::State::answer(int fd, Op op, Reader& in) {
  Writer out;
  switch (op) {
    case Op::kSet: {
      std::string key = in.text(kMaxKeyBytes);
      std::vector<uint8_t> value = in.blob(kMaxValueBytes);
      if (!in.ok()) return false;
      {
        std::lock_guard<std::mutex> lock(mu);
        data[std::move(key)] = std::move(value);
      }
      changed.notify_all();
      out.u8(static_cast<uint8_t>(Status::kOk));
      break;
    }
    case Op::kGet: {
      const std::string key = in.text(kMaxKeyBytes);
      const int64_t timeout_ms = in.i64();
      if (!in.ok()) return false;
      std::unique_lock<std::mutex> lock(mu);
      if (wait_for(lock, {key}, timeout_ms)) {
        out.u8(static_cast<uint8_t>(Status::kOk)).blob(data[key]);
      } else if (stopping) {
        return false;
      } else {
        out.u8(static_cast<uint8_t>(Status::kTimedOut));
      }
      break;
    }
    case Op::kAdd: {
      std::string key = in.text(kMaxKeyBytes);
      const int64_t delta = in.i64();
      if (!in.ok()) return false;
      std::unique_lock<std::mutex> lock(mu);
      int64_t value = delta;
      auto it = data.find(key);
      if (it != data.end()) {
        const auto current = parse_counter(it->second);
        if (!current) {
          out.u8(static_cast<uint8_t>(Status::kError))
              .text("its value is not a decimal integer in int64's range");
          break;
        }
        value += *current;
      }
      const std::string text = std::to_string(value);
      data[std::move(key)] = std::vector<uint8_t>(text.begin(), text.end());
      lock.unlock();
      changed.notify_all();
      out.u8(static_cast<uint8_t>(Status::kOk)).i64(value);
      break;
    }
    case Op::kCompareSet: {
      std::string key = in.text(kMaxKeyBytes);
      std::vector<uint8_t> expected = in.blob(kMaxValueBytes);
      std::vector<uint8_t> desired = in.blob(kMaxValueBytes);
      if (!in.ok()) return false;
      std::unique_lock<std::mutex> lock(mu);
      auto it = data.find(key);
      out.u8(static_cast<uint8_t>(Status::kOk));
      if (it == data.end() ? expected.empty() : it->second == expected) {
        // Absent and expected empty, or present and as expected: set it.
        out.blob(desired);
        data[std::move(key)] = std::move(desired);
        lock.unlock();
        changed.notify_all();
      } else {
        // Absent: the expected value comes back; present: the current one.
        out.blob(it == data.end() ? expected : it->second);
      }
      break;
    }
    case Op::kDeleteKey: {
      const std::string key = in.text(kMaxKeyBytes);
      if (!in.ok()) return false;
      std::lock_guard<std::mutex> lock(mu);
      out.u8(static_cast<uint8_t>(Status::kOk)).u8(data.erase(key) == 1 ? 1 : 0);
      break;
    }
    case Op::kCheck:
    case Op::kWait: {
      const uint32_t n = in.u32();
      if (!in.ok() || n > kMaxKeys) return false;
      std::vector<std::string> keys;
      for (uint32_t i = 0; i < n && in.ok(); ++i) keys.push_back(in.text(kMaxKeyBytes));
      const int64_t timeout_ms = op == Op::kWait ? in.i64() : 0;
      if (!in.ok()) return false;
      std::unique_lock<std::mutex> lock(mu);
      if (op == Op::kCheck) {
        bool all = true;
        for (const auto& k : keys) all = all && data.find(k) != data.end();
        out.u8(static_cast<uint8_t>(Status::kOk)).u8(all ? 1 : 0);
      } else if (wait_for(lock, keys, timeout_ms)) {
        out.u8(static_cast<uint8_t>(Status::kOk));
      } else if (stopping) {
        return false;
      } else {
        out.u8(static_cast<uint8_t>(Status::kTimedOut));
      }
      break;
    }
    case Op::kNumKeys: {
      std::lock_guard<std::mutex> lock(mu);
      out.u8(static_cast<uint8_t>(Status::kOk)).i64(static_cast<int64_t>(data.size()));
      break;
    }
    default:
      return false;  // an authenticated client of another build; close
  }
  return out.send(fd);
}

JobStoreServer::JobStoreServer(const std::string& address, int port, std::string token)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.token = std::move(token);
  VIADUCT_CHECK(port >= 0 && port <= 65535, "the rendezvous store port ", port,
                " is not a TCP port");
  const SocketAddress where = numeric_address(address, port);
  s.listen_fd = UniqueFd(::socket(where.family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  VIADUCT_CHECK(s.listen_fd.valid(), "cannot serve the rendezvous store on port ", port, " of ",
                address, ": socket: ", errno_text());
  // A restarted job may reuse the port while the last one's connections
  // linger in TIME_WAIT.
  const int one = 1;
  (void)::setsockopt(s.listen_fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(s.listen_fd.get(), reinterpret_cast<const sockaddr*>(&where.storage),
             where.length) != 0 ||
      ::listen(s.listen_fd.get(), 1024) != 0) {
    const int err = errno;
    throw Error(str("cannot serve the rendezvous store on port ", port, " of ", address, ": ",
                    std::strerror(err)));
  }
  sockaddr_storage bound{};
  socklen_t bound_len = sizeof(bound);
  VIADUCT_CHECK(::getsockname(s.listen_fd.get(), reinterpret_cast<sockaddr*>(&bound),
                              &bound_len) == 0,
                "the rendezvous store on port ", port, " of ", address,
                ": getsockname: ", errno_text());
  s.address = numeric_host(reinterpret_cast<const sockaddr*>(&bound));
  s.port = ntohs(bound.ss_family == AF_INET
                     ? reinterpret_cast<const sockaddr_in*>(&bound)->sin_port
                     : reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port);
  s.endpoint = describe(reinterpret_cast<const sockaddr*>(&bound));
  int pipe_fds[2];
  VIADUCT_CHECK(::pipe2(pipe_fds, O_CLOEXEC) == 0, "the rendezvous store: pipe: ",
                errno_text());
  s.wake_read = UniqueFd(pipe_fds[0]);
  s.wake_write = UniqueFd(pipe_fds[1]);
  s.acceptor = std::thread([&s] { s.accept_loop(); });
}

JobStoreServer::~JobStoreServer() {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stopping = true;
  }
  s.changed.notify_all();
  const char byte = 0;
  (void)!::write(s.wake_write.get(), &byte, 1);
  s.acceptor.join();
  // Ends every connection's blocking read; blocked gets and waits see
  // `stopping`.
  std::lock_guard<std::mutex> lock(s.peers_mu);
  for (auto& peer : s.peers) ::shutdown(peer->fd.get(), SHUT_RDWR);
  for (auto& peer : s.peers) peer->thread.join();
  s.peers.clear();
}

const std::string& JobStoreServer::address() const { return state_->address; }
int JobStoreServer::port() const { return state_->port; }

// ---------------------------------------------------------------- client

struct JobStore::Connection {
  UniqueFd fd;
  std::mutex mu;  // one request and its reply at a time
};

namespace {

// One connection attempt until `deadline`: the socket when the server
// answered the handshake; nullopt when nothing accepted the connection
// (refused, unreachable, not yet listening), worth another try. A server
// that took the connection and closed it throws.
std::optional<UniqueFd> try_connect(const SocketAddress& where, const std::string& endpoint,
                                    const std::string& token, Clock::time_point deadline,
                                    std::string& last_error) {
  UniqueFd fd(::socket(where.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  VIADUCT_CHECK(fd.valid(), "socket for the rendezvous store at ", endpoint, ": ",
                errno_text());
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&where.storage), where.length) != 0) {
    if (errno != EINPROGRESS) {
      last_error = errno_text();
      return std::nullopt;
    }
    for (;;) {
      const auto left =
          std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) {
        last_error = "connection timed out";
        return std::nullopt;
      }
      pollfd pfd{fd.get(), POLLOUT, 0};
      const int ready = ::poll(&pfd, 1, static_cast<int>(std::min<long long>(left, 1000)));
      if (ready < 0 && errno != EINTR) {
        last_error = errno_text();
        return std::nullopt;
      }
      if (ready > 0) break;
    }
    int err = 0;
    socklen_t len = sizeof(err);
    (void)::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      last_error = std::strerror(err);
      return std::nullopt;
    }
  }
  const int flags = ::fcntl(fd.get(), F_GETFL);
  (void)::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  set_no_delay(fd.get());
  Writer hello;
  hello.raw(kMagic, sizeof(kMagic)).u32(kJobStoreProtocolVersion).text(token);
  Reader in(fd.get(), std::max(deadline, Clock::now() + kHandshakeTimeout));
  const bool sent = hello.send(fd.get());
  const uint8_t accepted = in.u8();
  const uint32_t version = in.u32();
  VIADUCT_CHECK(sent && in.ok() && accepted == 1 && version == kJobStoreProtocolVersion,
                "the rendezvous store at ", endpoint,
                " refused this rank: its job token differs (VIADUCT_JOB_TOKEN must be the "
                "same on every node of the job), or another program holds that port");
  return fd;
}

}  // namespace

JobStore::JobStore(std::string address, int port, std::string token, milliseconds timeout,
                   std::shared_ptr<JobStoreServer> server)
    : c10d::Store(timeout),
      address_(std::move(address)),
      port_(port),
      token_(std::move(token)),
      server_(std::move(server)),
      conn_(std::make_unique<Connection>()) {
  const SocketAddress where = numeric_address(address_, port_);
  const auto deadline = Clock::now() + (timeout == kNoTimeout ? milliseconds(300'000) : timeout);
  std::string last_error = "not tried";
  milliseconds pause{50};
  for (;;) {
    auto fd = try_connect(where, endpoint(), token_, deadline, last_error);
    if (fd) {
      conn_->fd = std::move(*fd);
      return;
    }
    VIADUCT_CHECK(Clock::now() + pause < deadline, "no rendezvous store answered at ",
                  endpoint(), " within ", timeout.count(), " ms: ", last_error);
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, milliseconds(1000));
  }
}

JobStore::~JobStore() = default;

std::string JobStore::endpoint() const {
  return address_.find(':') == std::string::npos ? str(address_, ":", port_)
                                                 : str("[", address_, "]:", port_);
}

c10::intrusive_ptr<c10d::Store> JobStore::clone() {
  return c10::make_intrusive<JobStore>(address_, port_, token_, timeout_, server_);
}

namespace {

// Sends `request` and reads the status of its reply, then `read_rest` reads
// the op's fields; any failure of the connection throws naming `what`.
// `wait`: how long the server may take (the request's own timeout).
template <typename ReadRest>
void exchange(JobStore::Connection& conn, const std::string& endpoint, const std::string& what,
              const Writer& request, milliseconds wait, ReadRest&& read_rest) {
  std::lock_guard<std::mutex> lock(conn.mu);
  VIADUCT_CHECK(conn.fd.valid(), what, ": the connection to the rendezvous store at ",
                endpoint, " was lost earlier");
  std::optional<Clock::time_point> deadline;
  if (wait != c10d::Store::kNoTimeout) deadline = Clock::now() + wait + kReplySlack;
  Reader in(conn.fd.get(), deadline);
  const bool sent = request.send(conn.fd.get());
  const auto status = static_cast<Status>(in.u8());
  std::string error;
  if (in.ok() && status == Status::kError) error = in.text(kMaxKeyBytes);
  if (in.ok() && status == Status::kOk) read_rest(in);
  if (!sent || !in.ok()) {
    conn.fd.reset();  // the stream is out of step: no later request may use it
    throw Error(str(what, ": lost the connection to the rendezvous store at ", endpoint,
                    in.result() == ReadResult::kTimedOut ? " (no reply in time)"
                                                         : " (rank 0's server ended?)"));
  }
  VIADUCT_CHECK(status != Status::kError, what, ": ", error);
  if (status == Status::kTimedOut) {
    throw Error(str(what, " timed out after ", wait.count(), " ms (rendezvous store at ",
                    endpoint, ")"));
  }
}

std::string quoted_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "'" : ", '") + k + "'";
  return out;
}

}  // namespace

void JobStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  Writer req;
  req.u8(static_cast<uint8_t>(Op::kSet)).text(key).blob(value);
  exchange(*conn_, endpoint(), str("set of key '", key, "'"), req, timeout_, [](Reader&) {});
}

std::vector<uint8_t> JobStore::compareSet(const std::string& key,
                                          const std::vector<uint8_t>& expected,
                                          const std::vector<uint8_t>& desired) {
  Writer req;
  req.u8(static_cast<uint8_t>(Op::kCompareSet)).text(key).blob(expected).blob(desired);
  std::vector<uint8_t> value;
  exchange(*conn_, endpoint(), str("compareSet of key '", key, "'"), req, timeout_,
           [&](Reader& in) { value = in.blob(kMaxValueBytes); });
  return value;
}

std::vector<uint8_t> JobStore::get(const std::string& key) {
  Writer req;
  req.u8(static_cast<uint8_t>(Op::kGet)).text(key).i64(timeout_.count());
  std::vector<uint8_t> value;
  exchange(*conn_, endpoint(), str("get of key '", key, "'"), req, timeout_,
           [&](Reader& in) { value = in.blob(kMaxValueBytes); });
  return value;
}

int64_t JobStore::add(const std::string& key, int64_t value) {
  Writer req;
  req.u8(static_cast<uint8_t>(Op::kAdd)).text(key).i64(value);
  int64_t result = 0;
  exchange(*conn_, endpoint(), str("add to key '", key, "'"), req, timeout_,
           [&](Reader& in) { result = in.i64(); });
  return result;
}

bool JobStore::deleteKey(const std::string& key) {
  Writer req;
  req.u8(static_cast<uint8_t>(Op::kDeleteKey)).text(key);
  bool deleted = false;
  exchange(*conn_, endpoint(), str("delete of key '", key, "'"), req, timeout_,
           [&](Reader& in) { deleted = in.u8() == 1; });
  return deleted;
}

bool JobStore::check(const std::vector<std::string>& keys) {
  Writer req;
  req.u8(static_cast<uint8_t>(Op::kCheck)).u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) req.text(k);
  bool all = false;
  exchange(*conn_, endpoint(), str("check of keys ", quoted_keys(keys)), req, timeout_,
           [&](Reader& in) { all = in.u8() == 1; });
  return all;
}

int64_t JobStore::getNumKeys() {
  Writer req;
  req.u8(static_cast<uint8_t>(Op::kNumKeys));
  int64_t n = 0;
  exchange(*conn_, endpoint(), "count of keys", req, timeout_,
           [&](Reader& in) { n = in.i64(); });
  return n;
}

void JobStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void JobStore::wait(const std::vector<std::string>& keys, const milliseconds& timeout) {
  Writer req;
  req.u8(static_cast<uint8_t>(Op::kWait)).u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) req.text(k);
  req.i64(timeout.count());
  exchange(*conn_, endpoint(), str("wait for keys ", quoted_keys(keys)), req, timeout,
           [](Reader&) {});
}

// ------------------------------------------------------ job-level choices

bool job_on_one_host(const RendezvousInfo& info) {
  return info.local_world_size == info.world_size;
}

namespace {

bool loopback_name(const std::string& address) {
  return address == "localhost" || address.rfind("127.", 0) == 0 || address == "::1";
}

}  // namespace

std::string store_address(const RendezvousInfo& info) {
  if (job_on_one_host(info) || loopback_name(info.master_addr)) return "127.0.0.1";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(info.master_addr.c_str(), nullptr, &hints, &found);
  VIADUCT_CHECK(rc == 0 && found != nullptr, "MASTER_ADDR=", info.master_addr, " (from ",
                info.source, ") does not resolve: ", ::gai_strerror(rc));
  // IPv4 first: every rank must pick the same address of a name that has both.
  const addrinfo* pick = found;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      pick = a;
      break;
    }
  }
  const std::string address = numeric_host(pick->ai_addr);
  ::freeaddrinfo(found);
  VIADUCT_CHECK(!address.empty() && !loopback_name(address), "MASTER_ADDR=", info.master_addr,
                " (from ", info.source, ") resolves to ", address,
                " here, a loopback address the other nodes of this ", info.world_size,
                "-rank job cannot reach: set MASTER_ADDR to an address of node 0 that every "
                "node reaches");
  return address;
}

std::string job_token(const RendezvousInfo& info, const EnvLookup& env) {
  const auto token = env("VIADUCT_JOB_TOKEN");
  if (token && !token->empty()) return *token;
  VIADUCT_CHECK(job_on_one_host(info), "this job spans several hosts (", info.to_string(),
                ") and has no job token: export the same VIADUCT_JOB_TOKEN on every node "
                "before starting its ranks, e.g. `export VIADUCT_JOB_TOKEN=$(head -c16 "
                "/dev/urandom | xxd -p)`; the rendezvous store serves only ranks that send it");
  return "";
}

std::string new_job_token() {
  UniqueFd fd(::open("/dev/urandom", O_RDONLY | O_CLOEXEC));
  VIADUCT_CHECK(fd.valid(), "cannot open /dev/urandom for the job token: ", errno_text());
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t k = ::read(fd.get(), bytes + got, sizeof(bytes) - got);
    if (k < 0 && errno == EINTR) continue;
    VIADUCT_CHECK(k > 0, "cannot read /dev/urandom for the job token: ",
                  k == 0 ? "end of file" : errno_text());
    got += static_cast<size_t>(k);
  }
  static const char kHex[] = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) {
    token.push_back(kHex[b >> 4]);
    token.push_back(kHex[b & 15]);
  }
  return token;
}

}  // namespace viaduct::distributed
