// Fused compressed-gossip (CHOCO) mix-and-step CUDA kernel. Contract: kernels/mix_and_step.h
// ("Compressed gossip"); the arithmetic: kernels/compress.h (quantisers, copy updates, the mix) and
// kernels/update.h (the optimizer update), shared with the CPU kernels.
//
// One thread block of kThreads == kInt8Block threads per scale block (grid-stride over blocks), one
// element per thread: received q into the peer's copy and the mix, the optimizer update of the
// element's group (segment lookup by binary search when several groups share the bucket), then the
// next difference; for int8 and int4 (one code path, Bits = code_bits(C)) the block's max |d| comes
// from a warp-shuffle + shared-memory reduction, thread 0 writes the block's scale, and for int4 the
// even thread of each pair packs its neighbour's nibble (a shuffle) into the byte it writes. fp32
// parameters only. The launcher checks its CUDA calls. The group reduction of a compressed group
// exchange (GroupReduceArgs) is a second, smaller kernel below, on the same block layout.
#include <cuda_runtime.h>

#include <atomic>
#include <stdexcept>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/kernel_utils.cuh"
#include "cuda/mix_and_step_cuda.h"
#include "kernels/compress.h"
#include "kernels/update.h"

namespace decentpy {
namespace cuda {
namespace {

using detail::kThreads;
static_assert(kThreads == kInt8Block, "one thread per element of a scale block");

struct CArgs {
  float* param;
  void* grad;
  float* s0;
  float* s1;
  float* s2;
  const Segment* segs;
  int64_t num_segments;
  int64_t numel;
  int64_t nblocks;
  const void* q_recv;
  float* peer_copy;
  const float* self_copy_mix;
  float choco_mix;
  void* q_send;
  float* self_copy_next;
  float grad_scale;
  const float* grad_norm;
  const float* scaler_scale;
  float clip_norm;
  int32_t zero_grad;
  int32_t skip_update;
  int32_t num_groups;
  StepConstants hyp[kMaxGroups];
};

__device__ __forceinline__ int group_of(const CArgs& a, int64_t i) {
  if (a.num_groups <= 1 || a.segs == nullptr) return 0;
  return detail::clamp_group(__ldg(&a.segs[detail::segment_index(a.segs, a.num_segments, i)].group), a.num_groups);
}

template <OptKind K, Compressor C>
__global__ void __launch_bounds__(kThreads) choco_kernel(const __grid_constant__ CArgs a) {
  constexpr int Bits = code_bits(C);
  __shared__ float red[kThreads / 32];
  float gs = a.grad_scale;
  bool skip = a.skip_update != 0;
  if (K != OptKind::None && !skip && a.grad_norm != nullptr) {
    const GradFactor f = grad_factor(__ldg(a.grad_norm), a.scaler_scale ? __ldg(a.scaler_scale) : 1.f, a.clip_norm);
    skip = f.skip;
    gs = f.factor;
  }
  for (int64_t b = blockIdx.x; b < a.nblocks; b += gridDim.x) {
    const int64_t i = b * kInt8Block + threadIdx.x;
    const bool valid = i < a.numel;
    float p = 0.f;
    if (valid) {
      p = a.param[i];
      if (a.q_recv != nullptr) {
        float xp;
        if constexpr (Bits != 0) {
          const float s = block_scales(a.q_recv)[b];
          xp = block_copy_update(a.peer_copy[i], block_code_at<Bits>(block_codes(a.q_recv, a.numel), i), s);
        } else {
          xp = bf16_copy_update(a.peer_copy[i], static_cast<const uint16_t*>(a.q_recv)[i]);
        }
        a.peer_copy[i] = xp;
        p = choco_mix(p, xp, a.self_copy_mix[i], a.choco_mix);
      }
      float* grad = static_cast<float*>(a.grad);
      if constexpr (K != OptKind::None) {
        if (!skip) {
          const StepConstants& h = a.hyp[group_of(a, i)];
          const float g = grad[i];
          float m = a.s0 ? a.s0[i] : 0.f;
          float v = a.s1 ? a.s1[i] : 0.f;
          float acc = a.s2 ? a.s2[i] : 0.f;
          update<K, ScalarMath>(h, h.flags, gs, p, g, m, v, acc);
          if (a.s0 && (K == OptKind::SGD || writes_state01<K>(h.flags))) a.s0[i] = m;
          if (a.s1 && writes_state01<K>(h.flags)) a.s1[i] = v;
          if (a.s2) a.s2[i] = acc;
        }
      }
      if (a.zero_grad) grad[i] = 0.f;
      a.param[i] = p;
    }
    if (a.q_send != nullptr) {  // every thread of the block takes part (the reduction)
      const float d = valid ? p - a.self_copy_next[i] : 0.f;
      if constexpr (Bits != 0) {
        using BC = BlockCode<Bits>;
        const float s = block_scale<Bits>(detail::block_max(fabsf(d), red));
        if (threadIdx.x == 0) block_scales(a.q_send)[b] = s;
        const float c = valid ? block_code<Bits>(d, s) : 0.f;  // past the end: a 0 nibble (padding)
        // the byte of threads t .. t + kPerByte - 1 (t a multiple of kPerByte), written by thread t
        uint32_t byte = block_code_field<Bits>(c, 0);
#pragma unroll
        for (int j = 1; j < BC::kPerByte; ++j)
          byte |= __shfl_down_sync(0xffffffffu, block_code_field<Bits>(c, j), j);
        if (valid) {
          if (threadIdx.x % BC::kPerByte == 0)
            block_codes(a.q_send, a.numel)[i / BC::kPerByte] = static_cast<uint8_t>(byte);
          a.self_copy_next[i] = block_copy_update(a.self_copy_next[i], c, s);
        }
      } else {
        if (valid) {
          const uint16_t q = bf16_bits(d);
          static_cast<uint16_t*>(a.q_send)[i] = q;
          a.self_copy_next[i] = bf16_copy_update(a.self_copy_next[i], q);
        }
      }
    }
  }
}

template <OptKind K, Compressor C>
void launch_kc(const CArgs& a, cudaStream_t stream) {
  auto kernel = choco_kernel<K, C>;
  static std::atomic<int> occupancy{0};  // one per instantiation
  kernel<<<detail::occupancy_grid(kernel, occupancy, a.nblocks * kThreads), kThreads, 0, stream>>>(a);
  DECENTPY_CUDA_CHECK_LAUNCH();
}

template <Compressor C>
void launch_c(const CArgs& a, OptKind kind, cudaStream_t stream) {
  switch (kind) {
    case OptKind::None: return launch_kc<OptKind::None, C>(a, stream);
    case OptKind::SGD: return launch_kc<OptKind::SGD, C>(a, stream);
    case OptKind::Adam: return launch_kc<OptKind::Adam, C>(a, stream);
    case OptKind::AccumAdam: return launch_kc<OptKind::AccumAdam, C>(a, stream);
  }
}

// The group reduction (GroupReduceArgs): one thread block per scale block of the chunk, one element
// per thread, the block's max |mu| from block_max and int4 bytes packed as in choco_kernel.
template <Compressor C>
__global__ void __launch_bounds__(kThreads) group_reduce_kernel(const __grid_constant__ GroupReduceArgs a) {
  constexpr int Bits = code_bits(C);
  __shared__ float red[kThreads / 32];
  const float mf = static_cast<float>(a.num_inputs);
  const float inv_m = ScalarMath::div(1.f, mf);
  const int64_t b0 = a.lo / kInt8Block, nb = num_scale_blocks(a.hi) - b0;
  for (int64_t bi = blockIdx.x; bi < nb; bi += gridDim.x) {
    const int64_t b = b0 + bi;
    const int64_t i = b * kInt8Block + threadIdx.x;
    const bool valid = i < a.hi;
    const float mu = valid ? group_mean<C>(a.inputs, a.num_inputs, a.numel, i, inv_m) : 0.f;
    if constexpr (Bits != 0) {
      using BC = BlockCode<Bits>;
      const float s = block_scale<Bits>(detail::block_max(fabsf(mu), red));
      if (threadIdx.x == 0) block_scales(a.out)[b] = s;
      const float c = valid ? block_code<Bits>(mu, s) : 0.f;
      uint32_t byte = block_code_field<Bits>(c, 0);
#pragma unroll
      for (int j = 1; j < BC::kPerByte; ++j) byte |= __shfl_down_sync(0xffffffffu, block_code_field<Bits>(c, j), j);
      if (valid) {
        if (threadIdx.x % BC::kPerByte == 0) block_codes(a.out, a.numel)[i / BC::kPerByte] = static_cast<uint8_t>(byte);
        a.self_copy[i] = group_copy_adjust(a.self_copy[i], block_value(c, s), mu, mf);
      }
    } else if (valid) {
      const uint16_t r = bf16_bits(mu);
      static_cast<uint16_t*>(a.out)[i] = r;
      a.self_copy[i] = group_copy_adjust(a.self_copy[i], bf16_value(r), mu, mf);
    }
  }
}

template <Compressor C>
void launch_group(const GroupReduceArgs& a, cudaStream_t stream) {
  auto kernel = group_reduce_kernel<C>;
  static std::atomic<int> occupancy{0};
  const int64_t blocks = num_scale_blocks(a.hi) - a.lo / kInt8Block;
  kernel<<<detail::occupancy_grid(kernel, occupancy, blocks * kThreads), kThreads, 0, stream>>>(a);
  DECENTPY_CUDA_CHECK_LAUNCH();
}

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("decentpy compressed mix_and_step (CUDA): ") + what);
}

}  // namespace

void launch_choco_mix_and_step(const MixStepArgs& args, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  require(args.numel >= 0, "numel must be >= 0");
  if (args.numel == 0) return;
  require(args.param_dtype == DType::Float32, "param must be float32");
  require(args.compressor == Compressor::BF16 || args.compressor == Compressor::Int8 ||
              args.compressor == Compressor::Int4,
          "unknown compressor (valid: BF16 = 1, Int8 = 2, Int4 = 3)");
  require(args.param != nullptr, "param is required");
  require(args.q_recv == nullptr || (args.peer_copy != nullptr && args.self_copy_mix != nullptr),
          "q_recv needs peer_copy and self_copy_mix");
  require(args.q_send == nullptr || args.self_copy_next != nullptr, "q_send needs self_copy_next");
  const OptKind kind = args.skip_update ? OptKind::None : args.kind;
  const bool sgd_momentum = detail::check_optimizer_args(args, kind, "decentpy compressed mix_and_step (CUDA)");
  require(!args.zero_grad || args.grad != nullptr, "zero_grad needs grad");

  CArgs a{};
  a.param = static_cast<float*>(args.param);
  a.grad = args.grad;
  a.s0 = kind == OptKind::None ? nullptr : args.state0;
  a.s1 = (kind == OptKind::Adam || kind == OptKind::AccumAdam) ? args.state1 : nullptr;
  a.s2 = kind == OptKind::AccumAdam ? args.state2 : nullptr;
  if (kind == OptKind::SGD && !sgd_momentum) a.s0 = nullptr;
  a.segs = args.num_groups > 1 ? args.segments : nullptr;
  a.num_segments = args.num_groups > 1 ? args.num_segments : 0;
  a.numel = args.numel;
  a.nblocks = num_scale_blocks(args.numel);
  a.q_recv = args.q_recv;
  a.peer_copy = args.peer_copy;
  a.self_copy_mix = args.self_copy_mix;
  a.choco_mix = args.choco_mix;
  a.q_send = args.q_send;
  a.self_copy_next = args.self_copy_next;
  a.grad_scale = args.grad_scale;
  a.grad_norm = args.grad_norm;
  a.scaler_scale = args.scaler_scale;
  a.clip_norm = args.clip_norm;
  a.zero_grad = args.zero_grad ? 1 : 0;
  a.skip_update = args.skip_update ? 1 : 0;
  a.num_groups = kind != OptKind::None ? args.num_groups : 0;
  for (int g = 0; g < args.num_groups && g < kMaxGroups; ++g) a.hyp[g] = derive_step(args, args.groups[g]);
  switch (args.compressor) {
    case Compressor::Int8: return launch_c<Compressor::Int8>(a, kind, stream);
    case Compressor::Int4: return launch_c<Compressor::Int4>(a, kind, stream);
    default: return launch_c<Compressor::BF16>(a, kind, stream);
  }
}

void launch_choco_group_reduce(const GroupReduceArgs& args, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  require(args.lo >= 0 && args.lo % kInt8Block == 0 && args.lo <= args.hi && args.hi <= args.numel,
          "group reduce: the chunk [lo, hi) must start on a scale block and lie in [0, numel)");
  require(args.num_inputs >= 1 && args.num_inputs <= kMaxGroupInputs, "group reduce: 1 to kMaxGroupInputs inputs");
  require(args.out != nullptr && args.self_copy != nullptr, "group reduce: out and self_copy are required");
  if (args.hi == args.lo) return;
  switch (args.compressor) {
    case Compressor::Int8: return launch_group<Compressor::Int8>(args, stream);
    case Compressor::Int4: return launch_group<Compressor::Int4>(args, stream);
    case Compressor::BF16: return launch_group<Compressor::BF16>(args, stream);
    default: require(false, "group reduce: unknown compressor (valid: BF16 = 1, Int8 = 2, Int4 = 3)");
  }
}

}  // namespace cuda
}  // namespace decentpy
