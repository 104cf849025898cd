// See Note [Activation checkpointing] (recompute.h): the autograd node.
#include "ops/recompute.h"

#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <torch/csrc/autograd/functions/utils.h>

#include "core/check.h"

namespace viaduct::ops {
namespace {

using torch::autograd::variable_list;

std::atomic<int64_t> g_recomputes{0};
std::atomic<int64_t> g_op_computes{0}, g_op_replays{0};
thread_local int tl_recomputing = 0;
thread_local int tl_first_forward = 0;

// See Note [Per-op activation checkpointing]: one checkpointed body's saved op
// outputs, in call order, with their versions at the end of the op (an
// in-place change by a later op of the first forward would make them other
// values than the recompute's).
struct SavedOps {
  std::vector<std::vector<at::Tensor>> ops;
  std::vector<std::vector<int64_t>> versions;
  size_t next = 0;  // replay: the next op's entry
  bool replay = false;
};
thread_local SavedOps* tl_saved_ops = nullptr;

// Makes `ops` the list this thread's expensive ops record into or replay
// from, for the scope's lifetime.
struct SavedOpsScope {
  SavedOpsScope(SavedOps* ops, bool replay) : prev_(tl_saved_ops) {
    if (ops != nullptr) ops->replay = replay;
    tl_saved_ops = ops;
  }
  ~SavedOpsScope() { tl_saved_ops = prev_; }
  SavedOpsScope(const SavedOpsScope&) = delete;
  SavedOpsScope& operator=(const SavedOpsScope&) = delete;
  SavedOps* prev_;
};

struct FlagScope {
  explicit FlagScope(int& f) : f_(f) { ++f_; }
  ~FlagScope() { --f_; }
  FlagScope(const FlagScope&) = delete;
  FlagScope& operator=(const FlagScope&) = delete;
  int& f_;
};

class CheckpointBackward : public torch::autograd::Node {
 public:
  CheckpointBackward(CheckpointBody body, std::vector<at::Tensor> inputs,
                     std::vector<at::Tensor> params, std::shared_ptr<SavedOps> saved_ops)
      : body_(std::move(body)),
        inputs_(std::move(inputs)),
        params_(std::move(params)),
        saved_ops_(std::move(saved_ops)) {
    for (const auto& t : inputs_) versions_.push_back(t.defined() ? t._version() : 0);
  }

  std::string name() const override { return "viaduct::CheckpointBackward"; }

  void release_variables() override {
    body_ = nullptr;
    inputs_.clear();
    params_.clear();
    recomputed_inputs_.clear();
    recomputed_outputs_.clear();
    saved_ops_.reset();
    released_ = true;
  }

  variable_list apply(variable_list&& grads) override {
    VIADUCT_CHECK(!released_,
                  "activation checkpointing: backward through a checkpointed layer whose "
                  "graph was already freed (a second backward without retain_graph)");
    const size_t n_in = inputs_.size(), n_p = params_.size();
    variable_list out(n_in + n_p);
    if (recomputed_outputs_.empty()) recompute();

    std::vector<at::Tensor> outs, grad_outs;
    for (size_t k = 0; k < grads.size(); ++k) {
      if (grads[k].defined() && recomputed_outputs_[k].requires_grad()) {
        outs.push_back(recomputed_outputs_[k]);
        grad_outs.push_back(grads[k]);
      }
    }
    std::vector<at::Tensor> targets;
    std::vector<size_t> where;
    bool params_left = false;  // a parameter gradient a later pass (W) will ask for
    for (size_t i = 0; i < n_in + n_p; ++i) {
      const auto& t = i < n_in ? recomputed_inputs_[i] : params_[i - n_in];
      if (!t.defined() || !t.requires_grad()) continue;
      const bool wanted = task_should_compute_output(i);
      if (i >= n_in) {
        if (wanted) {
          params_done_[i - n_in] = true;
        } else if (!params_done_[i - n_in]) {
          params_left = true;
        }
      }
      if (wanted) {
        targets.push_back(t);
        where.push_back(i);
      }
    }
    if (!outs.empty() && !targets.empty()) {
      auto g = torch::autograd::grad(outs, targets, grad_outs, /*retain_graph=*/params_left,
                                     /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t j = 0; j < where.size(); ++j) out[where[j]] = g[j];
    }
    if (!params_left) {  // nothing more to ask of the recomputed graph
      recomputed_inputs_.clear();
      recomputed_outputs_.clear();
      done_ = true;
    }
    return out;
  }

 private:
  void recompute() {
    VIADUCT_CHECK(!done_,
                  "activation checkpointing: a checkpointed layer was asked for gradients "
                  "after every one of them was computed (a second backward)");
    for (size_t i = 0; i < inputs_.size(); ++i) {
      const auto& t = inputs_[i];
      VIADUCT_CHECK(!t.defined() || t._version() == versions_[i],
                    "activation checkpointing: input ", i,
                    " of a checkpointed layer was modified in place between its forward and "
                    "its backward; the recompute would not give the forward's bits");
      if (t.defined() && t.is_floating_point()) {
        recomputed_inputs_.push_back(t.detach().requires_grad_(t.requires_grad()));
      } else {
        recomputed_inputs_.push_back(t);
      }
    }
    params_done_.assign(params_.size(), false);
    g_recomputes.fetch_add(1);
    FlagScope recomputing(tl_recomputing);
    at::AutoGradMode grad_on(true);
    if (saved_ops_ == nullptr) {
      recomputed_outputs_ = body_(recomputed_inputs_);
      return;
    }
    {
      SavedOpsScope replay(saved_ops_.get(), /*replay=*/true);
      recomputed_outputs_ = body_(recomputed_inputs_);
    }
    VIADUCT_CHECK(saved_ops_->next == saved_ops_->ops.size(),
                  "activation checkpointing (\"op\"): the recompute of a layer replayed ",
                  saved_ops_->next, " of the ", saved_ops_->ops.size(),
                  " expensive ops its forward ran; the layer must run the same ops every time");
    saved_ops_.reset();  // the outputs live on in the recomputed graph
  }

  CheckpointBody body_;
  std::vector<at::Tensor> inputs_;
  std::vector<int64_t> versions_;
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> recomputed_inputs_, recomputed_outputs_;
  std::vector<bool> params_done_;
  std::shared_ptr<SavedOps> saved_ops_;  // "op": the expensive ops' outputs
  bool done_ = false;
  bool released_ = false;
};

}  // namespace

int64_t recomputes() { return g_recomputes.load(); }

int64_t saved_op_computes() { return g_op_computes.load(); }

int64_t saved_op_replays() { return g_op_replays.load(); }

std::vector<at::Tensor> run_saved_op_outputs(
    const std::function<std::vector<at::Tensor>()>& compute) {
  SavedOps* ops = tl_saved_ops;
  if (ops == nullptr || !ops->replay) {
    auto outs = compute();
    g_op_computes.fetch_add(1);
    if (ops != nullptr) {
      std::vector<int64_t> versions;
      for (const auto& t : outs) versions.push_back(t.defined() ? t._version() : 0);
      ops->ops.push_back(outs);
      ops->versions.push_back(std::move(versions));
    }
    return outs;
  }
  VIADUCT_CHECK(ops->next < ops->ops.size(),
                "activation checkpointing (\"op\"): the recompute of a layer ran more expensive "
                "ops than its forward (", ops->ops.size(),
                "); the layer must run the same ops every time");
  const size_t i = ops->next++;
  auto outs = std::move(ops->ops[i]);
  for (size_t j = 0; j < outs.size(); ++j) {
    VIADUCT_CHECK(!outs[j].defined() || outs[j]._version() == ops->versions[i][j],
                  "activation checkpointing (\"op\"): the output of expensive op ", i,
                  " of a layer was modified in place in its forward; its saved value is not "
                  "the one the recompute needs");
  }
  g_op_replays.fetch_add(1);
  return outs;
}

at::Tensor run_saved_op(const std::function<at::Tensor()>& compute) {
  return run_saved_op_outputs([&] { return std::vector<at::Tensor>{compute()}; }).at(0);
}

bool recomputing() { return tl_recomputing > 0; }

bool counts_training_statistics() {
  return tl_first_forward > 0 || (at::GradMode::is_enabled() && tl_recomputing == 0);
}

std::vector<at::Tensor> recompute(const CheckpointBody& body,
                                   const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& params,
                                   bool keep_op_outputs) {
  std::vector<at::Tensor> diff_params;
  for (const auto& p : params) {
    if (p.requires_grad()) diff_params.push_back(p);
  }
  bool needs_graph = at::GradMode::is_enabled() && !diff_params.empty();
  for (const auto& t : inputs) {
    needs_graph = needs_graph || (at::GradMode::is_enabled() && t.defined() && t.requires_grad());
  }
  if (!needs_graph) return body(inputs);

  std::vector<at::Tensor> outs;
  auto saved_ops = keep_op_outputs ? std::make_shared<SavedOps>() : nullptr;
  {
    at::NoGradGuard no_grad;
    FlagScope first(tl_first_forward);
    SavedOpsScope record(saved_ops.get(), /*replay=*/false);
    outs = body(inputs);
  }
  std::shared_ptr<CheckpointBackward> node(
      new CheckpointBackward(body, inputs, diff_params, std::move(saved_ops)),
      torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs, diff_params));
  for (auto& o : outs) {
    VIADUCT_CHECK(o.defined() && o.is_floating_point(),
                  "activation checkpointing: a checkpointed layer returned a tensor that is "
                  "undefined or not floating point");
    if (o.is_view()) o = o.clone();  // an own tensor to hang the node on
    torch::autograd::set_history(o, node);
  }
  return outs;
}

}  // namespace viaduct::ops
