// session::Collectives implemented by a Python object (csrc/collectives.cc), for a sharded
// Session (py_session.h).
#pragma once

#include <torch/extension.h>

#include "runtime/session.h"

namespace tiermem::torch_ext {

// session::Collectives implemented by a Python object (tiermem.distributed's, over
// torch.distributed): `all_gather(shard, full)` with uint8 CPU tensors viewing the session's
// buffers. The GIL is taken for the call (the session calls it from a bound method).
// Hidden, as pybind11 declares its own types: it holds Python objects.
class __attribute__((visibility("hidden"))) PyCollectives final : public session::Collectives {
 public:
  explicit PyCollectives(pybind11::object impl) : impl_(std::move(impl)) {}
  ~PyCollectives() override;
  Status AllGather(const void* shard, void* full, Bytes bytes) override;
  int world() const;

 private:
  pybind11::object impl_;
};

}  // namespace tiermem::torch_ext
