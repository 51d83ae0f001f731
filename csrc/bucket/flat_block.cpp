#include "bucket/flat_block.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <numeric>

namespace decentpy {

std::pair<at::Tensor, std::vector<at::Tensor>> make_flat_block(
    const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets, int64_t total,
    bool copy_values) {
  TORCH_CHECK(!tensors.empty(), "make_flat_block: tensors is empty (need at least one tensor)");
  TORCH_CHECK(tensors.size() == offsets.size(), "make_flat_block: got ", tensors.size(),
              " tensors but ", offsets.size(), " offsets");
  TORCH_CHECK(total >= 0, "make_flat_block: total must be >= 0, got ", total);
  const at::Tensor& first = tensors[0];
  TORCH_CHECK(first.defined(), "make_flat_block: tensors[0] is undefined (None)");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), "make_flat_block: tensors[", i, "] is undefined (None)");
    TORCH_CHECK(t.scalar_type() == first.scalar_type(), "make_flat_block: tensors[", i,
                "] has dtype ", t.scalar_type(), " but tensors[0] has dtype ", first.scalar_type(),
                "; a bucket holds a single dtype");
    TORCH_CHECK(t.device() == first.device(), "make_flat_block: tensors[", i, "] (dtype ",
                t.scalar_type(), ") is on ", t.device(), " but tensors[0] is on ", first.device(),
                "; a bucket lives on a single device");
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + t.numel() <= total, "make_flat_block: tensors[",
                i, "] (dtype ", t.scalar_type(), ", ", t.numel(), " elements) at offset ",
                offsets[i], " does not fit in a block of ", total, " elements");
  }
  // Views must not overlap.
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return offsets[a] < offsets[b]; });
  for (size_t k = 1; k < order.size(); ++k) {
    const size_t prev = order[k - 1], cur = order[k];
    TORCH_CHECK(offsets[prev] + tensors[prev].numel() <= offsets[cur], "make_flat_block: tensors[",
                prev, "] (offset ", offsets[prev], ", ", tensors[prev].numel(),
                " elements) overlaps tensors[", cur, "] (offset ", offsets[cur], ")");
  }

  c10::NoGradGuard no_grad;
  at::Tensor block = at::zeros({total}, first.options());
  std::vector<at::Tensor> views;
  views.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    at::Tensor v;
    if (t.is_non_overlapping_and_dense()) {
      v = block.as_strided(t.sizes(), t.strides(), offsets[i]);
    } else {
      v = block.narrow(0, offsets[i], t.numel()).view(t.sizes());
    }
    if (copy_values) v.copy_(t);
    views.push_back(std::move(v));
  }
  return {std::move(block), std::move(views)};
}

}  // namespace decentpy
