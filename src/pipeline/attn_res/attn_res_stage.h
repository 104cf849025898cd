// AttnResStage: a PipelineStage for models whose stages hand on an AttnRes
// stack (see Note [Kimi-K3 part activations] in model/kimi_k3.h). What crosses a
// hop and what stays in the rank's store is the layout tables' business;
// with the whole-stack tables this stage behaves exactly as PipelineStage.
//
// Note [AttnRes stage]
// Forward: the full stack is assembled from the rank store (one leaf per
// read entry) and the received tensors (one leaf each: hidden, then the
// delta), the part runs on {hidden, stack}, the entries a later stage of the
// rank reads are stored, and the payload (hidden, the receiving rank's
// delta) goes back to the executor. Backward: the payload gradient is
// spread over the part's full outputs, the deposits for the entries this
// stage collects are added (a count mismatch is an Error naming stage,
// micro-batch and block), the part's backward runs, and of the input
// gradients the tables' `returned` columns go back over P2P while the
// `deposited` ones go to the store (see Note [AttnRes cache backward]: with the
// whole-stack backward every column goes back and nothing is deposited).
// The rank's last stage releases the micro-batch's blocks
// right after its forward. Metadata inference and eval run the same
// assembly without autograd, under micro-batch kNoGradMicrobatch.
#pragma once

#include <memory>
#include <string>

#include "pipeline/attn_res/block_layout.h"
#include "pipeline/attn_res/block_store.h"
#include "pipeline/runtime/stage.h"

namespace viaduct::pipeline {

class AttnResStage : public PipelineStage {
 public:
  static constexpr int64_t kNoGradMicrobatch = -1;

  AttnResStage(int64_t stage_id, int64_t num_stages, std::shared_ptr<ModelPart> part,
               std::shared_ptr<const BlockLayoutTables> tables,
               std::shared_ptr<RankBlockStore> store);

  Activations forward(int64_t mb, const Activations& inputs, const at::Tensor& targets,
                      double loss_scale) override;
  Activations backward(int64_t mb, const Activations& grad_outputs) override;
  Activations backward_input(int64_t mb, const Activations& grad_outputs) override;
  Activations forward_no_grad(const Activations& inputs,
                              const at::Tensor& targets) override;
  void clear() override;
  void check_step_end(const std::string& what) override;
  // hidden + the tables' returned entries, each with hidden's shape and
  // dtype (every stack entry has them: see Note [Kimi-K3 part activations]).
  std::vector<TensorMeta> hop_grad_metas(int64_t s,
                                         const std::vector<TensorMeta>& forward) const override;

  const StageBlockLayout& layout() const { return tables_->stage(stage_id()); }
  RankBlockStore& store() { return *store_; }

 private:
  // {hidden, e_0 .. e_{in-1}} from the payload and the store.
  Activations assemble(int64_t mb, const Activations& payload);
  // Stores this stage's entries; releases on the rank's last stage; returns
  // the payload for the next stage.
  Activations hand_on(int64_t mb, const Activations& payload, const Activations& full_out);
  // The part's full output gradients from the payload's and the deposits.
  Activations expand_grads(int64_t mb, const Activations& grad_payload);
  // Deposits the stored columns' gradients; returns the received columns'.
  Activations route_input_grads(int64_t mb, const Activations& grads_full);

  std::shared_ptr<const BlockLayoutTables> tables_;
  std::shared_ptr<RankBlockStore> store_;
};

// The stages of one rank: AttnResStage over `tables` and one shared store
// when tables are given, else plain PipelineStages.
std::unique_ptr<PipelineStage> make_stage(int64_t stage_id, int64_t num_stages,
                                          std::shared_ptr<ModelPart> part,
                                          std::shared_ptr<const BlockLayoutTables> tables,
                                          std::shared_ptr<RankBlockStore> store);

}  // namespace viaduct::pipeline
