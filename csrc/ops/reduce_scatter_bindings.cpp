// Python bindings of the reduce-scatter bucket packing (called from csrc/bindings.cpp).
#include <torch/extension.h>

#include <pybind11/stl.h>

#include "ops/reduce_scatter_pack.h"

namespace py = pybind11;

namespace decentpy {

void bind_reduce_scatter(py::module& m) {
  m.def("pack_into_bucket", &pack_into_bucket, py::arg("bucket"), py::arg("offset"), py::arg("inputs"),
        py::call_guard<py::gil_scoped_release>(),
        "Copy inputs[r] (flattened, any strides) into bucket[r, offset:offset+numel] for every row r "
        "of a contiguous [world, shard_cap] bucket. All inputs must share the bucket's dtype and "
        "device and have the same numel; every check runs before any copy.");
}

}  // namespace decentpy
