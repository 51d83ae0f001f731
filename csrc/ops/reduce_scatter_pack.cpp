#include "ops/reduce_scatter_pack.h"

#include <ATen/MemoryOverlap.h>
#include <c10/core/DeviceGuard.h>

namespace decentpy {

void pack_into_bucket(const at::Tensor& bucket, int64_t offset, const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(bucket.defined(), "pack_into_bucket: bucket is undefined");
  TORCH_CHECK(bucket.layout() == at::kStrided, "pack_into_bucket: bucket has layout ", bucket.layout(),
              "; it must be a strided (dense) tensor");
  TORCH_CHECK(bucket.dim() == 2, "pack_into_bucket: bucket must be 2-D [world, shard_cap], got sizes ",
              bucket.sizes());
  TORCH_CHECK(bucket.is_contiguous(), "pack_into_bucket: bucket (sizes ", bucket.sizes(), ", strides ",
              bucket.strides(), ") must be contiguous");
  const int64_t world = bucket.size(0);
  const int64_t cap = bucket.size(1);
  TORCH_CHECK(static_cast<int64_t>(inputs.size()) == world, "pack_into_bucket: expected ", world,
              " inputs (one per bucket row; bucket sizes ", bucket.sizes(), "), got ", inputs.size());
  TORCH_CHECK(offset >= 0, "pack_into_bucket: offset must be >= 0, got ", offset);

  // Validate everything first, so that a bad call never leaves a half-packed bucket.
  int64_t numel = -1;
  for (int64_t r = 0; r < world; ++r) {
    const at::Tensor& t = inputs[r];
    TORCH_CHECK(t.defined(), "pack_into_bucket: inputs[", r, "] is undefined");
    TORCH_CHECK(t.layout() == at::kStrided, "pack_into_bucket: inputs[", r, "] has layout ", t.layout(),
                "; it must be a strided (dense) tensor");
    TORCH_CHECK(t.scalar_type() == bucket.scalar_type(), "pack_into_bucket: inputs[", r, "] has dtype ",
                t.scalar_type(), " but the bucket has dtype ", bucket.scalar_type(), "; they must match");
    TORCH_CHECK(t.device() == bucket.device(), "pack_into_bucket: inputs[", r, "] is on ", t.device(),
                " but the bucket is on ", bucket.device(), "; they must be on the same device");
    if (r == 0) {
      numel = t.numel();
    } else {
      TORCH_CHECK(t.numel() == numel, "pack_into_bucket: inputs[", r, "] has ", t.numel(),
                  " elements (sizes ", t.sizes(), ") but inputs[0] has ", numel, " (sizes ",
                  inputs[0].sizes(), "); every rank's input must have the same number of elements");
    }
    const at::MemOverlapStatus overlap = at::get_overlap_status(bucket, t);
    TORCH_CHECK(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
                "pack_into_bucket: inputs[", r, "] overlaps the bucket's memory; inputs must not alias it");
  }
  TORCH_CHECK(offset <= cap && numel <= cap - offset, "pack_into_bucket: ", numel,
              " elements at offset ", offset, " do not fit in a bucket row of ", cap, " elements");
  if (numel == 0) {
    return;
  }

  const c10::OptionalDeviceGuard guard(bucket.device());
  for (int64_t r = 0; r < world; ++r) {
    const at::Tensor& t = inputs[r];
    // The destination row slice is contiguous, so it can take the input's shape as a view; copy_
    // then reads a strided input directly, without a temporary contiguous copy.
    at::Tensor dst = bucket.select(0, r).narrow(0, offset, numel);
    dst.view(t.sizes()).copy_(t);
  }
}

}  // namespace decentpy
