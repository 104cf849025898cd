// CSV load and save of schedules (see csv.h).
#include "pipeline/schedule/csv.h"

#include <fstream>
#include <sstream>

#include "core/check.h"

namespace viaduct::pipeline {
namespace {

// RFC 4180 rows: commas, optional double quotes ("" escapes a quote), CRLF
// or LF line ends.
std::vector<std::vector<std::string>> parse_rows(const std::string& text,
                                                 const std::string& origin) {
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> row;
  std::string cell;
  bool quoted = false, any = false;
  int64_t line = 1;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"' && i + 1 < text.size() && text[i + 1] == '"') {
        cell += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        if (c == '\n') ++line;
        cell += c;
      }
      continue;
    }
    if (c == '"') {
      quoted = true;
      any = true;
    } else if (c == ',') {
      row.push_back(cell);
      cell.clear();
      any = true;
    } else if (c == '\r') {
      continue;
    } else if (c == '\n') {
      if (any || !cell.empty()) {
        row.push_back(cell);
        rows.push_back(row);
      } else {
        rows.emplace_back();  // an empty row: a rank with no action
      }
      row.clear();
      cell.clear();
      any = false;
      ++line;
    } else {
      cell += c;
      any = true;
    }
  }
  VIADUCT_CHECK(!quoted, origin, ": unterminated quote at line ", line);
  if (any || !cell.empty()) {
    row.push_back(cell);
    rows.push_back(row);
  }
  // Trailing empty lines are not ranks.
  while (!rows.empty() && rows.back().empty()) rows.pop_back();
  return rows;
}

}  // namespace

std::string schedule_to_csv(const Schedule& schedule) {
  std::string out;
  for (const auto& rank : schedule.ranks) {
    for (size_t i = 0; i < rank.size(); ++i) {
      if (i > 0) out += ",";
      out += to_string(rank[i]);
    }
    out += "\r\n";  // what Python's csv.writer writes
  }
  return out;
}

Schedule schedule_from_csv(const std::string& text, const std::string& origin,
                           int64_t pp, int64_t num_stages, int64_t microbatches) {
  const auto rows = parse_rows(text, origin);
  Schedule sch;
  sch.name = "csv:" + origin;
  sch.pp = pp > 0 ? pp : static_cast<int64_t>(rows.size());
  VIADUCT_CHECK(static_cast<int64_t>(rows.size()) == sch.pp, origin, " has ",
                rows.size(), " rows but the pipeline has ", sch.pp,
                " ranks; a schedule CSV holds one row per rank");
  int64_t max_stage = -1, max_mb = -1;
  for (size_t r = 0; r < rows.size(); ++r) {
    sch.ranks.emplace_back();
    for (size_t c = 0; c < rows[r].size(); ++c) {
      std::optional<Action> a;
      try {
        a = parse_action(rows[r][c]);
      } catch (const Error& e) {
        throw Error(str(origin, ": row ", r, " (rank ", r, "), column ", c, ": ",
                        e.what()));
      }
      if (!a) continue;  // idle slot
      for (const auto& leaf : leaf_actions(*a)) {
        max_stage = std::max(max_stage, leaf.stage);
        max_mb = std::max(max_mb, leaf.microbatch);
      }
      if (is_comm(a->kind)) sch.with_comms = true;
      sch.ranks.back().push_back(std::move(*a));
    }
  }
  sch.num_stages = num_stages > 0 ? num_stages : max_stage + 1;
  sch.microbatches = microbatches > 0 ? microbatches : max_mb + 1;
  VIADUCT_CHECK(sch.num_stages >= 1 && sch.microbatches >= 1, origin,
                " holds no compute action");
  try {
    sch.stage_to_rank = validate_schedule(compute_only(sch));
  } catch (const Error& e) {
    throw Error(str(origin, ": ", e.what()));
  }
  return sch;
}

Schedule load_schedule_csv(const std::string& path, int64_t pp,
                           int64_t num_stages, int64_t microbatches) {
  std::ifstream in(path, std::ios::binary);
  VIADUCT_CHECK_T(FileError, in.good(), "cannot read schedule CSV '", path,
                  "' (parallelism.pipeline_parallel_schedule_csv)");
  std::ostringstream ss;
  ss << in.rdbuf();
  return schedule_from_csv(ss.str(), path, pp, num_stages, microbatches);
}

}  // namespace viaduct::pipeline
