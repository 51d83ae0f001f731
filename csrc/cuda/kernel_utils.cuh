// Internal helpers shared by the CUDA kernels of csrc/cuda (not part of the public interface).
//
// - storage <-> fp32 conversion for float / __nv_bfloat16 / __half (round to nearest even),
// - 16-byte vector loads/stores of kVec<T> = 16 / sizeof(T) elements, unpacked to fp32,
// - the per-device SM count (queried once per device, cached) and the grid size (occupancy cached
//   per kernel),
// - the segment lookup of parameter groups, and the host checks of the optimizer arguments.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/cuda_check.h"
#include "kernels/mix_and_step.h"

namespace decentpy {
namespace cuda {
namespace detail {

constexpr int kThreads = 256;        // threads per block
constexpr int kMaxBlocksPerSm = 8;   // cap on resident blocks per SM used for the grid
constexpr int kVecBytes = 16;

template <typename T>
constexpr int kVec = kVecBytes / static_cast<int>(sizeof(T));

// ---- conversions --------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float to_f32(T x);
template <>
__device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

// x rounded to the storage type T and back (identity for float).
template <typename T>
__device__ __forceinline__ float round_to(float x) { return to_f32<T>(from_f32<T>(x)); }

// ---- 16-byte vectors ------------------------------------------------------------------------
// ptr must be 16-byte aligned. Plain (coherent) loads: `comm` may alias `send`.
__device__ __forceinline__ void load16(const float* ptr, float (&f)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(ptr);
  f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
}
__device__ __forceinline__ void load16(const __nv_bfloat16* ptr, float (&f)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(ptr);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    __nv_bfloat162 h;
    *reinterpret_cast<uint32_t*>(&h) = w[k];
    const float2 t = __bfloat1622float2(h);
    f[2 * k] = t.x; f[2 * k + 1] = t.y;
  }
}
__device__ __forceinline__ void load16(const __half* ptr, float (&f)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(ptr);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    __half2 h;
    *reinterpret_cast<uint32_t*>(&h) = w[k];
    const float2 t = __half22float2(h);
    f[2 * k] = t.x; f[2 * k + 1] = t.y;
  }
}

__device__ __forceinline__ void store16(float* ptr, const float (&f)[4]) {
  *reinterpret_cast<float4*>(ptr) = make_float4(f[0], f[1], f[2], f[3]);
}
__device__ __forceinline__ void store16(__nv_bfloat16* ptr, const float (&f)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
    w[k] = *reinterpret_cast<const uint32_t*>(&h);
  }
  *reinterpret_cast<uint4*>(ptr) = make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ void store16(__half* ptr, const float (&f)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __half2 h = __floats2half2_rn(f[2 * k], f[2 * k + 1]);
    w[k] = *reinterpret_cast<const uint32_t*>(&h);
  }
  *reinterpret_cast<uint4*>(ptr) = make_uint4(w[0], w[1], w[2], w[3]);
}

// 4 elements as fp32: one 16-byte access for float, one 8-byte access for the 2-byte types. A
// warp then reads every array it touches (the 2-byte ones and the fp32 optimizer state alike) as
// one contiguous span; 8 elements per thread would read the fp32 state as two half-used 32-byte
// sectors per instruction (measured on an H200: bf16 Adam at 50% of the copy bandwidth).
__device__ __forceinline__ void load4(const float* ptr, float (&f)[4]) { load16(ptr, f); }
__device__ __forceinline__ void store4(float* ptr, const float (&f)[4]) { store16(ptr, f); }
__device__ __forceinline__ void load4(const __nv_bfloat16* ptr, float (&f)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(ptr);
  __nv_bfloat162 a, b;
  *reinterpret_cast<uint32_t*>(&a) = u.x;
  *reinterpret_cast<uint32_t*>(&b) = u.y;
  const float2 x = __bfloat1622float2(a), y = __bfloat1622float2(b);
  f[0] = x.x; f[1] = x.y; f[2] = y.x; f[3] = y.y;
}
__device__ __forceinline__ void load4(const __half* ptr, float (&f)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(ptr);
  __half2 a, b;
  *reinterpret_cast<uint32_t*>(&a) = u.x;
  *reinterpret_cast<uint32_t*>(&b) = u.y;
  const float2 x = __half22float2(a), y = __half22float2(b);
  f[0] = x.x; f[1] = x.y; f[2] = y.x; f[3] = y.y;
}
__device__ __forceinline__ void store4(__nv_bfloat16* ptr, const float (&f)[4]) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(f[0], f[1]), b = __floats2bfloat162_rn(f[2], f[3]);
  *reinterpret_cast<uint2*>(ptr) = make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
}
__device__ __forceinline__ void store4(__half* ptr, const float (&f)[4]) {
  const __half2 a = __floats2half2_rn(f[0], f[1]), b = __floats2half2_rn(f[2], f[3]);
  *reinterpret_cast<uint2*>(ptr) = make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
}
// +0 in 4 elements of T (16 bytes for float, 8 for the 2-byte types).
template <typename T>
__device__ __forceinline__ void store4_zero(T* ptr) {
  if constexpr (sizeof(T) == 4) *reinterpret_cast<uint4*>(ptr) = make_uint4(0u, 0u, 0u, 0u);
  else *reinterpret_cast<uint2*>(ptr) = make_uint2(0u, 0u);
}

// N fp32 values (N a multiple of 4) from/to a 16-byte aligned pointer.
template <int N>
__device__ __forceinline__ void load_f32(const float* ptr, float (&f)[N]) {
  static_assert(N % 4 == 0, "N must be a multiple of 4");
#pragma unroll
  for (int k = 0; k < N / 4; ++k) {
    const float4 v = reinterpret_cast<const float4*>(ptr)[k];
    f[4 * k] = v.x; f[4 * k + 1] = v.y; f[4 * k + 2] = v.z; f[4 * k + 3] = v.w;
  }
}
template <int N>
__device__ __forceinline__ void store_f32(float* ptr, const float (&f)[N]) {
  static_assert(N % 4 == 0, "N must be a multiple of 4");
#pragma unroll
  for (int k = 0; k < N / 4; ++k) {
    reinterpret_cast<float4*>(ptr)[k] = make_float4(f[4 * k], f[4 * k + 1], f[4 * k + 2], f[4 * k + 3]);
  }
}

// ---- host helpers ---------------------------------------------------------------------------
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Vector split of [0, numel): elements [0, head) and [head + nvec*vec, numel) take the scalar path,
// vector k covers [head + k*vec, head + (k+1)*vec). `anchor` (element size `anchor_size`) decides
// head; then every pointer in `ptrs` (element sizes `sizes`, nullptr entries ignored) must be
// 16-byte aligned at element `head`, else everything is scalar (head = 0, nvec = 0).
struct VecSplit {
  int64_t head = 0;
  int64_t nvec = 0;
};
inline VecSplit vec_split(int64_t numel, int vec, const void* anchor, int anchor_size,
                          const void* const* ptrs, const int* sizes, int nptrs) {
  VecSplit s;
  const uintptr_t a = reinterpret_cast<uintptr_t>(anchor);
  if (a % static_cast<uintptr_t>(anchor_size) != 0) return s;  // not even element-aligned
  const int64_t head = static_cast<int64_t>(((16u - (a & 15u)) & 15u) / static_cast<uintptr_t>(anchor_size));
  if (head >= numel) return s;
  for (int k = 0; k < nptrs; ++k) {
    if (ptrs[k] == nullptr) continue;
    const uintptr_t p = reinterpret_cast<uintptr_t>(ptrs[k]) + static_cast<uintptr_t>(head * sizes[k]);
    if ((p & 15u) != 0) return s;
  }
  s.head = head;
  s.nvec = (numel - head) / vec;
  return s;
}

// Number of SMs of the current device, queried once per device.
inline int sm_count_current_device() {
  constexpr int kMaxDevices = 128;
  static std::atomic<int> cache[kMaxDevices];  // zero-initialised (static storage)
  int dev = 0;
  DECENTPY_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 0 && dev < kMaxDevices) {
    const int c = cache[dev].load(std::memory_order_relaxed);
    if (c > 0) return c;
  }
  int n = 0;
  DECENTPY_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  if (n < 1) n = 1;
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}

// Resident blocks per SM of `kernel` at kThreads threads (queried once per kernel by the caller),
// clamped to [1, kMaxBlocksPerSm].
template <typename Kernel>
inline int query_blocks_per_sm(Kernel kernel) {
  int n = 0;
  DECENTPY_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0));
  if (n < 1) n = 1;
  if (n > kMaxBlocksPerSm) n = kMaxBlocksPerSm;
  return n;
}

// Grid for `work` independent items (one per thread per grid-stride iteration): enough blocks to
// fill the chip once, fewer for small work.
inline unsigned grid_for(int64_t work, int blocks_per_sm) {
  const int64_t full = static_cast<int64_t>(sm_count_current_device()) * blocks_per_sm;
  int64_t need = (work + kThreads - 1) / kThreads;
  if (need < 1) need = 1;
  return static_cast<unsigned>(need < full ? need : full);
}

// The grid of a launch of `kernel` for `work` items; `cache` (one per kernel instantiation, a
// function-local static of the caller) keeps its occupancy after the first query.
template <typename Kernel>
inline unsigned occupancy_grid(Kernel kernel, std::atomic<int>& cache, int64_t work) {
  int bps = cache.load(std::memory_order_relaxed);
  if (bps == 0) {
    bps = query_blocks_per_sm(kernel);
    cache.store(bps, std::memory_order_relaxed);
  }
  return grid_for(work, bps);
}

// ---- parameter groups ------------------------------------------------------------------------
// Index of the segment holding element i: the last segment whose begin <= i (the table is sorted
// and covers [0, numel); validated on the host).
__device__ __forceinline__ int64_t segment_index(const Segment* __restrict__ segs, int64_t num_segments, int64_t i) {
  int64_t lo = 0, hi = num_segments - 1;
  while (lo < hi) {  // invariant: answer in [lo, hi]
    const int64_t mid = (lo + hi + 1) >> 1;
    if (__ldg(&segs[mid].begin) <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// A segment's group index clamped to [0, num_groups) (memory safety only: the table is validated on
// the host).
__device__ __forceinline__ int clamp_group(int64_t g, int num_groups) {
  if (g < 0) g = 0;
  if (g >= num_groups) g = num_groups - 1;
  return static_cast<int>(g);
}

// ---- host checks --------------------------------------------------------------------------
// The optimizer arguments both CUDA launchers require for `kind` (the effective kind: None when
// skip_update), as std::invalid_argument prefixed with `who`. Returns whether SGD has a momentum
// buffer to use (some group has momentum != 0).
inline bool check_optimizer_args(const MixStepArgs& args, OptKind kind, const char* who) {
  auto require = [who](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string(who) + ": " + what);
  };
  if (kind == OptKind::None) return false;
  require(args.grad != nullptr, "grad is required unless kind == None or skip_update");
  require(args.num_groups >= 1 && args.num_groups <= kMaxGroups, "num_groups must be in [1, kMaxGroups]");
  if (args.num_groups > 1)
    require(args.segments != nullptr && args.num_segments >= 1, "several groups need a device segment table");
  if (kind == OptKind::Adam)
    require(args.state0 != nullptr && args.state1 != nullptr, "Adam needs state0 (exp_avg) and state1 (exp_avg_sq)");
  if (kind == OptKind::AccumAdam)
    require(args.state0 != nullptr && args.state1 != nullptr && args.state2 != nullptr,
            "AccumAdam needs state0 (M), state1 (V) and state2 (acc)");
  if (kind != OptKind::SGD) return false;
  bool any_momentum = false;
  for (int g = 0; g < args.num_groups; ++g) any_momentum |= args.groups[g].momentum != 0.f;
  require(!any_momentum || args.state0 != nullptr, "SGD with momentum needs state0 (momentum buffer)");
  return any_momentum;
}

// The largest v over the kThreads threads of a block (every thread gets it): warp shuffles, then one
// warp over the warps' maxima in `shared` (kThreads / 32 floats). Every thread of the block must call it.
__device__ __forceinline__ float block_max(float v, float* shared) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (kThreads >> 5) ? shared[lane] : 0.f;
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  const float r = shared[0];
  __syncthreads();  // shared is reused by the next block of the grid-stride loop
  return r;
}

}  // namespace detail
}  // namespace cuda
}  // namespace decentpy
