// The peer check (decentpy/engine/peer_check.py): what arrives from a peer is measured against this
// replica before it is mixed. The contract of its two passes and their per-element arithmetic,
// written once for the CPU (csrc/cpu/peer_check_cpu_impl.h) and CUDA (csrc/cuda/peer_check.cu)
// kernels. Plain C++: no torch, no Python; host and device (DECENTPY_HD).
//
// Both passes split their elements into kPeerParts fixed parts (independent of the thread count and
// the grid), write each part's partial sums (float64) into row p of `out`, and the sum of the rows,
// added in row order, into row kPeerParts: a pass gives the same bits on every run. `out` is float64,
// (kPeerParts + 1) rows of the pass's width, on the buffers' device; the result is its last row.
//
// Sampling (`sample` > 1): both passes read unit u of kSampleUnit elements (four 64-byte lines of
// fp32) when u % sample == 0, and nothing else, so a pass over a large bucket reads 1 / sample of its memory;
// the sums are over the sampled elements (the caller scales them), the sketch is the sketch of the
// sampled subsequence z (element t of z the t-th sampled element: still a linear map of y). What the
// sample misses is covered in the fused pass itself, element by element (MixStepArgs::mix_guard).
//
// Stats (PeerStatsArgs, width kPeerStats): a received buffer c against this replica p (same dtype
// and numel), in one pass:
//   [kDistSq] = sum_i (c_i - p_i)^2     (0 without c)
//   [kSelfSq] = sum_i p_i^2
//   [kPeerNf] = sum_i (c_i - c_i)       0 when every c_i is finite, NaN otherwise (0 without c)
//   [kSelfNf] = sum_i (p_i - p_i)       the same for p
// fp32 products; fp32 sums inside a run of kStatRun elements (CPU; CUDA sums per thread in float64),
// float64 across runs: the distance is compared with a bound, where fp32 rounding is far below the
// margin.
//
// Sketch (PeerSketchArgs, width k + 2): a linear fingerprint of y (a group member's send buffer, or
// the group's all-reduced sum), so that the members of a group can see each member's distance to
// the others without an all-gather of the buffers:
//   L = sketch_chunk(m, k) (m the sampled count), a power of two in [1, kSketchMaxChunk]; chunk c =
//   elements [cL, cL + L) of z
//   x = mix64(c ^ seed);  h(c) = (x mod 2^32) mod k;  t(c) = -1 if bit 63 of x is set, else +1
//   s(j) = -1 if bit 63 of mix64(j + mix64(~seed)) is set, else +1      (j = position in a chunk)
//   [h]     += t(c) * sum_j s(j) z[cL + j]     for every chunk c with h(c) = h (float64, exact signs)
//   [k]      = sum_t z_t^2                      (float64)
//   [k + 1]  = sum_t (z_t - z_t)                0 when every z_t is finite, NaN otherwise
// A linear map up to rounding (sketch(y1 + y2) = sketch(y1) + sketch(y2)) with E ||S x||^2 = ||x||^2
// over the signs t: ||S y_j - S y_i|| estimates ||y_j - y_i||. Its null space is large: a member that
// chooses what it sends knowing the sketch (seed and layout are shared by the group) can hide a
// difference from it; the check is against faults, not against such an adversary.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/mix_and_step.h"
#include "kernels/update.h"  // DECENTPY_HD

namespace decentpy {

// The argument structs (PeerStatsArgs, PeerSketchArgs) and the constants (kPeerParts, ...) are types
// only and live with the other contracts in kernels/mix_and_step.h.

// Internal linkage, as kernels/update.h: every ISA translation unit keeps its own copy.
namespace {

// splitmix64's finaliser: the sketch's hash.
DECENTPY_HD uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The chunk length of a sketch of n elements into k slots: the largest power of two <= 256 that
// still leaves kSketchChunksPerSlot chunks per slot (1 for small buffers: one element per chunk).
DECENTPY_HD int64_t sketch_chunk(int64_t n, int32_t k) {
  int64_t L = 1;
  while (L < kSketchMaxChunk && 2 * L * kSketchChunksPerSlot * k <= n) L *= 2;
  return L;
}

// Slot and sign of chunk c.
DECENTPY_HD void sketch_slot(uint64_t c, uint64_t seed, int32_t k, int32_t& slot, double& sign) {
  const uint64_t x = mix64(c ^ seed);
  slot = static_cast<int32_t>(static_cast<uint32_t>(x) % static_cast<uint32_t>(k));
  sign = (x >> 63) ? -1.0 : 1.0;
}

// Sign of position j inside every chunk.
DECENTPY_HD double sketch_position_sign(int64_t j, uint64_t seed) {
  return (mix64(static_cast<uint64_t>(j) + mix64(~seed)) >> 63) ? -1.0 : 1.0;
}

// Rows of p parts over `units` units: part p covers units [p * per, min(units, (p + 1) * per)).
DECENTPY_HD int64_t peer_part_size(int64_t units) { return (units + kPeerParts - 1) / kPeerParts; }

// Sampling: the sampled units of n elements (units 0, sample, 2 sample, ...), and the elements they hold.
DECENTPY_HD int64_t sampled_units(int64_t n, int64_t sample) {
  const int64_t units = (n + kSampleUnit - 1) / kSampleUnit;
  return (units + sample - 1) / sample;
}
DECENTPY_HD int64_t sampled_count(int64_t n, int64_t sample) {
  const int64_t s = sampled_units(n, sample);
  if (s == 0) return 0;
  const int64_t last = (s - 1) * sample * kSampleUnit;  // the last sampled unit may be partial
  return (s - 1) * kSampleUnit + (n - last < kSampleUnit ? n - last : kSampleUnit);
}
// Element t of the sampled subsequence z: its index in the buffer.
DECENTPY_HD int64_t sampled_index(int64_t t, int64_t sample) {
  return (t / kSampleUnit) * sample * kSampleUnit + t % kSampleUnit;
}

// ---- the verdicts (decentpy/engine/peer_check.py pair_verdict / group_verdict) ------------------
// The rules on what the passes measured, in float64, once for the host and the device (a one-thread
// kernel: the GPU decides without the host). A bound tau that is NaN means "no accepted distance yet":
// the first bound, `first` times the norm (of this replica, or of the group's center).

// A pair: stats = the stats pass's [sum (c-p)^2, sum p^2, c's and p's non-finite indicators] over the
// sampled elements, `expand` scaling its sums to the whole buffer. out = [f, d, tau, c_ok, p_ok]:
// f = 1 within the bound, else 0 (clip: tau / d); 0 when c or p is not finite.
DECENTPY_HD void pair_verdict(const double* stats, double expand, double tau, double first, bool clip, double* out) {
  const double d = sqrt(stats[kDistSq] * expand), pn = sqrt(stats[kSelfSq] * expand);
  const bool c_ok = stats[kPeerNf] == 0.0, p_ok = stats[kSelfNf] == 0.0;
  const double t = tau != tau ? first * pn : tau;
  const bool within = d <= t;  // false for a NaN distance
  double f = within ? 1.0 : (clip ? t / d : 0.0);
  if (!(c_ok && p_ok)) f = 0.0;
  out[0] = f;
  out[1] = d;
  out[2] = t;
  out[3] = c_ok ? 1.0 : 0.0;
  out[4] = p_ok ? 1.0 : 0.0;
}

// Most members of a group the verdict takes (the compressed group exchange's limit too).
constexpr int kVerdictMaxMembers = 128;

// A group of m members, sketches of k slots: fp = the all-reduced fingerprints, row j = [member j's
// non-finite flag, its sum of squares, its sketch of y_j = scale x_j]; recv = the sketch of the
// all-reduced sum (k values, its sum of squares, its non-finite indicator). u: the unit roundoff of the
// buffers' dtype; `expand` scales sampled distances to the whole buffer. out = [f, consistent, tau,
// ||center||, d_0 .. d_{m-1}, bad_0 .. bad_{m-1}] (4 + 2m values):
//   x_j = sqrt(expand) S y_j / scale;  center = the coordinate-wise median of the x_j (the mean of the
//   two middle values for an even m);  d_j = ||x_j - center||;  bad_j = flag_j != 0, a non-finite value
//   in row j, or not d_j <= tau;
//   consistent = the sum's sketch is finite and |S(sum) - sum_j S y_j| <= kConsistencySigmas (m - 1) u
//   sqrt(m sum_j sq_j) in every slot (the rounding of an m-term float sum is at most (m - 1) u
//   sum_j |y_ij| per element; the sketch's random signs make a slot's error a Rademacher sum of those);
//   f = 1 when the group is consistent and no member is bad, else 0.
constexpr double kConsistencySigmas = 16.0;

DECENTPY_HD void group_verdict(const double* fp, int m, int k, const double* recv, double scale, double u,
                               double tau, double first, double expand, double* out) {
  const int w = k + 2;
  const double unscale = sqrt(expand) / scale;
  // consistency
  double sq = 0.0;
  for (int j = 0; j < m; ++j) sq += fp[j * w + 1] > 0.0 ? fp[j * w + 1] : 0.0;
  const double tol = kConsistencySigmas * (m > 1 ? m - 1 : 1) * u * sqrt(m * sq) + 1e-300;
  bool consistent = recv[k + 1] == 0.0;
  for (int h = 0; h < k + 1; ++h) consistent = consistent && (recv[h] - recv[h] == 0.0);
  for (int h = 0; h < k && consistent; ++h) {
    double total = 0.0;
    for (int j = 0; j < m; ++j) total += fp[j * w + 2 + h];
    consistent = fabs(recv[h] - total) <= tol;
  }
  // the center, slot by slot (an insertion sort of the m values: m is small)
  double cn2 = 0.0;
  double* d2 = out + 4;  // the squared distances, accumulated in place
  for (int j = 0; j < m; ++j) d2[j] = 0.0;
  double v[kVerdictMaxMembers];
  for (int h = 0; h < k; ++h) {
    for (int j = 0; j < m; ++j) {
      const double x = fp[j * w + 2 + h] * unscale;
      int i = j;
      for (; i > 0 && v[i - 1] > x; --i) v[i] = v[i - 1];
      v[i] = x;
    }
    const double c = (v[(m - 1) / 2] + v[m / 2]) / 2;
    cn2 += c * c;
    for (int j = 0; j < m; ++j) {
      const double x = fp[j * w + 2 + h] * unscale - c;
      d2[j] += x * x;
    }
  }
  const double cn = sqrt(cn2);
  const double t = tau != tau ? first * cn : tau;
  bool any_bad = false;
  for (int j = 0; j < m; ++j) {
    bool nonfinite = fp[j * w] != 0.0;
    for (int h = 0; h < w; ++h) nonfinite = nonfinite || !(fp[j * w + h] - fp[j * w + h] == 0.0);
    const double d = sqrt(d2[j]);
    const bool bad = nonfinite || !(d <= t);
    d2[j] = d;
    out[4 + m + j] = bad ? 1.0 : 0.0;
    any_bad = any_bad || bad;
  }
  out[0] = consistent && !any_bad ? 1.0 : 0.0;
  out[1] = consistent ? 1.0 : 0.0;
  out[2] = t;
  out[3] = cn;
}

}  // namespace
}  // namespace decentpy
