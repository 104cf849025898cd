// Text -> token file, the work of `viaduct prepare-data`: list the text
// files, split them into documents, encode them with a tokenizer (the byte
// tokenizer, or a real one: data/text_tokenizer.h) on every core and write a
// viaduct token file (plus an optional held-out split) atomically. The file
// holds uint32 tokens when the vocabulary passes 65,535 (llama-3's 128,256).
//
// Documents: a fortune file (one with a line holding only "%") is split at
// those lines; a `.jsonl` or `.jsonl.gz` file holds one document per line, a
// JSON object whose string field (`jsonl_field`, "text" by default) is the
// document; any other text file is one document. Each document is encoded
// with its separator (TextTokenizer::encode_document: the byte tokenizer's
// <|endoftext|> first), so documents are separated and the stream starts at a
// boundary. Whitespace-only documents are dropped.
//
// Encoding runs on `threads` threads over batches of documents; the output
// is the same for any thread count.
//
// Held-out split: with val_fraction f > 0, document i (counted over all files
// in order) goes to the val file when floor((i+1) f) > floor(i f): every
// (1/f)-th document, spread evenly over the corpus rather than its tail, so
// the val set covers every source file. The val file is `<stem>.val<.ext>`
// next to the output (val_path_for).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace viaduct::data {

enum class DocumentSplit {
  kAuto,       // fortune split when the file has a "%" line, else whole file
  kWholeFile,  // every file is one document
  kFortune,    // split at lines holding only "%"
};

struct PrepareOptions {
  double val_fraction = 0.0;  // in [0, 1)
  DocumentSplit split = DocumentSplit::kAuto;
  std::string tokenizer = "byte";  // load_tokenizer's spec
  std::string jsonl_field = "text";
  int threads = 0;        // 0: every core
  bool progress = false;  // a progress line on stderr every two seconds
};

struct PrepareStats {
  int64_t files = 0;
  int64_t documents = 0;
  int64_t train_documents = 0;
  int64_t val_documents = 0;
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  int64_t bytes_read = 0;     // text bytes
  int64_t bytes_written = 0;  // both token files
  double seconds = 0;          // reading and encoding
  std::string tokenizer;       // its name
  int64_t vocab_size = 0;
  std::string train_path;
  std::string val_path;  // "" without a held-out split
};

// The text files behind `inputs`, in a deterministic order: a file as given;
// a folder walked recursively with its entries sorted by path, skipping
// hidden names and binary files (a NUL byte in the first 4 KiB, such as
// fortune's `.dat` indexes; `.jsonl.gz` files are kept). A file reached
// twice (a symlink such as fortune's `*.u8`) is kept once, at its first
// place.
std::vector<std::string> list_text_files(
    const std::vector<std::string>& inputs);

// The whole decompressed content of a gzip file; a file cut short, corrupt
// or not gzip at all is a FileError naming it.
std::string read_gzip(const std::string& path);

// The documents of one file's text (views into `text`).
std::vector<std::string_view> split_documents(std::string_view text,
                                              DocumentSplit split);

// The documents of a JSON Lines text: `field` of each non-blank line's
// object. A line that is not a JSON object with that string field is a
// FileError naming `path` and the line number.
std::vector<std::string> jsonl_documents(std::string_view text,
                                         const std::string& field,
                                         const std::string& path);

PrepareStats prepare_text_data(const std::vector<std::string>& inputs,
                               const std::string& output_path,
                               const PrepareOptions& options = {});

}  // namespace viaduct::data
