// Python bindings of decentpy._C (thin: all logic lives in csrc/ops, csrc/bucket, csrc/cpu).
#include <ATen/record_function.h>
#include <torch/extension.h>

#include <pybind11/stl.h>

#include <stdexcept>
#include <string>

#include "bucket/bucket_plan.h"
#include "bucket/flat_block.h"
#include "cpu/mix_and_step_cpu.h"
#include "cuda/cuda_driver.h"
#include "ops/mix_and_step_op.h"
#include "ops/reduce_scatter_pack.h"
#include "kernels/update.h"
#include "kernels/peer_check.h"
#ifdef DECENTPY_WITH_CUDA
#include "cuda/mix_and_step_cuda.h"
#endif

namespace py = pybind11;

namespace decentpy {
void bind_nccl(py::module& m);          // csrc/nccl/nccl_bindings.cpp
void bind_pipe_message(py::module& m);  // csrc/pipeline/message_bindings.cpp
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
  // Why that is not torch's CPU capability ("" when it is): e.g. ATEN_CPU_CAPABILITY=avx512 on a
  // CPU without AVX-512.
  d["cpu_kernel_isa_note"] = decentpy::cpu_kernel_isa_note();
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "decentpy C++ extension: fused mix-and-step kernels and bucket packing";

  // The kernel contract's types, bound rather than copied: Python reads them from here.
  py::enum_<decentpy::OptKind>(m, "OptKind", "Optimizer update run by the fused kernel.")
      .value("NONE", decentpy::OptKind::None)
      .value("SGD", decentpy::OptKind::SGD)
      .value("ADAM", decentpy::OptKind::Adam)
      .value("ACCUM_ADAM", decentpy::OptKind::AccumAdam);
  m.attr("MAX_GROUPS") = decentpy::kMaxGroups;

  using decentpy::GroupHyper;
  py::class_<GroupHyper>(m, "GroupHyper",
                         "Hyper-parameters of one parameter group for one step (kernels/mix_and_step.h).")
      .def(py::init([](float lr, float weight_decay, float momentum, float dampening, bool nesterov,
                       float beta1, float beta2, float eps, int64_t bias_step, int32_t accum_iter,
                       bool no_update) {
             GroupHyper h;
             h.lr = lr;
             h.weight_decay = weight_decay;
             h.momentum = momentum;
             h.dampening = dampening;
             h.nesterov = nesterov ? 1 : 0;
             h.beta1 = beta1;
             h.beta2 = beta2;
             h.eps = eps;
             h.bias_step = bias_step;
             h.accum_iter = accum_iter;
             h.no_update = no_update ? 1 : 0;
             return h;
           }),
           py::kw_only(), py::arg("lr") = 0.f, py::arg("weight_decay") = 0.f, py::arg("momentum") = 0.f,
           py::arg("dampening") = 0.f, py::arg("nesterov") = false, py::arg("beta1") = 0.9f,
           py::arg("beta2") = 0.999f, py::arg("eps") = 1e-8f, py::arg("bias_step") = 1,
           py::arg("accum_iter") = 1, py::arg("no_update") = false)
      .def_readwrite("lr", &GroupHyper::lr)
      .def_readwrite("weight_decay", &GroupHyper::weight_decay)
      .def_readwrite("momentum", &GroupHyper::momentum)
      .def_readwrite("dampening", &GroupHyper::dampening)
      .def_property("nesterov", [](const GroupHyper& h) { return h.nesterov != 0; },
                    [](GroupHyper& h, bool v) { h.nesterov = v ? 1 : 0; })
      .def_readwrite("beta1", &GroupHyper::beta1)
      .def_readwrite("beta2", &GroupHyper::beta2)
      .def_readwrite("eps", &GroupHyper::eps)
      .def_readwrite("bias_step", &GroupHyper::bias_step)
      .def_readwrite("accum_iter", &GroupHyper::accum_iter)
      .def_property("no_update", [](const GroupHyper& h) { return h.no_update != 0; },
                    [](GroupHyper& h, bool v) { h.no_update = v ? 1 : 0; })
      .def("__repr__", [](const GroupHyper& h) {
        return "GroupHyper(lr=" + std::to_string(h.lr) + ", weight_decay=" + std::to_string(h.weight_decay) +
               ", momentum=" + std::to_string(h.momentum) + ", bias_step=" + std::to_string(h.bias_step) + ", ...)";
      });


  py::enum_<decentpy::Compressor>(m, "Compressor", "Compressor of the gossip exchange (kernels/mix_and_step.h).")
      .value("NONE", decentpy::Compressor::None)
      .value("BF16", decentpy::Compressor::BF16)
      .value("INT8", decentpy::Compressor::Int8)
      .value("INT4", decentpy::Compressor::Int4);
  m.attr("INT8_BLOCK") = decentpy::kInt8Block;  // also the int4 scale block
  m.attr("SPARSE_MAX_CHUNK") = decentpy::kSparseMaxChunk;  // a SparseLoCo chunk's most elements
  m.def("compressed_bytes",
        [](decentpy::Compressor c, int64_t n) { return decentpy::compressed_bytes(c, n); },
        py::arg("compressor"), py::arg("numel"), "Wire bytes of numel elements compressed with compressor.");

  // One fused pass's arguments, by name (StepCall in ops/mix_and_step_op.h: the one list); mix_and_step
  // takes them whole or as keyword arguments.
  using decentpy::StepCall;
  auto set_fields = [](StepCall& call, const py::kwargs& kw) {
    py::object obj = py::cast(&call, py::return_value_policy::reference);
    for (auto item : kw) {
      const std::string name = py::str(item.first);
      if (name.rfind("_", 0) == 0 || !py::hasattr(obj, name.c_str()))
        throw py::type_error("mix_and_step: unexpected argument '" + name + "'; the arguments are the fields of "
                             "decentpy._C.StepArgs (csrc/ops/mix_and_step_op.h StepCall)");
      obj.attr(name.c_str()) = item.second;
    }
  };
  py::class_<StepCall>(m, "StepArgs",
                       "The arguments of one fused pass (csrc/ops/mix_and_step_op.h StepCall): set by keyword.")
      .def(py::init([set_fields](const py::kwargs& kw) {
        StepCall call;
        set_fields(call, kw);
        return call;
      }))
      .def_readwrite("kind", &StepCall::kind)
      .def_readwrite("param", &StepCall::param)
      .def_readwrite("grad", &StepCall::grad)
      .def_readwrite("states", &StepCall::states)
      .def_readwrite("comm", &StepCall::comm)
      .def_readwrite("send", &StepCall::send)
      .def_readwrite("segments", &StepCall::segments)
      .def_readwrite("groups", &StepCall::groups)
      .def_readwrite("mix_a", &StepCall::mix_a)
      .def_readwrite("mix_b", &StepCall::mix_b)
      .def_readwrite("send_scale", &StepCall::send_scale)
      .def_readwrite("grad_scale", &StepCall::grad_scale)
      .def_readwrite("grad_norm", &StepCall::grad_norm)
      .def_readwrite("scaler_scale", &StepCall::scaler_scale)
      .def_readwrite("clip_norm", &StepCall::clip_norm)
      .def_readwrite("decoupled_weight_decay", &StepCall::decoupled_weight_decay)
      .def_readwrite("momentum_init", &StepCall::momentum_init)
      .def_readwrite("accum_boundary", &StepCall::accum_boundary)
      .def_readwrite("skip_update", &StepCall::skip_update)
      .def_readwrite("zero_grad", &StepCall::zero_grad)
      .def_readwrite("compressor", &StepCall::compressor)
      .def_readwrite("q_recv", &StepCall::q_recv)
      .def_readwrite("peer_copy", &StepCall::peer_copy)
      .def_readwrite("self_copy_mix", &StepCall::self_copy_mix)
      .def_readwrite("choco_mix", &StepCall::choco_mix)
      .def_readwrite("q_send", &StepCall::q_send)
      .def_readwrite("self_copy_next", &StepCall::self_copy_next)
      .def_readwrite("prev_skip", &StepCall::prev_skip)
      .def_readwrite("alt_bias_steps", &StepCall::alt_bias_steps)
      .def_readwrite("mix_factor", &StepCall::mix_factor)
      .def_readwrite("mix_guard", &StepCall::mix_guard)
      .def_readwrite("mix_guarded", &StepCall::mix_guarded);
  const char* mix_doc = "One fused pass over one flat bucket, in place: mix, optimizer step, send-buffer write (or, "
                        "with a compressor, the compressed-gossip pass). Takes a StepArgs or its fields as keyword "
                        "arguments. See csrc/kernels/mix_and_step.h for the contract.";
  m.def("mix_and_step", [](const StepCall& call) {
        py::gil_scoped_release release;
        decentpy::mix_and_step(call);
      }, py::arg("args"), mix_doc);
  m.def("mix_and_step", [set_fields](const py::kwargs& kw) {
        StepCall call;
        set_fields(call, kw);
        py::gil_scoped_release release;
        decentpy::mix_and_step(call);
      }, mix_doc);

  m.def("compressed_group_reduce", &decentpy::compressed_group_reduce, py::kw_only(), py::arg("compressor"),
        py::arg("inputs"), py::arg("out"), py::arg("self_copy"), py::arg("lo"), py::arg("hi"),
        py::call_guard<py::gil_scoped_release>(),
        "The owner's reduction of a compressed group exchange over the chunk [lo, hi): the members' q (wire "
        "bytes) averaged and re-quantised into out, the rounding kept in self_copy. See csrc/kernels/mix_and_step.h.");
  m.def("outer_pack", &decentpy::outer_pack, py::kw_only(), py::arg("param"), py::arg("theta"),
        py::arg("compressor"), py::arg("excess"), py::arg("out"), py::call_guard<py::gil_scoped_release>(),
        "The outer step's first pass: the pseudo-gradient theta - param into out (float32, or with a compressor "
        "its wire bytes, error-fed through excess). See csrc/kernels/outer_step.h.");
  m.def("outer_apply", &decentpy::outer_apply, py::kw_only(), py::arg("param"), py::arg("theta"),
        py::arg("theta_mix"), py::arg("compressor"), py::arg("delta"), py::arg("kind"), py::arg("hyper"),
        py::arg("states"), py::arg("decoupled_weight_decay"), py::arg("momentum_init"), py::arg("alpha"),
        py::call_guard<py::gil_scoped_release>(),
        "The outer step's second pass: the outer optimizer steps theta (or theta_mix) with the pseudo-gradient "
        "delta; theta and param take the result. See csrc/kernels/outer_step.h.");
  m.def("outer_decode", &decentpy::outer_decode, py::kw_only(), py::arg("compressor"), py::arg("wire"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>(),
        "out = D(wire): the float32 values of a compressed pseudo-gradient (the values outer_apply reads).");
  m.def("sparse_pack", &decentpy::sparse_pack, py::kw_only(), py::arg("param"), py::arg("theta"), py::arg("error"),
        py::arg("wire"), py::arg("chunk"), py::arg("k"), py::arg("decay"), py::call_guard<py::gil_scoped_release>(),
        "SparseLoCo's pack: error = decay * error + (theta - param); the chunk-wise top-k of error in 2 bits into "
        "wire; what it sends taken out of error. See csrc/kernels/sparse.h.");
  m.def("sparse_mean", &decentpy::sparse_mean, py::kw_only(), py::arg("inputs"), py::arg("out"), py::arg("chunk"),
        py::arg("k"), py::call_guard<py::gil_scoped_release>(),
        "out = the mean of the members' SparseLoCo messages (decoded, added in their order, times 1/m).");
  m.def("sparse_wire_bytes", &decentpy::sparse_wire_bytes, py::kw_only(), py::arg("numel"), py::arg("chunk"),
        py::arg("k"), "Bytes of one SparseLoCo message of numel elements.");
  m.def("compressed_wire_regions", &decentpy::compressed_wire_regions, py::kw_only(), py::arg("compressor"),
        py::arg("numel"), py::arg("lo"), py::arg("hi"),
        "The byte ranges [start, stop) of elements [lo, hi) (lo a multiple of INT8_BLOCK) in the wire of numel "
        "elements: the block scales, then the codes (bf16: one range).");

  m.def("peer_stats", &decentpy::peer_stats, py::arg("param"), py::arg("comm"), py::arg("sample"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>(),
        "The peer check's statistics of comm (optional) against param in one pass: out's last PEER_STATS "
        "float64 values are sum (c - p)^2, sum p^2, and the non-finite indicators of c and p (0, or NaN). "
        "See csrc/kernels/peer_check.h.");
  m.def("peer_sketch", &decentpy::peer_sketch, py::arg("src"), py::arg("seed"), py::arg("slots"), py::arg("sample"),
        py::arg("out"),
        py::call_guard<py::gil_scoped_release>(),
        "The peer check's linear sketch of src into slots float64 values, then sum src^2 and the non-finite "
        "indicator (out's last slots + 2 values). See csrc/kernels/peer_check.h.");
  m.def("peer_mix",
        [](float a, float b, float f) {
          const decentpy::PeerMix m = decentpy::peer_mix(a, b, f);
          return py::make_tuple(m.a, m.b, m.reads_comm);
        },
        py::arg("mix_a"), py::arg("mix_b"), py::arg("factor"),
        "(mix_a, mix_b, reads_comm) under the peer check's factor: the rule the kernels apply to mix_factor "
        "(kernels/update.h peer_mix).");
  m.attr("PEER_PARTS") = decentpy::kPeerParts;
  m.attr("PEER_STATS") = decentpy::kPeerStats;
  m.attr("SKETCH_MAX_SLOTS") = decentpy::kSketchMaxSlots;
  m.attr("SAMPLE_UNIT") = decentpy::kSampleUnit;
  m.def("peer_pair_verdict", &decentpy::peer_pair_verdict, py::arg("stats"), py::arg("expand"), py::arg("tau"),
        py::arg("first"), py::arg("clip"), py::arg("out"), py::call_guard<py::gil_scoped_release>(),
        "A pair's verdict into out: [f, d, tau, c_ok, p_ok] (kernels/peer_check.h pair_verdict; tau NaN: the "
        "first bound).");
  m.def("peer_group_verdict", &decentpy::peer_group_verdict, py::arg("fingerprints"), py::arg("recv"),
        py::arg("scale"), py::arg("unit_roundoff"), py::arg("tau"), py::arg("first"), py::arg("expand"),
        py::arg("out"), py::call_guard<py::gil_scoped_release>(),
        "A group's verdict into out: [f, consistent, tau, |center|, d_j..., bad_j...] (kernels/peer_check.h "
        "group_verdict; tau NaN: the first bound).");
  m.def("peer_sampled_count", [](int64_t n, int64_t sample) { return decentpy::sampled_count(n, sample); },
        py::arg("numel"), py::arg("sample"),
        "Elements the peer check's passes read of numel with one unit of SAMPLE_UNIT in every sample.");

  m.def("grad_factor",
        [](float norm, float scale, float clip) {
          const decentpy::GradFactor f = decentpy::grad_factor(norm, scale, clip);
          return py::make_tuple(f.factor, f.skip);
        },
        py::arg("norm"), py::arg("scale"), py::arg("clip"),
        "(factor, skip) for a bucket's gradient norm, the GradScaler's scale and the clip norm: the "
        "rule the kernels apply (kernels/update.h), for optimizers stepped outside the kernel.");

  m.def("check_segments", &decentpy::check_segments, py::arg("segments"), py::arg("numel"),
        py::arg("num_groups"),
        "Validate a CPU segment table (sorted, disjoint, covering [0, numel), groups < num_groups) "
        "before it is copied to the GPU.");

  m.def("scale_copy_", &decentpy::scale_copy_, py::arg("dst"), py::arg("src"), py::arg("alpha"),
        py::arg("sumsq") = py::none(), py::call_guard<py::gil_scoped_release>(),
        "dst = alpha * src (dst may be src); with sumsq (float32, NORM_SLOTS elements) also the partial "
        "sums of the squares of src, whose sum is its squared norm.");
  m.attr("NORM_SLOTS") = decentpy::kNormSlots;

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

  m.def("choose_cpu_isa", [](const std::string& torch_capability, bool cpu_avx2, bool cpu_avx512) {
    const auto c = decentpy::choose_cpu_isa_here(torch_capability, cpu_avx2, cpu_avx512);
    return py::make_tuple(std::string(c.isa), c.note);
  }, py::arg("torch_capability"), py::arg("cpu_avx2"), py::arg("cpu_avx512"),
     "(isa, note): the instruction set the CPU kernels would pick for torch's capability "
     "(\"DEFAULT\", \"AVX2\", \"AVX512\") on a CPU with those features, with this build's kernels; "
     "note says why it is not torch's choice (\"\" when it is). cpu_kernel_isa() is this rule "
     "applied to this CPU.");

  m.def("cuda_driver_problem", &decentpy::cuda::driver_problem, py::arg("driver_version"),
        py::arg("runtime_version"),
        "Why a driver supporting CUDA driver_version cannot be relied on to run a CUDA runtime "
        "runtime_version (1000 * major + 10 * minor; 0: no driver), or \"\" when it can.");
  m.def("cuda_driver_info", []() -> py::object {
#ifdef DECENTPY_WITH_CUDA
    const int driver = decentpy::cuda::driver_version();
    const int runtime = decentpy::cuda::runtime_version();
    py::dict d;
    d["driver_version"] = driver;
    d["runtime_version"] = runtime;
    d["problem"] = decentpy::cuda::driver_problem(driver, runtime);
    return std::move(d);
#else
    return py::none();
#endif
  }, "{driver_version, runtime_version, problem} of the installed driver and the CUDA runtime "
     "linked into this extension (None in a build without CUDA).");
  m.def("cuda_device_count", []() -> int {
#ifdef DECENTPY_WITH_CUDA
    return decentpy::cuda::device_count();
#else
    throw std::runtime_error(
        "decentpy._C was built without CUDA (no nvcc at build time, or DECENTPY_NO_CUDA=1)");
#endif
  }, "The CUDA devices this extension's own CUDA runtime sees; raises RuntimeError (the driver's and "
     "the runtime's CUDA releases, what to do) where the driver cannot run that runtime.");

  // at::RecordFunctionGuard has no Python binding; the exchange launcher needs it (see
  // decentpy/comm.py: a c10d Work started under the profiler ends its RecordFunction in wait(),
  // possibly after the profiler freed the event storage).
  m.def("record_function_enabled", &at::isRecordFunctionEnabled,
        "Whether RecordFunction (profiler) callbacks run on this thread.");
  m.def("set_record_function_enabled", &at::enableRecordFunction, py::arg("enable"),
        "Enable or disable RecordFunction callbacks on this thread (thread-local).");

  decentpy::bind_reduce_scatter(m);
  decentpy::bind_nccl(m);
  decentpy::bind_pipe_message(m);
}
