// prepare_text_data and its helpers (see prepare.h for the rules).
#include "data/prepare.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>
#include <set>

#include "core/check.h"
#include "core/log.h"
#include "data/token_file.h"
#include "data/tokenizer.h"

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

PrepareStats prepare_text_data(const std::vector<std::string>& inputs,
                               const std::string& output_path,
                               const PrepareOptions& options) {
  const double f = options.val_fraction;
  VIADUCT_CHECK(std::isfinite(f) && f >= 0.0 && f < 1.0,
                "prepare-data: --val-fraction must be in [0, 1), got ", f);
  VIADUCT_CHECK(!output_path.empty(), "prepare-data: --output is empty");
  std::vector<std::string> files = list_text_files(inputs);

  fs::path parent = fs::path(output_path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    fs::create_directories(parent, ec);
    VIADUCT_CHECK_T(FileError, !ec, "cannot create folder '", parent.string(),
                    "': ", ec.message());
  }

  PrepareStats stats;
  stats.train_path = output_path;
  const std::string val_path = val_path_for(output_path);
  TokenFileWriter train(output_path, ByteTokenizer::kVocabSize,
                        ByteTokenizer::kName);
  std::optional<TokenFileWriter> val;
  if (f > 0.0) {
    stats.val_path = val_path;
    val.emplace(val_path, ByteTokenizer::kVocabSize, ByteTokenizer::kName);
  }

  std::vector<int64_t> tokens;
  for (const auto& path : files) {
    MappedFile text_file(path);
    std::string_view text(reinterpret_cast<const char*>(text_file.data()),
                          text_file.size());
    stats.files += 1;
    stats.bytes_read += static_cast<int64_t>(text.size());
    int64_t file_docs = 0;
    for (std::string_view doc : split_documents(text, options.split)) {
      const int64_t i = stats.documents++;
      ++file_docs;
      const bool held_out = val && std::floor(static_cast<double>(i + 1) * f) >
                                       std::floor(static_cast<double>(i) * f);
      tokens.clear();
      tokens.push_back(ByteTokenizer::kEndOfText);
      ByteTokenizer::encode_into(doc, tokens);
      if (held_out) {
        val->append(tokens);
        stats.val_documents += 1;
        stats.val_tokens += static_cast<int64_t>(tokens.size());
      } else {
        train.append(tokens);
        stats.train_documents += 1;
        stats.train_tokens += static_cast<int64_t>(tokens.size());
      }
    }
    log::debug("prepare-data: ", path, ": ", file_docs, " documents");
  }
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
