// Each section's keys live in its own schema_<section>.cpp so the owners of
// each area add keys without touching the others.
#pragma once

#include <vector>

#include "config/config.h"

namespace viaduct {

void add_core_keys(std::vector<ConfigKey>& keys);         // job, training, optimizer, lr_scheduler, checkpoint, metrics
void add_model_keys(std::vector<ConfigKey>& keys);        // model
void add_data_keys(std::vector<ConfigKey>& keys);         // data
void add_parallelism_keys(std::vector<ConfigKey>& keys);  // parallelism

// Cross-field checks per area, run after the overrides.
void validate_core(const Config& cfg);
void validate_data(const Config& cfg);
void validate_parallelism(const Config& cfg);

}  // namespace viaduct
