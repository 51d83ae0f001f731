// Bucket assignment and aligned packing offsets. Pure C++ (no torch).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace decentpy {

// Greedy bucket assignment. Input: tensors in gradient-ready order, their sizes in bytes and a
// key per tensor (dtype/device id). One bucket is open per key; a tensor goes to its key's open
// bucket, which is closed once its size reaches cap_bytes (>=). cap_bytes <= 0: every tensor is
// its own bucket. Returns the buckets (lists of tensor indices) in the order they were closed;
// buckets still open at the end are closed in the order of their first tensor.
std::vector<std::vector<int64_t>> assign_buckets(const std::vector<int64_t>& size_bytes,
                                                 const std::vector<int64_t>& keys,
                                                 int64_t cap_bytes);

// Packing offsets (in elements) for tensors of `numels` elements placed one after the other in a
// flat buffer, each offset a multiple of align_bytes / element_size (align_bytes <= element_size
// or not a multiple of it: alignment of one element). Returns (offsets, total), total rounded up
// to the same alignment.
std::pair<std::vector<int64_t>, int64_t> aligned_offsets(const std::vector<int64_t>& numels,
                                                         int64_t element_size,
                                                         int64_t align_bytes);

}  // namespace decentpy
