// The data of one training process: the token sources (data.path, or the
// blend of data.paths with data.weights) in the sampler, which hands this
// data-parallel replica its batches, and the held-out tokens with the eval
// batches cut from them.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "config/job_config.h"
#include "data/sampler.h"
#include "data/token_file.h"

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

  data::TokenSampler& sampler() { return *sampler_; }
  const data::TokenSampler& sampler() const { return *sampler_; }
  const data::TokenStream* eval_tokens() const { return eval_tokens_.get(); }
  const data::EvalLoader& eval_loader() const { return *eval_loader_; }
  const data::SamplerOptions& options() const { return options_; }

 private:
  const DataSection data_;
  data::SamplerOptions options_;
  std::shared_ptr<const data::TokenStream> eval_tokens_;
  std::unique_ptr<data::TokenSampler> sampler_;
  std::unique_ptr<data::EvalLoader> eval_loader_;
};

}  // namespace viaduct
