// Small POSIX file-system helpers for the core. The core avoids std::filesystem on purpose:
// PyTorch's libtorch.so exports its own (partial) copies of libstdc++'s std::filesystem
// symbols, and a binary that links both can resolve a call into libtorch's copy and crash
// (seen: std::filesystem::remove_all jumping to address 0). errno is converted here.
//
// Thread-safety: pure functions over the file system.
#pragma once

#include <string>

#include "base/status.h"

namespace tiermem {

// `dir` and its missing parents, like `mkdir -p` (mode 0755). kIOError naming the path.
Status MakeDirs(const std::string& dir);
// The directory part of `path` ("" for a bare file name; "/" for "/x").
std::string DirName(const std::string& path);

}  // namespace tiermem
