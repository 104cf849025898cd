// The data of one training process: the token sources (data.path, or the
// blend of data.paths with data.weights) in the sampler, which hands this
// data-parallel replica its batches, and the held-out tokens with the eval
// batches cut from them.
//
// The next batch is read on a worker thread while the step before it runs
// (next_batch). The sampler stays the one record of where the data stands:
// sampler() first waits for a batch in flight and puts the sampler back to
// before it, so a checkpoint's cursor is that of the batches handed out,
// and the batch is read again by the next next_batch.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <vector>

#include "config/job_config.h"
#include "data/sampler.h"
#include "data/token_file.h"
#include "ops/documents.h"

namespace viaduct {


class TrainingData {
 public:
  // Opens every source and the held-out file (data.val_path, or
  // <stem>.val<.ext> beside the training data) for replica `dp_rank` of
  // `dp_size`. A missing or corrupt file is an error naming it.
  TrainingData(const JobConfig& job, int dp_rank, int dp_size);
  ~TrainingData();

  // A ConfigError when a token id of the training or the held-out data is
  // not below `vocab` (model.vocab_size).
  void check_fits_vocab(int64_t vocab) const;
  // checkpoint.last_save_in_hf without data.tokenizer: a hint when the token
  // files name the tokenizer that made them.
  void hint_export_tokenizer() const;
  // The eval batches, each split into `microbatches` like a training batch
  // (training.local_batch_size must divide by them: a ConfigError
  // otherwise). Without held-out data there are none.
  void cut_eval_batches(int64_t microbatches);
  // Whether eval can run; when training.eval_interval asks for it and it
  // cannot, a warning that says which held-out file is missing.
  bool can_eval(bool warn_if_not) const;

  // See Note [Document boundaries] (ops/documents.h). Under
  // model.attn_mask_type = "block_causal": masks the targets of `batch`
  // that are a document's first token (a no-op under "causal"); and the
  // documents of a micro-batch's inputs (null under "causal").
  void mask_document_starts(data::TokenBatch& batch) const;
  ops::DocumentsPtr documents(const at::Tensor& inputs) const;
  // Of `inputs` [B, T]: its documents (null without a marker), the document
  // pieces its windows hold (each row's first token starts one) and the
  // documents that start in them (a marker's start; a row that begins
  // mid-document starts none).
  struct DocumentCounts {
    ops::DocumentsPtr documents;
    int64_t pieces = 0;
    int64_t starts = 0;
  };
  DocumentCounts count_documents(const at::Tensor& inputs) const;
  // The marker the data's files record (kNone under "causal").
  const data::DocumentMarker& document_marker() const { return marker_; }

  // This replica's next batch (the sampler's next()), read ahead on a worker
  // thread.
  data::TokenBatch next_batch();
  // With no batch in flight (see the top of this file).
  data::TokenSampler& sampler();
  const data::TokenSampler& sampler() const;
  const data::TokenStream* eval_tokens() const { return eval_tokens_.get(); }
  const data::EvalLoader& eval_loader() const { return *eval_loader_; }
  const data::SamplerOptions& options() const { return options_; }

 private:
  const DataSection data_;
  data::DocumentMarker marker_;  // recorded only under block_causal
  bool reset_positions_ = false;
  data::SamplerOptions options_;
  std::shared_ptr<const data::TokenStream> eval_tokens_;
  std::shared_ptr<const data::ImageTextFile> eval_images_;  // image-text eval data
  std::unique_ptr<data::TokenSampler> sampler_;
  std::unique_ptr<data::EvalLoader> eval_loader_;
  // The batch read ahead and the sampler's cursor before it.
  mutable std::future<data::TokenBatch> ahead_;
  mutable data::DataCursor before_ahead_;
  void settle() const;
};

}  // namespace viaduct
