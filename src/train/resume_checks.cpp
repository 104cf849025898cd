#include "train/resume_checks.h"

#include "config/config.h"
#include "core/check.h"
#include "core/log.h"
#include "model/model.h"

namespace viaduct {

void check_checkpoint_matches_model(const JobConfig& job, const checkpoint::Checkpoint& ckpt) {
  // Every checkpoint tensor must belong to a module of this model: a model
  // with fewer layers would otherwise drop the others without a word
  // (shapes and missing tensors are checked as the tensors load).
  const auto modules = model_module_fqns(job);
  std::vector<std::string> strays;
  for (const auto& name : ckpt.tensors.names()) {
    if (name.rfind("optim.", 0) == 0) continue;
    bool owned = false;
    for (const auto& m : modules) {
      owned = owned || name == m || name.rfind(m + ".", 0) == 0;
    }
    if (!owned) strays.push_back(name);
  }
  std::string differences;
  try {
    const auto saved = JobConfig::parse(ckpt.metadata.config_toml, ckpt.dir.string());
    const auto was = describe_model(saved);
    const auto now = describe_model(job);
    if (was.family != now.family || was.n_layers != now.n_layers || was.params != now.params) {
      differences = str("; the checkpoint's model is ", was.family, "/", was.flavor, " with ",
                        was.n_layers, " layers and ", was.params, " parameters, this config's ",
                        now.family, "/", now.flavor, " with ", now.n_layers, " layers and ",
                        now.params, " parameters");
      for (const auto& k : config_schema()) {
        if (k.section != "model" || k.type != ConfigType::kInt) continue;
        const auto a = saved.model.keys.get_int_opt(k.dotted());
        const auto b = job.model.keys.get_int_opt(k.dotted());
        if (a == b) continue;
        differences += str("; ", k.dotted(), " = ", a ? str(*a) : std::string("(flavor)"),
                           " in the checkpoint, ", b ? str(*b) : std::string("(flavor)"),
                           " now (from ", job.source(k.dotted()), ")");
      }
    }
  } catch (const Error&) {
    // A checkpoint of an older config vocabulary: the tensors decide alone.
  }
  if (strays.empty() && differences.empty()) return;
  std::string stray_text;
  for (size_t i = 0; i < strays.size() && i < 4; ++i) {
    stray_text += str(i ? ", " : "", strays[i]);
  }
  if (strays.size() > 4) stray_text += str(" and ", strays.size() - 4, " more");
  throw ConfigError(str(
      "cannot resume from ", ckpt.dir.string(), ": it holds a different model than this config",
      differences.empty() ? "" : differences,
      strays.empty() ? "" : str("; tensors this model has no place for: ", stray_text),
      ". Resume with the checkpoint's model settings, or start a new run in another "
      "job.dump_folder (or with checkpoint.resume = false)"));
}

bool resume_loads_optimizer(const JobConfig& job, const checkpoint::Checkpoint& ckpt, bool log) {
  // A checkpoint of another optimizer holds state this one cannot take (or
  // none that it needs): dropping it is the user's call, never silent.
  std::string saved;
  try {
    saved = JobConfig::parse(ckpt.metadata.config_toml, ckpt.dir.string()).optimizer.name;
  } catch (const Error&) {
    return true;  // an older config vocabulary: the tensors decide as they load
  }
  const std::string& now = job.optimizer.name;
  if (saved == now) return true;
  size_t state_tensors = 0;
  for (const auto& name : ckpt.tensors.names()) state_tensors += name.rfind("optim.", 0) == 0;
  const std::string dropped =
      state_tensors > 0 ? str("its ", saved, " state (", state_tensors, " optim.* tensors)")
                        : str("its ", saved, " step count");
  VIADUCT_CHECK_T(ConfigError, job.checkpoint.resume_with_new_optimizer,
                  "cannot resume from ", ckpt.dir.string(), ": it was saved with optimizer.name = ",
                  saved, ", this config has ", now, " (from ", job.source("optimizer.name"),
                  "), and ", dropped, " would be dropped. Resume with optimizer.name = ", saved,
                  ", or set checkpoint.resume_with_new_optimizer = true to start ", now,
                  " fresh from the checkpoint's weights");
  if (log) {
    log::warn("resuming ", ckpt.dir.string(), " (saved with optimizer.name = ", saved, ") with ",
              now, ": ", dropped, " is dropped and ", now, " starts fresh "
              "(checkpoint.resume_with_new_optimizer = true)");
  }
  return false;
}

}  // namespace viaduct
