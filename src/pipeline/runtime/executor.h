// The executor of one rank's lowered action list (pipeline/schedule): runs
// F/B/I/W on its stages, posts receives, sends activations and gradients to
// the neighbouring stages' ranks over the pp group, and hands tensors over
// locally when adjacent stages share the rank.
//
// Note [Boundary metadata]
// Before the first step the executor runs one forward-only micro-batch
// through the pipeline (infer_metadata) and records, per stage boundary, the
// shapes and dtypes of the tensors that cross it. Receive buffers are then
// allocated dense and contiguous from that record; every micro-batch of a job
// has the same shapes. The gradients that travel back over a hop are sized by
// the stages' hop_grad_metas (by default like the forward tensors).
//
// Note [Measured bubble]
// With timing on (set_timing), run_step measures three sums per rank: the
// span of its schedule (`seconds`: from the first action until the last
// send has been waited for), the time in its stages' F, B, I and W calls
// (`compute_seconds`), and the time spent waiting for P2P receives and, at
// the end, sends (`p2p_wait_seconds`). On CPU these are host times; on CUDA
// device times between timing events on the compute stream (a wait is the
// time the stream stalls for NCCL; a gap inside one action, where the host
// launches slower than the device runs, counts as compute), read once per
// step (core/device_timer.h).
// The rank's measured bubble is 1 - compute_seconds / seconds, idle time in
// its span as the simulator counts it; the simulator's bubble_fraction,
// 1 - sum(busy) / (pp * makespan), compares with the mean over the pp ranks.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/device_timer.h"
#include "distributed/distributed.h"
#include "pipeline/runtime/stage.h"
#include "pipeline/schedule/plan.h"

namespace viaduct::pipeline {

// One rank's pipeline times over the run_steps since the last take
// (see Note [Measured bubble]).
struct PipelineTimes {
  double seconds = 0;           // the schedule's span
  double compute_seconds = 0;   // F, B, I, W of this rank's stages
  double p2p_wait_seconds = 0;  // waiting for receives and sends

  double bubble() const { return seconds > 0 ? 1.0 - compute_seconds / seconds : 0.0; }
};

class PipelineExecutor {
 public:
  // `stages`: this rank's stages (ids as the plan's rank_to_stages[pp_rank]).
  // `pp_group` may be null when pp == 1 (everything is local).
  PipelineExecutor(const PipelinePlan& plan, int pp_rank,
                   std::vector<std::unique_ptr<PipelineStage>> stages,
                   distributed::ProcessGroup* pp_group, at::Device device);

  // Learn the boundary shapes from one forward-only micro-batch of `tokens`
  // ([B/M, T]). Every rank calls it once, before the first step.
  void infer_metadata(const at::Tensor& tokens);

  // One step over the micro-batches: inputs/targets [B/M, T] each (only the
  // first stage reads inputs, only the last targets); `images`, empty or
  // one per micro-batch, go to the first stage after its tokens (a vision
  // tower's images, see Note [Kimi-K3 part activations]). Returns, on the
  // rank holding the last stage, each micro-batch's summed token
  // cross-entropy as a detached scalar on the device, in micro-batch order
  // (empty elsewhere): the caller reads them after the update is queued
  // (see Note [No sync between forward and backward], train/trainer.cpp).
  // `documents`: each micro-batch's documents (see Note [Document
  // boundaries], ops/documents.h), which every stage's part gets before its
  // forward; empty: none.
  std::vector<at::Tensor> run_step(const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& targets, double loss_scale,
                                   const std::vector<at::Tensor>& images = {},
                                   const std::vector<ops::DocumentsPtr>& documents = {});
  // Forward only, no autograd state: the summed loss of every micro-batch
  // (added in micro-batch order) on the rank holding the last stage, 0
  // elsewhere.
  double run_eval(const std::vector<at::Tensor>& inputs,
                  const std::vector<at::Tensor>& targets,
                  const std::vector<at::Tensor>& images = {},
                  const std::vector<ops::DocumentsPtr>& documents = {});

  const std::vector<std::unique_ptr<PipelineStage>>& stages() const {
    return stages_;
  }
  // Micro-batches per step: one more than the largest index the schedule uses.
  int64_t num_microbatches() const { return num_microbatches_; }
  bool holds_last_stage() const;
  bool holds_first_stage() const;
  // Bytes sent over P2P in the last step (activations + gradients).
  int64_t last_step_p2p_bytes() const { return p2p_bytes_; }
  // Bytes this rank sent over each hop s -> s + 1 in the last step (all
  // micro-batches), keyed by s: forward (activations) and backward
  // (gradients, as many unless a stage's hop_grad_metas says otherwise).
  const std::map<int64_t, int64_t>& last_step_hop_bytes() const { return hop_bytes_; }
  const std::map<int64_t, int64_t>& last_step_hop_grad_bytes() const {
    return hop_grad_bytes_;
  }
  // See Note [Measured bubble]. Off by default; the trainer turns it on.
  void set_timing(bool on);
  // See Note [Overlapped data-parallel reduction] (train/reduce.h): `fn(stage)`
  // runs inside run_step as soon as every backward of that stage has run
  // (after the action holding its last B or W): its parameters' gradients
  // are final from there on, while the schedule goes on.
  void set_grads_ready(std::function<void(int64_t stage)> fn) { grads_ready_ = std::move(fn); }
  bool timing() const { return timer_ != nullptr; }
  // The times of the run_steps since the previous take (sums over gradient
  // accumulation), then starts new sums; take once per optimizer step (on
  // CUDA the events of untaken steps pile up). Waits for the device only
  // until the last timed work has finished.
  PipelineTimes take_times();

 private:
  using Key = std::pair<int64_t, int64_t>;  // (stage, micro-batch)
  struct Pending {
    Activations tensors;
    std::vector<distributed::Work> works;
  };

  PipelineStage& stage(int64_t id);
  bool local(int64_t stage_id) const;
  int rank_of(int64_t stage_id) const;
  std::string context(const Action& a) const;
  int tag(int64_t stage, int64_t mb, int direction, size_t index) const;
  void run_action(const Action& a);
  Activations take_recv(std::map<Key, Pending>& from, const Key& key,
                        const Action& a);
  void post_recv(std::map<Key, Pending>& into, const Key& key,
                 const std::vector<TensorMeta>& metas, int src_rank,
                 int direction, const Action& a);
  void send(const Activations& tensors, int dst_rank, int64_t stage,
            int64_t mb, int direction, const Action& a);
  void finish_step(const char* what);
  // Hands stage `st` micro-batch mb's documents (none when the step has none).
  void set_documents(PipelineStage& st, const std::vector<ops::DocumentsPtr>* documents,
                     int64_t mb) const;
  // The first stage's inputs of micro-batch mb: its tokens, and its images
  // when the step has them.
  Activations first_inputs(const std::vector<at::Tensor>& inputs,
                           const std::vector<at::Tensor>* images, size_t mb) const;
  // Timer slots; each call is a no-op outside a timed run_step.
  enum TimerSlot : size_t { kSpanSlot, kComputeSlot, kWaitSlot, kNumSlots };
  void time_begin(TimerSlot slot) {
    if (timing_now_) timer_->begin(slot);
  }
  void time_end(TimerSlot slot) {
    if (timing_now_) timer_->end(slot);
  }

  const PipelinePlan& plan_;
  int pp_rank_;
  std::vector<std::unique_ptr<PipelineStage>> stages_;
  std::map<int64_t, PipelineStage*> by_id_;
  distributed::ProcessGroup* pp_group_;
  at::Device device_;
  int64_t num_microbatches_;
  // meta_[s]: the tensors stage s sends forward (s -> s+1); grad_meta_[s]:
  // those stage s+1 sends back over the same hop.
  std::map<int64_t, std::vector<TensorMeta>> meta_, grad_meta_;
  bool have_meta_ = false;

  // Per step.
  const std::vector<at::Tensor>* inputs_ = nullptr;
  const std::vector<at::Tensor>* targets_ = nullptr;
  const std::vector<at::Tensor>* images_ = nullptr;  // null or empty: none
  const std::vector<ops::DocumentsPtr>* documents_ = nullptr;
  double loss_scale_ = 1.0;
  std::map<Key, Activations> fwd_out_;  // stage's outputs awaiting SEND_F / local F
  std::map<Key, Activations> bwd_out_;  // stage's input grads awaiting SEND_B / local B
  std::map<Key, Pending> recv_f_, recv_b_;
  std::vector<Pending> sends_;
  int64_t p2p_bytes_ = 0;
  std::map<int64_t, int64_t> hop_bytes_, hop_grad_bytes_;
  std::unique_ptr<DeviceTimer> timer_;  // null: timing off
  bool timing_now_ = false;             // inside a timed run_step
  // Per lowered action of this rank: the stages whose last backward it ran.
  std::vector<std::vector<int64_t>> ready_after_;
  std::function<void(int64_t)> grads_ready_;
};

}  // namespace viaduct::pipeline
