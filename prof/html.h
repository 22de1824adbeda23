// The self-contained HTML timeline (`tiermem prof html`): one file, no network, with the data
// embedded as JSON and a small SVG renderer in plain JS. Memory per tier is drawn as stacked
// areas by category with budget lines; copies as spans on per-lane tracks; stalls as red
// bands; phases and moments as markers; zoom (wheel), pan (drag), reset (double-click), hover
// details. Large runs are downsampled to kBuckets time buckets per tier, keeping in each
// bucket the first, last, minimum and maximum states, so every tier's peak is exact.
//
// For tests and tools the page writes what it drew into the DOM: each chart is
// <svg class="chart" id="chart-<tier>" data-series="param,grad,..." data-peak-bytes=N>, each
// series a <path class="series" data-series=...>, the peak a <text class="peak-label"
// data-tier=.. data-bytes=..>, and <body data-rendered="1"> once drawing finished.
#pragma once

#include <string>

#include "base/status.h"

namespace tiermem::prof {

struct HtmlOptions {
  int buckets = 2000;  // time buckets per tier for the memory series
};

Status RenderHtml(const std::string& timeline_path, const std::string& out_path,
                  const HtmlOptions& options = {});

}  // namespace tiermem::prof
