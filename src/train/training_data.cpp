#include "train/training_data.h"

#include "config/job_config.h"
#include "core/check.h"
#include "core/log.h"
#include "data/documents.h"
#include "data/image_text_file.h"
#include "model/family.h"

namespace viaduct {

TrainingData::TrainingData(const JobConfig& job, int dp_rank, int dp_size) : data_(job.data) {
  options_.batch_size = job.training.local_batch_size;
  options_.seq_len = job.training.seq_len;
  options_.seed = static_cast<uint64_t>(job.training.seed);
  options_.shuffle = job.data.shuffle;
  options_.dp_rank = dp_rank;
  options_.dp_size = dp_size;
  // Image-text data: the placeholders the model's vision tower replaces
  // (see Note [Image-text rows], data/sampler.h).
  const auto image = image_input(job);
  if (image) {
    options_.image_tokens = image->patches;
    options_.image_token_id = image->image_token_id;
  }
  // data.path is a blend of one source (see Note [Windows and the data cursor]).
  const auto& format = job.data.format;
  const auto& paths = job.data.paths;
  const bool blend = !paths.empty();
  const std::vector<std::string> specs =
      blend ? paths : std::vector<std::string>{job.data.path};
  auto sources = data::open_data_sources(
      blend ? "data.paths" : "data.path", specs,
      blend ? job.data.weights : std::vector<double>{}, format);
  const auto val = data::resolve_val_paths(specs, job.data.val_path);
  if (val.size() == 1 && data::is_image_text_file(val.front())) {
    eval_images_ = std::make_shared<const data::ImageTextFile>(val.front());
  } else if (!val.empty()) {
    eval_tokens_ = data::open_token_stream(val, format);
  }
  // The images must be what the tower takes.
  std::vector<const data::ImageTextFile*> files;
  for (const auto& s : sources) {
    if (s.images) files.push_back(s.images.get());
  }
  if (eval_images_) files.push_back(eval_images_.get());
  for (const auto* f : files) {
    VIADUCT_CHECK_T(ConfigError, image, "the data '", f->path(),
                    "' is image-text data: it needs a model with a vision tower "
                    "(model.vision = true)");
    VIADUCT_CHECK_T(ConfigError,
                    f->channels() == image->channels && f->image_size() == image->image_size,
                    "the image-text data '", f->path(), "' holds ", f->channels(), "x",
                    f->image_size(), "x", f->image_size(), " images, but the vision tower "
                    "takes ", image->channels, "x", image->image_size, "x", image->image_size,
                    " (model.vision_image_size; prepare-images --image-size)");
  }
  sampler_ = std::make_unique<data::TokenSampler>(std::move(sources), options_);
  if (job.model.block_causal()) {
    // Every file of every source, and the held-out ones, must say where
    // documents start, and all alike (one stream's files agree already).
    auto check = [&](const data::TokenStream& stream, const char* what) {
      for (const auto& f : stream.files()) {
        VIADUCT_CHECK_T(ConfigError, f.document_marker().recorded(),
                        "model.attn_mask_type = \"block_causal\" needs to know where documents "
                        "start, but the ", what, " ", f.path(), " records no document marker "
                        "(prepare-data writes it into viaduct token files; llm.c and raw token "
                        "files, and viaduct files of version 1, have none): remake the file "
                        "with viaduct prepare-data, or set model.attn_mask_type = \"causal\"");
      }
      const auto& m = stream.document_marker();
      if (!marker_.recorded()) marker_ = m;
      VIADUCT_CHECK_T(ConfigError, m == marker_, "model.attn_mask_type = \"block_causal\": the ",
                      what, " ", stream.files().front().path(), " marks documents with ",
                      data::describe(m), ", the data before it with ", data::describe(marker_));
    };
    for (size_t s = 0; s < sampler_->num_sources(); ++s) {
      const auto& source = sampler_->source(s);
      VIADUCT_CHECK_T(ConfigError, source.tokens != nullptr,
                      "model.attn_mask_type = \"block_causal\" keeps the documents of token "
                      "files apart, but '", source.path, "' is image-text data, whose rows are "
                      "one caption each: set model.attn_mask_type = \"causal\"");
      check(*source.tokens, blend ? "data.paths file" : "data.path file");
    }
    if (eval_tokens_) check(*eval_tokens_, "held-out file");
    reset_positions_ = job.model.resets_positions();
  }
}

void TrainingData::mask_document_starts(data::TokenBatch& batch) const {
  if (marker_.recorded()) data::mask_document_start_targets(batch, marker_);
}

TrainingData::DocumentCounts TrainingData::count_documents(const at::Tensor& inputs) const {
  if (!marker_.recorded()) return {};
  const auto starts = data::document_starts(inputs, marker_);
  DocumentCounts c;
  c.documents = std::make_shared<const ops::Documents>(starts, reset_positions_);
  c.starts = starts.sum().item<int64_t>();
  c.pieces = static_cast<int64_t>(c.documents->spans().size());
  return c;
}

ops::DocumentsPtr TrainingData::documents(const at::Tensor& inputs) const {
  if (!marker_.recorded()) return nullptr;
  return std::make_shared<const ops::Documents>(data::document_starts(inputs, marker_),
                                                reset_positions_);
}

TrainingData::~TrainingData() {
  if (ahead_.valid()) ahead_.wait();
}

data::TokenBatch TrainingData::next_batch() {
  auto read_ahead = [this] {
    before_ahead_ = sampler_->cursor();
    ahead_ = std::async(std::launch::async, [s = sampler_.get()] { return s->next(); });
  };
  if (!ahead_.valid()) read_ahead();
  auto batch = ahead_.get();
  read_ahead();
  return batch;
}

void TrainingData::settle() const {
  if (!ahead_.valid()) return;
  try {
    ahead_.get();
  } catch (...) {
    // The read fails again, where the batch is asked for.
  }
  sampler_->restore(before_ahead_);
}

data::TokenSampler& TrainingData::sampler() {
  settle();
  return *sampler_;
}

const data::TokenSampler& TrainingData::sampler() const {
  settle();
  return *sampler_;
}

void TrainingData::check_fits_vocab(int64_t vocab) const {
  for (size_t s = 0; s < sampler_->num_sources(); ++s) {
    const auto& source = sampler_->source(s);
    if (source.images) {
      const int64_t max = source.images->max_token();
      VIADUCT_CHECK_T(ConfigError, max < vocab, "the data ", source.describe(),
                      " holds token id ", max, ", but model.vocab_size is ", vocab);
      continue;
    }
    const auto& tokens = *source.tokens;
    VIADUCT_CHECK_T(ConfigError, tokens.max_token() < vocab, "the data ", tokens.describe(),
                    " holds token id ", tokens.max_token(), ", but model.vocab_size is ", vocab);
  }
  // The held-out tokens too: eval would index past the embedding.
  if (eval_images_) {
    VIADUCT_CHECK_T(ConfigError, eval_images_->max_token() < vocab, "the held-out data ",
                    eval_images_->path(), " holds token id ", eval_images_->max_token(),
                    ", but model.vocab_size is ", vocab);
  }
  if (eval_tokens_) {
    VIADUCT_CHECK_T(ConfigError, eval_tokens_->max_token() < vocab, "the held-out data ",
                    eval_tokens_->describe(), " (data.val_path, or <stem>.val<.ext> beside the "
                    "training data) holds token id ", eval_tokens_->max_token(),
                    ", but model.vocab_size is ", vocab);
  }
}

void TrainingData::hint_export_tokenizer() const {
  if (!data_.tokenizer.empty()) return;
  // The token files' headers name the tokenizer that made them; a real one
  // belongs beside the exported weights.
  for (size_t s = 0; s < sampler_->num_sources(); ++s) {
    if (!sampler_->source(s).tokens) continue;
    for (const auto& file : sampler_->source(s).tokens->files()) {
      const auto& name = file.tokenizer();
      if (name.empty() || name == "byte") continue;
      log::info("the data ", file.path(), " was made with the tokenizer ", name,
                "; set data.tokenizer to its tokenizer.json to copy it into the Hugging "
                "Face folder of checkpoint.last_save_in_hf");
      return;
    }
  }
}

void TrainingData::cut_eval_batches(int64_t microbatches) {
  VIADUCT_CHECK_T(ConfigError, options_.batch_size % microbatches == 0,
                  "training.local_batch_size (", options_.batch_size,
                  ") must be divisible by the ", microbatches,
                  " micro-batches (parallelism.pipeline_parallel_microbatches)");
  if (eval_tokens_) {
    eval_loader_ = std::make_unique<data::EvalLoader>(eval_tokens_, options_,
                                                      data_.eval_batches);
  } else if (eval_images_) {
    eval_loader_ = std::make_unique<data::EvalLoader>(eval_images_, options_,
                                                      data_.eval_batches);
  }
}

bool TrainingData::can_eval(bool warn_if_not) const {
  if (eval_loader_ && eval_loader_->num_batches() > 0) return true;
  if (!warn_if_not) return false;
  if (data_.paths.empty()) {
    log::warn("no held-out data (", data::val_path_for(data_.path),
              " missing, data.val_path unset): eval is off");
  } else {
    log::warn("no held-out data (no data.paths entry is a file with a <stem>.val<.ext> "
              "beside it, data.val_path unset): eval is off");
  }
  return false;
}

}  // namespace viaduct
