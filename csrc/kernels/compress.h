// The per-element arithmetic of compressed gossip (CHOCO-style, Koloskova et al. 2019), written once
// for the CPU and CUDA kernels: the quantisers Q / dequantisers D of the wire formats, the update of
// a tracked public copy, and the consensus mix. Contract and wire layout: kernels/mix_and_step.h.
//
// Every rank that tracks a copy applies the same bytes with the same operations (an explicit fused
// multiply-add for int8 and int4, one addition for bf16: no compiler contraction can differ), so
// the two ends of an edge hold bit-identical copies; the mix p_i += gamma w (xhat_j - xhat_i) then
// moves the pair's sum by zero in exact arithmetic: the global mean is preserved.
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
// Int8 / Int4: one fp32 scale per block of kInt8Block elements (4-byte aligned at offset 0), then
// the codes (int8: one byte each; int4: two per byte, see "block-scaled integer codes" below).
DECENTPY_HD int64_t num_scale_blocks(int64_t n) { return (n + kInt8Block - 1) / kInt8Block; }
DECENTPY_HD float* block_scales(void* wire) { return static_cast<float*>(wire); }
DECENTPY_HD const float* block_scales(const void* wire) { return static_cast<const float*>(wire); }
DECENTPY_HD uint8_t* block_codes(void* wire, int64_t n) {
  return static_cast<uint8_t*>(wire) + 4 * num_scale_blocks(n);
}
DECENTPY_HD const uint8_t* block_codes(const void* wire, int64_t n) {
  return static_cast<const uint8_t*>(wire) + 4 * num_scale_blocks(n);
}

// ---- bf16 -----------------------------------------------------------------------------------
// fp32 -> bf16 bits, round to nearest even. Every NaN becomes the one quiet NaN 0x7fc0: the NaN an
// operation returns differs by device (x86 keeps an operand's payload and sign, CUDA returns its
// canonical NaN), and the wire bytes must not.
DECENTPY_HD uint16_t bf16_bits(float x) {
#if defined(__CUDA_ARCH__)
  uint32_t u = __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
#endif
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
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

// ---- block-scaled integer codes: int8 (Bits = 8) and int4 (Bits = 4) ------------------------
// One fp32 scale per block of kInt8Block elements, s = amax / kMax with kMax = 2^(Bits-1) - 1 (127,
// 7), and the codes round(d / s) in [-kMax, kMax], stored as Bits-bit two's complement, 8 / Bits
// codes per byte, the lower element in the lower bits: int4 element 2k is the low nibble of code
// byte k, element 2k+1 the high nibble. Blocks hold an even number of elements, so a byte never
// straddles two blocks; an odd element count leaves the high nibble of the last byte 0.
//
// Bits of the codes of a compressor (0: not block-scaled).
DECENTPY_HD constexpr int code_bits(Compressor c) {
  return c == Compressor::Int8 ? 8 : c == Compressor::Int4 ? 4 : 0;
}

template <int Bits>
struct BlockCode {
  static_assert(Bits == 8 || Bits == 4, "block-scaled codes are int8 or int4");
  static constexpr int kPerByte = 8 / Bits;
  static constexpr uint32_t kMask = (1u << Bits) - 1u;
  static constexpr float kMax = static_cast<float>((1 << (Bits - 1)) - 1);
};

// The scale of a block whose largest |d| is amax: s = amax / kMax (0 for an all-zero block).
template <int Bits>
DECENTPY_HD float block_scale(float amax) { return ScalarMath::div(amax, BlockCode<Bits>::kMax); }
// The code of d in a block of scale s: d / s rounded to nearest (ties to even), in [-kMax, kMax];
// 0 when s == 0 (then every d of the block is 0).
template <int Bits>
DECENTPY_HD float block_code(float d, float s) {
  constexpr float kMax = BlockCode<Bits>::kMax;
  if (!(s > 0.f)) return 0.f;
  const float c = ScalarMath::rint(ScalarMath::div(d, s));
  return c > kMax ? kMax : (c < -kMax ? -kMax : c);
}
// Code c (an integer-valued float in [-kMax, kMax]) as the j-th field of its byte (j < kPerByte).
template <int Bits>
DECENTPY_HD uint32_t block_code_field(float c, int j) {
  return (static_cast<uint32_t>(static_cast<int32_t>(c)) & BlockCode<Bits>::kMask) << (j * Bits);
}
// The j-th code of a code byte (j < kPerByte) as a float: shifted to the top, then an arithmetic
// shift back sign-extends it (no branch: the CPU loops over it vectorise).
template <int Bits>
DECENTPY_HD float block_code_of_byte(uint32_t byte, int j) {
  return static_cast<float>(static_cast<int32_t>(byte << (32 - Bits - j * Bits)) >> (32 - Bits));
}
// The code of element i (counted from the start of the codes) as a float.
template <int Bits>
DECENTPY_HD float block_code_at(const uint8_t* codes, int64_t i) {
  using BC = BlockCode<Bits>;
  return block_code_of_byte<Bits>(codes[i / BC::kPerByte], static_cast<int>(i % BC::kPerByte));
}
// xhat += D(q) = code * s, one rounding (fused multiply-add).
DECENTPY_HD float block_copy_update(float xhat, float code, float s) { return ScalarMath::fma(code, s, xhat); }

// The byte ranges [start, stop) that hold elements [lo, hi) of a wire of n elements (lo a multiple
// of kInt8Block, so a range never splits a block's scale or an int4 byte): int8 / int4 their block
// scales, then their codes; bf16 one range. Writes the pairs into out, returns how many (<= 2).
inline int wire_regions(Compressor c, int64_t n, int64_t lo, int64_t hi, int64_t out[4]) {
  if (c == Compressor::BF16) {
    out[0] = 2 * lo;
    out[1] = 2 * hi;
    return 1;
  }
  const int64_t per = c == Compressor::Int4 ? 2 : 1;  // elements per code byte
  const int64_t codes = 4 * num_scale_blocks(n);
  out[0] = 4 * (lo / kInt8Block);
  out[1] = 4 * num_scale_blocks(hi);
  out[2] = codes + lo / per;
  out[3] = codes + (hi + per - 1) / per;
  return 2;
}

// ---- group reduction (kernels/mix_and_step.h, GroupReduceArgs) ------------------------------
// acc + D(q)[i] with one rounding: a fused multiply-add of code and scale for int8 / int4 (written
// out: nvcc would contract acc + code * s into one on its own, a CPU build without FMA would not),
// one addition for bf16.
template <Compressor C>
DECENTPY_HD float wire_accumulate(float acc, const void* wire, int64_t n, int64_t i) {
  constexpr int Bits = code_bits(C);
  if constexpr (Bits != 0) {
    return ScalarMath::fma(block_code_at<Bits>(block_codes(wire, n), i), block_scales(wire)[i / kInt8Block], acc);
  } else {
    return acc + bf16_value(static_cast<const uint16_t*>(wire)[i]);
  }
}
// mu = (sum_t D(q_t)[i]) * inv_m, the members in their order (one rounding order on every device).
template <Compressor C>
DECENTPY_HD float group_mean(const void* const* inputs, int m, int64_t n, int64_t i, float inv_m) {
  float s = 0.f;
  for (int t = 0; t < m; ++t) s = wire_accumulate<C>(s, inputs[t], n, i);
  return ScalarMath::mul(s, inv_m);
}
// D(r) = code * scale of the owner's re-quantised mean, rounded on its own (see ScalarMath::mul).
DECENTPY_HD float block_value(float code, float s) { return ScalarMath::mul(code, s); }
// The owner's copy keeps what the re-quantisation of the mean dropped: xhat += m (D(r) - mu).
DECENTPY_HD float group_copy_adjust(float xhat, float dr, float mu, float m) {
  return ScalarMath::fma(m, dr - mu, xhat);
}

// ---- the consensus step ---------------------------------------------------------------------
// p += gamma * w_ij * (xhat_peer - xhat_self)   (gw = gamma * w_ij)
DECENTPY_HD float choco_mix(float p, float xpeer, float xself, float gw) {
  return ScalarMath::fma(gw, xpeer - xself, p);
}

}  // namespace
}  // namespace decentpy
