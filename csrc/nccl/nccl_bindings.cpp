// Python bindings of the NCCL communicator (called from csrc/bindings.cpp as bind_nccl(m)).
//
// Compiles in every configuration. Without CUDA + NCCL support, nccl_available() is False,
// nccl_info() says why, and NcclCommunicator / nccl_get_unique_id raise a RuntimeError naming
// the reason; nccl_load_library still finds and loads libnccl (nccl_loader.h needs no nccl.h), so
// its error -- every file tried, what to install or set -- is the same in every build. With it,
// tensors are validated here (CUDA, the communicator's device, contiguous, supported dtype) and
// the compute stream is torch's current stream of that device, taken from the device guard (no
// CUDA headers needed in this file).
#include <torch/extension.h>

#include <ATen/MemoryOverlap.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "nccl/nccl_communicator.h"
#include "nccl/nccl_loader.h"

namespace py = pybind11;

namespace decentpy {

namespace {

const char* unavailable_reason() {
#if defined(DECENTPY_HAVE_NCCL_COMM)
  return "";
#elif !defined(DECENTPY_WITH_CUDA)
  return "decentpy._C was built without CUDA (no nvcc at build time, or DECENTPY_NO_CUDA=1), so "
         "without its NCCL communicator; rebuild with the CUDA toolkit and NCCL headers";
#else
  return "decentpy._C was built without NCCL support: nccl.h was not found at build time (install "
         "the nvidia-nccl-cu12 / nvidia-nccl-cu13 wheel, or set NCCL_HOME, then rebuild), or "
         "DECENTPY_NO_NCCL=1 was set";
#endif
}

#ifdef DECENTPY_HAVE_NCCL_COMM

nccl::DataType to_nccl_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return nccl::DataType::Float32;
    case at::kHalf: return nccl::DataType::Float16;
    case at::kBFloat16: return nccl::DataType::BFloat16;
    case at::kDouble: return nccl::DataType::Float64;
    case at::kInt: return nccl::DataType::Int32;
    case at::kLong: return nccl::DataType::Int64;
    case at::kChar: return nccl::DataType::Int8;
    case at::kByte: return nccl::DataType::UInt8;
    default:
      TORCH_CHECK(false, what, " has dtype ", t.scalar_type(), "; the NCCL communicator supports "
                  "float32, bfloat16, float16, float64, int32, int64, int8 and uint8");
  }
  return nccl::DataType::Float32;
}

void check_tensor(const at::Tensor& t, int device, const char* what) {
  TORCH_CHECK(t.defined(), what, " is undefined");
  TORCH_CHECK(t.is_cuda(), what, " must be a CUDA tensor for the NCCL communicator, got one on ",
              t.device());
  TORCH_CHECK(t.device().index() == device, what, " is on ", t.device(),
              " but the NCCL communicator uses cuda:", device);
  TORCH_CHECK(t.layout() == at::kStrided, what, " must be a dense (strided) tensor");
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous, got sizes ", t.sizes(), " and strides ",
              t.strides());
}

void* current_stream(int device) {
  return c10::impl::getDeviceGuardImpl(c10::kCUDA)
      ->getStream(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)))
      .native_handle();
}

std::vector<std::string> default_candidates() { return {}; }

#endif  // DECENTPY_HAVE_NCCL_COMM

}  // namespace

void bind_nccl(py::module& m) {
  // A RuntimeError subclass: an NCCL communicator failed (timeout naming the peer, asynchronous
  // NCCL error, abort). Registered in every build so Python code can always name it.
  py::register_exception<nccl::NcclCommError>(m, "NcclCommError", PyExc_RuntimeError);

  m.def("nccl_available", []() {
#ifdef DECENTPY_HAVE_NCCL_COMM
    return true;
#else
    return false;
#endif
  }, "Whether this build of decentpy._C contains the NCCL communicator (compile time: CUDA and "
     "nccl.h were found). The library itself is loaded at run time (see nccl_load_library).");

  m.def("nccl_info", []() {
    py::dict d;
#ifdef DECENTPY_HAVE_NCCL_COMM
    d["compiled"] = true;
    d["reason"] = std::string(unavailable_reason());  // ""
    d["header_version"] = nccl::header_version();
    d["loaded"] = nccl::library_loaded();
    d["library"] = nccl::library_path();
    d["version"] = nccl::library_version();
#else
    d["compiled"] = false;
    d["reason"] = std::string(unavailable_reason());
    d["header_version"] = 0;
    d["loaded"] = false;
    d["library"] = std::string();
    d["version"] = 0;
#endif
    return d;
  }, "Build- and run-time NCCL facts: compiled, reason (why not compiled), header_version, "
     "loaded, library (path), version (of the loaded library).");

#ifdef DECENTPY_HAVE_NCCL_COMM
  m.def("nccl_load_library", [](const std::vector<std::string>& candidates) {
    {
      py::gil_scoped_release nogil;
      nccl::load_library(candidates);
    }
    return nccl::library_path();
  }, py::arg("candidates") = default_candidates(),
     "dlopen libnccl: the copy already loaded in the process (torch's), else the candidate paths "
     "in order, else the loader's search path. Returns the loaded file; raises RuntimeError "
     "listing every attempt when none is usable. Idempotent.");

  m.def("nccl_get_unique_id", []() {
    std::string id;
    {
      py::gil_scoped_release nogil;
      id = nccl::get_unique_id();
    }
    return py::bytes(id);
  }, "ncclGetUniqueId as bytes (share it with every rank, then construct NcclCommunicator).");

  py::class_<nccl::NcclWork>(m, "NcclWork",
                             "An NCCL operation in flight on a communicator's stream.")
      .def("wait", [](nccl::NcclWork& w, int64_t timeout_ms) {
        void* stream = current_stream(w.device());
        py::gil_scoped_release nogil;
        w.wait(stream, timeout_ms);
      }, py::arg("timeout_ms") = 0,
         "Make torch's current stream (of the communicator's device) wait for the operation "
         "(no host synchronisation). timeout_ms > 0 shortens the operation's deadline, which the "
         "watchdog enforces by aborting the communicator. Raises NcclCommError if the "
         "communicator failed.")
      .def("synchronize", &nccl::NcclWork::synchronize, py::arg("timeout_ms") = 0,
           py::call_guard<py::gil_scoped_release>(),
           "Block the host until the operation completes, at most timeout_ms (<= 0: the "
           "communicator's timeout); on timeout abort the communicator and raise NcclCommError "
           "naming the peer(s).")
      .def("is_completed", &nccl::NcclWork::is_completed, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("label", &nccl::NcclWork::label)
      .def_property_readonly("peers", &nccl::NcclWork::peers)
      .def_property_readonly("device", &nccl::NcclWork::device);

  py::class_<nccl::NcclCommunicator>(m, "NcclCommunicator",
                                     "decentpy's NCCL communicator (dedicated stream, watchdog, "
                                     "bounded waits). See csrc/nccl/nccl_communicator.h.")
      .def(py::init([](py::bytes unique_id, int rank, int nranks, int device, int64_t timeout_ms,
                       bool blocking, const std::string& name) {
             std::string id = unique_id;
             py::gil_scoped_release nogil;
             return std::make_unique<nccl::NcclCommunicator>(id, rank, nranks, device, timeout_ms,
                                                             blocking, name);
           }),
           py::arg("unique_id"), py::arg("rank"), py::arg("nranks"), py::arg("device"),
           py::arg("timeout_ms"), py::arg("blocking") = false, py::arg("name") = "world",
           "Collective over nranks processes holding the same unique_id (nccl_get_unique_id). "
           "Bounded by timeout_ms unless blocking=True.")
      .def("exchange", [](nccl::NcclCommunicator& c, const at::Tensor& send,
                          const at::Tensor& recv, int peer, const std::string& label) {
        check_tensor(send, c.device(), "NCCL exchange: send");
        check_tensor(recv, c.device(), "NCCL exchange: recv");
        const nccl::DataType dt = to_nccl_dtype(send, "NCCL exchange: send");
        TORCH_CHECK(recv.scalar_type() == send.scalar_type(), "NCCL exchange: recv has dtype ",
                    recv.scalar_type(), " but send has ", send.scalar_type());
        TORCH_CHECK(recv.numel() == send.numel(), "NCCL exchange: recv has ", recv.numel(),
                    " elements but send has ", send.numel());
        TORCH_CHECK(at::get_overlap_status(send, recv) == at::MemOverlapStatus::No || send.numel() == 0,
                    "NCCL exchange: send and recv must not share memory");
        void* stream = current_stream(c.device());
        const void* sp = send.data_ptr();
        void* rp = recv.data_ptr();
        const int64_t n = send.numel();
        py::gil_scoped_release nogil;
        return c.exchange(sp, rp, n, dt, peer, stream, label);
      }, py::arg("send"), py::arg("recv"), py::arg("peer"), py::arg("label") = "exchange",
         "Grouped ncclSend(send -> peer) + ncclRecv(recv <- peer) on the communicator's stream, "
         "after the work queued so far on torch's current stream. Returns an NcclWork.")
      .def("all_reduce", [](nccl::NcclCommunicator& c, const at::Tensor& t,
                            const std::string& label) {
        check_tensor(t, c.device(), "NCCL all_reduce: tensor");
        const nccl::DataType dt = to_nccl_dtype(t, "NCCL all_reduce: tensor");
        void* stream = current_stream(c.device());
        void* p = t.data_ptr();
        const int64_t n = t.numel();
        py::gil_scoped_release nogil;
        return c.all_reduce(p, n, dt, stream, label);
      }, py::arg("tensor"), py::arg("label") = "all_reduce",
         "In-place sum over the communicator (stream-ordered like exchange). Returns an NcclWork.")
      .def("split", &nccl::NcclCommunicator::split, py::arg("color"), py::arg("key"),
           py::arg("name") = "split", py::call_guard<py::gil_scoped_release>(),
           "ncclCommSplit, collective over this communicator: ranks with the same color >= 0 form "
           "a new communicator ordered by key; color < 0 (NCCL_SPLIT_NOCOLOR) returns None.")
      .def("abort", &nccl::NcclCommunicator::abort, py::arg("reason") = "aborted by the user",
           py::call_guard<py::gil_scoped_release>(),
           "ncclCommAbort; every later operation (and wait) raises NcclCommError with reason.")
      .def("close", &nccl::NcclCommunicator::close, py::call_guard<py::gil_scoped_release>(),
           "Finalize and destroy (bounded by the timeout; abort otherwise). Idempotent.")
      .def("check", &nccl::NcclCommunicator::check, py::call_guard<py::gil_scoped_release>(),
           "Raise NcclCommError if the communicator failed (polls ncclCommGetAsyncError).")
      .def("set_global_ranks", &nccl::NcclCommunicator::set_global_ranks, py::arg("ranks"),
           "Global rank of each communicator rank, for error messages.")
      .def_property_readonly("rank", &nccl::NcclCommunicator::rank)
      .def_property_readonly("size", &nccl::NcclCommunicator::size)
      .def_property_readonly("device", &nccl::NcclCommunicator::device)
      .def_property_readonly("timeout_ms", &nccl::NcclCommunicator::timeout_ms)
      .def_property_readonly("blocking", &nccl::NcclCommunicator::blocking)
      .def_property_readonly("aborted", &nccl::NcclCommunicator::aborted)
      .def_property_readonly("closed", &nccl::NcclCommunicator::closed)
      .def_property_readonly("error", &nccl::NcclCommunicator::error)
      .def_property_readonly("name", &nccl::NcclCommunicator::name)
      .def_property_readonly("outstanding", &nccl::NcclCommunicator::outstanding)
      .def_property_readonly("stream", [](const nccl::NcclCommunicator& c) {
        return reinterpret_cast<intptr_t>(c.stream());
      }, "The communicator's cudaStream_t as an int (torch.cuda.ExternalStream(stream)).");
#else
  const std::string reason = unavailable_reason();
  m.def("nccl_load_library", [](const std::vector<std::string>& candidates) {
    py::gil_scoped_release nogil;
    int version = 0;
    return nccl::open_library(candidates, [&version](void* h) { return nccl::check_version(h, &version); }).path;
  }, py::arg("candidates") = std::vector<std::string>(),
     "Without the communicator compiled in: dlopen a usable libnccl as an NCCL build would (the copy "
     "already loaded, the candidates, the loader's search path) and return its file, or raise "
     "RuntimeError listing every attempt. The communicator itself still needs an NCCL build.");
  m.def("nccl_get_unique_id", [reason](py::args, py::kwargs) -> py::object {
    throw std::runtime_error(reason);
  });
  m.def("NcclCommunicator", [reason](py::args, py::kwargs) -> py::object {
    throw std::runtime_error(reason);
  }, "Unavailable in this build (see nccl_info()['reason']).");
#endif
}

}  // namespace decentpy
