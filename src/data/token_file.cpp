// Token files: the memory mapping, the three formats' headers and their
// validation, the multi-file stream and the atomic viaduct-format writer.
#include "data/token_file.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/check.h"
#include "core/file_io.h"
#include "core/log.h"

namespace viaduct::data {

static_assert(
    std::endian::native == std::endian::little,
    "token files are little-endian; a big-endian host needs byte swaps");

namespace {

constexpr char kViaductMagic[8] = {'V', 'I', 'A', 'D', 'T', 'O', 'K', '\0'};
constexpr size_t kTokenizerField = 64;
constexpr int32_t kLlmcVersion = 1;
constexpr int32_t kLlmcVersionLlama3 = 7;
constexpr size_t kWriteChunk = 1 << 20;


bool has_viaduct_magic(const MappedFile& f) {
  return f.size() >= sizeof(kViaductMagic) &&
         std::memcmp(f.data(), kViaductMagic, sizeof(kViaductMagic)) == 0;
}
bool has_llmc_magic(const MappedFile& f) {
  if (f.size() < 8) return false;
  int32_t magic = load_i32(f.data());
  return magic == kLlmcMagic || magic == kLlmcMagicLlama3;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_glob(const std::string& s) {
  return s.find_first_of("*?[") != std::string::npos;
}

template <typename T>
void copy_tokens(const uint8_t* base, int64_t start, int64_t count,
                 int64_t* out) {
  const T* src = reinterpret_cast<const T*>(base) + start;
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<int64_t>(src[i]);
}

template <typename T>
int64_t max_of(const uint8_t* base, int64_t count) {
  const T* src = reinterpret_cast<const T*>(base);
  T m = 0;
  for (int64_t i = 0; i < count; ++i) m = std::max(m, src[i]);
  return static_cast<int64_t>(m);
}

}  // namespace

std::string format_name(TokenFormat format) {
  switch (format) {
    case TokenFormat::kViaduct:
      return "viaduct";
    case TokenFormat::kLlmc:
      return "llmc";
    case TokenFormat::kUint16:
      return "uint16";
    case TokenFormat::kUint32:
      return "uint32";
  }
  return "?";
}

// ---------------------------------------------------------------- MappedFile

MappedFile::MappedFile(const std::string& path) : path_(path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  VIADUCT_CHECK_T(FileError, fd.get() >= 0, "cannot open token file '", path,
                  "': ", errno_text());
  struct stat st {};
  VIADUCT_CHECK_T(FileError, ::fstat(fd.get(), &st) == 0, "cannot stat '", path,
                  "': ", errno_text());
  VIADUCT_CHECK_T(FileError, S_ISREG(st.st_mode), "token file '", path,
                  "' is not a regular file");
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd.get(), 0);
    VIADUCT_CHECK_T(FileError, p != MAP_FAILED, "cannot mmap '", path, "' (",
                    size_, " bytes): ", errno_text());
    data_ = static_cast<const uint8_t*>(p);
  }
  // The mapping outlives the descriptor; closing it keeps many shards from
  // exhausting the fd limit.
  try {
    fd.close_checked(path);
  } catch (...) {
    release();
    throw;
  }
}

MappedFile::~MappedFile() { release(); }

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)), data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    data_ = other.data_;
    size_ = other.size_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

void MappedFile::release() noexcept {
  if (data_ != nullptr) {
    if (::munmap(const_cast<uint8_t*>(data_), size_) != 0) {
      log::error("munmap of '", path_, "' failed: ", errno_text());
    }
    data_ = nullptr;
    size_ = 0;
  }
}

// ----------------------------------------------------------------- TokenFile

TokenFile::TokenFile(const std::string& path, TokenFormat format)
    : file_(path), format_(format) {
  const uint8_t* d = file_.data();
  const size_t bytes = file_.size();
  auto fail = [&](const std::string& what) {
    throw FileError(str("token file '", path, "' (", format_name(format),
                        " format, ", bytes, " bytes): ", what));
  };
  switch (format) {
    case TokenFormat::kViaduct: {
      if (bytes < static_cast<size_t>(kViaductHeaderBytes)) {
        fail(str("truncated header: need ", kViaductHeaderBytes, " bytes"));
      }
      if (std::memcmp(d, kViaductMagic, sizeof(kViaductMagic)) != 0) {
        fail("bad magic (not a viaduct token file)");
      }
      uint32_t version = load_u32(d + 8);
      if (version != 1 && version != kViaductVersion) {
        fail(str("unsupported version ", version, " (expected 1 or ",
                 kViaductVersion, ")"));
      }
      uint32_t bpt = load_u32(d + 12);
      if (bpt != 2 && bpt != 4) {
        fail(str("bad dtype field: ", bpt,
                 " bytes per token (expected 2 = uint16 or 4 = uint32)"));
      }
      bytes_per_token_ = static_cast<int>(bpt);
      uint64_t count = load_u64(d + 16);
      uint64_t vocab = load_u64(d + 24);
      if (vocab == 0 || vocab > (uint64_t{1} << (8 * bpt))) {
        fail(str("bad vocab size ", vocab, " for ", 8 * bpt, "-bit tokens"));
      }
      const char* name = reinterpret_cast<const char*>(d + 32);
      size_t len = ::strnlen(name, kTokenizerField);
      if (len == kTokenizerField) fail("tokenizer name is not terminated");
      for (size_t i = len; i < kTokenizerField; ++i) {
        if (name[i] != '\0') fail("tokenizer name field has trailing bytes");
      }
      const size_t reserved_from = version == 1 ? 96 : 105;
      for (size_t i = reserved_from; i < static_cast<size_t>(kViaductHeaderBytes); ++i) {
        if (d[i] != 0) fail("reserved header bytes are not zero");
      }
      if (version >= 2) {
        const uint64_t token = load_u64(d + 96);
        const uint8_t kind = d[104];
        if (kind > 2) fail(str("bad document marker kind ", int{kind}, " (0, 1 or 2)"));
        if (kind == 0 && token != 0) fail("a document marker token without a kind");
        if (kind != 0) {
          if (token >= vocab) {
            fail(str("document marker token ", token, " is outside the vocab (", vocab, ")"));
          }
          marker_.token = static_cast<int64_t>(token);
          marker_.kind = static_cast<DocumentMarker::Kind>(kind);
        }
      }
      uint64_t expect = static_cast<uint64_t>(kViaductHeaderBytes);
      if (count > (UINT64_MAX - expect) / bpt) {
        fail(str("token count ", count, " is impossible"));
      }
      expect += count * bpt;
      if (bytes != expect) {
        fail(str("header says ", count, " tokens (", expect,
                 " bytes) but the file has ", bytes, " bytes",
                 bytes < expect ? " (truncated)" : " (trailing bytes)"));
      }
      size_ = static_cast<int64_t>(count);
      vocab_size_ = static_cast<int64_t>(vocab);
      tokenizer_.assign(name, len);
      tokens_ = d + kViaductHeaderBytes;
      break;
    }
    case TokenFormat::kLlmc: {
      constexpr size_t kHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);
      if (bytes < kHeaderBytes) {
        fail(str("truncated header: need ", kHeaderBytes, " bytes"));
      }
      int32_t magic = load_i32(d);
      int32_t version = load_i32(d + 4);
      if (magic == kLlmcMagic) {
        if (version != kLlmcVersion) {
          fail(str("unsupported version ", version, " (expected ", kLlmcVersion,
                   " for magic ", kLlmcMagic, ")"));
        }
        bytes_per_token_ = 2;
      } else if (magic == kLlmcMagicLlama3) {
        if (version != kLlmcVersionLlama3) {
          fail(str("unsupported version ", version, " (expected ",
                   kLlmcVersionLlama3, " for magic ", kLlmcMagicLlama3, ")"));
        }
        bytes_per_token_ = 4;
      } else {
        fail(str("bad magic ", magic, " (expected ", kLlmcMagic, " or ",
                 kLlmcMagicLlama3, ")"));
      }
      int32_t count = load_i32(d + 8);
      if (count < 0) fail(str("negative token count ", count));
      uint64_t expect =
          kHeaderBytes + static_cast<uint64_t>(count) *
                             static_cast<uint64_t>(bytes_per_token_);
      if (bytes != expect) {
        fail(str("header says ", count, " tokens (", expect,
                 " bytes) but the file has ", bytes, " bytes",
                 bytes < expect ? " (truncated)" : " (trailing bytes)"));
      }
      size_ = count;
      tokens_ = d + kHeaderBytes;
      break;
    }
    case TokenFormat::kUint16:
    case TokenFormat::kUint32: {
      bytes_per_token_ = format == TokenFormat::kUint16 ? 2 : 4;
      if (bytes % bytes_per_token_ != 0) {
        fail(str("size is not a multiple of ", bytes_per_token_,
                 " bytes (truncated?)"));
      }
      size_ = static_cast<int64_t>(bytes / bytes_per_token_);
      tokens_ = d;
      break;
    }
  }
}

int64_t TokenFile::token(int64_t i) const {
  int64_t t;
  read(i, 1, &t);
  return t;
}

void TokenFile::read(int64_t start, int64_t count, int64_t* out) const {
  VIADUCT_CHECK(start >= 0 && count >= 0 && start + count <= size_,
                "token range [", start, ", ", start + count, ") is outside '",
                path(), "' (", size_, " tokens)");
  if (count == 0) return;
  if (bytes_per_token_ == 2) {
    copy_tokens<uint16_t>(tokens_, start, count, out);
  } else {
    copy_tokens<uint32_t>(tokens_, start, count, out);
  }
}

int64_t TokenFile::max_token() const {
  if (size_ == 0) return 0;
  return bytes_per_token_ == 2 ? max_of<uint16_t>(tokens_, size_)
                               : max_of<uint32_t>(tokens_, size_);
}

TokenFile open_token_file(const std::string& path, const std::string& format) {
  if (format == "viaduct") return TokenFile(path, TokenFormat::kViaduct);
  if (format == "llmc") return TokenFile(path, TokenFormat::kLlmc);
  if (format == "uint16") return TokenFile(path, TokenFormat::kUint16);
  if (format == "uint32") return TokenFile(path, TokenFormat::kUint32);
  VIADUCT_CHECK_T(ConfigError, format == "auto",
                  "data.format: unknown format '", format,
                  "' (expected auto, viaduct, llmc, uint16 or uint32)");
  // Sniff once, then reopen in the chosen format (mapping is cheap).
  TokenFormat chosen;
  {
    MappedFile probe(path);
    if (has_viaduct_magic(probe)) {
      chosen = TokenFormat::kViaduct;
    } else if (has_llmc_magic(probe)) {
      chosen = TokenFormat::kLlmc;
    } else if (ends_with(path, ".u16")) {
      chosen = TokenFormat::kUint16;
    } else if (ends_with(path, ".u32")) {
      chosen = TokenFormat::kUint32;
    } else {
      throw FileError(str(
          "token file '", path, "' (", probe.size(),
          " bytes): unrecognised format: no viaduct or llm.c magic and no "
          ".u16/.u32 extension; set data.format to viaduct, llmc, uint16 or "
          "uint32"));
    }
  }
  return TokenFile(path, chosen);
}

// --------------------------------------------------------------- TokenStream

TokenStream::TokenStream(std::vector<TokenFile> files)
    : files_(std::move(files)) {
  VIADUCT_CHECK(!files_.empty(), "a token stream needs at least one file");
  for (const auto& f : files_) {
    // One stream, one way to find its documents.
    VIADUCT_CHECK_T(FileError, f.document_marker() == files_.front().document_marker(),
                    "token files '", files_.front().path(), "' and '", f.path(),
                    "' mark documents differently (", data::describe(files_.front().document_marker()),
                    "; ", data::describe(f.document_marker()),
                    "): prepare them with the same tokenizer");
    starts_.push_back(size_);
    size_ += f.size();
  }
}

int64_t TokenStream::token(int64_t i) const {
  int64_t t;
  read(i, 1, &t);
  return t;
}

void TokenStream::read(int64_t start, int64_t count, int64_t* out) const {
  VIADUCT_CHECK(start >= 0 && count >= 0 && start + count <= size_,
                "token range [", start, ", ", start + count, ") is outside ",
                describe(), " (", size_, " tokens)");
  // The last file whose first index is <= start.
  size_t k = static_cast<size_t>(
      std::upper_bound(starts_.begin(), starts_.end(), start) -
      starts_.begin() - 1);
  while (count > 0) {
    int64_t local = start - starts_[k];
    int64_t n = std::min(count, files_[k].size() - local);
    files_[k].read(local, n, out);
    out += n;
    start += n;
    count -= n;
    ++k;
  }
}

int64_t TokenStream::vocab_size() const {
  int64_t v = 0;
  for (const auto& f : files_) v = std::max(v, f.vocab_size());
  return v;
}

int64_t TokenStream::max_token() const {
  int64_t m = 0;
  for (const auto& f : files_) m = std::max(m, f.max_token());
  return m;
}

std::string TokenStream::describe() const {
  std::string s = "'" + files_.front().path() + "'";
  if (files_.size() > 1) s += str(" (+", files_.size() - 1, " more)");
  return s;
}

std::vector<std::string> expand_token_paths(const std::string& spec) {
  VIADUCT_CHECK_T(ConfigError, !spec.empty(), "data.path is empty");
  if (!is_glob(spec)) return {spec};
  glob_t g{};
  int rc = ::glob(spec.c_str(), GLOB_ERR, nullptr, &g);
  std::vector<std::string> out;
  if (rc == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  }
  ::globfree(&g);
  VIADUCT_CHECK_T(FileError, rc != GLOB_NOMATCH && !out.empty(),
                  "no token file matches '", spec, "'");
  VIADUCT_CHECK_T(FileError, rc == 0, "cannot expand '", spec,
                  "': glob failed (",
                  rc == GLOB_ABORTED ? "read error" : "error", ")");
  std::sort(out.begin(), out.end());
  return out;
}

std::shared_ptr<const TokenStream> open_token_stream(
    const std::vector<std::string>& paths, const std::string& format) {
  std::vector<TokenFile> files;
  files.reserve(paths.size());
  for (const auto& p : paths) files.push_back(open_token_file(p, format));
  return std::make_shared<const TokenStream>(std::move(files));
}

std::shared_ptr<const TokenStream> open_token_stream(
    const std::string& spec, const std::string& format) {
  return open_token_stream(expand_token_paths(spec), format);
}

std::string val_path_for(const std::string& path) {
  std::filesystem::path p(path);
  std::filesystem::path out =
      p.parent_path() / (p.stem().string() + ".val" + p.extension().string());
  return out.string();
}

std::string resolve_val_path(const std::string& path,
                             const std::string& val_path) {
  if (!val_path.empty()) return val_path;
  if (path.empty() || is_glob(path)) return "";
  std::string derived = val_path_for(path);
  std::error_code ec;
  return std::filesystem::exists(derived, ec) ? derived : "";
}

std::vector<std::string> resolve_val_paths(const std::vector<std::string>& paths,
                                           const std::string& val_path) {
  if (!val_path.empty()) return expand_token_paths(val_path);
  std::vector<std::string> out;
  for (const auto& p : paths) {
    std::string v = resolve_val_path(p, "");
    if (!v.empty()) out.push_back(std::move(v));
  }
  return out;
}

std::string describe(const DocumentMarker& m) {
  switch (m.kind) {
    case DocumentMarker::Kind::kStarts:
      return str("token ", m.token, " starts each document");
    case DocumentMarker::Kind::kEnds:
      return str("token ", m.token, " ends each document");
    case DocumentMarker::Kind::kNone:
      break;
  }
  return "no document marker recorded";
}

// ----------------------------------------------------------- TokenFileWriter

TokenFileWriter::TokenFileWriter(const std::string& path, int64_t vocab_size,
                                 const std::string& tokenizer, const DocumentMarker& marker)
    : path_(path),
      vocab_size_(vocab_size),
      tokenizer_(tokenizer),
      marker_(marker),
      bytes_per_token_(vocab_size <= 65536 ? 2 : 4) {
  VIADUCT_CHECK(!marker.recorded() || (marker.token >= 0 && marker.token < vocab_size),
                "token file '", path, "': document marker token ", marker.token,
                " is outside the vocab (", vocab_size, ")");
  VIADUCT_CHECK(vocab_size > 0 && vocab_size <= (int64_t{1} << 32),
                "token file '", path, "': vocab size ", vocab_size,
                " does not fit 32-bit tokens");
  VIADUCT_CHECK(tokenizer.size() < kTokenizerField, "token file '", path,
                "': tokenizer name '", tokenizer, "' is longer than ",
                kTokenizerField - 1, " characters");
  out_ = std::make_unique<AtomicFile>(path);
  buffer_.reserve(kWriteChunk + 64);
}

TokenFileWriter::~TokenFileWriter() = default;

void TokenFileWriter::write_all(const void* data, size_t bytes,
                                int64_t offset) {
  out_->file().write_at(data, bytes, static_cast<uint64_t>(offset));
}

void TokenFileWriter::append(const int64_t* tokens, int64_t count) {
  VIADUCT_CHECK(out_ != nullptr, "token file '", path_, "' is already finished");
  for (int64_t i = 0; i < count; ++i) {
    int64_t t = tokens[i];
    VIADUCT_CHECK(t >= 0 && t < vocab_size_, "token file '", path_, "': token ",
                  t, " is outside the vocab [0, ", vocab_size_, ")");
    if (bytes_per_token_ == 2) {
      uint16_t v = static_cast<uint16_t>(t);
      const auto* b = reinterpret_cast<const uint8_t*>(&v);
      buffer_.insert(buffer_.end(), b, b + 2);
    } else {
      uint32_t v = static_cast<uint32_t>(t);
      const auto* b = reinterpret_cast<const uint8_t*>(&v);
      buffer_.insert(buffer_.end(), b, b + 4);
    }
    if (buffer_.size() >= kWriteChunk) {
      write_all(buffer_.data(), buffer_.size(),
                kViaductHeaderBytes + (count_ + i + 1) * bytes_per_token_ -
                    static_cast<int64_t>(buffer_.size()));
      buffer_.clear();
    }
  }
  count_ += count;
}

int64_t TokenFileWriter::finish() {
  VIADUCT_CHECK(out_ != nullptr, "token file '", path_, "' is already finished");
  if (!buffer_.empty()) {
    write_all(buffer_.data(), buffer_.size(),
              kViaductHeaderBytes + count_ * bytes_per_token_ -
                  static_cast<int64_t>(buffer_.size()));
    buffer_.clear();
  }
  uint8_t header[kViaductHeaderBytes] = {};
  std::memcpy(header, kViaductMagic, sizeof(kViaductMagic));
  uint32_t version = kViaductVersion;
  uint32_t bpt = static_cast<uint32_t>(bytes_per_token_);
  uint64_t count = static_cast<uint64_t>(count_);
  uint64_t vocab = static_cast<uint64_t>(vocab_size_);
  std::memcpy(header + 8, &version, 4);
  std::memcpy(header + 12, &bpt, 4);
  std::memcpy(header + 16, &count, 8);
  std::memcpy(header + 24, &vocab, 8);
  std::memcpy(header + 32, tokenizer_.data(), tokenizer_.size());
  if (marker_.recorded()) {
    const uint64_t token = static_cast<uint64_t>(marker_.token);
    std::memcpy(header + 96, &token, 8);
    header[104] = static_cast<uint8_t>(marker_.kind);
  }
  write_all(header, sizeof(header), 0);
  // See Note [Atomic replace] (core/file_io.h); a failure leaves no .tmp behind.
  out_->commit();
  out_.reset();
  return kViaductHeaderBytes + count_ * bytes_per_token_;
}

}  // namespace viaduct::data
