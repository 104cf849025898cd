// The schedule timeline as an SVG picture for design documents: ranks as
// rows, time left to right, one box per compute action coloured by
// micro-batch (F light, B dark, I mid with a dashed edge, W pale), idle time
// hatched grey so the bubble shows.
#pragma once

#include <string>

#include "pipeline/schedule/schedule.h"
#include "pipeline/schedule/simulate.h"

namespace viaduct::pipeline {

std::string timeline_svg(const Schedule& schedule, const SimulationResult& sim,
                         const std::string& title);

}  // namespace viaduct::pipeline
