// Python bindings of AsyncPipe's wire format (called from csrc/bindings.cpp).
#include <torch/extension.h>

#include <pybind11/stl.h>

#include "pipeline/message.h"

namespace py = pybind11;

namespace decentpy {

void bind_pipe_message(py::module& m) {
  using namespace decentpy::pipe;
  m.attr("PIPE_HEADER_SLOTS") = kHeaderSlots;
  m.def("pipe_dtypes", &dtypes, "The dtypes a pipeline message carries, by wire code.");
  m.def("pipe_header", &encode_header, py::arg("kind"), py::arg("mb"), py::arg("count"), py::arg("tensors"),
        py::arg("requires_grad"), py::arg("is_tuple"),
        "A pipeline message's header as an int64 CPU tensor (at least PIPE_HEADER_SLOTS long).");
  m.def(
      "pipe_decode",
      [](const std::vector<int64_t>& values) {
        Header h = decode_header(values);
        py::list specs;
        for (const auto& s : h.specs) {
          if (s)
            specs.append(py::make_tuple(s->dtype, s->requires_grad, s->shape));
          else
            specs.append(py::none());
        }
        return py::make_tuple(h.kind, h.mb, h.count, h.is_tuple, specs);
      },
      py::arg("values"),
      "A header's (kind, mb, count, is_tuple, specs): per tensor None or (dtype, requires_grad, shape).");
  m.def("pipe_header_length", &header_length, py::arg("values"),
        "A header's length in slots, read from its first PIPE_HEADER_SLOTS.");
  m.def("pipe_message_bytes", &message_bytes, py::arg("tensors"),
        "Bytes of the one-buffer message carrying these tensors (None: an absent one), header included.");
  m.def("pipe_pack", &pack, py::arg("buf"), py::arg("kind"), py::arg("mb"), py::arg("count"), py::arg("tensors"),
        py::arg("requires_grad"), py::arg("is_tuple"), py::call_guard<py::gil_scoped_release>(),
        "Write a one-buffer pipeline message into the uint8 CPU buffer buf.");
  m.def("pipe_unpack", &unpack, py::arg("buf"),
        "A one-buffer message: (kind, mb, count, is_tuple, tensors as views of buf, requires_grad).");
}

}  // namespace decentpy
