// Rendering of Reports: the 80-column terminal report, the JSON report (`report --json`, the
// schema golden tests check), and the side-by-side diff of two runs. Pure functions.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "prof/analysis.h"

namespace tiermem::prof {

// "1.234 s", "12.35 ms", "4.50 us", "950 ns".
std::string FormatDuration(uint64_t ns);

nlohmann::json ReportToJson(const Report& r);
// Lines of at most 80 columns.
std::string RenderReportText(const Report& r, const std::string& name);

// Rows: per-tier peaks, bytes moved (total and per tier pair), stall time, step time,
// duration; each with A, B and the change in percent (null when A is 0).
nlohmann::json DiffToJson(const Report& a, const Report& b);
std::string RenderDiffText(const Report& a, const Report& b, const std::string& name_a,
                           const std::string& name_b);

}  // namespace tiermem::prof
