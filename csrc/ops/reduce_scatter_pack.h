// Packing of small reduce-scatter inputs into a [world, shard_cap] bucket (used by
// decentpy.ReduceScatterBucketer): many small reduce-scatters become one collective.
#pragma once

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

namespace decentpy {

// Copies inputs[r] (read in its logical, row-major order, any strides) into
// bucket[r, offset : offset + numel] for every rank r.
//
// bucket: contiguous 2-D [world, shard_cap] strided tensor.
// inputs: exactly `world` tensors with the bucket's dtype and device and the same numel
//         (inputs[0] is the shard shape), none overlapping the bucket.
// Requires 0 <= offset and offset + numel <= shard_cap. Every check runs before any copy, so
// a bad call leaves the bucket untouched. Copies run on the current stream of the bucket's device.
void pack_into_bucket(const at::Tensor& bucket, int64_t offset, const std::vector<at::Tensor>& inputs);

// Registers pack_into_bucket on the extension module (defined in reduce_scatter_bindings.cpp).
void bind_reduce_scatter(pybind11::module& m);

}  // namespace decentpy
