// Python bindings of decentpy._C (thin: all logic lives in csrc/ops, csrc/bucket, csrc/cpu).
#include <ATen/record_function.h>
#include <torch/extension.h>

#include <pybind11/stl.h>

#include <string>

#include "bucket/bucket_plan.h"
#include "bucket/flat_block.h"
#include "cpu/mix_and_step_cpu.h"
#include "ops/mix_and_step_op.h"
#include "ops/reduce_scatter_pack.h"
#ifdef DECENTPY_WITH_CUDA
#include "cuda/mix_and_step_cuda.h"
#endif

namespace py = pybind11;

namespace decentpy {
void bind_nccl(py::module& m);  // csrc/nccl/nccl_bindings.cpp
}  // namespace decentpy

namespace {

std::string compiler_string() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return "gcc " + std::to_string(__GNUC__) + "." + std::to_string(__GNUC_MINOR__) + "." +
         std::to_string(__GNUC_PATCHLEVEL__);
#elif defined(_MSC_VER)
  return "msvc " + std::to_string(_MSC_VER);
#else
  return "unknown";
#endif
}

py::dict build_info() {
  py::dict d;
  d["cpu_kernels"] = true;
#ifdef DECENTPY_WITH_CUDA
  d["cuda_kernels"] = true;
  d["cuda_archs"] = std::string(decentpy::cuda::compiled_archs());
#else
  d["cuda_kernels"] = false;
  d["cuda_archs"] = std::string();
#endif
#ifdef DECENTPY_WITH_NCCL
  d["nccl"] = true;
#else
  d["nccl"] = false;
#endif
#ifdef _OPENMP
  d["openmp"] = true;
#else
  d["openmp"] = false;
#endif
  // fp32 lanes of the CPU kernels actually in use (they pick AVX2/AVX512 at run time).
  d["vector_width_fp32"] = static_cast<int64_t>(decentpy::cpu_kernel_vector_width());
  d["compiler"] = compiler_string();
  // Extra: the instruction set the CPU kernels picked at run time (default/avx2/avx512).
  d["cpu_kernel_isa"] = std::string(decentpy::cpu_kernel_isa());
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "decentpy C++ extension: fused mix-and-step kernels and bucket packing";

  m.def("mix_and_step", &decentpy::mix_and_step, py::arg("kind"), py::arg("param"),
        py::arg("grad"), py::arg("states"), py::arg("comm"), py::arg("send"), py::arg("segments"),
        py::arg("hyper"), py::arg("mix_a"), py::arg("mix_b"), py::arg("send_scale"),
        py::arg("grad_scale"), py::arg("decoupled_weight_decay"), py::arg("momentum_init"),
        py::arg("accum_boundary"), py::arg("skip_update"), py::arg("zero_grad") = false,
        py::call_guard<py::gil_scoped_release>(),
        "Fused mix + optimizer step + send-buffer write over one flat bucket (in place). "
        "kind: 0 None, 1 SGD, 2 Adam, 3 AccumAdam. hyper rows: [lr, weight_decay, momentum, "
        "dampening, nesterov, beta1, beta2, eps, bias_correction1, bias_correction2_sqrt, "
        "accum_scale]. zero_grad: write 0 to each grad element right after reading it (same "
        "pass; also with skip_update / kind None, where grad is only zeroed).");

  m.def("check_segments", &decentpy::check_segments, py::arg("segments"), py::arg("numel"),
        py::arg("num_groups"),
        "Validate a CPU segment table (sorted, disjoint, covering [0, numel), groups < num_groups) "
        "before it is copied to the GPU.");

  m.def("scale_copy_", &decentpy::scale_copy_, py::arg("dst"), py::arg("src"), py::arg("alpha"),
        py::call_guard<py::gil_scoped_release>(), "dst = alpha * src (dst may be src).");

  m.def("assign_buckets", &decentpy::assign_buckets, py::arg("size_bytes"), py::arg("keys"),
        py::arg("cap_bytes"),
        "Greedy bucket assignment in gradient-ready order, one open bucket per key; returns "
        "lists of tensor indices in closing order.");

  m.def("aligned_offsets", &decentpy::aligned_offsets, py::arg("numels"), py::arg("element_size"),
        py::arg("align_bytes"),
        "Element offsets aligned to align_bytes, and the (aligned) total number of elements.");

  m.def("make_flat_block", &decentpy::make_flat_block, py::arg("tensors"), py::arg("offsets"),
        py::arg("total"), py::arg("copy_values"),
        "Zero-filled flat block plus one view per tensor (strides kept when dense).");

  m.def("build_info", &build_info, "What this build of decentpy._C contains.");

  // at::RecordFunctionGuard has no Python binding; the exchange launcher needs it (see
  // decentpy/comm.py: a c10d Work started under the profiler ends its RecordFunction in wait(),
  // possibly after the profiler freed the event storage).
  m.def("record_function_enabled", &at::isRecordFunctionEnabled,
        "Whether RecordFunction (profiler) callbacks run on this thread.");
  m.def("set_record_function_enabled", &at::enableRecordFunction, py::arg("enable"),
        "Enable or disable RecordFunction callbacks on this thread (thread-local).");

  decentpy::bind_reduce_scatter(m);
  decentpy::bind_nccl(m);
}
