// tiermem._C's doors to the kernels the session runs, as torch code can call them (tests
// compare the engine with them bit for bit; benchmarks race torch): the fused AdamW step, the
// gradient statistics, the compressed optimizer-state codecs, and the CPU kernels' thread
// pool and ISA.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <utility>

#include "integrations/torch/cpp/torch_pool.h"
#include "integrations/torch/csrc/bindings.h"
#include "integrations/torch/csrc/errors.h"
#include "integrations/torch/csrc/tensor_args.h"
#include "kernels/cpu/optim.h"
#include "runtime/device_kernels.h"

namespace py = pybind11;

namespace tiermem::torch_ext {
namespace {

kernels::AdamConfig AdamConfigOf(double lr, double beta1, double beta2, double eps,
                                 double weight_decay, int64_t step) {
  kernels::AdamConfig c;
  c.lr = static_cast<float>(lr);
  c.beta1 = static_cast<float>(beta1);
  c.beta2 = static_cast<float>(beta2);
  c.eps = static_cast<float>(eps);
  c.weight_decay = static_cast<float>(weight_decay);
  c.step = step;
  return c;
}

// The spans of four checked tensors (fp32 param and state; grad in its own dtype).
kernels::AdamSpans AdamSpansOf(torch::Tensor& param, torch::Tensor& grad, torch::Tensor& exp_avg,
                               torch::Tensor& exp_avg_sq) {
  kernels::AdamSpans s;
  s.param = param.data_ptr<float>();
  s.exp_avg = exp_avg.data_ptr<float>();
  s.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  s.grad = grad.data_ptr();
  s.grad_dtype = KernelDType(grad);
  s.n = static_cast<size_t>(param.numel());
  return s;
}

// One fused AdamW step where the tensors live — the kernels the session runs, as torch code
// can call them (tests compare the engine with them bit for bit; benchmarks race torch's fused
// AdamW). CPU tensors: kernels::AdamStep now, on this thread's pool. CUDA tensors: the
// device-placed step (session::DeviceAdamStep) enqueued on `stream`
// (torch.cuda.current_stream().cuda_stream; 0 = the legacy default stream); a build without
// CUDA raises there. Param and state are fp32, grad in its own dtype, `param_out` (the
// low-precision copy) bf16/fp16; all contiguous, of one size, on one device.
//
// Compressed state (kernels/cpu/optim.h "Compressed state"): exp_avg and exp_avg_sq as uint8
// codes with `exp_avg_absmax` / `exp_avg_sq_absmax` (fp32, one per `state_block` elements) for
// int8 state, or as bfloat16 for bf16 state (`stochastic` rounding keyed by `rounding_seed`).
void AdamStepBinding(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg,
                     torch::Tensor exp_avg_sq, std::optional<torch::Tensor> param_out, double lr,
                     double beta1, double beta2, double eps, double weight_decay, int64_t step,
                     double inv_loss_scale, double clip_factor, uintptr_t stream,
                     std::optional<torch::Tensor> exp_avg_absmax,
                     std::optional<torch::Tensor> exp_avg_sq_absmax, int64_t state_block,
                     bool stochastic, uint64_t rounding_seed) {
  const int64_t n = param.numel();
  const torch::Device dev = param.device();
  const bool cuda = dev.is_cuda();
  if (!cuda && !dev.is_cpu()) {
    throw py::value_error("adam_step: CPU or CUDA tensors expected, got " + dev.str());
  }
  const auto check = [&](const torch::Tensor& t, const char* what) {
    if (!t.is_contiguous() || t.device() != dev || t.numel() != n) {
      throw py::value_error(std::string("adam_step: ") + what + " must be a contiguous tensor " +
                            "of " + std::to_string(n) + " elements on " + dev.str() +
                            " like param");
    }
  };
  check(grad, "grad");
  // The state format, from the state tensors' dtype.
  kernels::StateFormat format;
  if (exp_avg.scalar_type() == torch::kUInt8) format.dtype = kernels::StateDType::kInt8;
  if (exp_avg.scalar_type() == torch::kBFloat16) format.dtype = kernels::StateDType::kBF16;
  format.block = static_cast<uint32_t>(state_block);
  format.stochastic = stochastic;
  const torch::ScalarType state_type =
      format.compressed() ? exp_avg.scalar_type() : torch::kFloat32;
  for (const auto& [t, what] : {std::pair<const torch::Tensor*, const char*>{&param, "param"},
                                {&exp_avg, "exp_avg"},
                                {&exp_avg_sq, "exp_avg_sq"}}) {
    check(*t, what);
    const torch::ScalarType want = t == &param ? torch::kFloat32 : state_type;
    if (t->scalar_type() != want) {
      const char* name = want == torch::kFloat32    ? "float32"
                         : want == torch::kBFloat16 ? "bfloat16"
                                                    : "uint8";
      throw py::value_error(std::string("adam_step: ") + what + " must be " + name +
                            (t == &param ? ""
                                         : " (m and v alike: float32, or compressed: "
                                           "bfloat16, or uint8 codes with their absmax)") +
                            ", got " + std::string(c10::toString(t->scalar_type())));
    }
  }
  kernels::AdamConfig c = AdamConfigOf(lr, beta1, beta2, eps, weight_decay, step);
  c.inv_loss_scale = static_cast<float>(inv_loss_scale);
  c.clip_factor = static_cast<float>(clip_factor);
  c.rounding_seed = rounding_seed;
  kernels::AdamSpans s;
  if (!format.compressed()) {
    s = AdamSpansOf(param, grad, exp_avg, exp_avg_sq);
  } else {
    s.param = param.data_ptr<float>();
    s.grad = grad.data_ptr();
    s.grad_dtype = KernelDType(grad);
    s.n = static_cast<size_t>(n);
    s.state = format;
    Check(kernels::ValidateStateFormat(format));
    float* absmax[2] = {nullptr, nullptr};
    if (format.dtype == kernels::StateDType::kInt8) {
      const int64_t blocks = static_cast<int64_t>(kernels::StateBlocks(format, n));
      int k = 0;
      for (const auto& [t, what] : {std::pair<std::optional<torch::Tensor>*, const char*>{
                                        &exp_avg_absmax, "exp_avg_absmax"},
                                    {&exp_avg_sq_absmax, "exp_avg_sq_absmax"}}) {
        if (!*t || !(*t)->is_contiguous() || (*t)->device() != dev ||
            (*t)->scalar_type() != torch::kFloat32 || (*t)->numel() != blocks) {
          throw py::value_error(std::string("adam_step: uint8 state needs ") + what +
                                ": a contiguous float32 tensor of " + std::to_string(blocks) +
                                " elements (one per block of " + std::to_string(state_block) + ")");
        }
        absmax[k++] = (*t)->data_ptr<float>();
      }
    }
    s.exp_avg_q = {exp_avg.data_ptr(), absmax[0]};
    s.exp_avg_sq_q = {exp_avg_sq.data_ptr(), absmax[1]};
  }
  if (param_out) {
    check(*param_out, "param_out");
    s.param_out = param_out->data_ptr();
    s.out_dtype = KernelDType(*param_out);
    if (s.out_dtype == kernels::DType::kF32) throw py::value_error("param_out must be bf16/fp16");
  }
  if (cuda) {
    Check(session::DeviceAdamStep(true, c, s, ComputeStream{stream}));
    return;
  }
  if (stream != 0) throw py::value_error("adam_step: a stream is for CUDA tensors only");
  Check(kernels::ValidateAdam(c, s));
  py::gil_scoped_release nogil;
  kernels::ScopedParallelFor pool(torch_pool::ForThisThread());
  kernels::AdamStep(c, s);
}

kernels::GradStats GradStatsBinding(torch::Tensor grad) {
  if (!grad.is_contiguous() || grad.device().type() != torch::kCPU) {
    throw py::value_error("grad must be a contiguous CPU tensor");
  }
  const kernels::DType dt = KernelDType(grad);
  kernels::GradStats st;
  {
    py::gil_scoped_release nogil;
    kernels::ScopedParallelFor pool(torch_pool::ForThisThread());
    st = kernels::GradNormAndOverflow(grad.data_ptr(), dt, static_cast<size_t>(grad.numel()));
  }
  return st;  // bound as GradStats (records.cc)
}

void BindAdam(py::module_& m) {
  m.def("adam_step", &AdamStepBinding, py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("param_out"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
        py::arg("inv_loss_scale") = 1.0, py::arg("clip_factor") = 1.0, py::arg("stream") = 0,
        py::arg("exp_avg_absmax") = py::none(), py::arg("exp_avg_sq_absmax") = py::none(),
        py::arg("state_block") = 256, py::arg("stochastic") = false, py::arg("rounding_seed") = 0);
  m.def("grad_stats", &GradStatsBinding);
}

// The compressed optimizer-state formats (kernels/cpu/optim.h "Compressed state"): the
// dynamic code maps, and blockwise quantization of fp32 values (int8: (codes, absmax);
// bf16: (bf16 values, None)) and back.
void BindStateCodecs(py::module_& m) {
  m.def(
      "dynamic_code",
      [](bool is_signed) {
        return torch::from_blob(const_cast<float*>(kernels::DynamicCode(is_signed)), {256},
                                torch::kFloat32)
            .clone();
      },
      py::arg("signed"));
  m.def(
      "quantize_state",
      [](const torch::Tensor& x, const std::string& dtype, int64_t block, bool is_signed,
         bool stochastic, uint64_t seed) {
        namespace k = kernels;
        if (!x.is_contiguous() || !x.device().is_cpu() || x.scalar_type() != torch::kFloat32) {
          throw py::value_error("quantize_state: a contiguous float32 CPU tensor");
        }
        k::StateFormat f{Check(k::ParseStateDType(dtype)), static_cast<uint32_t>(block),
                         stochastic};
        Check(k::ValidateStateFormat(f));
        const int64_t n = x.numel();
        torch::Tensor codes =
            torch::empty({n}, f.dtype == k::StateDType::kInt8   ? torch::kUInt8
                              : f.dtype == k::StateDType::kBF16 ? torch::kBFloat16
                                                                : torch::kFloat32);
        torch::Tensor absmax =
            torch::empty({static_cast<int64_t>(k::StateBlocks(f, n))}, torch::kFloat32);
        k::QuantizeState(f, is_signed, x.data_ptr<float>(),
                         {codes.data_ptr(), absmax.data_ptr<float>()}, static_cast<size_t>(n),
                         seed);
        return py::make_tuple(codes, f.dtype == k::StateDType::kInt8 ? py::object(py::cast(absmax))
                                                                     : py::object(py::none()));
      },
      py::arg("x"), py::arg("dtype"), py::arg("block") = 256, py::arg("signed") = true,
      py::arg("stochastic") = false, py::arg("seed") = 0);
  m.def(
      "dequantize_state",
      [](const torch::Tensor& codes, const std::optional<torch::Tensor>& absmax, int64_t block,
         bool is_signed) {
        namespace k = kernels;
        k::StateFormat f;
        if (codes.scalar_type() == torch::kUInt8)
          f.dtype = k::StateDType::kInt8;
        else if (codes.scalar_type() == torch::kBFloat16)
          f.dtype = k::StateDType::kBF16;
        else
          throw py::value_error("dequantize_state: uint8 codes (with absmax) or bfloat16");
        f.block = static_cast<uint32_t>(block);
        Check(k::ValidateStateFormat(f));
        const int64_t n = codes.numel();
        if (!codes.is_contiguous() || !codes.device().is_cpu() ||
            (f.dtype == k::StateDType::kInt8 &&
             (!absmax || !absmax->is_contiguous() || absmax->scalar_type() != torch::kFloat32 ||
              absmax->numel() != static_cast<int64_t>(k::StateBlocks(f, n))))) {
          throw py::value_error(
              "dequantize_state: contiguous CPU codes and, for uint8, float32 absmax "
              "of one value per block");
        }
        torch::Tensor out = torch::empty({n}, torch::kFloat32);
        k::DequantizeState(f, is_signed,
                           {codes.data_ptr(), absmax ? absmax->data_ptr<float>() : nullptr},
                           out.data_ptr<float>(), static_cast<size_t>(n));
        return out;
      },
      py::arg("codes"), py::arg("absmax") = py::none(), py::arg("block") = 256,
      py::arg("signed") = true);
}

// Where the CPU kernels run: their pool (torch's intra-op threads or their own), its width,
// and the ISA picked at load.
void BindKernelPool(py::module_& m) {
  m.def(
      "set_kernel_pool",
      [](const std::string& pool) {
        if (pool != "torch" && pool != "own") {
          throw py::value_error(
              "set_kernel_pool: 'torch' (torch's intra-op threads, the default) "
              "or 'own' (the kernels' oneTBB pool), not '" +
              pool + "'");
        }
        torch_pool::SetEnabled(pool == "torch");
      },
      "Where CPU optimizer calls from torch's thread run their tiles (torch_pool.h).");
  m.def("kernel_pool", [] { return std::string(torch_pool::Enabled() ? "torch" : "own"); });
  m.def("_torch_pool_width", &torch_pool::Width);
  m.def(
      "set_kernel_threads", [](int n) { kernels::SetKernelThreads(n); },
      "threads of the CPU kernels (0 = all cores)");
  m.def("kernel_isa", [] { return std::string(kernels::IsaName(kernels::KernelIsa())); });
}

}  // namespace

void BindKernels(py::module_& m) {
  BindAdam(m);
  BindStateCodecs(m);
  BindKernelPool(m);
}

}  // namespace tiermem::torch_ext
