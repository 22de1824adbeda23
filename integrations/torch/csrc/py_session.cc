// PySession (py_session.h): chunk memory as tensors over session::Session; everything else
// forwards.
#include "integrations/torch/csrc/py_session.h"

#include <string>
#include <utility>
#include <vector>

#include "integrations/torch/cpp/dtypes.h"
#include "integrations/torch/cpp/torch_pool.h"
#include "integrations/torch/csrc/errors.h"
#include "integrations/torch/csrc/tensor_args.h"
#include "kernels/cpu/optim.h"

namespace py = pybind11;

namespace tiermem::torch_ext {

using chunks::ChunkKind;
using session::Session;
using session::SessionConfig;
using torch_dtypes::TorchDType;

PySession::PySession(const SessionConfig& config, std::vector<session::TensorSpec> specs,
                     const Sharding* sharding) {
  session::Sharding sh;
  if (sharding != nullptr) {
    sh.world = sharding->world;
    sh.rank = sharding->rank;
    collectives_ = std::make_unique<PyCollectives>(sharding->collectives);
    sh.collectives = collectives_.get();
  }
  s_ = Check(Session::Create(config, std::move(specs), sh));
  protocol_ = std::make_unique<session::UnitProtocol>(s_.get());
}

torch::Tensor PySession::View(void* addr, size_t group, ChunkKind kind, TierKind where) const {
  auto opts = torch::TensorOptions().dtype(TorchDType(s_->layout().dtype(kind)));
  if (where == TierKind::kDevice && s_->placement().cuda()) opts = opts.device(torch::kCUDA, 0);
  if ((kind == ChunkKind::kExpAvg || kind == ChunkKind::kExpAvgSq) &&
      s_->values().state_format(group).compressed()) {
    // Compressed m or v: the chunk's bytes (codes, then int8's absmax); read_tensor
    // dequantizes.
    return torch::from_blob(addr, {static_cast<int64_t>(s_->chunks().ChunkBytes(group, kind))},
                            opts.dtype(torch::kUInt8));
  }
  // Sharded: this rank's whole shard; else the chunk up to its last tensor.
  const uint64_t n =
      s_->layout().sharded() ? s_->layout().shard_elems : s_->layout().group(group).used_elems;
  return torch::from_blob(addr, {static_cast<int64_t>(n)}, opts);
}
Scratch PySession::AllocateScratch(TierKind where, uint64_t bytes) {
  const Region r = Check(s_->memory().AllocateScratch(where, bytes));
  auto opts = torch::TensorOptions().dtype(torch::kUInt8);
  if (where == TierKind::kDevice && s_->placement().cuda()) opts = opts.device(torch::kCUDA, 0);
  return Scratch{r, torch::from_blob(r.addr, {static_cast<int64_t>(bytes)}, opts)};
}
void PySession::FreeScratch(TierKind where, const Region& region) {
  Check(s_->memory().FreeScratch(where, region));
}
Region PySession::AllocateSpill(uint64_t bytes) { return Check(s_->memory().AllocateSpill(bytes)); }
void PySession::FreeSpill(const Region& region) { Check(s_->memory().FreeSpill(region)); }
std::shared_ptr<Completion> PySession::StartSpillCopy(const Region& spill, uint64_t spill_offset,
                                                      const Region& host, uint64_t host_offset,
                                                      uint64_t bytes, bool to_nvme) {
  return Check(s_->memory().StartSpillCopy(spill, spill_offset, host, host_offset, bytes, to_nvme));
}
torch::Tensor PySession::Acquire(size_t group, ChunkKind kind, TierKind where, int64_t cls) {
  return View(Check(s_->chunks().Acquire(group, kind, where, ClassOf(cls))), group, kind, where);
}
// A lazily zero chunk landing on the device is zeroed by torch on the compute device (a memset
// kernel on CUDA, ordered on the current stream before the caller's writes) instead of a copy
// from a zeros buffer.
torch::Tensor PySession::AcquireForWrite(size_t group, ChunkKind kind, TierKind where,
                                         int64_t cls) {
  bool must_zero = false;
  void* addr = Check(s_->chunks().AcquireForWrite(group, kind, where, &must_zero, ClassOf(cls)));
  torch::Tensor v = View(addr, group, kind, where);
  if (must_zero) {
    const int64_t bytes = static_cast<int64_t>(s_->chunks().ChunkBytes(group, kind));
    torch::from_blob(addr, {bytes}, v.options().dtype(torch::kUInt8)).zero_();
  }
  return v;
}

torch::Tensor PySession::ReadParam(size_t t) {
  torch::Tensor out = torch::empty({Numel(t)}, torch::kFloat32);
  Check(s_->values().ReadParam(t, out.data_ptr<float>()));
  return out;
}
void PySession::WriteParam(size_t t, const torch::Tensor& v) {
  CheckHostSpan(v, "value", Numel(t), torch::kFloat32);
  Check(s_->values().WriteParam(t, v.data_ptr<float>()));
}
torch::Tensor PySession::ReadTensor(size_t t, ChunkKind kind) {
  torch::Tensor out = torch::empty({Numel(t)}, TorchDType(s_->layout().dtype(kind)));
  Check(s_->values().ReadTensor(t, kind, out.data_ptr()));
  return out;
}
void PySession::WriteTensor(size_t t, ChunkKind kind, const torch::Tensor& v) {
  CheckHostSpan(v, "value", Numel(t), TorchDType(s_->layout().dtype(kind)));
  Check(s_->values().WriteTensor(t, kind, v.data_ptr()));
}
void PySession::SetHasGrad(const std::vector<bool>& flags) {
  if (flags.size() != s_->layout().num_tensors()) throw py::value_error("one flag per tensor");
  for (size_t i = 0; i < flags.size(); ++i) s_->optimizer().SetHasGrad(i, flags[i]);
}
session::StepResult PySession::Step(const std::vector<session::GroupHyper>& hyper,
                                    const kernels::GradStats* global_stats) {
  StatusOr<session::StepResult> r = InternalError("not run");
  {
    py::gil_scoped_release nogil;
    kernels::ScopedParallelFor pool(torch_pool::ForThisThread());
    r = s_->optimizer().Step(hyper, global_stats);
  }
  return Check(std::move(r));
}
void PySession::SetStepHyper(std::vector<session::GroupHyper> hyper) {
  s_->SetStepHyper(std::move(hyper));
}
kernels::GradStats PySession::GradStats() {
  StatusOr<kernels::GradStats> st = InternalError("not run");
  {
    py::gil_scoped_release nogil;
    kernels::ScopedParallelFor pool(torch_pool::ForThisThread());
    st = s_->optimizer().GradStats();
  }
  return Check(std::move(st));
}
const session::ChunkGroup& PySession::Group(size_t g) const {
  if (g >= s_->layout().num_groups()) throw py::value_error("unknown chunk group");
  return s_->layout().group(g);
}
const std::vector<session::Piece>& PySession::Place(size_t t) const {
  if (t >= s_->layout().num_tensors()) throw py::value_error("unknown tensor");
  return s_->layout().place(t).pieces;
}
PySession::~PySession() = default;

void PySession::Close() {
  s_->Close();
  collectives_.reset();
}

uint32_t PySession::ClassOf(int64_t cls) {
  return cls < 0 ? chunks::kNoClass : static_cast<uint32_t>(cls);
}
int64_t PySession::Numel(size_t t) const {
  if (t >= s_->layout().num_tensors()) throw py::value_error("unknown tensor " + std::to_string(t));
  return static_cast<int64_t>(s_->layout().place(t).numel);
}

}  // namespace tiermem::torch_ext
