#include "bucket/bucket_plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace decentpy {

std::vector<std::vector<int64_t>> assign_buckets(const std::vector<int64_t>& size_bytes,
                                                 const std::vector<int64_t>& keys,
                                                 int64_t cap_bytes) {
  if (size_bytes.size() != keys.size()) {
    throw std::invalid_argument("assign_buckets: size_bytes has " +
                                std::to_string(size_bytes.size()) + " entries but keys has " +
                                std::to_string(keys.size()));
  }
  const int64_t n = static_cast<int64_t>(size_bytes.size());
  std::vector<std::vector<int64_t>> out;
  if (cap_bytes <= 0) {
    out.reserve(n);
    for (int64_t i = 0; i < n; ++i) out.push_back({i});
    return out;
  }
  struct Open {
    std::vector<int64_t> members;
    int64_t bytes = 0;
  };
  std::unordered_map<int64_t, Open> open;
  for (int64_t i = 0; i < n; ++i) {
    if (size_bytes[i] < 0) {
      throw std::invalid_argument("assign_buckets: size_bytes[" + std::to_string(i) +
                                  "] is negative (" + std::to_string(size_bytes[i]) + ")");
    }
    Open& b = open[keys[i]];
    b.members.push_back(i);
    b.bytes += size_bytes[i];
    if (b.bytes >= cap_bytes) {
      out.push_back(std::move(b.members));
      open.erase(keys[i]);
    }
  }
  // Close the remaining buckets in the order of their first tensor.
  std::vector<std::vector<int64_t>> rest;
  rest.reserve(open.size());
  for (auto& kv : open) rest.push_back(std::move(kv.second.members));
  std::sort(rest.begin(), rest.end(),
            [](const std::vector<int64_t>& a, const std::vector<int64_t>& b) { return a[0] < b[0]; });
  for (auto& r : rest) out.push_back(std::move(r));
  return out;
}

std::pair<std::vector<int64_t>, int64_t> aligned_offsets(const std::vector<int64_t>& numels,
                                                         int64_t element_size,
                                                         int64_t align_bytes) {
  if (element_size <= 0) {
    throw std::invalid_argument("aligned_offsets: element_size must be positive, got " +
                                std::to_string(element_size));
  }
  int64_t align = 1;
  if (align_bytes > element_size && align_bytes % element_size == 0) align = align_bytes / element_size;
  auto round_up = [align](int64_t x) { return (x + align - 1) / align * align; };
  std::vector<int64_t> offsets;
  offsets.reserve(numels.size());
  int64_t cur = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    if (numels[i] < 0) {
      throw std::invalid_argument("aligned_offsets: numels[" + std::to_string(i) +
                                  "] is negative (" + std::to_string(numels[i]) + ")");
    }
    cur = round_up(cur);
    offsets.push_back(cur);
    cur += numels[i];
  }
  return {std::move(offsets), round_up(cur)};
}

}  // namespace decentpy
