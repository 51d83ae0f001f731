// Flat bucket blocks: one 1-D buffer per bucket, tensors become views into it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace decentpy {

// Returns a zero-filled 1-D block of `total` elements (dtype and device of tensors[0]) and, for
// each tensor, a view into the block starting at offsets[i] (in elements) with the tensor's
// sizes. Dense non-overlapping sources keep their strides (a channels_last parameter gets a
// channels_last view); others get contiguous strides. With copy_values the values are copied in.
// Errors on mixed dtypes/devices, on offsets out of range and on overlapping views.
std::pair<at::Tensor, std::vector<at::Tensor>> make_flat_block(
    const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets, int64_t total,
    bool copy_values);

}  // namespace decentpy
