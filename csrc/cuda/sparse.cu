// CUDA kernels of SparseLoCo's outer exchange (contract and arithmetic: kernels/sparse.h, shared with
// csrc/cpu/sparse_cpu.cpp). One thread block per chunk (grid-stride over chunks). The pack keeps the
// chunk's selection keys in shared memory (kSparseMaxChunk x 8 bytes), sorts them descending with a
// bitonic network (the k largest come first: the same set as the CPU's partial selection, the order
// being total), sorts the selected offsets ascending the same way, and one thread computes the
// chunk's two scales in list order (as the CPU does). The mean adds the members' messages in their
// order, a barrier between members (a message lists an element once: no two threads write one
// element between barriers). Every launch is checked.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/sparse_cuda.h"
#include "kernels/sparse.h"

namespace decentpy {
namespace cuda {
namespace {

constexpr int kSparseThreads = 256;

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("decentpy sparse outer exchange (CUDA): ") + what);
}

unsigned grid_of(int64_t chunks) {
  int dev = 0, sms = 0;
  DECENTPY_CUDA_CHECK(cudaGetDevice(&dev));
  DECENTPY_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int64_t cap = static_cast<int64_t>(sms) * 8;
  return static_cast<unsigned>(chunks < cap ? chunks : cap);
}

// keys[0, p) (p a power of two) sorted descending (or ascending) by the whole block.
__device__ void bitonic(uint64_t* keys, int64_t p, bool descending) {
  for (int64_t size = 2; size <= p; size <<= 1) {
    for (int64_t stride = size >> 1; stride > 0; stride >>= 1) {
      for (int64_t i = threadIdx.x; i < p / 2; i += blockDim.x) {
        const int64_t a = 2 * i - (i & (stride - 1)), b = a + stride;
        const bool up = (a & size) == 0;
        const uint64_t ka = keys[a], kb = keys[b];
        if (((ka < kb) == up) == descending && ka != kb) {
          keys[a] = kb;
          keys[b] = ka;
        }
      }
      __syncthreads();
    }
  }
}

__host__ __device__ int64_t pow2_at_least(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

__device__ float bits_float(uint32_t u) { return __uint_as_float(u); }

__global__ void __launch_bounds__(kSparseThreads) pack_kernel(const __grid_constant__ SparsePackArgs a) {
  __shared__ uint64_t keys[kSparseMaxChunk];
  __shared__ float sc[3];
  const int64_t n = a.numel, chunk = a.chunk, k = a.k;
  const int64_t chunks = sparse_chunks(n, chunk);
  uint8_t* offsets = sparse_offsets(a.wire, n, chunk);
  uint8_t* codes = sparse_codes(a.wire, n, chunk, k);
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t base = c * chunk, size = sparse_chunk_size(n, chunk, c), kc = sparse_chunk_k(n, chunk, k, c);
    float* E = a.error + base;
    for (int64_t j = threadIdx.x; j < chunk; j += blockDim.x) {
      if (j < size) {
        const float e = sparse_error(E[j], a.theta[base + j], a.param[base + j], a.decay);
        E[j] = e;
        keys[j] = sparse_key(e, j);
      } else {
        keys[j] = 0;  // below every element's key (an offset's low word is > 0xffffffff - 4096)
      }
    }
    __syncthreads();
    bitonic(keys, chunk, true);
    // the selected offsets, then sorted ascending (the rest padded above every offset)
    const int64_t kp = pow2_at_least(kc);
    for (int64_t t = threadIdx.x; t < kp; t += blockDim.x) {  // (each thread rewrites its own slots)
      keys[t] = t < kc ? static_cast<uint64_t>(0xffffffffu - static_cast<uint32_t>(keys[t] & 0xffffffffu)) : ~0ull;
    }
    __syncthreads();
    bitonic(keys, kp, false);
    // each slot's value beside its offset: keys[t] = (value bits << 32) | offset
    for (int64_t t = threadIdx.x; t < kc; t += blockDim.x) {
      const uint32_t o = static_cast<uint32_t>(keys[t]);
      keys[t] = (static_cast<uint64_t>(__float_as_uint(E[o])) << 32) | o;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float s_lo, s_hi;
      sc[0] = sparse_scales_of([&](int64_t t) { return bits_float(static_cast<uint32_t>(keys[t] >> 32)); }, kc,
                               &s_lo, &s_hi);
      sc[1] = s_lo;
      sc[2] = s_hi;
      sparse_scales(a.wire)[2 * c] = s_lo;
      sparse_scales(a.wire)[2 * c + 1] = s_hi;
    }
    __syncthreads();
    const int64_t first = sparse_first_slot(c, k);
    for (int64_t q = 2 * threadIdx.x; q < kc; q += 2 * blockDim.x) {  // (a pair's three bytes per thread)
      sparse_put_offsets(offsets, (first + q) / 2, static_cast<uint32_t>(keys[q]),
                         q + 1 < kc ? static_cast<uint32_t>(keys[q + 1]) : 0u, q + 1 < kc);
    }
    for (int64_t b = threadIdx.x; 4 * b < kc; b += blockDim.x) {
      uint32_t byte = 0;
      for (int64_t j = 0; j < 4 && 4 * b + j < kc; ++j) {
        const uint64_t kv = keys[4 * b + j];
        const float v = bits_float(static_cast<uint32_t>(kv >> 32));
        const uint32_t code = sparse_code(v, sc[0]);
        byte |= code << (2 * j);
        E[static_cast<uint32_t>(kv)] = v - sparse_value(code, sc[1], sc[2]);
      }
      codes[first / 4 + b] = static_cast<uint8_t>(byte);
    }
    __syncthreads();  // the keys are the next chunk's
  }
}

__global__ void __launch_bounds__(kSparseThreads) mean_kernel(const __grid_constant__ SparseMeanArgs a) {
  const int64_t n = a.numel, chunk = a.chunk, k = a.k;
  const int64_t chunks = sparse_chunks(n, chunk);
  const float inv_m = ScalarMath::div(1.f, static_cast<float>(a.num_inputs));
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t base = c * chunk, size = sparse_chunk_size(n, chunk, c), kc = sparse_chunk_k(n, chunk, k, c);
    const int64_t first = sparse_first_slot(c, k);
    float* O = a.out + base;
    for (int64_t j = threadIdx.x; j < size; j += blockDim.x) O[j] = 0.f;
    __syncthreads();
    for (int t = 0; t < a.num_inputs; ++t) {
      const void* w = a.inputs[t];
      const uint8_t* I = sparse_offsets(w, n, chunk);
      const uint8_t* Q = sparse_codes(w, n, chunk, k);
      const float s_lo = sparse_scales(w)[2 * c], s_hi = sparse_scales(w)[2 * c + 1];
      for (int64_t j = threadIdx.x; j < kc; j += blockDim.x)
        O[sparse_offset_at(I, first + j)] += sparse_value(sparse_code_at(Q, first + j), s_lo, s_hi);
      __syncthreads();
    }
    for (int64_t j = threadIdx.x; j < size; j += blockDim.x) O[j] = ScalarMath::mul(O[j], inv_m);
    __syncthreads();
  }
}

}  // namespace

void launch_sparse_pack(const SparsePackArgs& args, void* stream_ptr) {
  require(args.numel >= 0, "numel must be >= 0");
  if (args.numel == 0) return;
  require(args.param != nullptr && args.theta != nullptr && args.error != nullptr && args.wire != nullptr,
          "param, theta, error and wire are required");
  require(args.chunk >= 4 && args.chunk <= kSparseMaxChunk && pow2_at_least(args.chunk) == args.chunk,
          "chunk must be a power of two in [4, 4096]");
  require(args.k >= 4 && args.k <= args.chunk && args.k % 4 == 0, "k must be a multiple of 4 in [4, chunk]");
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  pack_kernel<<<grid_of(sparse_chunks(args.numel, args.chunk)), kSparseThreads, 0, stream>>>(args);
  DECENTPY_CUDA_CHECK_LAUNCH();
}

void launch_sparse_mean(const SparseMeanArgs& args, void* stream_ptr) {
  require(args.numel >= 0, "numel must be >= 0");
  if (args.numel == 0) return;
  require(args.out != nullptr && args.num_inputs >= 1 && args.num_inputs <= kSparseMaxMembers,
          "out and 1..kSparseMaxMembers inputs are required");
  for (int t = 0; t < args.num_inputs; ++t) require(args.inputs[t] != nullptr, "an input message is null");
  require(args.chunk >= 4 && args.chunk <= kSparseMaxChunk && args.k >= 4 && args.k <= args.chunk && args.k % 4 == 0,
          "chunk in [4, 4096] and k a multiple of 4 in [4, chunk]");
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  mean_kernel<<<grid_of(sparse_chunks(args.numel, args.chunk)), kSparseThreads, 0, stream>>>(args);
  DECENTPY_CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace decentpy
