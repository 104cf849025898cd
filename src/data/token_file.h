// Token files, memory-mapped. Three on-disk formats hold a flat array of token
// ids; a TokenFile reads any of them and a TokenStream concatenates several
// (the shards of one data set) into one stream of int64 tokens.
//
//   viaduct  written by `viaduct prepare-data` (TokenFileWriter); a fixed
//            128-byte little-endian header, then the tokens:
//              [0, 8)     magic "VIADTOK\0"
//              [8, 12)    uint32 version (1)
//              [12, 16)   uint32 bytes per token (2 = uint16, 4 = uint32)
//              [16, 24)   uint64 token count
//              [24, 32)   uint64 vocab size
//              [32, 96)   tokenizer name, NUL-padded (at most 63 chars)
//              [96, 104)  version 2: the document marker's token id
//              [104, 105) version 2: the marker's kind (0 none, 1 starts,
//                         2 ends; see DocumentMarker)
//              [105, 128) reserved, zero (version 1: [96, 128) zero)
//   llmc     llm.c's `.bin` shards: 256 int32 header (magic 20240520,
//            version 1, token count) then uint16 tokens; the llama-3 variant
//            (magic 20240801, version 7) holds uint32 tokens.
//   uint16 / uint32   a raw array of tokens, nothing else (`.u16` / `.u32`).
//
// Every header field is validated on open and the file size must match the
// token count exactly; anything else raises viaduct::FileError naming the file
// and what is wrong.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/file_io.h"

namespace viaduct::data {

enum class TokenFormat { kViaduct, kLlmc, kUint16, kUint32 };

// "viaduct", "llmc", "uint16", "uint32".
std::string format_name(TokenFormat format);

// A read-only memory mapping of a whole file. Owns the mapping; the
// descriptor is closed as soon as the file is mapped.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void release() noexcept;

  std::string path_;
  const uint8_t* data_ = nullptr;  // nullptr for an empty file
  size_t size_ = 0;
};

// The token that marks where documents meet in a token file, as
// prepare-data wrote it (TextTokenizer::document_marker): kStarts, the token
// begins each document (a separator or BOS written first); kEnds, it closes
// each one (an EOS written last). Files of other formats, and viaduct files
// of version 1, record none.
struct DocumentMarker {
  enum class Kind : uint8_t { kNone = 0, kStarts = 1, kEnds = 2 };
  int64_t token = -1;
  Kind kind = Kind::kNone;
  bool recorded() const { return kind != Kind::kNone; }
  bool operator==(const DocumentMarker&) const = default;
};
// "<|endoftext|> (id 50256) starts each document", or "none recorded".
std::string describe(const DocumentMarker& m);

class TokenFile {
 public:
  // Opens `path` in `format`; see open_token_file for "auto".
  TokenFile(const std::string& path, TokenFormat format);

  const std::string& path() const { return file_.path(); }
  TokenFormat format() const { return format_; }
  // 2 (uint16) or 4 (uint32).
  int bytes_per_token() const { return bytes_per_token_; }
  int64_t size() const { return size_; }
  // From the header; 0 where the format does not record it.
  int64_t vocab_size() const { return vocab_size_; }
  // From the header; "" where the format does not record it.
  const std::string& tokenizer() const { return tokenizer_; }
  // From the header; none where the format does not record it.
  const DocumentMarker& document_marker() const { return marker_; }

  // Token i, 0 <= i < size().
  int64_t token(int64_t i) const;
  // Copies tokens [start, start + count) into out[0, count).
  void read(int64_t start, int64_t count, int64_t* out) const;
  // The largest token id (scans the whole file; 0 when empty).
  int64_t max_token() const;

 private:
  MappedFile file_;
  TokenFormat format_;
  int bytes_per_token_ = 2;
  const uint8_t* tokens_ = nullptr;
  int64_t size_ = 0;
  int64_t vocab_size_ = 0;
  std::string tokenizer_;
  DocumentMarker marker_;
};

// `format`: "auto", "viaduct", "llmc", "uint16" or "uint32". "auto" sniffs the
// magic (viaduct, then llm.c) and otherwise goes by the extension (`.u16`,
// `.u32`); a file it cannot place is refused naming the file.
TokenFile open_token_file(const std::string& path, const std::string& format);

// Several token files read as one concatenated stream, in the given order.
class TokenStream {
 public:
  explicit TokenStream(std::vector<TokenFile> files);

  int64_t size() const { return size_; }
  int64_t token(int64_t i) const;
  // Copies tokens [start, start + count) into out[0, count); a range may
  // cross file boundaries.
  void read(int64_t start, int64_t count, int64_t* out) const;
  // The vocab size recorded by the headers (the largest); 0 if none records it.
  int64_t vocab_size() const;
  int64_t max_token() const;
  // The files' document marker (they agree: checked when the stream opens;
  // none when no file records one).
  const DocumentMarker& document_marker() const { return files_.front().document_marker(); }

  const std::vector<TokenFile>& files() const { return files_; }
  // The first file's path, with ", +N more" for a multi-file stream.
  std::string describe() const;

 private:
  std::vector<TokenFile> files_;
  std::vector<int64_t> starts_;  // starts_[k]: first stream index of file k
  int64_t size_ = 0;
};

// `spec` is one path or a glob pattern (`*`, `?`, `[`), expanded in sorted
// order; a pattern that matches nothing is a FileError.
std::vector<std::string> expand_token_paths(const std::string& spec);
std::shared_ptr<const TokenStream> open_token_stream(const std::string& spec,
                                                     const std::string& format);
std::shared_ptr<const TokenStream> open_token_stream(
    const std::vector<std::string>& paths, const std::string& format);

// The held-out file that belongs to `path`: `<stem>.val<.ext>`
// ("data/fortunes.tok" -> "data/fortunes.val.tok").
std::string val_path_for(const std::string& path);
// The eval file to use: `val_path` when given, else val_path_for(path) when
// that file exists (and `path` is no glob), else "".
std::string resolve_val_path(const std::string& path,
                             const std::string& val_path);
// The eval files of one or several training specs (data.path, or the
// entries of data.paths): `val_path` expanded when given, else
// resolve_val_path of each spec that has one, in order; empty = no eval.
std::vector<std::string> resolve_val_paths(const std::vector<std::string>& paths,
                                           const std::string& val_path);

// Writes a viaduct token file atomically (see Note [Atomic replace] in
// core/file_io.h): tokens go to `<path>.tmp`, and finish() writes the header,
// fsyncs, renames onto `path` and fsyncs the folder. Dropped without
// finish(), it removes the temporary file.
class TokenFileWriter {
 public:
  // bytes_per_token is derived from vocab_size (uint16 when it fits).
  TokenFileWriter(const std::string& path, int64_t vocab_size,
                  const std::string& tokenizer, const DocumentMarker& marker = {});
  ~TokenFileWriter();
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;

  // Every token must lie in [0, vocab_size).
  void append(const int64_t* tokens, int64_t count);
  void append(const std::vector<int64_t>& tokens) {
    append(tokens.data(), static_cast<int64_t>(tokens.size()));
  }
  // Returns the file's size in bytes.
  int64_t finish();

  int64_t tokens_written() const { return count_; }
  const std::string& path() const { return path_; }

 private:
  void write_all(const void* data, size_t bytes, int64_t offset);

  std::string path_;
  std::unique_ptr<AtomicFile> out_;  // null once finished
  int64_t vocab_size_;
  std::string tokenizer_;
  DocumentMarker marker_;
  int bytes_per_token_;
  int64_t count_ = 0;
  std::vector<uint8_t> buffer_;
};

constexpr int64_t kViaductHeaderBytes = 128;
constexpr uint32_t kViaductVersion = 2;  // 1 is read too (no document marker)
constexpr int64_t kLlmcHeaderInts = 256;
constexpr int32_t kLlmcMagic = 20240520;        // GPT-2 shards, uint16 tokens
constexpr int32_t kLlmcMagicLlama3 = 20240801;  // llama-3 shards, uint32

}  // namespace viaduct::data
