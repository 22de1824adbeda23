// tiermem._C's pretrained weights (runtime/weights.h), registered by module.cc:
//   weights_inspect(path)              the checkpoint's tensors (dtype, shape, file, whether a
//                                      torch tensor - a buffer - can hold it), headers only
//   load_weights(session, path, ...)   validate, then stream the checkpoint into the session
//   save_weights(session, path, ...)   stream the session (and given buffers) out, HF layout
//   read_weight_tensors(path, keys)    single tensors as CPU tensors (a module's buffers)
//   copy_weights(src, dst, entries)    another checkpoint's tensors to the HF layout, renamed
//                                      and cut as given, streamed (`tiermem export`: no session)
// Names are the caller's: tiermem/weights.py passes the model's parameter names (and the other
// names of tied ones); explicit targets (key segments per tensor) are for the conventions a
// framework layer adds on top. The GIL is released while a load or an export streams.
//
// Threading: the session's (the training thread).
#include "integrations/torch/csrc/weights.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <set>
#include <string>
#include <vector>

#include "integrations/torch/cpp/dtypes.h"
#include "integrations/torch/cpp/weight_tensors.h"
#include "integrations/torch/csrc/errors.h"
#include "kernels/cpu/optim.h"
#include "runtime/weights.h"
#include "weights/shard_writer.h"
#include "weights/weight_files.h"

namespace tiermem::torch_ext {
namespace {

namespace py = pybind11;
using session::Session;
using session::ValueDType;

py::dict Inspect(const std::string& path) {
  const weights::WeightFiles files = Check(weights::OpenWeights(path));
  py::dict tensors;
  py::list paths;
  for (const weights::Header& h : files.files) {
    paths.append(h.path);
    for (const weights::TensorInfo& t : h.tensors) {
      py::dict d;
      d["dtype"] = std::string(weights::DTypeName(t.dtype));
      d["shape"] = py::cast(t.shape);
      d["file"] = h.path;
      d["buffer"] = torch_dtypes::TorchDType(t.dtype).has_value();  // a torch tensor can hold it
      tensors[py::str(t.key)] = d;
    }
  }
  py::dict out;
  out["path"] = files.path;
  out["index"] = files.index_path.empty() ? py::object(py::none()) : py::str(files.index_path);
  out["files"] = paths;
  out["tensors"] = tensors;
  out["total_size"] = files.total_size;
  return out;
}

// Explicit targets: [(tensor, [(key, offset, shape or None, transpose), ...]), ...].
std::vector<session::WeightTarget> TargetsFrom(const py::list& targets) {
  std::vector<session::WeightTarget> out;
  for (const py::handle& t : targets) {
    const py::tuple tt = t.cast<py::tuple>();
    if (tt.size() != 2) throw py::value_error("load_weights: a target is (tensor, segments)");
    session::WeightTarget target{tt[0].cast<size_t>(), {}};
    for (const py::handle& s : tt[1].cast<py::list>()) {
      const py::tuple st = s.cast<py::tuple>();
      if (st.size() != 4) {
        throw py::value_error("load_weights: a segment is (key, offset, shape, transpose)");
      }
      session::WeightSegment seg{st[0].cast<std::string>(), st[1].cast<uint64_t>()};
      if (!st[2].is_none()) seg.shape = st[2].cast<std::vector<int64_t>>();
      seg.transpose = st[3].cast<bool>();
      target.segments.push_back(std::move(seg));
    }
    out.push_back(std::move(target));
  }
  return out;
}

py::dict Load(Session& s, const std::string& path, bool strict,
              const std::vector<std::vector<std::string>>& aliases,
              const std::vector<std::string>& ignore, const py::object& targets,
              uint64_t request_bytes, int depth, bool serving) {
  const weights::WeightFiles files = Check(weights::OpenWeights(path));
  std::set<std::string> allowed(ignore.begin(), ignore.end());
  const std::vector<session::WeightTarget> t =
      targets.is_none() ? session::TargetsByName(s, files, aliases, &allowed)
                        : TargetsFrom(targets.cast<py::list>());
  session::LoadWeightsOptions o;
  o.strict = strict;
  o.ignore = [&allowed](std::string_view k) { return allowed.count(std::string(k)) > 0; };
  o.request_bytes = request_bytes;
  o.depth = depth;
  o.serving = serving;
  StatusOr<session::LoadWeightsReport> r = InternalError("not loaded");
  {
    py::gil_scoped_release nogil;
    r = session::LoadWeights(s, files, t, o);
  }
  const session::LoadWeightsReport report = Check(std::move(r));
  py::dict out;
  out["missing"] = py::cast(report.missing);
  out["ignored"] = py::cast(report.ignored);
  out["bytes_read"] = report.bytes_read;
  out["requests"] = report.requests;
  out["io_backend"] = report.io_backend;
  out["staging_bytes"] = report.staging_bytes;
  out["chunks_in_place"] = report.chunks_in_place;
  out["bytes_in_place"] = report.bytes_in_place;
  return out;
}

// entries: [(key, shape, segments or a CPU tensor)], segments [(tensor, offset, numel,
// transpose)]; a tensor's bytes are written as they are, in its dtype.
void Save(Session& s, const std::string& path, const py::list& entries, const std::string& dtype,
          uint64_t max_shard_bytes, bool single_file) {
  std::vector<session::ExportEntry> out;
  std::vector<torch::Tensor> held;  // the buffers, contiguous, alive during the export
  for (const py::handle& e : entries) {
    const py::tuple et = e.cast<py::tuple>();
    if (et.size() != 3) throw py::value_error("save_weights: an entry is (key, shape, values)");
    session::ExportEntry entry;
    entry.key = et[0].cast<std::string>();
    entry.shape = et[1].cast<std::vector<int64_t>>();
    if (py::isinstance<py::list>(et[2])) {
      for (const py::handle& sg : et[2].cast<py::list>()) {
        const py::tuple st = sg.cast<py::tuple>();
        entry.segments.push_back({st[0].cast<size_t>(), st[1].cast<uint64_t>(),
                                  st[2].cast<uint64_t>(), st[3].cast<bool>()});
      }
    } else {
      torch::Tensor t = et[2].cast<torch::Tensor>().detach().cpu().contiguous();
      const std::optional<weights::DType> d = torch_dtypes::WeightsDType(t.scalar_type());
      if (!d) {
        throw py::value_error("save_weights: '" + entry.key + "' is " +
                              std::string(c10::toString(t.scalar_type())) +
                              ", which safetensors has no dtype for here");
      }
      held.push_back(t);
      entry.host_bytes = held.back().data_ptr();
      entry.host_dtype = *d;
    }
    out.push_back(std::move(entry));
  }
  session::ExportOptions o;
  const std::optional<weights::DType> d = weights::ParseDType(dtype);
  if (!d) throw py::value_error("save_weights: unknown dtype '" + dtype + "'");
  o.dtype = *d;
  o.writer.max_shard_bytes = max_shard_bytes;
  o.writer.single_file = single_file;
  Status st;
  {
    py::gil_scoped_release nogil;
    st = session::ExportWeights(s, path, out, o);
  }
  Check(st);
}

py::dict ReadTensors(const std::string& path, const std::vector<std::string>& keys) {
  const weights::WeightFiles files = Check(weights::OpenWeights(path));
  py::dict out;
  for (const std::string& k : keys) out[py::str(k)] = Check(torch_weights::ReadTensor(files, k));
  return out;
}

// ---- copy_weights: file to file, without a session ----------------------------------------

// One run of a source tensor's elements written into an entry: [offset, offset + numel), or
// (transpose) the whole 2-D source [R, C] written as its [C, R].
struct CopySegment {
  const weights::TensorInfo* info = nullptr;
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t numel = 0;
  bool transpose = false;
};

// Reads the source's elements [first, first + n) as fp32 into `out` (`raw`: scratch bytes).
Status ReadValues(const weights::WeightFiles& files, const std::vector<int>& fds,
                  const CopySegment& seg, uint64_t first, uint64_t n, std::vector<char>* raw,
                  float* out) {
  const weights::Header& h = files.files[seg.file];
  const kernels::DType d = *ValueDType(seg.info->dtype);
  const size_t esize = kernels::DTypeSize(d);
  raw->resize(n * esize);
  const uint64_t at = h.data_start + seg.info->begin + first * esize;
  for (uint64_t got = 0; got < raw->size();) {
    const ssize_t r =
        pread(fds[seg.file], raw->data() + got, raw->size() - got, static_cast<off_t>(at + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoToStatus(errno, "reading " + h.path);
    if (r == 0) return DataLossError(h.path + " ends inside tensor '" + seg.info->key + "'");
    got += static_cast<uint64_t>(r);
  }
  kernels::CastToF32(raw->data(), d, out, n);
  return OkStatus();
}

// Streams `segs` (per entry, in the writer's order) from `files` through `w`, as `out`.
Status CopyValues(const weights::WeightFiles& files,
                  const std::vector<std::vector<CopySegment>>& segs, kernels::DType out,
                  weights::ShardWriter& w) {
  std::vector<int> fds;
  Status st;
  for (const weights::Header& h : files.files) {
    fds.push_back(open(h.path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fds.back() < 0) st = ErrnoToStatus(errno, "opening " + h.path);
  }
  constexpr uint64_t kPiece = 4 << 20;  // elements converted at once
  std::vector<char> raw;
  std::vector<float> values;
  std::vector<uint16_t> low;
  auto put = [&](const float* v, uint64_t n) {
    if (out == kernels::DType::kF32) return w.Put(v, n * 4);
    low.resize(n);
    kernels::CastFromF32(v, low.data(), out, n);
    return w.Put(low.data(), n * 2);
  };
  for (size_t i = 0; i < w.order().size() && st.ok(); ++i) {
    for (const CopySegment& seg : segs[w.order()[i]]) {
      if (seg.transpose) {  // [R, C] read whole, written as [C, R]
        const uint64_t rows = seg.info->shape[0], cols = seg.info->shape[1];
        std::vector<float> held(seg.numel), flipped(seg.numel);
        st = ReadValues(files, fds, seg, 0, seg.numel, &raw, held.data());
        for (uint64_t c = 0; c < cols && st.ok(); ++c) {
          for (uint64_t r = 0; r < rows; ++r) flipped[c * rows + r] = held[r * cols + c];
        }
        if (st.ok()) st = put(flipped.data(), seg.numel);
        continue;
      }
      for (uint64_t done = 0; done < seg.numel && st.ok(); done += kPiece) {
        const uint64_t n = std::min(kPiece, seg.numel - done);
        values.resize(n);
        st = ReadValues(files, fds, seg, seg.offset + done, n, &raw, values.data());
        if (st.ok()) st = put(values.data(), n);
      }
    }
  }
  for (int fd : fds) {
    if (fd >= 0) close(fd);
  }
  if (!st.ok()) return st;
  return w.Finish();
}

// entries: [(key, shape, [(source key, element offset, numel, transpose)])] — each entry's
// elements taken from the source tensors in order, converted from F32/BF16/F16 to `dtype`
// (rounded to nearest even). Everything is checked before the first byte is written.
void Copy(const std::string& src, const std::string& dst, const py::list& entries,
          const std::string& dtype, uint64_t max_shard_bytes) {
  const weights::WeightFiles files = Check(weights::OpenWeights(src));
  const std::optional<weights::DType> d = weights::ParseDType(dtype);
  if (!d || !ValueDType(*d)) throw py::value_error("copy_weights: unknown dtype '" + dtype + "'");
  std::vector<weights::ShardEntry> out;
  std::vector<std::vector<CopySegment>> segs;
  for (const py::handle& e : entries) {
    const py::tuple et = e.cast<py::tuple>();
    weights::ShardEntry entry{et[0].cast<std::string>(), *d, {}};
    for (int64_t x : et[1].cast<std::vector<int64_t>>()) entry.shape.push_back(x);
    const std::string where = "copy_weights: '" + entry.key + "'";
    uint64_t covered = 0;
    segs.emplace_back();
    for (const py::handle& sg : et[2].cast<py::list>()) {
      const py::tuple st = sg.cast<py::tuple>();
      CopySegment seg;
      const std::string key = st[0].cast<std::string>();
      seg.info = files.Find(key, &seg.file);
      if (seg.info == nullptr)
        throw py::value_error(where + ": " + src + " has no key '" + key + "'");
      seg.offset = st[1].cast<uint64_t>();
      seg.numel = st[2].cast<uint64_t>();
      seg.transpose = st[3].cast<bool>();
      const std::string of = where + " from '" + key + "' in " + files.FileOf(key);
      if (!ValueDType(seg.info->dtype)) {
        throw py::value_error(of + ": " + std::string(weights::DTypeName(seg.info->dtype)) +
                              " is not a value dtype (F32, BF16, F16)");
      }
      if (seg.offset > seg.info->numel || seg.numel > seg.info->numel - seg.offset ||
          (seg.transpose && (seg.info->shape.size() != 2 || seg.numel != seg.info->numel))) {
        throw py::value_error(of + ": the elements asked for are not in it");
      }
      covered += seg.numel;
      segs.back().push_back(seg);
    }
    if (covered != entry.numel()) {
      throw py::value_error(where + " has " + std::to_string(entry.numel()) +
                            " elements, its sources " + std::to_string(covered));
    }
    out.push_back(std::move(entry));
  }
  weights::ShardWriterOptions o;
  o.max_shard_bytes = max_shard_bytes;
  Status st;
  {
    py::gil_scoped_release nogil;
    StatusOr<std::unique_ptr<weights::ShardWriter>> w = weights::ShardWriter::Create(dst, out, o);
    st = w.ok() ? CopyValues(files, segs, *ValueDType(*d), **w) : w.status();
  }
  Check(st);
}

}  // namespace

void RegisterWeights(py::module_& m, std::function<Session&(const py::handle&)> session_of) {
  m.def("weights_inspect", &Inspect, py::arg("path"));
  m.def(
      "load_weights",
      [session_of](const py::handle& session, const std::string& path, bool strict,
                   const std::vector<std::vector<std::string>>& aliases,
                   const std::vector<std::string>& ignore, const py::object& targets,
                   uint64_t request_bytes, int depth, bool serving) {
        return Load(session_of(session), path, strict, aliases, ignore, targets, request_bytes,
                    depth, serving);
      },
      py::arg("session"), py::arg("path"), py::arg("strict") = true,
      py::arg("aliases") = std::vector<std::vector<std::string>>{},
      py::arg("ignore") = std::vector<std::string>{}, py::arg("targets") = py::none(),
      py::arg("request_bytes") = 8 * kMiB, py::arg("depth") = 4, py::arg("serving") = false);
  m.def(
      "save_weights",
      [session_of](const py::handle& session, const std::string& path, const py::list& entries,
                   const std::string& dtype, uint64_t max_shard_bytes, bool single_file) {
        Save(session_of(session), path, entries, dtype, max_shard_bytes, single_file);
      },
      py::arg("session"), py::arg("path"), py::arg("entries"), py::arg("dtype") = "F32",
      py::arg("max_shard_bytes") = 5'000'000'000ull, py::arg("single_file") = false);
  m.def("read_weight_tensors", &ReadTensors, py::arg("path"), py::arg("keys"));
  m.def("copy_weights", &Copy, py::arg("src"), py::arg("dst"), py::arg("entries"),
        py::arg("dtype") = "F32", py::arg("max_shard_bytes") = 5'000'000'000ull);
}

}  // namespace tiermem::torch_ext
