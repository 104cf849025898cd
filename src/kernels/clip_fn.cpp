// The clip coefficient formed on the device (CUDA build).
#include "kernels/fused.h"

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <mutex>
#include <unordered_map>
#include <utility>

#include "kernels/fn_common.h"
#include "kernels/clip.h"

namespace viaduct::kernels {

// Note [The clip's norms during the backward]
// The clip's norm reads every fp32 gradient once after the backward, at the
// memory's pace, while the device has nothing else queued. A parameter's
// gradient is final once its accumulator (AccumulateGrad) has run in the step's
// last backward, most of them long before the backward ends (the head's first,
// the embedding's last). So a post hook on each accumulator, armed for that
// backward only, takes the gradient, and every ~64 MiB of taken gradients go to
// a second stream (one `_foreach_norm`, after an event on the backward's
// stream): the norms' reads overlap the rest of the backward. clip_on_device
// then makes its stream wait for the second one and stacks the norms in the
// gradients' order, forming here those no hook took (an accumulator that did
// not run, a gradient replaced since). Each norm is `_foreach_norm`'s over a
// group's list, not the whole one: ATen sums a tensor's fixed-size chunks and
// then those sums in one block, the list's shorter tensors padded with zeros,
// which add exactly, so a tensor's norm does not depend on the list it is in
// and the update keeps the bits of the norms formed after the backward (test
// FusedKernels.BackwardNormsHaveTheClipsBits). An accumulator that runs again
// in the same backward takes its gradient again; the last take wins (a norm
// queued before it, whose read raced that accumulation, is dropped).
// clip_on_device queues the last group before it waits. Under the step graph's
// capture the events fork the second stream into the capture and
// clip_on_device's wait joins it back, and the second stream's allocations come
// from the graph's pool as the capture's own do. The hooks go on when armed,
// on the accumulators alive then (the forward's, or new ones), which are held
// only until the clip collects: an accumulator remembers the stream it was
// made on, and one kept alive into the next step (made on the default stream,
// say) would make the engine tie that stream to the step graph's capture,
// which CUDA refuses. An accumulator that lives on keeps its one hook. The
// hooks hold the norms' state weakly.
class BackwardNorms : public std::enable_shared_from_this<BackwardNorms> {
 public:
  // The gradient is held only so that its TensorImpl, the map's key, stays
  // its own until the clip looks it up.
  struct Taken {
    at::Tensor grad, norm;
  };

  BackwardNorms(std::vector<at::Tensor> params, c10::DeviceIndex device)
      : params_(std::move(params)),
        device_(device),
        side_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device)) {}

  // Creates every event now, outside any capture.
  void init();
  // With the step's stream current, after its last forward: hooks each
  // parameter's accumulator (see the Note) and starts taking.
  void arm();
  size_t taken() const {
    std::lock_guard<std::mutex> lock(mu_);
    return taken_.size() + pending_.size();
  }
  // On the accumulator's thread, with the backward's stream current.
  void take(size_t slot);
  // Queues the pending gradients' norms and joins the second stream into
  // the current one; disarms and hands over what was taken.
  std::unordered_map<const c10::TensorImpl*, Taken> collect();

 private:
  // The pending gradients' norms on the second stream, after the work the
  // current stream has queued. Under mu_.
  void flush();

  std::vector<at::Tensor> params_;
  c10::DeviceIndex device_;
  c10::cuda::CUDAStream side_;
  // The fork's event, recorded again for each flush (a wait takes the
  // record before it), and the join's.
  at::cuda::CUDAEvent fork_;
  at::cuda::CUDAEvent done_;
  // The accumulators armed for this backward, held until collect(); and each
  // parameter's last hooked one, so that one that lives on is hooked once.
  std::vector<std::shared_ptr<torch::autograd::Node>> held_;
  std::vector<std::weak_ptr<torch::autograd::Node>> hooked_;
  mutable std::mutex mu_;
  bool armed_ = false;
  bool forked_ = false;  // the second stream has work the current one has not waited for
  // Gradients waiting for a flush, by tensor (a second take of one replaces
  // the first); their bytes.
  std::unordered_map<const c10::TensorImpl*, at::Tensor> pending_;
  int64_t pending_bytes_ = 0;
  std::unordered_map<const c10::TensorImpl*, Taken> taken_;
};

namespace {

struct NormWhenFinal : torch::autograd::FunctionPostHook {
  NormWhenFinal(std::weak_ptr<BackwardNorms> owner, size_t slot)
      : owner_(std::move(owner)), slot_(slot) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto o = owner_.lock()) o->take(slot_);
    return outputs;
  }
  std::weak_ptr<BackwardNorms> owner_;
  size_t slot_;
};

}  // namespace

void BackwardNorms::init() {
  fork_.record(side_);
  done_.record(side_);
  side_.synchronize();
  hooked_.resize(params_.size());
}

void BackwardNorms::arm() {
  std::lock_guard<std::mutex> lock(mu_);
  held_.clear();
  const std::weak_ptr<BackwardNorms> self = weak_from_this();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    VIADUCT_CHECK(acc != nullptr, "backward_norms: parameter ", i, " has no gradient accumulator");
    if (hooked_[i].lock() != acc) {
      acc->add_post_hook(std::make_unique<NormWhenFinal>(self, i));
      hooked_[i] = acc;
    }
    held_.push_back(std::move(acc));
  }
  armed_ = true;
  taken_.clear();
  pending_.clear();
  pending_bytes_ = 0;
}

// The gradients' norms go to the second stream in groups of about this many
// bytes: one `_foreach_norm` a group (a few launches) rather than one a
// parameter, most of them small, and each group soon after its gradients.
constexpr int64_t kNormGroupBytes = int64_t{64} << 20;

void BackwardNorms::take(size_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!armed_) return;
  const at::Tensor g = params_[slot].grad();
  if (!g.defined() || !g.is_cuda() || g.scalar_type() != at::kFloat) return;
  auto& held = pending_[g.unsafeGetTensorImpl()];
  if (!held.defined()) pending_bytes_ += static_cast<int64_t>(g.nbytes());
  held = g;
  if (pending_bytes_ >= kNormGroupBytes) flush();
}

void BackwardNorms::flush() {
  if (pending_.empty()) return;
  fork_.record(c10::cuda::getCurrentCUDAStream(device_));
  fork_.block(side_);
  std::vector<at::Tensor> grads;
  for (const auto& [impl, g] : pending_) grads.push_back(g);
  std::vector<at::Tensor> norms;
  {
    const c10::cuda::CUDAStreamGuard on_side(side_);
    norms = at::_foreach_norm(grads, 2);
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    taken_[grads[i].unsafeGetTensorImpl()] = {grads[i], norms[i]};
  }
  pending_.clear();
  pending_bytes_ = 0;
  forked_ = true;
}

std::unordered_map<const c10::TensorImpl*, BackwardNorms::Taken> BackwardNorms::collect() {
  std::lock_guard<std::mutex> lock(mu_);
  if (armed_) flush();
  armed_ = false;
  held_.clear();
  if (forked_) {
    done_.record(side_);
    done_.block(c10::cuda::getCurrentCUDAStream(device_));
    forked_ = false;
  }
  return std::exchange(taken_, {});
}

std::shared_ptr<BackwardNorms> backward_norms(const std::vector<at::Tensor>& params) {
  if (params.empty()) return nullptr;
  const auto dev = params.front().device();
  for (const auto& p : params) {
    if (!p.defined() || !p.is_cuda() || p.device() != dev || p.scalar_type() != at::kFloat ||
        !p.requires_grad() || !p.is_leaf()) {
      return nullptr;
    }
  }
  auto norms = std::make_shared<BackwardNorms>(params, dev.index());
  norms->init();
  return norms;
}

void arm_backward_norms(BackwardNorms& norms) { norms.arm(); }

size_t backward_norms_taken(const BackwardNorms& norms) { return norms.taken(); }

bool clip_on_device_takes(const std::vector<at::Tensor>& grads) {
  if (grads.empty() || !usable(grads.front())) return false;
  for (const auto& g : grads) {
    if (!g.defined() || g.device() != grads.front().device() || g.scalar_type() != at::kFloat)
      return false;
  }
  return true;
}

DeviceClip clip_on_device(const std::vector<at::Tensor>& grads, double max_norm,
                          const std::vector<at::Tensor>& also, BackwardNorms* during) {
  VIADUCT_CHECK(clip_on_device_takes(grads),
                "clip_on_device: the gradients must be fp32 on one CUDA device");
  const auto opts = grads.front().options();
  for (const auto& t : also) {
    VIADUCT_CHECK(t.defined() && t.numel() == 1 && t.device() == opts.device(),
                  "clip_on_device: each value to fetch must be one element on the gradients' "
                  "device");
  }
  // The norms as grad_squared_norms (train/optimizer.cpp) forms them, or as
  // the backward took them: See Note [The clip's norms during the backward].
  at::Tensor norms;
  if (during != nullptr) {
    auto taken = during->collect();
    std::vector<at::Tensor> each(grads.size()), rest;
    std::vector<size_t> rest_at;
    for (size_t i = 0; i < grads.size(); ++i) {
      const auto it = taken.find(grads[i].unsafeGetTensorImpl());
      if (it != taken.end()) {
        each[i] = it->second.norm;
      } else {
        rest.push_back(grads[i]);
        rest_at.push_back(i);
      }
    }
    if (!rest.empty()) {
      const auto formed = at::_foreach_norm(rest, 2);
      for (size_t k = 0; k < rest.size(); ++k) each[rest_at[k]] = formed[k];
    }
    norms = at::stack(each).contiguous();
  } else {
    norms = at::stack(at::_foreach_norm(grads, 2)).contiguous();
  }
  const auto n = static_cast<int64_t>(also.size());
  auto vals = at::empty({1 + n}, opts.dtype(at::kDouble));  // [norm, also...]
  auto scale = at::empty({1}, opts.dtype(at::kFloat));
  const auto stream = c10::cuda::getCurrentCUDAStream(opts.device().index());
  check_launch(cuda::clip_scale(norms.data_ptr<float>(), norms.numel(), max_norm,
                                vals.data_ptr<double>(), scale.data_ptr<float>(), stream.stream()),
               "clip_scale");
  if (n > 0) {
    std::vector<at::Tensor> flat;
    for (const auto& t : also) flat.push_back(t.reshape({1}));
    vals.narrow(0, 1, n).copy_(at::cat(flat));
  }
  return {scale, vals};
}

std::function<std::vector<double>()> fetch_clip_values(const DeviceClip& clip) {
  const auto& vals = clip.values;
  VIADUCT_CHECK(vals.defined() && vals.is_cuda() && vals.scalar_type() == at::kDouble,
                "fetch_clip_values: the values of clip_on_device");
  const auto stream = c10::cuda::getCurrentCUDAStream(vals.device().index());
  auto host = at::empty(vals.sizes(), at::TensorOptions().dtype(at::kDouble).pinned_memory(true));
  host.copy_(vals, /*non_blocking=*/true);
  auto ready = std::make_shared<at::cuda::CUDAEvent>();
  ready->record(stream);
  return [host, ready, vals] {
    ready->synchronize();
    const double* v = host.data_ptr<double>();
    return std::vector<double>(v, v + host.numel());
  };
}

}  // namespace viaduct::kernels
