// The peer check's two passes on CUDA (contract and arithmetic: kernels/peer_check.h, shared with
// csrc/cpu/peer_check_cpu_impl.h).
//
// One block per part (kPeerParts blocks, whatever the device: the parts, hence the bits, do not
// depend on the grid), each over its share of the sampled elements (t of the sampled subsequence at
// sampled_index(t)); each block writes its part's partial sums (float64) into row blockIdx.x of
// `out`, reduced over the block in a fixed tree; a second one-block kernel adds the rows in row order
// into the last row. Nothing is read back to the host: the caller reads the result on the device
// (decentpy/engine/peer_check.py turns it into the kernel's mix factor there).
//
// Stats: each thread sums its elements of the part (a block-stride loop) in float64. Sketch: a block
// takes its part's chunks in batches of kThreads / L chunks; thread t holds position t % L of chunk
// t / L of the batch; the chunk's signed sum is a tree reduction over its L threads (L a power of two),
// and thread 0 adds the batch's chunk sums to the block's k shared slots in chunk order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/kernel_utils.cuh"
#include "cuda/mix_and_step_cuda.h"
#include "kernels/peer_check.h"

namespace decentpy {
namespace cuda {
namespace {

using detail::kThreads;
static_assert(kThreads >= kSketchMaxChunk, "a sketch batch holds at least one whole chunk");
static_assert((kThreads & (kThreads - 1)) == 0, "the block reductions halve the block");

// The block's sum of v (every thread's), in a fixed tree; valid in thread 0. `shared` holds kThreads.
__device__ __forceinline__ double block_sum(double v, double* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  const double r = shared[0];
  __syncthreads();  // shared may be written again right after
  return r;
}

template <typename T, bool HasComm>
__global__ void __launch_bounds__(kThreads) peer_stats_kernel(const T* __restrict__ param, const T* __restrict__ comm,
                                                               int64_t m, int64_t sample, int64_t per,
                                                               double* __restrict__ out) {
  __shared__ double shared[kThreads];
  const int64_t lo = min(m, static_cast<int64_t>(blockIdx.x) * per * kSampleUnit);
  const int64_t hi = min(m, lo + per * kSampleUnit);
  double d2 = 0.0, p2 = 0.0, cnf = 0.0, pnf = 0.0;
  for (int64_t t = lo + threadIdx.x; t < hi; t += kThreads) {
    const int64_t i = sampled_index(t, sample);
    const float p = detail::to_f32<T>(param[i]);
    p2 += static_cast<double>(p) * p;
    pnf += static_cast<double>(p - p);
    if constexpr (HasComm) {
      const float c = detail::to_f32<T>(comm[i]);
      const float x = c - p;
      d2 += static_cast<double>(x) * x;
      cnf += static_cast<double>(c - c);
    }
  }
  double* row = out + static_cast<int64_t>(blockIdx.x) * kPeerStats;
  d2 = block_sum(d2, shared);
  p2 = block_sum(p2, shared);
  cnf = block_sum(cnf, shared);
  pnf = block_sum(pnf, shared);
  if (threadIdx.x == 0) {
    row[kDistSq] = d2;
    row[kSelfSq] = p2;
    row[kPeerNf] = cnf;
    row[kSelfNf] = pnf;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) peer_sketch_kernel(const T* __restrict__ src, int64_t m, int64_t sample,
                                                                uint64_t seed, int k, int64_t L, int64_t chunks,
                                                                int64_t per, double* __restrict__ out) {
  __shared__ double shared[kThreads];
  __shared__ double slots[kSketchMaxSlots];
  for (int w = threadIdx.x; w < k; w += kThreads) slots[w] = 0.0;
  const int64_t c0 = min(chunks, static_cast<int64_t>(blockIdx.x) * per);
  const int64_t c1 = min(chunks, c0 + per);
  const int64_t batch = kThreads / L;  // chunks per batch
  const int64_t j = threadIdx.x % L;   // this thread's position in its chunk
  const int64_t q = threadIdx.x / L;   // its chunk in the batch
  const double sig = sketch_position_sign(j, seed);
  double sq = 0.0, nf = 0.0;
  __syncthreads();
  for (int64_t cb = c0; cb < c1; cb += batch) {
    const int64_t c = cb + q;
    const int64_t t = c * L + j;  // in the sampled subsequence
    double v = 0.0;
    if (c < c1 && t < m) {
      const double y = detail::to_f32<T>(src[sampled_index(t, sample)]);
      v = sig * y;
      sq += y * y;
      nf += y - y;
    }
    // the signed sum of each chunk: a tree over its L threads (segments of L consecutive threads)
    shared[threadIdx.x] = v;
    __syncthreads();
    for (int64_t s = L / 2; s > 0; s >>= 1) {
      if (j < s) shared[threadIdx.x] += shared[threadIdx.x + s];
      __syncthreads();
    }
    if (threadIdx.x == 0) {  // in chunk order: the same bits on every run
      for (int64_t b = 0; b < batch && cb + b < c1; ++b) {
        int32_t slot;
        double t;
        sketch_slot(static_cast<uint64_t>(cb + b), seed, k, slot, t);
        slots[slot] += t * shared[b * L];
      }
    }
    __syncthreads();
  }
  sq = block_sum(sq, shared);
  nf = block_sum(nf, shared);
  double* row = out + static_cast<int64_t>(blockIdx.x) * (k + 2);
  for (int w = threadIdx.x; w < k; w += kThreads) row[w] = slots[w];
  if (threadIdx.x == 0) {
    row[k] = sq;
    row[k + 1] = nf;
  }
}

// The rows' sum, in row order, into row kPeerParts (one thread per column).
__global__ void __launch_bounds__(kThreads) peer_rows_kernel(double* __restrict__ out, int width) {
  for (int w = threadIdx.x; w < width; w += kThreads) {
    double s = 0.0;
    for (int64_t p = 0; p < kPeerParts; ++p) s += out[p * width + w];
    out[kPeerParts * width + w] = s;
  }
}

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("decentpy peer check (CUDA): ") + what);
}

template <typename T>
void stats_typed(const PeerStatsArgs& a, cudaStream_t stream) {
  const int64_t m = sampled_count(a.numel, a.sample);
  const int64_t per = peer_part_size(sampled_units(a.numel, a.sample));  // sampled units per part
  const T* param = static_cast<const T*>(a.param);
  const T* comm = static_cast<const T*>(a.comm);
  if (comm != nullptr)
    peer_stats_kernel<T, true><<<kPeerParts, kThreads, 0, stream>>>(param, comm, m, a.sample, per, a.out);
  else
    peer_stats_kernel<T, false><<<kPeerParts, kThreads, 0, stream>>>(param, comm, m, a.sample, per, a.out);
  DECENTPY_CUDA_CHECK_LAUNCH();
}

template <typename T>
void sketch_typed(const PeerSketchArgs& a, cudaStream_t stream) {
  const int64_t m = sampled_count(a.numel, a.sample);
  const int64_t L = sketch_chunk(m, a.slots);
  const int64_t chunks = (m + L - 1) / L;
  peer_sketch_kernel<T><<<kPeerParts, kThreads, 0, stream>>>(static_cast<const T*>(a.src), m, a.sample, a.seed,
                                                              a.slots, L, chunks, peer_part_size(chunks), a.out);
  DECENTPY_CUDA_CHECK_LAUNCH();
}

__global__ void peer_pair_verdict_kernel(const double* stats, double expand, double tau, double first, bool clip,
                                         double* out) {
  pair_verdict(stats, expand, tau, first, clip, out);
}

__global__ void peer_group_verdict_kernel(const double* fp, int m, int k, const double* recv, double scale, double u,
                                          double tau, double first, double expand, double* out) {
  group_verdict(fp, m, k, recv, scale, u, tau, first, expand, out);
}

}  // namespace

void launch_peer_pair_verdict(const double* stats, double expand, double tau, double first, bool clip, double* out,
                              void* stream_ptr) {
  peer_pair_verdict_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream_ptr)>>>(stats, expand, tau, first, clip, out);
  DECENTPY_CUDA_CHECK_LAUNCH();
}

void launch_peer_group_verdict(const double* fingerprints, int members, int slots, const double* recv, double scale,
                               double unit_roundoff, double tau, double first, double expand, double* out,
                               void* stream_ptr) {
  require(members >= 1 && members <= kVerdictMaxMembers && slots >= 1 && slots <= kSketchMaxSlots,
          "a group verdict takes 1 to kVerdictMaxMembers members and 1 to kSketchMaxSlots slots");
  peer_group_verdict_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream_ptr)>>>(
      fingerprints, members, slots, recv, scale, unit_roundoff, tau, first, expand, out);
  DECENTPY_CUDA_CHECK_LAUNCH();
}

void launch_peer_stats(const PeerStatsArgs& args, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  require(args.numel >= 0, "numel must be >= 0");
  require(args.param != nullptr || args.numel == 0, "param is required");
  require(args.out != nullptr, "out is required");
  require(args.sample >= 1, "sample must be >= 1");
  switch (args.dtype) {
    case DType::Float32: stats_typed<float>(args, stream); break;
    case DType::BFloat16: stats_typed<__nv_bfloat16>(args, stream); break;
    case DType::Float16: stats_typed<__half>(args, stream); break;
  }
  peer_rows_kernel<<<1, kThreads, 0, stream>>>(args.out, kPeerStats);
  DECENTPY_CUDA_CHECK_LAUNCH();
}

void launch_peer_sketch(const PeerSketchArgs& args, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  require(args.numel >= 0, "numel must be >= 0");
  require(args.src != nullptr || args.numel == 0, "src is required");
  require(args.out != nullptr, "out is required");
  require(args.sample >= 1, "sample must be >= 1");
  require(args.slots >= 1 && args.slots <= kSketchMaxSlots, "slots must be in [1, kSketchMaxSlots]");
  switch (args.dtype) {
    case DType::Float32: sketch_typed<float>(args, stream); break;
    case DType::BFloat16: sketch_typed<__nv_bfloat16>(args, stream); break;
    case DType::Float16: sketch_typed<__half>(args, stream); break;
  }
  peer_rows_kernel<<<1, kThreads, 0, stream>>>(args.out, args.slots + 2);
  DECENTPY_CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace decentpy
