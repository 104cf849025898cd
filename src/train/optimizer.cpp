#include "train/optimizer.h"

#include <cmath>

#include "checkpoint/tensor_index.h"
#include "config/job_config.h"
#include "core/check.h"
#include "core/torch_compat.h"
#include "model/model.h"
#include "ops/adamw.h"

namespace viaduct {

std::vector<NamedParam> named_params_for_training(const torch::nn::Module& m) {
  std::vector<NamedParam> out;
  for (const auto& item : m.named_parameters(/*recurse=*/true)) {
    const auto& fqn = item.key();
    const auto& p = item.value();
    const bool embedding = fqn.rfind("tok_embeddings.", 0) == 0 ||
                           fqn.rfind("pos_embeddings.", 0) == 0;
    out.push_back(NamedParam{fqn, p, p.dim() >= 2 && !embedding});
  }
  return out;
}

void Optimizer::zero_grad() {
  for (auto& np : params_) {
    auto& g = np.param.mutable_grad();
    if (g.defined()) g = at::Tensor();
  }
}

void Optimizer::load_from(const checkpoint::TensorFileIndex& index) {
  std::map<std::string, at::Tensor> tensors;
  for (const auto& key : state_keys()) {
    // A sharded expert tensor's state is stored whole ("optim.<state>.<fqn>",
    // shaped like the whole weight): only this rank's rows of it are read.
    const NamedParam* expert = nullptr;
    for (const auto& np : params_) {
      const std::string suffix = "." + np.fqn;
      if (np.whole_rows > 0 && key.size() > suffix.size() &&
          key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0) {
        expert = &np;
      }
    }
    if (expert && index.contains(key)) {
      const auto shape = index.info(key).shape;
      if (!shape.empty() && shape[0] == expert->whole_rows) {
        tensors[key] = index.load_rows(key, expert->first_row, expert->param.size(0));
        continue;
      }
    }
    tensors[key] = index.load(key);
  }
  load_state(tensors);
}

int64_t Optimizer::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& [name, t] : state()) {
    bytes += t.numel() * static_cast<int64_t>(t.element_size());
  }
  return bytes;
}

AdamW::AdamW(std::vector<NamedParam> params, double beta1, double beta2,
             double eps, double weight_decay)
    : Optimizer(std::move(params)),
      beta1_(beta1),
      beta2_(beta2),
      eps_(eps),
      weight_decay_(weight_decay) {
  for (const auto& np : params_) {
    exp_avg_.push_back(at::zeros_like(np.param, at::MemoryFormat::Contiguous));
    exp_avg_sq_.push_back(at::zeros_like(np.param, at::MemoryFormat::Contiguous));
  }
}

bool AdamW::fusable() const {
  // Note [Fused AdamW]
  // On CUDA, one pass per tensor instead of the loop's ~7 kernels and 2
  // temporaries: viaduct's kernel where ops::adamw_kernel_runs(), else
  // ATen's multi-tensor kernel (2.x), the same formulas in fp32.
  // Elementwise, so every layout still gets the same bits. Both need every
  // parameter with a gradient to be a contiguous fp32 tensor on one GPU.
  if (params_.empty()) return false;
  const auto& first = params_.front().param;
  if (!first.is_cuda()) return false;
  for (const auto& np : params_) {
    const auto& pr = np.param;
    if (pr.grad().defined() &&
        (pr.device() != first.device() || pr.scalar_type() != at::kFloat ||
         pr.grad().scalar_type() != at::kFloat || !pr.is_contiguous() ||
         !pr.grad().is_contiguous())) {
      return false;
    }
  }
  return true;
}

bool AdamW::own_kernel() const {
  return fusable() && ops::adamw_kernel_runs(params_.front().param, kernel_options_);
}

// Note [Clip folded into AdamW]
// Clipping multiplied every gradient in place
// (one more read and write of every fp32 gradient) before the update read
// them again.
// viaduct's kernel multiplies each gradient value by the coefficient as it
// loads it, rounded as a separate fp32 multiply -- the bits ATen's in-place
// multiply writes -- so the update is bitwise the same. Where the kernel
// does not run, the gradients are scaled in place as before.
void Optimizer::step_scaled(double lr, double grad_scale) {
  multiply_grads(params_, grad_scale);
  step(lr);
}

void AdamW::step_scaled(double lr, double grad_scale) {
  if (grad_scale == 1.0 || !own_kernel()) {
    Optimizer::step_scaled(lr, grad_scale);
    return;
  }
  // The kernel reads grad_scale_ during this one step only (also when it
  // throws).
  struct Reset {
    double& v;
    ~Reset() { v = 1.0; }
  } reset{grad_scale_};
  grad_scale_ = grad_scale;
  step(lr);
}

void Optimizer::step_device_scaled(double, const at::Tensor&) {
  throw Error("this optimizer cannot read its clip coefficient on the device");
}

bool AdamW::takes_device_scale() const {
  return own_kernel();
}

void AdamW::step_device_scaled(double lr, const at::Tensor& scale) {
  VIADUCT_CHECK(takes_device_scale(),
                "AdamW: the clip coefficient on the device needs viaduct's CUDA kernel");
  struct Reset {  // the kernels read scale_dev_ during this one step only
    at::Tensor& t;
    ~Reset() { t = at::Tensor(); }
  } reset{scale_dev_};
  scale_dev_ = scale;
  step(lr);
}

bool AdamW::fused_step(double lr, double bc1, double bc2) {
  if (!fusable()) return false;
  const auto& first = params_.front().param;
  if (ops::adamw_kernel_runs(first, kernel_options_)) {
    std::vector<ops::AdamWParam> ps;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].param.grad().defined()) continue;
      ps.push_back({params_[i].param, exp_avg_[i], exp_avg_sq_[i],
                    params_[i].weight_decay ? weight_decay_ : 0.0});
    }
    ops::adamw_kernel_step_(ps, {lr, beta1_, beta2_, eps_, bc1, bc2, grad_scale_, scale_dev_},
                            kernel_options_);
    return true;
  }
  std::vector<at::Tensor> p[2], g[2], m[2], v[2];
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& pr = params_[i].param;
    if (!pr.grad().defined()) continue;
    const int k = params_[i].weight_decay ? 1 : 0;
    p[k].push_back(pr);
    g[k].push_back(pr.grad());
    m[k].push_back(exp_avg_[i]);
    v[k].push_back(exp_avg_sq_[i]);
  }
  if (!step_tensor_.defined() || step_tensor_.device() != first.device()) {
    step_tensor_ = at::zeros({1}, first.options());
  }
  step_tensor_.fill_(static_cast<double>(steps_));
  for (int k = 0; k < 2; ++k) {
    if (p[k].empty()) continue;
    if (!compat::fused_adamw(p[k], g[k], m[k], v[k], step_tensor_, lr, beta1_, beta2_,
                             k == 1 ? weight_decay_ : 0.0, eps_)) {
      return false;  // only ever before the first group: no kernel at all
    }
    // Whether ATen's multi-tensor kernel moves the version counters is its
    // business; the weight cache relies on them moving.
    for (auto& t : p[k]) torch::autograd::impl::bump_version(t);
  }
  return true;
}

void AdamW::step(double lr) {
  torch::NoGradGuard no_grad;
  ++steps_;
  const double bc1 = 1.0 - std::pow(beta1_, static_cast<double>(steps_));
  const double bc2 = 1.0 - std::pow(beta2_, static_cast<double>(steps_));
  if (fused_step(lr, bc1, bc2)) return;
  const double step_size = lr / bc1;
  const double bc2_sqrt = std::sqrt(bc2);
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i].param;
    const auto& g = p.grad();
    if (!g.defined()) continue;
    if (params_[i].weight_decay && weight_decay_ != 0.0) {
      p.mul_(1.0 - lr * weight_decay_);
    }
    exp_avg_[i].lerp_(g, 1.0 - beta1_);
    exp_avg_sq_[i].mul_(beta2_).addcmul_(g, g, 1.0 - beta2_);
    auto denom = (exp_avg_sq_[i].sqrt() / bc2_sqrt).add_(eps_);
    p.addcdiv_(exp_avg_[i], denom, -step_size);
  }
}

std::vector<std::pair<std::string, at::Tensor>> AdamW::state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back("optim.exp_avg." + params_[i].fqn, exp_avg_[i]);
    out.emplace_back("optim.exp_avg_sq." + params_[i].fqn, exp_avg_sq_[i]);
  }
  return out;
}

std::vector<std::string> AdamW::state_keys() const {
  std::vector<std::string> keys;
  for (const auto& [k, t] : state()) keys.push_back(k);
  return keys;
}

void AdamW::load_state(const std::map<std::string, at::Tensor>& tensors) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    for (auto* slot : {&exp_avg_[i], &exp_avg_sq_[i]}) {
      const std::string key =
          (slot == &exp_avg_[i] ? "optim.exp_avg." : "optim.exp_avg_sq.") +
          params_[i].fqn;
      auto it = tensors.find(key);
      VIADUCT_CHECK_T(FileError, it != tensors.end(),
                      "optimizer state '", key, "' is missing from the checkpoint");
      VIADUCT_CHECK_T(FileError, it->second.sizes() == slot->sizes(),
                      "optimizer state '", key, "' has shape ", it->second.sizes(),
                      ", expected ", slot->sizes());
      slot->copy_(it->second);
    }
  }
}

void SGD::step(double lr) {
  torch::NoGradGuard no_grad;
  ++steps_;
  for (auto& np : params_) {
    const auto& g = np.param.grad();
    if (g.defined()) np.param.add_(g, -lr);
  }
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerSection& section, std::vector<NamedParam> params,
                                          const ops::KernelOptions& kernels) {
  const auto& name = section.name;
  if (name == "SGD") return std::make_unique<SGD>(std::move(params));
  auto adamw = std::make_unique<AdamW>(
      std::move(params), section.beta1, section.beta2, section.eps,
      section.weight_decay);
  adamw->set_own_kernel_options(kernels);  // model.cuda_kernels, the weight cache
  return adamw;
}

double lr_at(const JobConfig& job, int64_t step) {
  const double peak = job.optimizer.lr;
  const int64_t warmup = job.lr_scheduler.warmup_steps;
  const int64_t total = job.training.steps;
  const auto& type = job.lr_scheduler.decay_type;
  const double min_f = job.lr_scheduler.min_lr_factor;
  if (warmup > 0 && step <= warmup) {
    return peak * static_cast<double>(step) / static_cast<double>(warmup);
  }
  if (type == "constant" || total <= warmup) return peak;
  const double progress = std::clamp(
      static_cast<double>(step - warmup) / static_cast<double>(total - warmup),
      0.0, 1.0);
  double factor = 1.0;
  if (type == "cosine") {
    factor = min_f + (1.0 - min_f) * 0.5 * (1.0 + std::cos(M_PI * progress));
  } else {
    factor = 1.0 - (1.0 - min_f) * progress;
  }
  return peak * factor;
}

std::vector<at::Tensor> defined_grads(const std::vector<NamedParam>& params,
                                      std::vector<size_t>* where) {
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& g = params[i].param.grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    if (where) where->push_back(i);
  }
  return grads;
}

std::vector<double> squared_norms(std::vector<at::Tensor> tensors) {
  // One fp32 norm per tensor on its device (one multi-tensor kernel per
  // device, a loop on CPU), fetched with a single copy (not one device sync
  // per tensor), then squared in double on the host.
  for (auto& t : tensors) {
    if (t.scalar_type() != at::kDouble) t = t.to(at::kFloat);
  }
  std::vector<double> out(tensors.size(), 0.0);
  if (tensors.empty()) return out;
  auto host = at::stack(at::_foreach_norm(tensors, 2)).to(at::kCPU, at::kDouble);
  const double* v = host.data_ptr<double>();
  for (size_t k = 0; k < out.size(); ++k) out[k] = v[k] * v[k];
  return out;
}

std::vector<double> grad_squared_norms(const std::vector<NamedParam>& params) {
  std::vector<size_t> where;
  const auto sq = squared_norms(defined_grads(params, &where));
  std::vector<double> out(params.size(), 0.0);
  for (size_t k = 0; k < where.size(); ++k) out[where[k]] = sq[k];
  return out;
}

double total_norm(const std::vector<double>& sq) {
  double s = 0.0;
  for (double v : sq) s += v;
  return std::sqrt(s);
}

double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  const double coef = max_norm / (norm + 1e-6);
  return coef < 1.0 ? coef : 1.0;
}

void scale_grads(const std::vector<NamedParam>& params, double norm,
                 double max_norm) {
  multiply_grads(params, clip_coefficient(norm, max_norm));
}

void multiply_grads(const std::vector<NamedParam>& params, double coef) {
  if (coef == 1.0) return;
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& np : params) {
    if (np.param.grad().defined()) grads.push_back(np.param.grad());
  }
  if (!grads.empty()) at::_foreach_mul_(grads, coef);
}

}  // namespace viaduct
