// dst = alpha * src on flat buffers of fp32 / bf16 / fp16 (contract: kernels/mix_and_step.h,
// ScaleCopyArgs). dst may equal src. fp32 math, result rounded to nearest even.
// 16-byte vectors on the co-aligned middle (kUnroll independent vectors in flight per thread),
// scalar head / tail / unaligned fallback, grid-stride over a grid that fills the chip once.
// With sumsq: each block also writes the sum of the squares of the src elements it read into slot
// blockIdx.x (threads' fp32 sums, reduced in a fixed order: the same bits in every run), block 0
// zeroes the slots beyond the grid; the grid is capped at kNormSlots blocks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <stdexcept>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/kernel_utils.cuh"
#include "cuda/mix_and_step_cuda.h"

namespace decentpy {
namespace cuda {
namespace {

using detail::kThreads;
using detail::kVec;

constexpr int kUnroll = 4;

// Sum of v over the block, in a fixed order (warp shuffles, then the warps' sums in order); the
// result is valid in thread 0.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[kThreads / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  float s = 0.f;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) s += warp_sums[w];
  }
  return s;
}

template <typename T, bool SUMSQ>
__global__ void __launch_bounds__(kThreads)
scale_copy_kernel(T* dst, const T* src, float alpha, int64_t numel, int64_t head, int64_t nvec,
                  float* __restrict__ sumsq) {
  // dst and src may be the same buffer: no __restrict__. Each element is read, then written,
  // by the same thread only.
  constexpr int VEC = kVec<T>;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  float ss = 0.f;  // SUMSQ: this thread's sum of squares

  for (int64_t k0 = tid; k0 < nvec; k0 += stride * kUnroll) {
    float x[kUnroll][VEC];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = k0 + u * stride;
      if (k < nvec) detail::load16(src + head + k * VEC, x[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = k0 + u * stride;
      if (k < nvec) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          if constexpr (SUMSQ) ss = __fmaf_rn(x[u][e], x[u][e], ss);
          x[u][e] *= alpha;
        }
        detail::store16(dst + head + k * VEC, x[u]);
      }
    }
  }

  const int64_t tail_begin = head + nvec * VEC;
  const int64_t nscalar = head + (numel - tail_begin);
  for (int64_t t = tid; t < nscalar; t += stride) {
    const int64_t i = t < head ? t : tail_begin + (t - head);
    const float x = detail::to_f32<T>(src[i]);
    if constexpr (SUMSQ) ss = __fmaf_rn(x, x, ss);
    dst[i] = detail::from_f32<T>(alpha * x);
  }
  if constexpr (SUMSQ) {
    const float s = block_sum(ss);
    if (threadIdx.x == 0) sumsq[blockIdx.x] = s;
    if (blockIdx.x == 0) {
      for (int64_t j = gridDim.x + threadIdx.x; j < kNormSlots; j += kThreads) sumsq[j] = 0.f;
    }
  }
}

template <typename T, bool SUMSQ>
void launch_typed(const ScaleCopyArgs& args, int esize, cudaStream_t stream) {
  static std::atomic<int> blocks_per_sm{0};
  int bps = blocks_per_sm.load(std::memory_order_relaxed);
  if (bps == 0) {
    bps = detail::query_blocks_per_sm(scale_copy_kernel<T, SUMSQ>);
    blocks_per_sm.store(bps, std::memory_order_relaxed);
  }
  const void* ptrs[1] = {args.src};
  const int sizes[1] = {esize};
  const detail::VecSplit split =
      detail::vec_split(args.numel, kVec<T>, args.dst, esize, ptrs, sizes, 1);
  const int64_t nscalar = args.numel - split.nvec * kVec<T>;
  const int64_t vec_work = (split.nvec + kUnroll - 1) / kUnroll;
  const int64_t work = vec_work > nscalar ? vec_work : nscalar;
  unsigned grid = detail::grid_for(work, bps);
  if (SUMSQ && grid > static_cast<unsigned>(kNormSlots)) grid = static_cast<unsigned>(kNormSlots);
  scale_copy_kernel<T, SUMSQ><<<grid, kThreads, 0, stream>>>(
      static_cast<T*>(args.dst), static_cast<const T*>(args.src), args.alpha, args.numel,
      split.head, split.nvec, args.sumsq);
  DECENTPY_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_scale_copy(const ScaleCopyArgs& args, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (args.numel < 0) throw std::invalid_argument("decentpy scale_copy (CUDA): numel must be >= 0");
  if (args.numel == 0) {
    if (args.sumsq != nullptr)
      DECENTPY_CUDA_CHECK(cudaMemsetAsync(args.sumsq, 0, sizeof(float) * kNormSlots, stream));
    return;
  }
  if (args.dst == nullptr || args.src == nullptr)
    throw std::invalid_argument("decentpy scale_copy (CUDA): dst and src are required");
  if (args.sumsq != nullptr) {
    switch (args.dtype) {
      case DType::Float32: launch_typed<float, true>(args, 4, stream); return;
      case DType::BFloat16: launch_typed<__nv_bfloat16, true>(args, 2, stream); return;
      case DType::Float16: launch_typed<__half, true>(args, 2, stream); return;
    }
  }
  if (args.dst == args.src && args.alpha == 1.f) return;  // identity in place
  switch (args.dtype) {
    case DType::Float32: launch_typed<float, false>(args, 4, stream); return;
    case DType::BFloat16: launch_typed<__nv_bfloat16, false>(args, 2, stream); return;
    case DType::Float16: launch_typed<__half, false>(args, 2, stream); return;
  }
  throw std::invalid_argument("decentpy scale_copy (CUDA): unknown dtype " +
                              std::to_string(static_cast<int>(args.dtype)));
}

}  // namespace cuda
}  // namespace decentpy
