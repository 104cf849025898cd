// What a resume checks before it loads a checkpoint into this config's
// model: that the checkpoint holds the same model, and what happens to an
// optimizer state saved under another optimizer.
#pragma once

#include "checkpoint/manager.h"
#include "config/job_config.h"

namespace viaduct {

// A ConfigError naming the difference when the checkpoint holds another
// model than `cfg` (its saved config's family, layers, parameters and model
// keys) or tensors this model has no place for (a model with fewer layers
// would otherwise drop them without a word; shapes and missing tensors are
// checked as the tensors load).
void check_checkpoint_matches_model(const JobConfig& job, const checkpoint::Checkpoint& ckpt);

// False when the checkpoint was saved under another optimizer.name and
// checkpoint.resume_with_new_optimizer allows starting it fresh (with a
// warning when `log`); a ConfigError naming both optimizers without that
// key; true when the optimizers agree.
bool resume_loads_optimizer(const JobConfig& job, const checkpoint::Checkpoint& ckpt, bool log);

}  // namespace viaduct
