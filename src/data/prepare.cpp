// prepare_text_data and its helpers (see prepare.h for the rules).
#include "data/prepare.h"

#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <deque>
#include <exception>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "core/check.h"
#include "core/log.h"
#include "data/token_file.h"
#include "data/text_tokenizer.h"

namespace viaduct::data {

namespace fs = std::filesystem;

namespace {

constexpr size_t kBinarySniffBytes = 4096;

bool looks_binary(const MappedFile& f) {
  size_t n = std::min(f.size(), kBinarySniffBytes);
  return n > 0 && std::find(f.data(), f.data() + n, uint8_t{0}) != f.data() + n;
}

bool is_hidden(const fs::path& p) {
  std::string name = p.filename().string();
  return !name.empty() && name[0] == '.';
}

// A line of `text` starting at `pos` (without its '\n'), and where the next
// one starts.
std::string_view line_at(std::string_view text, size_t pos, size_t* next) {
  size_t end = text.find('\n', pos);
  if (end == std::string_view::npos) {
    *next = text.size();
    return text.substr(pos);
  }
  *next = end + 1;
  return text.substr(pos, end - pos);
}

bool is_separator(std::string_view line) {
  return line == "%" || line == "%\r";
}

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' ||
           c == '\v';
  });
}

bool has_separator_line(std::string_view text) {
  for (size_t pos = 0; pos < text.size();) {
    size_t next;
    if (is_separator(line_at(text, pos, &next))) return true;
    pos = next;
  }
  return false;
}

}  // namespace

// The whole decompressed stream. zlib checks each member's CRC and length
// as it reads (a mismatch fails gzread); a stream cut short, even at a
// line boundary, shows only in gzclose's Z_BUF_ERROR; a file that is not
// gzip at all would be read as it is (gzdirect).
std::string read_gzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  VIADUCT_CHECK_T(FileError, f != nullptr, "cannot open '", path, "'");
  std::string out;
  std::vector<char> buf(1 << 20);
  while (true) {
    int n = gzread(f, buf.data(), static_cast<unsigned>(buf.size()));
    if (n < 0) {
      int err = 0;
      std::string msg = gzerror(f, &err);
      gzclose(f);
      throw FileError(str("'", path, "' is not a readable gzip file: ", msg,
                          " (gzip -t '", path, "' says the same); nothing was written"));
    }
    if (n == 0) break;
    out.append(buf.data(), static_cast<size_t>(n));
  }
  const bool plain = gzdirect(f) != 0;
  const int closed = gzclose(f);
  VIADUCT_CHECK_T(FileError, !plain, "'", path,
                  "' is not gzip data although its name ends in .gz; decompress it or "
                  "rename it; nothing was written");
  VIADUCT_CHECK_T(FileError, closed == Z_OK, "'", path, "' is a truncated or corrupt gzip file (",
                  closed == Z_BUF_ERROR ? "unexpected end of file: the stream stops before its "
                                          "trailer"
                                        : str("zlib error ", closed),
                  ", after ", out.size(), " decompressed bytes); nothing was written");
  return out;
}


std::vector<std::string> list_text_files(
    const std::vector<std::string>& inputs) {
  VIADUCT_CHECK(!inputs.empty(), "prepare-data: no --input given");
  std::vector<std::string> out;
  std::set<std::string> seen;  // canonical paths
  auto add = [&](const fs::path& p) {
    std::error_code ec;
    fs::path canon = fs::canonical(p, ec);
    VIADUCT_CHECK_T(FileError, !ec, "cannot resolve '", p.string(),
                    "': ", ec.message());
    if (seen.insert(canon.string()).second) out.push_back(p.string());
  };
  for (const auto& input : inputs) {
    std::error_code ec;
    fs::file_status st = fs::status(input, ec);
    VIADUCT_CHECK_T(FileError, !ec && fs::exists(st), "input '", input,
                    "' does not exist");
    if (fs::is_regular_file(st)) {
      add(input);
      continue;
    }
    VIADUCT_CHECK_T(FileError, fs::is_directory(st), "input '", input,
                    "' is neither a file nor a folder");
    std::vector<fs::path> files;
    fs::recursive_directory_iterator it(
        input, fs::directory_options::follow_directory_symlink, ec);
    VIADUCT_CHECK_T(FileError, !ec, "cannot list '", input,
                    "': ", ec.message());
    for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
      VIADUCT_CHECK_T(FileError, !ec, "cannot list '", input,
                      "': ", ec.message());
      const fs::path& p = it->path();
      if (is_hidden(p)) {
        if (it->is_directory(ec)) it.disable_recursion_pending();
        continue;
      }
      if (!it->is_regular_file(ec)) continue;
      files.push_back(p);
    }
    VIADUCT_CHECK_T(FileError, !ec, "cannot list '", input,
                    "': ", ec.message());
    std::sort(files.begin(), files.end());
    for (const auto& p : files) {
      if (p.string().size() > 9 &&
          p.string().compare(p.string().size() - 9, 9, ".jsonl.gz") == 0) {
        add(p);
        continue;
      }
      if (looks_binary(MappedFile(p.string()))) {
        log::debug("prepare-data: skipping binary file '", p.string(), "'");
        continue;
      }
      add(p);
    }
  }
  VIADUCT_CHECK_T(FileError, !out.empty(),
                  "prepare-data: no text files found in ", inputs.front(),
                  inputs.size() > 1 ? " and the other inputs" : "");
  return out;
}

std::vector<std::string_view> split_documents(std::string_view text,
                                              DocumentSplit split) {
  if (split == DocumentSplit::kAuto) {
    split = has_separator_line(text) ? DocumentSplit::kFortune
                                     : DocumentSplit::kWholeFile;
  }
  std::vector<std::string_view> docs;
  if (split == DocumentSplit::kWholeFile) {
    if (!is_blank(text)) docs.push_back(text);
    return docs;
  }
  size_t doc_start = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t next;
    std::string_view line = line_at(text, pos, &next);
    if (is_separator(line)) {
      std::string_view doc = text.substr(doc_start, pos - doc_start);
      if (!is_blank(doc)) docs.push_back(doc);
      doc_start = next;
    }
    pos = next;
  }
  std::string_view tail = text.substr(doc_start);
  if (!is_blank(tail)) docs.push_back(tail);
  return docs;
}

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_jsonl(const std::string& path) {
  return ends_with(path, ".jsonl") || ends_with(path, ".jsonl.gz");
}

// Documents of a batch of files, kept alive until the batch is written.
struct DocumentBatch {
  std::vector<std::unique_ptr<MappedFile>> maps;
  std::deque<std::string> owned;
  std::vector<std::string_view> docs;
  int64_t bytes = 0;
};

constexpr int64_t kBatchBytes = 32 << 20;

}  // namespace

std::vector<std::string> jsonl_documents(std::string_view text,
                                         const std::string& field,
                                         const std::string& path) {
  std::vector<std::string> docs;
  int64_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t next;
    std::string_view line = line_at(text, pos, &next);
    pos = next;
    ++line_no;
    if (is_blank(line)) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw FileError(str("'", path, "' line ", line_no,
                          " is not valid JSON: ", e.what()));
    }
    VIADUCT_CHECK_T(FileError,
                    j.is_object() && j.contains(field) && j[field].is_string(),
                    "'", path, "' line ", line_no,
                    " is not a JSON object with a string field '", field,
                    "' (--jsonl-field names it)");
    std::string doc = j[field].get<std::string>();
    if (!is_blank(doc)) docs.push_back(std::move(doc));
  }
  return docs;
}

PrepareStats prepare_text_data(const std::vector<std::string>& inputs,
                               const std::string& output_path,
                               const PrepareOptions& options) {
  const double f = options.val_fraction;
  VIADUCT_CHECK(std::isfinite(f) && f >= 0.0 && f < 1.0,
                "prepare-data: --val-fraction must be in [0, 1), got ", f);
  VIADUCT_CHECK(!output_path.empty(), "prepare-data: --output is empty");
  VIADUCT_CHECK(options.threads >= 0, "prepare-data: --threads must be >= 0, got ",
                options.threads);
  std::vector<std::string> files = list_text_files(inputs);
  // The token files replace what is at their paths: never an input (the
  // same path, or another name of it through a link).
  std::vector<std::string> outputs{output_path};
  if (f > 0.0) outputs.push_back(val_path_for(output_path));
  for (const std::string& out : outputs) {
    std::error_code ec;
    const fs::path out_canon = fs::weakly_canonical(out, ec);
    for (const auto& in : files) {
      std::error_code ec_in;
      const bool same = (!ec && fs::weakly_canonical(in, ec_in) == out_canon) ||
                        fs::equivalent(in, out, ec_in);
      VIADUCT_CHECK_T(FileError, !same, "prepare-data: the output '", out, "' is the input '", in,
                      "'; writing it would destroy the text: give --output another path");
    }
  }
  std::unique_ptr<TextTokenizer> tokenizer = load_tokenizer(options.tokenizer);
  {
    // A tokenizer with no document separator fails here, before any work.
    auto state = tokenizer->new_state();
    std::vector<int64_t> probe;
    tokenizer->encode_document("probe", probe, *state);
  }

  fs::path parent = fs::path(output_path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    fs::create_directories(parent, ec);
    VIADUCT_CHECK_T(FileError, !ec, "cannot create folder '", parent.string(),
                    "': ", ec.message());
  }

  PrepareStats stats;
  stats.train_path = output_path;
  stats.tokenizer = tokenizer->name();
  stats.vocab_size = tokenizer->vocab_size();
  const std::string val_path = val_path_for(output_path);
  const DocumentMarker marker = tokenizer->document_marker();
  TokenFileWriter train(output_path, tokenizer->vocab_size(), tokenizer->name(), marker);
  std::optional<TokenFileWriter> val;
  if (f > 0.0) {
    stats.val_path = val_path;
    val.emplace(val_path, tokenizer->vocab_size(), tokenizer->name(), marker);
  }

  int threads = options.threads > 0
                    ? options.threads
                    : std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::unique_ptr<EncodeState>> states;
  for (int t = 0; t < threads; ++t) states.push_back(tokenizer->new_state());

  const auto t0 = std::chrono::steady_clock::now();
  auto seconds_since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t)
        .count();
  };
  int64_t bytes_encoded = 0;  // documents' bytes, before this batch
  double last_progress = 0;

  // Encodes a batch on every thread, then writes it in document order.
  auto flush = [&](DocumentBatch& batch) {
    const size_t n = batch.docs.size();
    std::vector<std::vector<int64_t>> encoded(n);
    std::atomic<size_t> next{0};
    std::atomic<size_t> done{0};
    std::atomic<int64_t> done_bytes{0};
    std::exception_ptr error;
    std::mutex error_mutex;
    auto work = [&](int t) {
      try {
        for (size_t i; (i = next.fetch_add(1)) < n;) {
          tokenizer->encode_document(batch.docs[i], encoded[i], *states[t]);
          done_bytes.fetch_add(static_cast<int64_t>(batch.docs[i].size()));
          done.fetch_add(1);
        }
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        next.store(n);
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
    std::thread progress;
    std::atomic<bool> finished{false};
    if (options.progress) {
      progress = std::thread([&] {
        while (!finished.load()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
          double s = seconds_since(t0);
          if (s - last_progress < 2.0 || finished.load()) continue;
          last_progress = s;
          const int64_t docs = stats.documents + static_cast<int64_t>(done.load());
          const double mb = static_cast<double>(bytes_encoded + done_bytes.load()) / 1e6;
          log::info("prepare-data: ", docs, " documents, ", mb, " MB, ",
                    static_cast<int64_t>(static_cast<double>(docs) / s),
                    " documents/s, ", mb / s, " MB/s");
        }
      });
    }
    work(0);
    for (auto& th : pool) th.join();
    finished.store(true);
    if (progress.joinable()) progress.join();
    if (error) std::rethrow_exception(error);
    for (size_t k = 0; k < n; ++k) {
      const int64_t i = stats.documents++;
      const bool held_out = val && std::floor(static_cast<double>(i + 1) * f) >
                                       std::floor(static_cast<double>(i) * f);
      const int64_t count = static_cast<int64_t>(encoded[k].size());
      if (held_out) {
        val->append(encoded[k]);
        stats.val_documents += 1;
        stats.val_tokens += count;
      } else {
        train.append(encoded[k]);
        stats.train_documents += 1;
        stats.train_tokens += count;
      }
    }
    bytes_encoded += batch.bytes;
    batch = DocumentBatch();
  };

  DocumentBatch batch;
  for (const auto& path : files) {
    stats.files += 1;
    size_t before = batch.docs.size();
    if (is_jsonl(path)) {
      std::string text;
      if (ends_with(path, ".gz")) {
        text = read_gzip(path);
      } else {
        MappedFile m(path);
        text.assign(reinterpret_cast<const char*>(m.data()), m.size());
      }
      stats.bytes_read += static_cast<int64_t>(text.size());
      for (auto& doc : jsonl_documents(text, options.jsonl_field, path)) {
        batch.bytes += static_cast<int64_t>(doc.size());
        batch.docs.push_back(batch.owned.emplace_back(std::move(doc)));
      }
    } else {
      auto& m = batch.maps.emplace_back(std::make_unique<MappedFile>(path));
      std::string_view text(reinterpret_cast<const char*>(m->data()), m->size());
      stats.bytes_read += static_cast<int64_t>(text.size());
      for (std::string_view doc : split_documents(text, options.split)) {
        batch.bytes += static_cast<int64_t>(doc.size());
        batch.docs.push_back(doc);
      }
    }
    log::debug("prepare-data: ", path, ": ", batch.docs.size() - before,
               " documents");
    if (batch.bytes >= kBatchBytes) flush(batch);
  }
  flush(batch);
  stats.seconds = seconds_since(t0);
  VIADUCT_CHECK(stats.train_documents > 0,
                "prepare-data: no training "
                "documents in ",
                files.size(),
                " files (all blank, or all "
                "held out by --val-fraction ",
                f, ")");
  VIADUCT_CHECK(!val || stats.val_documents > 0,
                "prepare-data: --val-fraction ", f,
                " holds out no document of ", stats.documents,
                "; raise it or give more text");

  stats.bytes_written += train.finish();
  if (val) {
    stats.bytes_written += val->finish();
  } else {
    // A val file left from an earlier run would be picked up by the trainer
    // (data.val_path derives it) and no longer match the training data.
    std::error_code ec;
    if (fs::remove(val_path, ec)) {
      log::info("prepare-data: removed stale held-out file ", val_path);
    }
  }
  return stats;
}

}  // namespace viaduct::data
