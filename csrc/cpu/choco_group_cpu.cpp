// CPU group reduction of compressed gossip (contract: kernels/mix_and_step.h, GroupReduceArgs; the
// arithmetic: kernels/compress.h, shared with csrc/cuda/choco.cu). One scale block at a time: the
// members' mean into a block-local buffer, its max |mu| and scale, the codes into r and the owner's
// copy adjustment. Scalar code: the chunk is 1/m of a bucket and the loop is memory-bound on the m
// inputs.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "cpu/mix_and_step_cpu.h"
#include "kernels/compress.h"

namespace decentpy {
namespace {

constexpr int64_t kGrainBlocks = 16;  // 4096 elements per task

template <Compressor C>
void reduce_block(const GroupReduceArgs& A, int64_t lo, int64_t hi) {
  constexpr int Bits = code_bits(C);
  const int m = A.num_inputs;
  const float mf = static_cast<float>(m);
  const float inv_m = ScalarMath::div(1.f, mf);
  float* X = A.self_copy;
  if constexpr (Bits != 0) {
    using BC = BlockCode<Bits>;
    float mu[kInt8Block];
    float amax = 0.f;
    for (int64_t i = lo; i < hi; ++i) {
      const float v = group_mean<C>(A.inputs, m, A.numel, i, inv_m);
      mu[i - lo] = v;
      amax = std::max(amax, std::fabs(v));
    }
    const float s = block_scale<Bits>(amax);
    block_scales(A.out)[lo / kInt8Block] = s;
    uint8_t* Q = block_codes(A.out, A.numel) + lo / BC::kPerByte;
    for (int64_t k = 0; k * BC::kPerByte < hi - lo; ++k) {
      uint32_t byte = 0;  // a partial byte's missing codes are 0 (int4's padding nibble)
      for (int j = 0; j < BC::kPerByte; ++j) {
        const int64_t e = k * BC::kPerByte + j;
        if (lo + e >= hi) break;
        const float c = block_code<Bits>(mu[e], s);
        byte |= block_code_field<Bits>(c, j);
        X[lo + e] = group_copy_adjust(X[lo + e], block_value(c, s), mu[e], mf);
      }
      Q[k] = static_cast<uint8_t>(byte);
    }
  } else {
    uint16_t* R = static_cast<uint16_t*>(A.out);
    for (int64_t i = lo; i < hi; ++i) {
      const float v = group_mean<C>(A.inputs, m, A.numel, i, inv_m);
      const uint16_t r = bf16_bits(v);
      R[i] = r;
      X[i] = group_copy_adjust(X[i], bf16_value(r), v, mf);
    }
  }
}

template <Compressor C>
void run(const GroupReduceArgs& A) {
  const int64_t b0 = A.lo / kInt8Block, b1 = num_scale_blocks(A.hi);
  at::parallel_for(b0, b1, kGrainBlocks, [&](int64_t bb, int64_t be) {
    for (int64_t b = bb; b < be; ++b)
      reduce_block<C>(A, std::max(A.lo, b * kInt8Block), std::min(A.hi, (b + 1) * kInt8Block));
  });
}

}  // namespace

void choco_group_reduce_cpu(const GroupReduceArgs& args) {
  if (args.hi <= args.lo) return;
  switch (args.compressor) {
    case Compressor::Int8: return run<Compressor::Int8>(args);
    case Compressor::Int4: return run<Compressor::Int4>(args);
    default: return run<Compressor::BF16>(args);
  }
}

}  // namespace decentpy
