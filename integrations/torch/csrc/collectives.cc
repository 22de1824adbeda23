#include "integrations/torch/csrc/collectives.h"

#include <string>

namespace py = pybind11;

namespace tiermem::torch_ext {

PyCollectives::~PyCollectives() {
  py::gil_scoped_acquire gil;
  impl_ = py::object();
}

Status PyCollectives::AllGather(const void* shard, void* full, Bytes bytes) {
  py::gil_scoped_acquire gil;
  auto opts = torch::TensorOptions().dtype(torch::kUInt8);
  torch::Tensor s = torch::from_blob(const_cast<void*>(shard), {static_cast<int64_t>(bytes)}, opts);
  torch::Tensor f = torch::from_blob(full, {static_cast<int64_t>(bytes) * world()}, opts);
  try {
    impl_.attr("all_gather")(s, f);
  } catch (py::error_already_set& e) {
    return UnavailableError(std::string("collective all_gather failed: ") + e.what());
  }
  return OkStatus();
}

int PyCollectives::world() const {
  py::gil_scoped_acquire gil;
  return impl_.attr("world").cast<int>();
}

}  // namespace tiermem::torch_ext
