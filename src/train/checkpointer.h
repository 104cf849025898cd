// Saving the training state: which files this rank writes under the job's
// layout, the write itself (at once, or by a background writer), and the
// wait for that writer. The trainer says what to save and when; the
// CheckpointManager (checkpoint/manager.h) owns the folder, the atomic
// protocol and the resume choice.
//
// Note [Asynchronous checkpoint]
// With checkpoint.async_mode = "async", save() copies the state to host
// memory at the step boundary (pinned memory from a GPU) and a writer
// thread saves it under the same atomic protocol (see Note [Atomic checkpoint
// save]) while training goes on. The next save, a signal's stop, the end of
// the run and the destructor wait for it; its error surfaces there. Under a
// launcher the writers of all ranks meet through the rendezvous store
// (distributed::Mesh::store_barrier), never through the process groups the steps
// use from the main thread.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <thread>
#include <vector>

#include "checkpoint/manager.h"
#include "train/expert_parallel.h"

namespace viaduct {

struct JobConfig;
class ModelPart;
namespace distributed {
class Mesh;
}  // namespace distributed

// What decides the files a rank writes (see Note [Expert parallelism] for the
// pieces of sharded experts, see Note [ZeRO-1] for the optimizer's).
struct CheckpointLayout {
  int pp = 1, pp_rank = 0;
  int dp = 1, dp_rank = 0;
  int64_t num_stages = 1;
  bool shards_optimizer = false;  // ZeRO-1 over the dp replicas
  int ep = 1;
  bool moe = false;  // the model has routed experts
};

struct CheckpointerOptions {
  bool async = false;  // checkpoint.async_mode = "async"
  // How long the writers of an asynchronous save wait for each other.
  std::chrono::milliseconds timeout{300000};
  // Holds every background write back this long, as a slow disk would: a
  // test seam (train/fault_injection.h), 0 in a real run.
  std::chrono::milliseconds hold_writes{0};
};

class Checkpointer {
 public:
  // `mesh`: null for one process.
  Checkpointer(std::filesystem::path folder, checkpoint::CheckpointPolicy policy,
               CheckpointLayout layout, CheckpointerOptions options, distributed::Mesh* mesh,
               at::Device device);
  // Waits for a writer still running; its error is logged (run() saw none
  // of it only when it failed itself).
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  checkpoint::CheckpointManager& manager() { return *manager_; }
  const checkpoint::CheckpointManager& manager() const { return *manager_; }

  // Saves `files` (this rank's model and optimizer parts, as
  // training_state_parts gives them) under `meta`: renamed and cut into
  // pieces as the layout asks, then written now or in the background.
  // Waits for the previous background write first.
  void save(const checkpoint::CheckpointMetadata& meta,
            std::vector<checkpoint::CheckpointPart> files,
            const std::vector<ExpertShard>& expert_shards);
  // Waits for the background writer; rethrows its error.
  void wait();
  // checkpoint.last_save_in_hf: the final weights of step `step` as a
  // Hugging Face model folder, written by rank 0; under a launcher read back
  // from the final checkpoint, which every rank has finished with.
  void write_final_hf(const JobConfig& job, int64_t step,
                      const std::vector<std::shared_ptr<ModelPart>>& parts) const;

 private:
  // The parts' tensors replaced by host copies taken now.
  void snapshot_to_host(std::vector<checkpoint::CheckpointPart>& files) const;

  std::unique_ptr<checkpoint::CheckpointManager> manager_;
  CheckpointLayout layout_;
  CheckpointerOptions options_;
  distributed::Mesh* mesh_;
  at::Device device_;
  std::thread writer_;
  std::exception_ptr writer_error_;
  int64_t async_saves_ = 0;  // numbers the store keys of their barriers
};

}  // namespace viaduct
