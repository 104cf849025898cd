// SentencePiece `.model` files for prepare-data and `viaduct tokenize`.
//
// Debian's libsentencepiece brings protobuf code that crashes beside
// LibTorch's protobuf in one process, so the encoding runs in `viaduct-spm`
// (src/tools/spm_worker.cpp), a small program that links SentencePiece and
// no LibTorch: every EncodeState owns one such process, so prepare-data's
// threads each talk to their own, and the tokenizer keeps one more for its
// header facts and decode().
//
// Documents: a model with a BOS id gets it first (as llama's tokenizer
// does); one without BOS but with EOS gets EOS before each document; the
// text itself is encoded as SentencePiece encodes it.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "data/text_tokenizer.h"

namespace viaduct::data {

class SpmWorker;

class SpmTokenizer final : public TextTokenizer {
 public:
  // `model`: a SentencePiece .model file. The worker program is
  // $VIADUCT_SPM_WORKER, else `viaduct-spm` beside the running executable.
  // A missing worker or a model it cannot load is a FileError naming them.
  explicit SpmTokenizer(const std::string& model);
  ~SpmTokenizer() override;

  std::string name() const override;
  int64_t vocab_size() const override { return vocab_size_; }
  std::unique_ptr<EncodeState> new_state() const override;
  void encode_into(std::string_view text, bool add_special_tokens, std::vector<int64_t>& out,
                   EncodeState& state) const override;
  std::string decode(const std::vector<int64_t>& ids) const override;
  DocumentMarker document_marker() const override;
  void encode_document(std::string_view text, std::vector<int64_t>& out,
                       EncodeState& state) const override;

  int64_t bos_id() const { return bos_id_; }
  int64_t eos_id() const { return eos_id_; }

 private:
  std::string model_;
  std::string worker_;
  int64_t vocab_size_ = 0;
  int64_t bos_id_ = -1;
  int64_t eos_id_ = -1;
  mutable std::mutex control_mutex_;
  std::unique_ptr<SpmWorker> control_;  // header facts and decode()
};

// The worker program SpmTokenizer runs (see its constructor).
std::string spm_worker_path();

}  // namespace viaduct::data
