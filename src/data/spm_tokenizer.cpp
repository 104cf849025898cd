// The client side of viaduct-spm (see spm_tokenizer.h): one child process
// per worker, spoken to over a UNIX socket pair (send with MSG_NOSIGNAL, so a
// worker that died is an error here, not a SIGPIPE).
#include "data/spm_tokenizer.h"

#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/check.h"

extern char** environ;

namespace viaduct::data {

namespace fs = std::filesystem;

std::string spm_worker_path() {
  if (const char* env = std::getenv("VIADUCT_SPM_WORKER"); env != nullptr && *env != '\0') {
    return env;
  }
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("viaduct-spm") : (self.parent_path() / "viaduct-spm").string();
}

class SpmWorker {
 public:
  SpmWorker(const std::string& worker, const std::string& model) : model_(model) {
    int fds[2];
    VIADUCT_CHECK_T(FileError, ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0,
                    "tokenizer '", model, "': socketpair: ", std::strerror(errno));
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&fa, fds[1], STDOUT_FILENO);
    std::vector<char*> argv{const_cast<char*>(worker.c_str()), const_cast<char*>(model.c_str()),
                            nullptr};
    const int rc = ::posix_spawn(&pid_, worker.c_str(), &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    ::close(fds[1]);
    fd_ = fds[0];
    if (rc != 0) {
      ::close(fd_);
      VIADUCT_CHECK_T(FileError, false, "tokenizer '", model,
                      "': SentencePiece models are encoded by the viaduct-spm program, which "
                      "could not be started from '", worker, "': ", std::strerror(rc),
                      " (it is built beside viaduct when libsentencepiece-dev is installed; "
                      "VIADUCT_SPM_WORKER names another)");
    }
    try {
      handshake(worker, model);
    } catch (...) {
      shutdown();  // no destructor runs for a constructor that threw
      throw;
    }
  }

  void handshake(const std::string& worker, const std::string& model) {
    char magic[4];
    receive(magic, 4);
    if (std::memcmp(magic, "VSPE", 4) == 0) {
      const std::string why = receive_string(receive_u32());
      VIADUCT_CHECK_T(FileError, false, "tokenizer '", model,
                      "' is not a SentencePiece model SentencePiece can load: ", why);
    }
    VIADUCT_CHECK_T(FileError, std::memcmp(magic, "VSPM", 4) == 0, "tokenizer '", model,
                    "': '", worker, "' is not viaduct's SentencePiece worker");
    int32_t head[4];
    receive(head, sizeof head);
    vocab_size = head[0];
    bos_id = head[1];
    eos_id = head[2];
  }

  ~SpmWorker() { shutdown(); }

  void shutdown() {
    ::close(fd_);  // the worker sees the end of its input and exits
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }

  SpmWorker(const SpmWorker&) = delete;
  SpmWorker& operator=(const SpmWorker&) = delete;

  void encode(std::string_view text, std::vector<int64_t>& out) {
    request('E', text.data(), text.size(), text.size());
    const uint32_t k = receive_u32_or_failure("encode");
    std::vector<int32_t> ids(k);
    if (k > 0) receive(ids.data(), k * sizeof(int32_t));
    out.insert(out.end(), ids.begin(), ids.end());
  }

  std::string decode(const std::vector<int64_t>& ids) {
    std::vector<int32_t> narrow;
    narrow.reserve(ids.size());
    for (int64_t id : ids) {
      VIADUCT_CHECK(id >= 0 && id < vocab_size, "tokenizer '", model_, "': id ", id,
                    " is outside the vocabulary of ", vocab_size);
      narrow.push_back(static_cast<int32_t>(id));
    }
    request('D', narrow.data(), narrow.size() * sizeof(int32_t), narrow.size());
    return receive_string(receive_u32_or_failure("decode"));
  }

  int64_t vocab_size = 0;
  int64_t bos_id = -1;
  int64_t eos_id = -1;

 private:
  void request(char op, const void* payload, size_t bytes, size_t count) {
    VIADUCT_CHECK(count <= 0xFFFFFFF0u, "tokenizer '", model_, "': a document of ", count,
                  " units is too long for one request");
    const uint32_t n = static_cast<uint32_t>(count);
    send(&op, 1);
    send(&n, sizeof n);
    if (bytes > 0) send(payload, bytes);
  }

  void send(const void* p, size_t n) {
    const auto* c = static_cast<const char*>(p);
    while (n > 0) {
      const ssize_t w = ::send(fd_, c, n, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      VIADUCT_CHECK_T(FileError, w > 0, "tokenizer '", model_,
                      "': the viaduct-spm worker is gone (", std::strerror(errno), ")");
      c += w;
      n -= static_cast<size_t>(w);
    }
  }

  void receive(void* p, size_t n) {
    auto* c = static_cast<char*>(p);
    while (n > 0) {
      const ssize_t r = ::recv(fd_, c, n, 0);
      if (r < 0 && errno == EINTR) continue;
      VIADUCT_CHECK_T(FileError, r > 0, "tokenizer '", model_,
                      "': the viaduct-spm worker ended without an answer",
                      r < 0 ? str(" (", std::strerror(errno), ")") : std::string());
      c += r;
      n -= static_cast<size_t>(r);
    }
  }

  uint32_t receive_u32() {
    uint32_t v = 0;
    receive(&v, sizeof v);
    return v;
  }

  std::string receive_string(uint32_t n) {
    std::string s(n, '\0');
    if (n > 0) receive(s.data(), n);
    return s;
  }

  uint32_t receive_u32_or_failure(const char* what) {
    const uint32_t v = receive_u32();
    if (v == 0xFFFFFFFFu) {
      const std::string why = receive_string(receive_u32());
      VIADUCT_CHECK(false, "tokenizer '", model_, "': SentencePiece ", what, " failed: ", why);
    }
    return v;
  }

  std::string model_;
  int fd_ = -1;
  pid_t pid_ = -1;
};

namespace {
struct SpmState final : EncodeState {
  std::unique_ptr<SpmWorker> worker;
};
}  // namespace

SpmTokenizer::SpmTokenizer(const std::string& model)
    : model_(model), worker_(spm_worker_path()) {
  control_ = std::make_unique<SpmWorker>(worker_, model_);
  vocab_size_ = control_->vocab_size;
  bos_id_ = control_->bos_id;
  eos_id_ = control_->eos_id;
}

SpmTokenizer::~SpmTokenizer() = default;

std::string SpmTokenizer::name() const {
  // Token file headers hold 63 characters.
  return ("spm:" + fs::path(model_).stem().string()).substr(0, 63);
}

std::unique_ptr<EncodeState> SpmTokenizer::new_state() const {
  auto s = std::make_unique<SpmState>();
  s->worker = std::make_unique<SpmWorker>(worker_, model_);
  return s;
}

void SpmTokenizer::encode_into(std::string_view text, bool add_special_tokens,
                               std::vector<int64_t>& out, EncodeState& state) const {
  if (add_special_tokens && bos_id_ >= 0) out.push_back(bos_id_);
  static_cast<SpmState&>(state).worker->encode(text, out);
}

std::string SpmTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::lock_guard<std::mutex> lock(control_mutex_);
  return control_->decode(ids);
}

DocumentMarker SpmTokenizer::document_marker() const {
  // As encode_document: BOS first, else EOS first as a separator.
  if (bos_id_ >= 0) return {bos_id_, DocumentMarker::Kind::kStarts};
  if (eos_id_ >= 0) return {eos_id_, DocumentMarker::Kind::kStarts};
  return {};
}

void SpmTokenizer::encode_document(std::string_view text, std::vector<int64_t>& out,
                                   EncodeState& state) const {
  if (bos_id_ >= 0) {
    out.push_back(bos_id_);
  } else if (eos_id_ >= 0) {
    out.push_back(eos_id_);
  }
  static_cast<SpmState&>(state).worker->encode(text, out);
}

}  // namespace viaduct::data
