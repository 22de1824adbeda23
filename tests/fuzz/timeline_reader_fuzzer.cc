// libFuzzer harness for the timeline reader and the analysis on top of it: any byte string
// must give a Status (or a report), never a crash, hang or sanitizer report. Built with clang
// by -DTIERMEM_BUILD_FUZZERS=ON; run by scripts/fuzz_timeline.sh.
#include <cstddef>
#include <cstdint>
#include <string>

#include "base/timeline_reader.h"
#include "prof/analysis.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto reader = tiermem::TimelineReader::FromBytes(
      std::string(reinterpret_cast<const char*>(data), size));
  if (!reader.ok()) return 0;
  tiermem::prof::OrderedEvents events(reader->get(), /*window=*/64);
  tiermem::prof::Analyzer analyzer;
  tiermem::TimelineEntry e;
  while (true) {
    auto more = events.Next(&e);
    if (!more.ok() || !*more) break;
    analyzer.Add(e.event, e.label);
  }
  tiermem::prof::Report r = analyzer.Finish();
  (void)r;
  (void)(*reader)->end_note();
  return 0;
}
