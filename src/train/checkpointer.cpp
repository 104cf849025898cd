// Saving the training state (see checkpointer.h).
#include "train/checkpointer.h"

#include <cmath>

#include "core/check.h"
#include "core/device.h"
#include "core/log.h"
#include "distributed/distributed.h"
#include "model/model.h"
#include "train/warm_start.h"

namespace viaduct {
namespace fs = std::filesystem;
namespace ck = checkpoint;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

Checkpointer::Checkpointer(fs::path folder, ck::CheckpointPolicy policy, CheckpointLayout layout,
                           CheckpointerOptions options, distributed::Mesh* mesh, at::Device device)
    : manager_(std::make_unique<ck::CheckpointManager>(std::move(folder), std::move(policy))),
      layout_(layout),
      options_(options),
      mesh_(mesh),
      device_(device) {}

Checkpointer::~Checkpointer() {
  try {
    wait();
  } catch (const std::exception& e) {
    log::error("the last asynchronous checkpoint failed: ", e.what());
  }
}

void Checkpointer::wait() {
  if (writer_.joinable()) writer_.join();
  if (writer_error_) {
    auto error = writer_error_;
    writer_error_ = nullptr;
    std::rethrow_exception(error);
  }
}

void Checkpointer::save(const ck::CheckpointMetadata& meta, std::vector<ck::CheckpointPart> files,
                        const std::vector<ExpertShard>& expert_shards) {
  // A previous asynchronous save still writing stalls training here until
  // it is done. Say so when it costs time, since a longer
  // checkpoint.interval would avoid it.
  const auto t_wait = std::chrono::steady_clock::now();
  wait();
  if (const double waited = seconds_since(t_wait); waited >= 1.0) {
    log::warn("checkpoint step ", meta.step, ": waited ", std::round(waited * 10) / 10,
              " s for the previous checkpoint's write to finish (it takes longer than ",
              "checkpoint.interval steps of training)");
  }
  const auto& l = layout_;
  const int optim_dp = l.shards_optimizer ? l.dp : 1;
  // Every replica of a sharded optimizer writes its own optim file; the
  // model's weights are written by the first replica alone. Under expert
  // parallelism the first ep replicas each write their experts, as pieces
  // of the whole tensors, into files of their own; the first writes the
  // rest too.
  // A job-wide choice: every pp rank names its files alike, those without
  // MoE layers too (their other ep replicas write empty files).
  const int model_dp = l.ep > 1 && l.moe ? l.ep : 1;
  if (model_dp > 1) {
    // files: the model part, then the optimizer's (ZeRO-1's already in
    // pieces, in a file per replica).
    for (size_t k = 0; k < files.size(); ++k) {
      if (k == 1 && optim_dp > 1) continue;
      files[k].file_name =
          ck::part_file_name(k == 0 ? "model" : "optim", l.pp_rank, l.pp, l.dp_rank, model_dp);
      store_experts_as_pieces(files[k], expert_shards, /*keep_rest=*/l.dp_rank == 0);
    }
  }
  if (l.dp_rank >= model_dp) files.erase(files.begin());
  const auto t_copy = std::chrono::steady_clock::now();
  if (options_.async) snapshot_to_host(files);
  const double copy_seconds = seconds_since(t_copy);
  std::shared_ptr<ck::SaveGroup> group;
  if (mesh_) {
    // The dp-rank-0 replica of every pipeline rank writes its parts.
    group = std::make_shared<ck::SaveGroup>();
    group->rank = mesh_->rank();
    group->writes_parts = l.dp_rank < model_dp || optim_dp > 1;
    for (int r = 0; r < l.pp; ++r) {
      for (int d = 0; d < model_dp; ++d) {
        group->expected_files.push_back(ck::part_file_name("model", r, l.pp, d, model_dp));
      }
      for (int d = 0; d < std::max(optim_dp, model_dp); ++d) {
        group->expected_files.push_back(
            ck::part_file_name("optim", r, l.pp, d, std::max(optim_dp, model_dp)));
      }
    }
    distributed::Mesh* mesh = mesh_;
    if (options_.async) {
      // See Note [Asynchronous checkpoint]: the writer thread must not use the
      // process groups the training steps use; it meets the other ranks'
      // writers through the store.
      const int64_t save_id = ++async_saves_;
      const auto timeout = options_.timeout;
      group->barrier = [mesh, save_id, timeout](const std::string& what) {
        mesh->store_barrier(str("viaduct/async_checkpoint/", save_id, "/", what), what, timeout);
      };
    } else {
      group->barrier = [mesh](const std::string& what) {
        mesh->world().barrier().wait(str("rank ", mesh->rank(), " ", what));
      };
    }
  }
  if (!options_.async) {
    manager_->save(meta, files, group.get());
    return;
  }
  log::info("checkpoint step ", meta.step, ": state copied to host memory in ",
            std::round(copy_seconds * 100) / 100, " s, writing it in the background");
  writer_ = std::thread([this, meta, files = std::move(files), group] {
    if (options_.hold_writes.count() > 0) std::this_thread::sleep_for(options_.hold_writes);
    try {
      manager_->save(meta, files, group.get());
    } catch (...) {
      writer_error_ = std::current_exception();
    }
  });
}

void Checkpointer::snapshot_to_host(std::vector<ck::CheckpointPart>& files) const {
  // See Note [Asynchronous checkpoint]: the copies are taken at the step
  // boundary, so the next steps' updates cannot reach the writer; device
  // tensors go to pinned host memory, copied on the stream and awaited once.
  bool on_device = false;
  for (auto& part : files) {
    for (auto& [name, t] : part.tensors) {
      if (t.is_cuda()) {
        auto host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
        host.copy_(t, /*non_blocking=*/true);
        t = host;
        on_device = true;
      } else {
        t = t.clone();
      }
    }
  }
  if (on_device) synchronize(device_);
}

void Checkpointer::write_final_hf(const JobConfig& job, int64_t step,
                                  const std::vector<std::shared_ptr<ModelPart>>& parts) const {
  if (mesh_ && mesh_->rank() != 0) return;
  const fs::path folder = hf_export_folder(job, step);
  if (fs::exists(folder)) {
    log::info("the final weights' Hugging Face folder ", folder.string(), " is already there");
    return;
  }
  checkpoint::TensorMap tensors;
  if (!mesh_) {
    for (const auto& part : parts) {
      for (const auto& p : part->named_parameters()) {
        tensors[p.key()] = p.value().detach().to(at::kCPU).contiguous();
      }
    }
  } else {
    // Every rank's weights are in the final checkpoint, which every rank
    // has finished with (the save's last barrier).
    const auto ckpt = manager_->open(step, checkpoint::Verify::kSizes);
    for (const auto& name : ckpt.tensors.names()) {
      if (name.rfind("optim.", 0) != 0) tensors[name] = ckpt.tensors.load(name);
    }
  }
  write_hf_export(job, folder, tensors);
  log::info("final weights as a Hugging Face model: ", folder.string());
}

}  // namespace viaduct
