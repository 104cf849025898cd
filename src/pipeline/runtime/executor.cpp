#include "pipeline/runtime/executor.h"

#include <cstdio>
#include <cstdlib>

#include "core/check.h"
#include "core/device.h"

namespace viaduct::pipeline {
namespace {
// VIADUCT_TRACE_P2P=1: every action and metadata hop is printed to stderr
// before it runs, to find where a rank waits (a hang across GPUs).
bool trace_p2p() {
  static const bool on = [] {
    const char* e = std::getenv("VIADUCT_TRACE_P2P");
    return e != nullptr && *e != '\0' && std::string(e) != "0";
  }();
  return on;
}
void trace(const std::string& what) {
  if (!trace_p2p()) return;
  std::fprintf(stderr, "trace: %s\n", what.c_str());
  std::fflush(stderr);
}
constexpr int kForwardDir = 0;
constexpr int kBackwardDir = 1;
constexpr size_t kMaxTensorsPerHop = 64;
// Metadata headers use their own tag range above every data tag.
constexpr int kHeaderTagBase = 1 << 29;

int64_t bytes_of(const Activations& ts) {
  int64_t n = 0;
  for (const auto& t : ts) {
    if (t.defined()) n += t.numel() * static_cast<int64_t>(t.element_size());
  }
  return n;
}
}  // namespace

PipelineExecutor::PipelineExecutor(const PipelinePlan& plan, int pp_rank,
                                   std::vector<std::unique_ptr<PipelineStage>> stages,
                                   distributed::ProcessGroup* pp_group, at::Device device)
    : plan_(plan),
      pp_rank_(pp_rank),
      stages_(std::move(stages)),
      pp_group_(pp_group),
      device_(device) {
  for (auto& s : stages_) by_id_[s->stage_id()] = s.get();
  const auto& mine = plan_.split.rank_to_stages.at(pp_rank_);
  VIADUCT_ASSERT(mine.size() == stages_.size(), "rank ", pp_rank_, " holds ",
                 mine.size(), " stages in the plan, ", stages_.size(), " given");
  for (int64_t s : mine) {
    VIADUCT_ASSERT(by_id_.count(s), "stage ", s, " missing on rank ", pp_rank_);
  }
  VIADUCT_CHECK(plan_.split.pp == 1 || pp_group_ != nullptr,
                "pipeline_parallel_degree ", plan_.split.pp,
                " needs a process group");
  int64_t m = 0;
  for (const auto& rank_actions : plan_.compute.ranks) {
    for (const auto& a : rank_actions) {
      for (const auto& leaf : leaf_actions(a)) m = std::max(m, leaf.microbatch + 1);
    }
  }
  num_microbatches_ = m;
  // See Note [Deferred gradient accumulation]: a stage whose weight gradients
  // the schedule produces out of micro-batch order accumulates them apart.
  std::map<int64_t, int64_t> last_mb;
  for (const auto& a : plan_.compute.ranks.at(pp_rank_)) {
    for (const auto& leaf : leaf_actions(a)) {
      if (leaf.kind != ActionKind::kBackward && leaf.kind != ActionKind::kBackwardWeight) continue;
      auto it = last_mb.find(leaf.stage);
      if (it != last_mb.end() && leaf.microbatch < it->second) {
        by_id_.at(leaf.stage)->set_deferred_grads(true);
      }
      last_mb[leaf.stage] = leaf.microbatch;
    }
  }
  // See Note [Overlapped data-parallel reduction]: the action after which each
  // stage of this rank has run all of its step's backwards (B, or W under
  // the split backward) -- its gradients are final there.
  const auto& lowered = plan_.lowered.ranks.at(pp_rank_);
  ready_after_.assign(lowered.size(), {});
  std::map<int64_t, int64_t> backwards;
  for (size_t i = 0; i < lowered.size(); ++i) {
    for (const auto& leaf : leaf_actions(lowered[i])) {
      if (leaf.kind != ActionKind::kBackward && leaf.kind != ActionKind::kBackwardWeight) continue;
      if (++backwards[leaf.stage] == num_microbatches_) ready_after_[i].push_back(leaf.stage);
    }
  }
}

PipelineStage& PipelineExecutor::stage(int64_t id) {
  auto it = by_id_.find(id);
  VIADUCT_CHECK(it != by_id_.end(), "rank ", pp_rank_,
                " was asked to run stage ", id, ", which it does not hold");
  return *it->second;
}

bool PipelineExecutor::local(int64_t stage_id) const {
  return by_id_.count(stage_id) != 0;
}

int PipelineExecutor::rank_of(int64_t stage_id) const {
  return static_cast<int>(plan_.split.stage_to_rank.at(stage_id));
}

bool PipelineExecutor::holds_last_stage() const {
  return local(plan_.split.num_stages - 1);
}
bool PipelineExecutor::holds_first_stage() const { return local(0); }

std::string PipelineExecutor::context(const Action& a) const {
  return str("pp rank ", pp_rank_, " stage ", a.stage, " micro-batch ",
             a.microbatch, " action ", to_string(a));
}

int PipelineExecutor::tag(int64_t stage, int64_t mb, int direction,
                          size_t index) const {
  const int64_t t = ((stage * num_microbatches_ + mb) * 2 + direction) *
                        static_cast<int64_t>(kMaxTensorsPerHop) +
                    static_cast<int64_t>(index);
  VIADUCT_CHECK(t < kHeaderTagBase, "too many stages x micro-batches for the "
                "P2P tag space (stage ", stage, ", micro-batch ", mb, ")");
  return static_cast<int>(t);
}

void PipelineExecutor::send(const Activations& tensors, int dst_rank,
                            int64_t stage, int64_t mb, int direction,
                            const Action& a) {
  VIADUCT_CHECK(tensors.size() <= kMaxTensorsPerHop, context(a), ": ",
                tensors.size(), " tensors in one hop (at most ",
                kMaxTensorsPerHop, ")");
  Pending p;
  for (size_t i = 0; i < tensors.size(); ++i) {
    // An undefined gradient (an input that needs none) travels as zeros so
    // both sides keep the same message count.
    auto t = tensors[i];
    VIADUCT_CHECK(t.defined(), context(a), ": tensor ", i, " is undefined");
    t = t.contiguous();
    std::vector<at::Tensor> one{t};
    p.works.push_back(pp_group_->send(one, dst_rank, tag(stage, mb, direction, i)));
    p.tensors.push_back(t);
  }
  p2p_bytes_ += bytes_of(p.tensors);
  if (direction == kForwardDir) {
    hop_bytes_[stage - 1] += bytes_of(p.tensors);
  } else {
    hop_grad_bytes_[stage] += bytes_of(p.tensors);  // the hop stage -> stage + 1
  }
  sends_.push_back(std::move(p));
}

void PipelineExecutor::post_recv(std::map<Key, Pending>& into, const Key& key,
                                 const std::vector<TensorMeta>& metas,
                                 int src_rank, int direction, const Action& a) {
  VIADUCT_CHECK(!into.count(key), context(a), ": receive posted twice");
  Pending p;
  for (size_t i = 0; i < metas.size(); ++i) {
    auto buf = at::empty(metas[i].shape,
                         at::TensorOptions().dtype(metas[i].dtype).device(device_));
    std::vector<at::Tensor> one{buf};
    p.works.push_back(pp_group_->recv(one, src_rank,
                                      tag(key.first, key.second, direction, i)));
    p.tensors.push_back(buf);
  }
  into.emplace(key, std::move(p));
}

Activations PipelineExecutor::take_recv(std::map<Key, Pending>& from,
                                        const Key& key, const Action& a) {
  auto it = from.find(key);
  VIADUCT_CHECK(it != from.end(), context(a),
                ": its input was neither received nor produced locally (the "
                "schedule has no matching RECV)");
  time_begin(kWaitSlot);
  for (auto& w : it->second.works) w.wait(context(a));
  time_end(kWaitSlot);
  auto out = std::move(it->second.tensors);
  from.erase(it);
  p2p_bytes_ += bytes_of(out);
  return out;
}

void PipelineExecutor::run_action(const Action& a) {
  trace(context(a));
  const int64_t s = a.stage, mb = a.microbatch;
  const Key key{s, mb};
  switch (a.kind) {
    case ActionKind::kOverlapFB:
      for (const auto& sub : a.sub_actions) run_action(sub);
      return;
    case ActionKind::kReduceGrad:
      return;  // data-parallel sync happens after the step (train/)
    case ActionKind::kRecvF:
      post_recv(recv_f_, key, meta_.at(s - 1), rank_of(s - 1), kForwardDir, a);
      return;
    case ActionKind::kRecvB:
      post_recv(recv_b_, key, grad_meta_.at(s), rank_of(s + 1), kBackwardDir, a);
      return;
    case ActionKind::kSendF: {
      auto it = fwd_out_.find(key);
      VIADUCT_CHECK(it != fwd_out_.end(), context(a), ": nothing to send (no F ran)");
      send(it->second, rank_of(s + 1), s + 1, mb, kForwardDir, a);
      fwd_out_.erase(it);
      return;
    }
    case ActionKind::kSendB: {
      auto it = bwd_out_.find(key);
      VIADUCT_CHECK(it != bwd_out_.end(), context(a), ": nothing to send (no B/I ran)");
      send(it->second, rank_of(s - 1), s - 1, mb, kBackwardDir, a);
      bwd_out_.erase(it);
      return;
    }
    case ActionKind::kForward: {
      auto& st = stage(s);
      Activations in;
      if (st.is_first()) {
        in = first_inputs(*inputs_, images_, static_cast<size_t>(mb));
      } else if (local(s - 1)) {
        auto it = fwd_out_.find({s - 1, mb});
        VIADUCT_CHECK(it != fwd_out_.end(), context(a),
                      ": stage ", s - 1, " has not run F for this micro-batch");
        in = std::move(it->second);
        fwd_out_.erase(it);
      } else {
        in = take_recv(recv_f_, key, a);
      }
      at::Tensor tgt;
      if (st.is_last()) tgt = to_device_async(targets_->at(mb), device_);
      set_documents(st, documents_, mb);
      time_begin(kComputeSlot);
      auto out = st.forward(mb, in, tgt, loss_scale_);
      time_end(kComputeSlot);
      if (!st.is_last()) fwd_out_[key] = std::move(out);
      return;
    }
    case ActionKind::kBackward:
    case ActionKind::kBackwardInput: {
      auto& st = stage(s);
      Activations grads;
      if (!st.is_last()) {
        if (local(s + 1)) {
          auto it = bwd_out_.find({s + 1, mb});
          VIADUCT_CHECK(it != bwd_out_.end(), context(a), ": stage ", s + 1,
                        " has not run B for this micro-batch");
          grads = std::move(it->second);
          bwd_out_.erase(it);
        } else {
          grads = take_recv(recv_b_, key, a);
        }
      }
      time_begin(kComputeSlot);
      auto gin = a.kind == ActionKind::kBackward ? st.backward(mb, grads)
                                                 : st.backward_input(mb, grads);
      time_end(kComputeSlot);
      if (!st.is_first()) {
        // Inputs that need no gradient still travel, as zeros.
        const auto& metas = grad_meta_.at(s - 1);
        VIADUCT_CHECK(gin.size() == metas.size(), context(a), ": the backward returned ",
                      gin.size(), " input gradients, the hop carries ", metas.size());
        for (size_t i = 0; i < gin.size(); ++i) {
          if (!gin[i].defined()) {
            gin[i] = at::zeros(metas.at(i).shape,
                               at::TensorOptions().dtype(metas[i].dtype).device(device_));
          }
        }
        bwd_out_[key] = std::move(gin);
      }
      return;
    }
    case ActionKind::kBackwardWeight: {
      auto& st = stage(s);
      time_begin(kComputeSlot);
      st.backward_weight(mb);
      time_end(kComputeSlot);
      return;
    }
  }
}

void PipelineExecutor::finish_step(const char* what) {
  time_begin(kWaitSlot);
  for (auto& p : sends_) {
    for (auto& w : p.works) w.wait(str("pp rank ", pp_rank_, " ", what));
  }
  time_end(kWaitSlot);
  sends_.clear();
  VIADUCT_CHECK(recv_f_.empty() && recv_b_.empty(), "pp rank ", pp_rank_, " ",
                what, ": ", recv_f_.size() + recv_b_.size(),
                " receives were posted but never used");
  VIADUCT_CHECK(fwd_out_.empty() && bwd_out_.empty(), "pp rank ", pp_rank_, " ",
                what, ": ", fwd_out_.size() + bwd_out_.size(),
                " outputs were produced but never consumed");
  for (auto& st : stages_) {
    VIADUCT_CHECK(st->live_microbatches() == 0, "pp rank ", pp_rank_, " ", what,
                  ": stage ", st->stage_id(), " still holds ",
                  st->live_microbatches(), " micro-batches (a missing B or W)");
    st->check_step_end(str("pp rank ", pp_rank_, " ", what));
  }
}

void PipelineExecutor::set_documents(PipelineStage& st,
                                     const std::vector<ops::DocumentsPtr>* documents,
                                     int64_t mb) const {
  st.part().set_documents(documents != nullptr && !documents->empty()
                              ? documents->at(static_cast<size_t>(mb))
                              : nullptr);
}

Activations PipelineExecutor::first_inputs(const std::vector<at::Tensor>& inputs,
                                           const std::vector<at::Tensor>* images,
                                           size_t mb) const {
  Activations in{to_device_async(inputs.at(mb), device_)};
  if (images && !images->empty()) in.push_back(to_device_async(images->at(mb), device_));
  return in;
}

std::vector<at::Tensor> PipelineExecutor::run_step(const std::vector<at::Tensor>& inputs,
                                                   const std::vector<at::Tensor>& targets,
                                                   double loss_scale,
                                                   const std::vector<at::Tensor>& images,
                                                   const std::vector<ops::DocumentsPtr>& documents) {
  VIADUCT_CHECK(have_meta_, "run_step before infer_metadata");
  VIADUCT_CHECK(static_cast<int64_t>(inputs.size()) == num_microbatches_ &&
                    static_cast<int64_t>(targets.size()) == num_microbatches_ &&
                    (images.empty() || static_cast<int64_t>(images.size()) == num_microbatches_),
                "the schedule has ", num_microbatches_, " micro-batches, the batch ",
                inputs.size());
  VIADUCT_CHECK(documents.empty() || documents.size() == inputs.size(), "the step has ",
                inputs.size(), " micro-batches but documents for ", documents.size());
  inputs_ = &inputs;
  targets_ = &targets;
  images_ = &images;
  documents_ = &documents;
  loss_scale_ = loss_scale;
  p2p_bytes_ = 0;
  hop_bytes_.clear();
  hop_grad_bytes_.clear();
  for (auto& st : stages_) st->clear();
  timing_now_ = timer_ != nullptr;
  try {
    time_begin(kSpanSlot);
    const auto& actions = plan_.lowered.ranks.at(pp_rank_);
    for (size_t i = 0; i < actions.size(); ++i) {
      run_action(actions[i]);
      for (int64_t s : ready_after_[i]) {
        auto& st = stage(s);
        // The rank's own work, not waiting: timed as compute so that the
        // bubble still measures the time spent waiting for peers.
        time_begin(kComputeSlot);
        if (st.deferred_grads()) st.flush_deferred_grads();
        if (grads_ready_) grads_ready_(s);
        time_end(kComputeSlot);
      }
    }
    finish_step("step end");
    time_end(kSpanSlot);
    timing_now_ = false;
  } catch (...) {
    inputs_ = targets_ = images_ = nullptr;
    documents_ = nullptr;
    timing_now_ = false;
    if (timer_) timer_->reset();
    throw;
  }
  std::vector<at::Tensor> losses;
  if (holds_last_stage()) {
    auto& last = stage(plan_.split.num_stages - 1);
    for (int64_t mb = 0; mb < num_microbatches_; ++mb) losses.push_back(last.loss_sum(mb));
  }
  inputs_ = targets_ = images_ = nullptr;
  documents_ = nullptr;
  return losses;
}

void PipelineExecutor::set_timing(bool on) {
  if (!on) {
    timer_.reset();
  } else if (!timer_) {
    timer_ = std::make_unique<DeviceTimer>(device_, kNumSlots);
  }
}

PipelineTimes PipelineExecutor::take_times() {
  if (!timer_) return {};
  const auto s = timer_->take_seconds();
  return {s[kSpanSlot], s[kComputeSlot], s[kWaitSlot]};
}

// Forward only, micro-batch by micro-batch, each rank's stages in ascending
// order: every dependency points to a lower stage of the same micro-batch,
// so the blocking receives cannot deadlock.
double PipelineExecutor::run_eval(const std::vector<at::Tensor>& inputs,
                                  const std::vector<at::Tensor>& targets,
                                  const std::vector<at::Tensor>& images,
                                  const std::vector<ops::DocumentsPtr>& documents) {
  double loss = 0.0;
  const auto& mine = plan_.split.rank_to_stages.at(pp_rank_);
  for (size_t mb = 0; mb < inputs.size(); ++mb) {
    Activations carry;
    for (int64_t s : mine) {
      auto& st = stage(s);
      const Action a = make_action(s, ActionKind::kForward, static_cast<int64_t>(mb));
      Activations in;
      if (st.is_first()) {
        in = first_inputs(inputs, &images, mb);
      } else if (local(s - 1)) {
        in = std::move(carry);
      } else {
        std::map<Key, Pending> tmp;
        post_recv(tmp, {s, 0}, meta_.at(s - 1), rank_of(s - 1), kForwardDir, a);
        in = take_recv(tmp, {s, 0}, a);
      }
      set_documents(st, &documents, static_cast<int64_t>(mb));
      auto out = st.forward_no_grad(
          in, st.is_last() ? to_device_async(targets[mb], device_) : at::Tensor());
      if (st.is_last()) {
        if (targets[mb].defined()) loss += out.at(0).item<double>();
      } else if (local(s + 1)) {
        carry = std::move(out);
      } else {
        send(out, rank_of(s + 1), s + 1, 0, kForwardDir, a);
      }
    }
  }
  finish_step("eval");
  return loss;
}

void PipelineExecutor::infer_metadata(const at::Tensor& tokens) {
  // The dry run sends a small header before each hop: count, then per tensor
  // (dtype, ndim, dims...).
  const auto& mine = plan_.split.rank_to_stages.at(pp_rank_);
  Activations carry;
  for (int64_t s : mine) {
    auto& st = stage(s);
    const Action a = make_action(s, ActionKind::kForward, 0);
    Activations in;
    if (st.is_first()) {
      in = {tokens.to(device_)};
    } else if (local(s - 1)) {
      in = std::move(carry);
    } else {
      // Header first, then the tensors themselves.
      auto len = at::empty({1}, at::TensorOptions().dtype(at::kLong).device(device_));
      std::vector<at::Tensor> one{len};
      const int base = kHeaderTagBase + static_cast<int>(2 * s);
      trace(context(a) + " (metadata receive)");
      pp_group_->recv(one, rank_of(s - 1), base).wait(context(a) + " (metadata)");
      auto header = at::empty({len.item<int64_t>()}, len.options());
      std::vector<at::Tensor> h{header};
      pp_group_->recv(h, rank_of(s - 1), base + 1).wait(context(a) + " (metadata)");
      auto hv = header.cpu();
      const int64_t* v = hv.data_ptr<int64_t>();
      std::vector<TensorMeta> metas(static_cast<size_t>(v[0]));
      int64_t k = 1;
      for (auto& m : metas) {
        m.dtype = static_cast<at::ScalarType>(v[k++]);
        const int64_t nd = v[k++];
        for (int64_t d = 0; d < nd; ++d) m.shape.push_back(v[k++]);
      }
      meta_[s - 1] = metas;
      grad_meta_[s - 1] = st.hop_grad_metas(s - 1, metas);
      std::map<Key, Pending> tmp;
      post_recv(tmp, {s, 0}, metas, rank_of(s - 1), kForwardDir, a);
      in = take_recv(tmp, {s, 0}, a);
    }
    set_documents(st, nullptr, 0);  // the shapes are the same with documents
    if (st.is_last()) {
      st.forward_no_grad(in);
      continue;
    }
    auto out = st.forward_no_grad(in);
    std::vector<TensorMeta> metas;
    std::vector<int64_t> header{static_cast<int64_t>(out.size())};
    for (const auto& t : out) {
      metas.push_back({t.sizes().vec(), t.scalar_type()});
      header.push_back(static_cast<int64_t>(t.scalar_type()));
      header.push_back(t.dim());
      for (auto d : t.sizes()) header.push_back(d);
    }
    meta_[s] = metas;
    grad_meta_[s] = st.hop_grad_metas(s, metas);
    if (local(s + 1)) {
      carry = std::move(out);
    } else {
      auto len = at::tensor({static_cast<int64_t>(header.size())}, at::kLong).to(device_);
      auto htensor = at::tensor(header, at::kLong).to(device_);
      const int base = kHeaderTagBase + static_cast<int>(2 * (s + 1));
      std::vector<at::Tensor> l{len}, h{htensor};
      trace(context(a) + " (metadata send)");
      pp_group_->send(l, rank_of(s + 1), base).wait(context(a) + " (metadata)");
      pp_group_->send(h, rank_of(s + 1), base + 1).wait(context(a) + " (metadata)");
      send(out, rank_of(s + 1), s + 1, 0, kForwardDir, a);
    }
  }
  trace(str("pp rank ", pp_rank_, ": metadata sent and received"));
  finish_step("metadata inference");
  have_meta_ = true;
}

}  // namespace viaduct::pipeline
