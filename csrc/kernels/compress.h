// The per-element arithmetic of compressed gossip (CHOCO-style, Koloskova et al. 2019), written once
// for the CPU and CUDA kernels: the quantisers Q / dequantisers D of the wire formats, the update of
// a tracked public copy, and the consensus mix. Contract and wire layout: kernels/mix_and_step.h.
//
// Every rank that tracks a copy applies the same bytes with the same operations (an explicit fused
// multiply-add for int8, one addition for bf16: no compiler contraction can differ), so the two
// ends of an edge hold bit-identical copies; the mix p_i += gamma w (xhat_j - xhat_i) then moves
// the pair's sum by zero in exact arithmetic: the global mean is preserved.
//
// No torch types; host and device (DECENTPY_HD). Internal linkage, like update.h.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/mix_and_step.h"
#include "kernels/update.h"

namespace decentpy {
namespace {

// ---- wire layout ----------------------------------------------------------------------------
DECENTPY_HD int64_t int8_num_blocks(int64_t n) { return (n + kInt8Block - 1) / kInt8Block; }
// Int8: the scales come first (4-byte aligned at offset 0), then the codes.
DECENTPY_HD float* int8_scales(void* wire) { return static_cast<float*>(wire); }
DECENTPY_HD const float* int8_scales(const void* wire) { return static_cast<const float*>(wire); }
DECENTPY_HD int8_t* int8_codes(void* wire, int64_t n) {
  return reinterpret_cast<int8_t*>(static_cast<char*>(wire) + 4 * int8_num_blocks(n));
}
DECENTPY_HD const int8_t* int8_codes(const void* wire, int64_t n) {
  return reinterpret_cast<const int8_t*>(static_cast<const char*>(wire) + 4 * int8_num_blocks(n));
}

// ---- bf16 -----------------------------------------------------------------------------------
// fp32 -> bf16 bits, round to nearest even (NaN stays a quiet NaN).
DECENTPY_HD uint16_t bf16_bits(float x) {
#if defined(__CUDA_ARCH__)
  uint32_t u = __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
#endif
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
DECENTPY_HD float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}
// xhat += D(q) for a bf16 q.
DECENTPY_HD float bf16_copy_update(float xhat, uint16_t q) { return xhat + bf16_value(q); }

// ---- int8 with one fp32 scale per block of kInt8Block elements ------------------------------
// The scale of a block whose largest |d| is amax: s = amax / 127 (0 for an all-zero block).
DECENTPY_HD float int8_scale(float amax) { return ScalarMath::div(amax, 127.f); }
// The code of d in a block of scale s: d / s rounded to nearest (ties to even), in [-127, 127];
// 0 when s == 0 (then every d of the block is 0).
DECENTPY_HD float int8_code(float d, float s) {
  if (!(s > 0.f)) return 0.f;
  const float c = ScalarMath::rint(ScalarMath::div(d, s));
  return c > 127.f ? 127.f : (c < -127.f ? -127.f : c);
}
// xhat += D(q) = code * s, one rounding (fused multiply-add).
DECENTPY_HD float int8_copy_update(float xhat, float code, float s) { return ScalarMath::fma(code, s, xhat); }

// ---- the consensus step ---------------------------------------------------------------------
// p += gamma * w_ij * (xhat_peer - xhat_self)   (gw = gamma * w_ij)
DECENTPY_HD float choco_mix(float p, float xpeer, float xself, float gw) {
  return ScalarMath::fma(gw, xpeer - xself, p);
}

}  // namespace
}  // namespace decentpy
