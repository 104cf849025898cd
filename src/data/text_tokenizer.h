// The tokenizer behind `viaduct prepare-data --tokenizer` and `viaduct
// tokenize`: one interface over the built-in byte tokenizer and the real
// tokenizers of published models (hf_tokenizer.h: a Hugging Face
// tokenizer.json with a byte-level BPE model, or a tiktoken rank file).
//
// Encoding is const and thread-safe: each thread owns an EncodeState (its
// regex match buffers and word cache), so prepare-data encodes documents on
// every core with one shared vocabulary.
//
// Documents in a token file: `encode_document` adds what the tokenizer's
// post-processor adds (llama-3's tokenizer.json puts <|begin_of_text|>
// first); a tokenizer whose post-processor adds nothing (GPT-2) gets its
// end-of-text token before each document instead, as the byte tokenizer and
// llm.c's data scripts do, so documents stay separated in the stream.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "data/token_file.h"

namespace viaduct::data {

// Per-thread scratch of a tokenizer; opaque to callers.
class EncodeState {
 public:
  virtual ~EncodeState() = default;
};

class TextTokenizer {
 public:
  virtual ~TextTokenizer() = default;

  // Written into token file headers (at most 63 characters).
  virtual std::string name() const = 0;
  // One past the largest id the tokenizer can produce.
  virtual int64_t vocab_size() const = 0;

  virtual std::unique_ptr<EncodeState> new_state() const = 0;
  // Appends the ids of `text` to `out`. With add_special_tokens, the
  // post-processor's tokens (BOS / EOS) are added around them. Added and
  // special tokens written in `text` are recognised as those tokens.
  virtual void encode_into(std::string_view text, bool add_special_tokens,
                           std::vector<int64_t>& out,
                           EncodeState& state) const = 0;
  // Ids back to text; an id outside the vocab is an Error.
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;

  // The ids prepare-data writes for one document (see the top of this file).
  virtual void encode_document(std::string_view text, std::vector<int64_t>& out,
                               EncodeState& state) const = 0;
  // The token encode_document puts first (kStarts) or last (kEnds) in every
  // document, which prepare-data records in its token files so that
  // training can find where documents meet. A tokenizer whose
  // encode_document cannot run (no separator) throws as that does.
  virtual DocumentMarker document_marker() const = 0;

  // One-off encoding with a fresh state.
  std::vector<int64_t> encode(std::string_view text,
                              bool add_special_tokens = true) const;
};

// `spec`: "byte" (the built-in byte tokenizer), a path to a Hugging Face
// tokenizer.json (or a model folder holding one), a tiktoken rank file
// named after its encoding (`cl100k_base.tiktoken`, ...), or a SentencePiece
// `.model` file (spm_tokenizer.h). A missing,
// unreadable or unsupported file is a FileError naming the file and the
// problem.
std::unique_ptr<TextTokenizer> load_tokenizer(const std::string& spec);

// `text` with every invalid UTF-8 sequence replaced by U+FFFD, one per
// maximal invalid subpart (the WHATWG / Python errors="replace" rule), as
// Hugging Face's tokenizers see a file read as text. Returns `text` itself
// (no copy) when it is valid.
std::string_view to_valid_utf8(std::string_view text, std::string& storage);

}  // namespace viaduct::data
