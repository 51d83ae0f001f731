// SparseLoCo's outer exchange (Sarfi et al. 2025, arXiv 2508.15706): chunk-wise top-k of an
// error-fed pseudo-gradient, its values in 2 bits, and the mean of the members' sparse messages.
// The contract of the two kernels and their per-element and per-chunk arithmetic, written once for
// the CPU (csrc/cpu/sparse_cpu.cpp) and CUDA (csrc/cuda/sparse.cu) kernels. Plain C++: no torch, no
// Python; host and device (DECENTPY_HD).
//
// Pack (SparsePackArgs), a flat buffer of n fp32 elements in chunks of `chunk` elements (the last
// one may be shorter), each chunk independently:
//   e[i] = fma(decay, e[i], theta[i] - x[i])   the error-feedback buffer takes the pseudo-gradient
//                                              (DiLoCo's sign) on top of its decayed self: it
//                                              replaces the outer momentum
//   S    = the k_c = min(k, chunk size) elements of largest |e| (a total order: |e| descending,
//          NaN above every number, then the lower index first), listed in ascending index order
//   the values e[S] in 2 bits: a = mean |e[S]| (summed in list order, divided once); an element is
//          "high" when |e| >= a; s_lo / s_hi the means of |e| over the low / high elements (0 for an
//          empty side); the code is the sign bit (bit 0: negative) and the high bit (bit 1);
//          D(code) = +-(high ? s_hi : s_lo)
//   e[S] -= D(code)                            what was sent leaves the buffer; the rest stays
// Mean (SparseMeanArgs): out = (sum over the members, in their order, of D(message_t)) * (1 / m),
// element by element: out[i] starts at 0, each member's listed elements add their value once (a
// message lists an element at most once), then one multiplication.
//
// Wire layout of one message (n, chunk, k fixed for a buffer): for each of the C = ceil(n / chunk)
// chunks two fp32 scales (s_lo, s_hi); then the listed offsets within their chunk, 12 bits each,
// chunk after chunk (S_total = sum_c k_c of them): slots 2m and 2m + 1 in bytes 3m..3m+2 (slot 2m in
// byte 3m and the low nibble of 3m+1, slot 2m + 1 in the high nibble of 3m+1 and byte 3m+2); then the
// 2-bit codes, four per byte, the lower slot in the lower bits, in the same order. k is a multiple of
// 4, so a chunk's offsets and codes start on a byte (no byte holds two chunks'); the last bytes of
// the last chunk may be partly unused (0). 1.75 bytes per sent entry.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/update.h"

namespace decentpy {

// Most elements one chunk may have: its offsets are 12 bits and the CUDA pack sorts a chunk's keys in
// shared memory (8 bytes each: 32 KiB).
constexpr int64_t kSparseMaxChunk = 4096;

struct SparsePackArgs {
  int64_t numel = 0;
  int32_t chunk = 0;             // elements per chunk, in [k, kSparseMaxChunk], a power of two
  int32_t k = 0;                 // elements sent per (full) chunk, a multiple of 4
  float decay = 0.f;             // the error buffer's decay (beta)
  const float* param = nullptr;  // x, fp32
  const float* theta = nullptr;  // the global copy, fp32
  float* error = nullptr;        // e (in and out)
  void* wire = nullptr;          // the message (sparse_wire_bytes(numel, chunk, k) bytes)
};

// Most members of one mean (the CUDA launcher passes their pointers by value).
constexpr int kSparseMaxMembers = 128;

struct SparseMeanArgs {
  int64_t numel = 0;
  int32_t chunk = 0;
  int32_t k = 0;
  int32_t num_inputs = 0;                     // m: the members' messages, this rank's own included
  const void* inputs[kSparseMaxMembers] = {};
  float* out = nullptr;                       // fp32, numel elements
};

namespace {

DECENTPY_HD int64_t sparse_chunks(int64_t n, int64_t chunk) { return (n + chunk - 1) / chunk; }
// Elements of chunk c.
DECENTPY_HD int64_t sparse_chunk_size(int64_t n, int64_t chunk, int64_t c) {
  const int64_t rest = n - c * chunk;
  return rest < chunk ? rest : chunk;
}
// Elements chunk c sends.
DECENTPY_HD int64_t sparse_chunk_k(int64_t n, int64_t chunk, int64_t k, int64_t c) {
  const int64_t size = sparse_chunk_size(n, chunk, c);
  return size < k ? size : k;
}
// The first slot of chunk c (every chunk before it is full, so sends k).
DECENTPY_HD int64_t sparse_first_slot(int64_t chunk_index, int64_t k) { return chunk_index * k; }
DECENTPY_HD int64_t sparse_slots(int64_t n, int64_t chunk, int64_t k) {
  const int64_t c = sparse_chunks(n, chunk);
  return c == 0 ? 0 : (c - 1) * k + sparse_chunk_k(n, chunk, k, c - 1);
}

}  // namespace

// Bytes of one message.
inline int64_t sparse_wire_bytes(int64_t n, int64_t chunk, int64_t k) {
  const int64_t s = sparse_slots(n, chunk, k);
  return 8 * sparse_chunks(n, chunk) + (3 * s + 1) / 2 + (s + 3) / 4;
}

namespace {

DECENTPY_HD float* sparse_scales(void* wire) { return static_cast<float*>(wire); }
DECENTPY_HD const float* sparse_scales(const void* wire) { return static_cast<const float*>(wire); }
DECENTPY_HD uint8_t* sparse_offsets(void* wire, int64_t n, int64_t chunk) {
  return static_cast<uint8_t*>(wire) + 8 * sparse_chunks(n, chunk);
}
DECENTPY_HD const uint8_t* sparse_offsets(const void* wire, int64_t n, int64_t chunk) {
  return static_cast<const uint8_t*>(wire) + 8 * sparse_chunks(n, chunk);
}
DECENTPY_HD uint8_t* sparse_codes(void* wire, int64_t n, int64_t chunk, int64_t k) {
  return sparse_offsets(wire, n, chunk) + (3 * sparse_slots(n, chunk, k) + 1) / 2;
}
DECENTPY_HD const uint8_t* sparse_codes(const void* wire, int64_t n, int64_t chunk, int64_t k) {
  return sparse_offsets(wire, n, chunk) + (3 * sparse_slots(n, chunk, k) + 1) / 2;
}
// The offset in slot s (12 bits: see the layout).
DECENTPY_HD uint32_t sparse_offset_at(const uint8_t* offsets, int64_t s) {
  const uint8_t* p = offsets + 3 * (s / 2);
  return (s % 2 == 0) ? (static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1] & 0x0fu) << 8))
                      : ((static_cast<uint32_t>(p[1]) >> 4) | (static_cast<uint32_t>(p[2]) << 4));
}
// Slots 2m and 2m + 1 (o1 ignored when the pair has one slot: the last of an odd count) into their
// three bytes (the last one not written then: only its pair's bytes exist).
DECENTPY_HD void sparse_put_offsets(uint8_t* offsets, int64_t m, uint32_t o0, uint32_t o1, bool two) {
  uint8_t* p = offsets + 3 * m;
  p[0] = static_cast<uint8_t>(o0 & 0xffu);
  p[1] = static_cast<uint8_t>(((o0 >> 8) & 0x0fu) | (two ? ((o1 & 0x0fu) << 4) : 0u));
  if (two) p[2] = static_cast<uint8_t>((o1 >> 4) & 0xffu);
}

// The new error of one element: decay * e + (theta - x), the difference rounded once, then one
// fused multiply-add (written out: CPU and CUDA must not contract differently).
DECENTPY_HD float sparse_error(float e, float theta, float x, float decay) {
  return ScalarMath::fma(decay, e, theta - x);
}

// |e| as an ordered key: the bits of a non-negative float order as the floats do, and a NaN's
// (exponent all ones, mantissa non-zero) lie above infinity's. Selection key of element j of a
// chunk: larger |e| first, then the lower index (a total order: no ties).
DECENTPY_HD uint32_t sparse_abs_bits(float e) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(e) & 0x7fffffffu;
#else
  uint32_t u;
  std::memcpy(&u, &e, sizeof(u));
  return u & 0x7fffffffu;
#endif
}
DECENTPY_HD uint64_t sparse_key(float e, int64_t j) {
  return (static_cast<uint64_t>(sparse_abs_bits(e)) << 32) | static_cast<uint64_t>(0xffffffffu - static_cast<uint32_t>(j));
}

// The 2-bit code of a value v whose chunk's threshold is a: bit 0 the sign, bit 1 |v| >= a.
DECENTPY_HD uint32_t sparse_code(float v, float a) {
  const float m = v < 0.f ? -v : v;
  return (v < 0.f ? 1u : 0u) | (m >= a ? 2u : 0u);
}
DECENTPY_HD float sparse_value(uint32_t code, float s_lo, float s_hi) {
  const float s = (code & 2u) ? s_hi : s_lo;
  return (code & 1u) ? -s : s;
}
DECENTPY_HD uint32_t sparse_code_at(const uint8_t* codes, int64_t slot) {
  return (static_cast<uint32_t>(codes[slot / 4]) >> (2 * (slot % 4))) & 3u;
}

// The chunk's scales from its listed values v(0..kc) (in list order; v a callable, so the CPU reads
// an array and CUDA its shared keys): a = mean |v|; s_lo, s_hi the means over |v| < a and |v| >= a.
// Sums in list order, each divided once. Returns a.
template <typename Values>
DECENTPY_HD float sparse_scales_of(const Values& v, int64_t kc, float* s_lo, float* s_hi) {
  float sum = 0.f;
  for (int64_t t = 0; t < kc; ++t) {
    const float x = v(t);
    sum += x < 0.f ? -x : x;
  }
  const float a = kc > 0 ? ScalarMath::div(sum, static_cast<float>(kc)) : 0.f;
  float lo = 0.f, hi = 0.f;
  int64_t nlo = 0, nhi = 0;
  for (int64_t t = 0; t < kc; ++t) {
    const float x = v(t);
    const float m = x < 0.f ? -x : x;
    if (m >= a) {
      hi += m;
      ++nhi;
    } else {
      lo += m;
      ++nlo;
    }
  }
  *s_lo = nlo > 0 ? ScalarMath::div(lo, static_cast<float>(nlo)) : 0.f;
  *s_hi = nhi > 0 ? ScalarMath::div(hi, static_cast<float>(nhi)) : 0.f;
  return a;
}

}  // namespace
}  // namespace decentpy
