#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpoint/checkpoint.h"
#include "core/check.h"
#include "core/device.h"
#include "core/log.h"
#include "core/torch_compat.h"
#include "data/sampler.h"
#include "data/token_file.h"

namespace viaduct {
namespace fs = std::filesystem;

namespace {

at::ScalarType resolve_dtype(const std::string& name, const at::Device& dev) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  return dev.is_cuda() ? at::kBFloat16 : at::kFloat;  // auto
}

std::string human_bytes(double b) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2) << b / (1024.0 * 1024 * 1024) << " GiB";
  return os.str();
}

// Enough digits to round-trip a float32 (and more than enough for display).
std::string float_repr(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

}  // namespace

Trainer::Trainer(Config cfg)
    : cfg_(std::move(cfg)),
      device_(resolve_device(cfg_.get_string("training.device"))) {
  const auto lvl = cfg_.get_string("job.log_level");
  log::set_level(lvl == "debug"     ? log::Level::kDebug
                 : lvl == "warning" ? log::Level::kWarn
                 : lvl == "error"   ? log::Level::kError
                                    : log::Level::kInfo);
  // The same thread count whether launched or run alone (determinism).
  at::set_num_threads(static_cast<int>(cfg_.get_int("training.num_threads")));
  compute_dtype_ = resolve_dtype(cfg_.get_string("training.dtype"), device_);

  const auto path = cfg_.get_string("data.path");
  const auto format = cfg_.get_string("data.format");
  train_tokens_ = data::open_token_stream(path, format);
  const auto val = data::resolve_val_path(path, cfg_.get_string("data.val_path"));
  if (!val.empty()) eval_tokens_ = data::open_token_stream(val, format);

  parts_.push_back(build_model_part(cfg_));
  auto& model = *parts_.front();
  const auto info = describe_model(cfg_);
  flops_per_token_ = info.flops_per_token;
  const int64_t vocab = cfg_.get_int_opt("model.vocab_size").value_or(-1);
  (void)vocab;
  model.init_weights(static_cast<uint64_t>(cfg_.get_int("training.seed")));
  model.to(device_);
  model.set_compute_dtype(compute_dtype_);

  // Token ids must fit the embedding.
  int64_t model_vocab = 0;
  for (const auto& p : model.named_parameters()) {
    if (p.key() == "tok_embeddings.weight") model_vocab = p.value().size(0);
  }
  VIADUCT_CHECK_T(ConfigError, train_tokens_->max_token() < model_vocab,
                  "the data ", train_tokens_->describe(), " holds token id ",
                  train_tokens_->max_token(), ", but model.vocab_size is ",
                  model_vocab);

  optimizer_ = make_optimizer(cfg_, named_params_for_training(model));

  data::SamplerOptions so;
  so.batch_size = cfg_.get_int("training.local_batch_size");
  so.seq_len = cfg_.get_int("training.seq_len");
  so.seed = static_cast<uint64_t>(cfg_.get_int("training.seed"));
  so.shuffle = cfg_.get_bool("data.shuffle");
  sampler_ = std::make_unique<data::TokenSampler>(train_tokens_, so);
  if (eval_tokens_) {
    eval_loader_ = std::make_unique<data::EvalLoader>(
        eval_tokens_, so, cfg_.get_int("data.eval_batches"));
  }
  progress_bar_ = cfg_.get_bool("metrics.progress_bar") && isatty(STDOUT_FILENO);

  int64_t n_params = 0;
  for (const auto& np : optimizer_->params()) n_params += np.param.numel();
  log::info("model ", info.family, "/", info.flavor, ": ", info.n_layers,
            " layers, ", n_params, " parameters; device ", device_name(device_),
            ", dtype ", c10::toString(compute_dtype_), ", LibTorch ",
            compat::torch_version(), ", ", at::get_num_threads(), " threads");
  log::info("data ", train_tokens_->describe(), ": ", train_tokens_->size(),
            " tokens", eval_tokens_ ? ", eval " + eval_tokens_->describe() : "");
}

Trainer::~Trainer() = default;

std::string Trainer::checkpoint_folder() const {
  fs::path f = cfg_.get_string("checkpoint.folder");
  if (f.is_absolute()) return f.string();
  return (fs::path(cfg_.get_string("job.dump_folder")) / f).string();
}

at::Tensor Trainer::forward_loss(const at::Tensor& inputs,
                                 const at::Tensor& targets) {
  Activations acts{inputs.to(device_)};
  for (auto& part : parts_) acts = part->forward(acts);
  return summed_cross_entropy(acts.at(0), targets.to(device_));
}

StepMetrics Trainer::train_step() {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t accum = cfg_.get_int("training.gradient_accumulation_steps");
  const int64_t n_micro =
      cfg_.get_int_opt("parallelism.pipeline_parallel_microbatches").value_or(1);
  std::vector<data::TokenBatch> batches;
  int64_t tokens = 0;
  for (int64_t a = 0; a < accum; ++a) {
    batches.push_back(sampler_->next());
    tokens += (batches.back().targets != -100).sum().item<int64_t>();
  }
  for (auto& p : parts_) p->train();
  double loss_sum = 0.0;
  for (const auto& batch : batches) {
    for (const auto& mb : data::split_microbatches(batch, n_micro)) {
      auto loss = forward_loss(mb.inputs, mb.targets);
      loss_sum += loss.item<double>();
      (loss / static_cast<double>(tokens)).backward();
    }
  }
  const auto& params = optimizer_->params();
  const double norm = total_norm(grad_squared_norms(params));
  VIADUCT_CHECK(std::isfinite(norm), "step ", step_ + 1,
                ": the gradient norm is not finite (", norm,
                "); lower optimizer.lr or check the data");
  scale_grads(params, norm, cfg_.get_float("training.max_norm"));
  const double lr = lr_at(cfg_, step_ + 1);
  optimizer_->step(lr);
  optimizer_->zero_grad();
  for (auto& p : parts_) p->after_optimizer_step();
  ++step_;
  tokens_seen_ += tokens;
  synchronize(device_);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  StepMetrics m;
  m.step = step_;
  m.loss = loss_sum / static_cast<double>(tokens);
  m.grad_norm = norm;
  m.lr = lr;
  m.tokens = tokens;
  m.seconds = secs;
  m.tokens_per_sec = static_cast<double>(tokens) / secs;
  if (auto peak = peak_flops(device_, compute_dtype_)) {
    m.mfu = flops_per_token_ * m.tokens_per_sec / *peak;
  }
  m.peak_memory_bytes = peak_memory_bytes(device_);
  return m;
}

double Trainer::evaluate() {
  if (!eval_loader_ || eval_loader_->num_batches() == 0) return std::nan("");
  torch::NoGradGuard no_grad;
  for (auto& p : parts_) p->eval();
  double sum = 0.0;
  int64_t tokens = 0;
  for (const auto& b : eval_loader_->batches()) {
    sum += forward_loss(b.inputs, b.targets).item<double>();
    tokens += (b.targets != -100).sum().item<int64_t>();
  }
  return sum / static_cast<double>(tokens);
}

void Trainer::save_checkpoint() {
  namespace ck = checkpoint;
  ck::CheckpointMetadata meta;
  meta.step = step_;
  meta.tokens_seen = tokens_seen_;
  meta.data_cursor = nlohmann::json::parse(sampler_->cursor().to_json());
  meta.config_toml = cfg_.to_toml();
  meta.layout = {{"pp", 1}, {"dp", 1}, {"stages", static_cast<int>(parts_.size())}};
  meta.extra = {{"optimizer_steps", optimizer_->steps_taken()}};
  meta.torch_version = compat::torch_version();
  ck::CheckpointPart model_part{"model.safetensors", {}, {}};
  for (const auto& part : parts_) {
    for (const auto& p : part->named_parameters()) {
      model_part.tensors.emplace_back(p.key(), p.value().detach());
    }
  }
  ck::CheckpointPart optim_part{"optim.safetensors", optimizer_->state(), {}};
  const auto dir = ck::save_checkpoint(checkpoint_folder(), meta,
                                       {model_part, optim_part});
  const auto removed = ck::prune_checkpoints(
      checkpoint_folder(), static_cast<int>(cfg_.get_int("checkpoint.keep_latest_k")));
  log::info("saved checkpoint ", dir.string(),
            removed.empty() ? "" : str(" (pruned ", removed.size(), " older)"));
}

bool Trainer::resume() {
  namespace ck = checkpoint;
  // The newest step-<N> folder must load: a damaged one is an error rather
  // than a silent restart from an older step (or from scratch).
  std::optional<int64_t> newest;
  if (fs::is_directory(checkpoint_folder())) {
    for (const auto& e : fs::directory_iterator(checkpoint_folder())) {
      const auto name = e.path().filename().string();
      if (!e.is_directory() || name.rfind("step-", 0) != 0 ||
          name.find(".tmp") != std::string::npos) {
        continue;
      }
      try {
        const int64_t s = std::stoll(name.substr(5));
        if (!newest || s > *newest) newest = s;
      } catch (const std::exception&) {
      }
    }
  }
  const auto latest = ck::find_latest_checkpoint(checkpoint_folder());
  if (newest && (!latest || *latest != *newest)) {
    ck::verify_checkpoint(ck::checkpoint_dir(checkpoint_folder(), *newest),
                          ck::Verify::kSizes);  // throws, naming the file
    throw FileError(str("checkpoint ", ck::checkpoint_dir(checkpoint_folder(), *newest).string(),
                        " is incomplete; remove it to resume from an older one"));
  }
  if (!latest) return false;
  const auto ckpt = ck::open_checkpoint(ck::checkpoint_dir(checkpoint_folder(), *latest));
  for (const auto& part : parts_) ckpt.tensors.load_into(*part);
  const auto keys = optimizer_->state_keys();
  optimizer_->load_state(ckpt.tensors.load_many(keys));
  optimizer_->set_steps_taken(ckpt.metadata.extra.value("optimizer_steps", ckpt.metadata.step));
  sampler_->restore(data::DataCursor::from_json(ckpt.metadata.data_cursor.dump()));
  step_ = ckpt.metadata.step;
  tokens_seen_ = ckpt.metadata.tokens_seen;
  log::info("resumed from ", ckpt.dir.string(), " at step ", step_);
  return true;
}

void Trainer::append_metrics(const std::string& line) {
  if (!cfg_.get_bool("metrics.enable_jsonl")) return;
  const fs::path dir = cfg_.get_string("job.dump_folder");
  fs::create_directories(dir);
  std::ofstream out(dir / "metrics.jsonl", std::ios::app);
  VIADUCT_CHECK_T(FileError, out.good(), "cannot append to ",
                  (dir / "metrics.jsonl").string());
  out << line << '\n';
}

void Trainer::truncate_metrics_after(int64_t step) {
  // Lines a crashed run wrote past its last checkpoint are dropped, so the
  // file reads as one uninterrupted run.
  const fs::path file = fs::path(cfg_.get_string("job.dump_folder")) / "metrics.jsonl";
  if (!fs::exists(file)) return;
  std::ifstream in(file);
  std::ostringstream kept;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.value("step", int64_t{0}) > step) continue;
    kept << line << '\n';
  }
  in.close();
  const fs::path tmp = file.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << kept.str();
    VIADUCT_CHECK_T(FileError, out.good(), "cannot write ", tmp.string());
  }
  fs::rename(tmp, file);
}

void Trainer::log_step(const StepMetrics& m) {
  nlohmann::json j;
  j["step"] = m.step;
  j["loss"] = nlohmann::json::parse(float_repr(m.loss));
  j["grad_norm"] = nlohmann::json::parse(float_repr(m.grad_norm));
  j["lr"] = m.lr;
  j["tokens"] = m.tokens;
  j["tokens_per_sec"] = m.tokens_per_sec;
  j["step_seconds"] = m.seconds;
  j["mfu"] = m.mfu >= 0 ? nlohmann::json(m.mfu) : nlohmann::json(nullptr);
  j["peak_memory_bytes"] = m.peak_memory_bytes;
  append_metrics(j.dump());

  const int64_t total = cfg_.get_int("training.steps");
  const bool log_now = m.step % cfg_.get_int("metrics.log_freq") == 0 ||
                       m.step == total;
  std::ostringstream line;
  line << "step " << std::setw(5) << m.step << " | loss " << std::fixed
       << std::setprecision(4) << m.loss << " | grad_norm " << std::setprecision(3)
       << m.grad_norm << " | lr " << std::scientific << std::setprecision(2) << m.lr
       << std::fixed << " | " << std::setprecision(0) << m.tokens_per_sec
       << " tok/s | mfu ";
  if (m.mfu >= 0) {
    line << std::setprecision(2) << 100 * m.mfu << "%";
  } else {
    line << "n/a";
  }
  line << " | mem " << human_bytes(m.peak_memory_bytes);
  if (progress_bar_) {
    const int width = 30;
    const int filled = static_cast<int>(width * m.step / std::max<int64_t>(total, 1));
    std::printf("\r\033[K");
    if (log_now) std::printf("%s\n", line.str().c_str());
    std::printf("[%s%s] %lld/%lld", std::string(filled, '#').c_str(),
                std::string(width - filled, ' ').c_str(),
                static_cast<long long>(m.step), static_cast<long long>(total));
    if (m.step == total) std::printf("\n");
    std::fflush(stdout);
  } else if (log_now) {
    std::printf("%s\n", line.str().c_str());
    std::fflush(stdout);
  }
}

void Trainer::log_eval(double loss) {
  nlohmann::json j;
  j["step"] = step_;
  j["eval_loss"] = nlohmann::json::parse(float_repr(loss));
  append_metrics(j.dump());
  if (progress_bar_) std::printf("\r\033[K");
  std::printf("step %5lld | eval_loss %.4f\n", static_cast<long long>(step_), loss);
  std::fflush(stdout);
}

StepMetrics Trainer::run() {
  const bool ckpt = cfg_.get_bool("checkpoint.enable");
  if (ckpt && cfg_.get_bool("checkpoint.resume")) resume();
  truncate_metrics_after(step_);
  const int64_t total = cfg_.get_int("training.steps");
  const int64_t eval_every = cfg_.get_int("training.eval_interval");
  const bool can_eval = eval_loader_ && eval_loader_->num_batches() > 0;
  if (!can_eval && eval_every > 0) {
    log::warn("no held-out data (", data::val_path_for(cfg_.get_string("data.path")),
              " missing, data.val_path unset): eval is off");
  }
  if (can_eval && eval_every > 0 && step_ == 0) log_eval(evaluate());
  StepMetrics last;
  reset_peak_memory(device_);
  while (step_ < total) {
    last = train_step();
    log_step(last);
    if (can_eval && eval_every > 0 && (step_ % eval_every == 0 || step_ == total)) {
      log_eval(evaluate());
    }
    if (ckpt && (step_ % cfg_.get_int("checkpoint.interval") == 0 || step_ == total)) {
      save_checkpoint();
    }
  }
  return last;
}

}  // namespace viaduct
