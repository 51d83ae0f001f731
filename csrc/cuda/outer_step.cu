// CUDA passes of the fused outer step (contract and arithmetic: kernels/outer_step.h, shared with
// csrc/cpu/outer_step_cpu.cpp). The pack: one thread block of kThreads == kInt8Block threads per
// scale block (grid-stride over blocks), one element per thread, the block's max |d| from a
// warp-shuffle + shared-memory reduction and int4 bytes packed by the even thread of each pair, as
// the compressed gossip kernel (choco.cu) does. The apply: a grid-stride loop, one element per
// thread. Every launch is checked.
#include <cuda_runtime.h>

#include <atomic>
#include <stdexcept>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/kernel_utils.cuh"
#include "cuda/mix_and_step_cuda.h"
#include "kernels/outer_step.h"

namespace decentpy {
namespace cuda {
namespace {

using detail::kThreads;
static_assert(kThreads == kInt8Block, "one thread per element of a scale block");

template <typename T, Compressor C>
__global__ void __launch_bounds__(kThreads) pack_kernel(const __grid_constant__ OuterPackArgs a) {
  constexpr int Bits = code_bits(C);
  __shared__ float red[kThreads / 32];
  const T* x = static_cast<const T*>(a.param);
  const int64_t nblocks = num_scale_blocks(a.numel);
  for (int64_t b = blockIdx.x; b < nblocks; b += gridDim.x) {
    const int64_t i = b * kInt8Block + threadIdx.x;
    const bool valid = i < a.numel;
    const float xe = valid ? detail::to_f32<T>(x[i]) : 0.f;
    if constexpr (C == Compressor::None) {
      if (valid) static_cast<float*>(a.out)[i] = outer_pseudo_gradient(a.theta[i], xe, 0.f);
    } else {
      const float d = valid ? outer_pseudo_gradient(a.theta[i], xe, a.excess[i]) : 0.f;
      if constexpr (Bits != 0) {
        using BC = BlockCode<Bits>;
        const float s = block_scale<Bits>(detail::block_max(fabsf(d), red));
        if (threadIdx.x == 0) block_scales(a.out)[b] = s;
        const float c = valid ? block_code<Bits>(d, s) : 0.f;  // past the end: a 0 nibble (padding)
        uint32_t byte = block_code_field<Bits>(c, 0);
#pragma unroll
        for (int j = 1; j < BC::kPerByte; ++j) byte |= __shfl_down_sync(0xffffffffu, block_code_field<Bits>(c, j), j);
        if (valid) {
          if (threadIdx.x % BC::kPerByte == 0) block_codes(a.out, a.numel)[i / BC::kPerByte] = static_cast<uint8_t>(byte);
          a.excess[i] = outer_excess_code(c, s, d);
        }
      } else if (valid) {
        const uint16_t q = bf16_bits(d);
        static_cast<uint16_t*>(a.out)[i] = q;
        a.excess[i] = outer_excess(bf16_value(q), d);
      }
    }
  }
}

template <typename T, Compressor C, OptKind K>
__global__ void __launch_bounds__(kThreads) apply_kernel(const __grid_constant__ OuterApplyArgs a,
                                                          const StepConstants h) {
  T* x = static_cast<T*>(a.param);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.numel; i += stride) {
    const float g = outer_delta_at<C>(a.delta, a.numel, i);
    float t = a.theta_mix ? a.theta_mix[i] : a.theta[i];
    float m = a.state0 ? a.state0[i] : 0.f;
    float v = a.state1 ? a.state1[i] : 0.f;
    outer_update<K>(h, t, g, m, v);
    if (a.state0) a.state0[i] = m;
    if (a.state1) a.state1[i] = v;
    a.theta[i] = t;
    x[i] = detail::from_f32<T>(a.alpha == 0.f ? t : outer_merge(t, detail::to_f32<T>(x[i]), a.alpha));  // reset: x unread
  }
}

template <Compressor C>
__global__ void __launch_bounds__(kThreads) decode_kernel(const void* wire, float* out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = outer_delta_at<C>(wire, n, i);
}

template <Compressor C>
void decode_c(const void* wire, float* out, int64_t n, cudaStream_t stream) {
  auto kernel = decode_kernel<C>;
  static std::atomic<int> occupancy{0};
  kernel<<<detail::occupancy_grid(kernel, occupancy, n), kThreads, 0, stream>>>(wire, out, n);
  DECENTPY_CUDA_CHECK_LAUNCH();
}

template <typename T, Compressor C>
void pack_tc(const OuterPackArgs& a, cudaStream_t stream) {
  auto kernel = pack_kernel<T, C>;
  static std::atomic<int> occupancy{0};  // one per instantiation
  kernel<<<detail::occupancy_grid(kernel, occupancy, num_scale_blocks(a.numel) * kThreads), kThreads, 0, stream>>>(a);
  DECENTPY_CUDA_CHECK_LAUNCH();
}

template <typename T>
void pack_t(const OuterPackArgs& a, cudaStream_t stream) {
  switch (a.compressor) {
    case Compressor::None: return pack_tc<T, Compressor::None>(a, stream);
    case Compressor::BF16: return pack_tc<T, Compressor::BF16>(a, stream);
    case Compressor::Int8: return pack_tc<T, Compressor::Int8>(a, stream);
    case Compressor::Int4: return pack_tc<T, Compressor::Int4>(a, stream);
  }
}

template <typename T, Compressor C, OptKind K>
void apply_tck(const OuterApplyArgs& a, const StepConstants& h, cudaStream_t stream) {
  auto kernel = apply_kernel<T, C, K>;
  static std::atomic<int> occupancy{0};
  kernel<<<detail::occupancy_grid(kernel, occupancy, a.numel), kThreads, 0, stream>>>(a, h);
  DECENTPY_CUDA_CHECK_LAUNCH();
}

template <typename T, Compressor C>
void apply_tc(const OuterApplyArgs& a, const StepConstants& h, cudaStream_t stream) {
  if (a.kind == OptKind::Adam) return apply_tck<T, C, OptKind::Adam>(a, h, stream);
  return apply_tck<T, C, OptKind::SGD>(a, h, stream);
}

template <typename T>
void apply_t(const OuterApplyArgs& a, const StepConstants& h, cudaStream_t stream) {
  switch (a.compressor) {
    case Compressor::None: return apply_tc<T, Compressor::None>(a, h, stream);
    case Compressor::BF16: return apply_tc<T, Compressor::BF16>(a, h, stream);
    case Compressor::Int8: return apply_tc<T, Compressor::Int8>(a, h, stream);
    case Compressor::Int4: return apply_tc<T, Compressor::Int4>(a, h, stream);
  }
}

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("decentpy outer step (CUDA): ") + what);
}

}  // namespace

void launch_outer_pack(const OuterPackArgs& args, void* stream_ptr) {
  require(args.numel >= 0, "numel must be >= 0");
  if (args.numel == 0) return;
  require(args.param != nullptr && args.theta != nullptr && args.out != nullptr, "param, theta and out are required");
  require(args.compressor == Compressor::None || args.excess != nullptr, "a compressor needs the excess buffer");
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (args.param_dtype) {
    case DType::Float32: return pack_t<float>(args, stream);
    case DType::BFloat16: return pack_t<__nv_bfloat16>(args, stream);
    case DType::Float16: return pack_t<__half>(args, stream);
  }
  require(false, "unknown param dtype");
}

void launch_outer_apply(const OuterApplyArgs& args, void* stream_ptr) {
  require(args.numel >= 0, "numel must be >= 0");
  if (args.numel == 0) return;
  require(args.param != nullptr && args.theta != nullptr && args.delta != nullptr,
          "param, theta and delta are required");
  require(args.kind == OptKind::SGD || args.kind == OptKind::Adam, "the outer optimizer is SGD or Adam");
  require(args.kind != OptKind::Adam || (args.state0 != nullptr && args.state1 != nullptr),
          "Adam needs exp_avg and exp_avg_sq");
  const StepConstants h = derive_outer(args);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (args.param_dtype) {
    case DType::Float32: return apply_t<float>(args, h, stream);
    case DType::BFloat16: return apply_t<__nv_bfloat16>(args, h, stream);
    case DType::Float16: return apply_t<__half>(args, h, stream);
  }
  require(false, "unknown param dtype");
}

void launch_outer_decode(Compressor c, const void* wire, float* out, int64_t n, void* stream_ptr) {
  require(n >= 0, "numel must be >= 0");
  if (n == 0) return;
  require(wire != nullptr && out != nullptr, "wire and out are required");
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (c) {
    case Compressor::Int8: return decode_c<Compressor::Int8>(wire, out, n, stream);
    case Compressor::Int4: return decode_c<Compressor::Int4>(wire, out, n, stream);
    case Compressor::BF16: return decode_c<Compressor::BF16>(wire, out, n, stream);
    case Compressor::None: return decode_c<Compressor::None>(wire, out, n, stream);
  }
  require(false, "unknown compressor");
}

}  // namespace cuda
}  // namespace decentpy
