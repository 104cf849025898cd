// `viaduct-spm MODEL`: SentencePiece encoding for viaduct, in a process of
// its own. Debian's libsentencepiece carries protobuf code built against
// another protobuf than LibTorch's, and the two crash in one process before
// main; so viaduct (data/spm_tokenizer.h) runs this small program, which
// links SentencePiece and no LibTorch, and talks to it over a socket.
//
// Protocol on stdin/stdout, little-endian, one request at a time:
//   start:   "VSPM" i32 vocab_size, i32 bos_id, i32 eos_id, i32 unk_id
//            (ids -1 when the model has none); or, when the model cannot be
//            loaded, "VSPE" u32 n, n bytes of message, and exit 1.
//   'E' u32 n, n bytes of text  ->  u32 k, k x i32 ids
//   'D' u32 k, k x i32 ids      ->  u32 n, n bytes of text
//   any failure                 ->  u32 0xFFFFFFFF, u32 n, n bytes of message
//   end of input                ->  exit 0
#include <sentencepiece_processor.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr uint32_t kFailure = 0xFFFFFFFFu;

// Reads exactly n bytes; false at a clean end of input before the first one.
bool read_all(void* p, size_t n, bool* eof) {
  auto* c = static_cast<char*>(p);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::read(STDIN_FILENO, c + done, n - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      *eof = r == 0 && done == 0;
      return false;
    }
    done += static_cast<size_t>(r);
  }
  return true;
}

bool write_all(const void* p, size_t n) {
  const auto* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::write(STDOUT_FILENO, c, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool write_u32(uint32_t v) { return write_all(&v, sizeof v); }

bool fail(const std::string& message) {
  return write_u32(kFailure) && write_u32(static_cast<uint32_t>(message.size())) &&
         write_all(message.data(), message.size());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: viaduct-spm MODEL (run by viaduct, not by hand)\n");
    return 2;
  }
  sentencepiece::SentencePieceProcessor sp;
  const auto status = sp.Load(argv[1]);
  if (!status.ok()) {
    const std::string message = status.ToString();
    (void)(write_all("VSPE", 4) && write_u32(static_cast<uint32_t>(message.size())) &&
           write_all(message.data(), message.size()));
    return 1;
  }
  const int32_t head[4] = {sp.GetPieceSize(), sp.bos_id(), sp.eos_id(), sp.unk_id()};
  if (!write_all("VSPM", 4) || !write_all(head, sizeof head)) return 1;
  std::string text;
  std::vector<int> ids;
  for (;;) {
    char op = 0;
    uint32_t n = 0;
    bool eof = false;
    if (!read_all(&op, 1, &eof)) return eof ? 0 : 1;
    if (!read_all(&n, sizeof n, &eof)) return 1;
    bool ok = true;
    if (op == 'E') {
      text.resize(n);
      if (n > 0 && !read_all(text.data(), n, &eof)) return 1;
      const auto s = sp.Encode(text, &ids);
      if (!s.ok()) {
        ok = fail(s.ToString());
      } else {
        ok = write_u32(static_cast<uint32_t>(ids.size())) &&
             write_all(ids.data(), ids.size() * sizeof(int));
      }
    } else if (op == 'D') {
      ids.resize(n);
      if (n > 0 && !read_all(ids.data(), n * sizeof(int), &eof)) return 1;
      std::string out;
      bool in_range = true;
      for (int id : ids) in_range = in_range && id >= 0 && id < sp.GetPieceSize();
      const auto s = in_range ? sp.Decode(ids, &out)
                              : sentencepiece::util::Status(
                                    sentencepiece::util::StatusCode::kOutOfRange,
                                    "an id is outside the vocabulary");
      if (!s.ok()) {
        ok = fail(s.ToString());
      } else {
        ok = write_u32(static_cast<uint32_t>(out.size())) && write_all(out.data(), out.size());
      }
    } else {
      ok = fail(std::string("unknown request '") + op + "'");
    }
    if (!ok) return 1;
  }
}
