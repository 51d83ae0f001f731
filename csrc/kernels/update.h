// The per-element arithmetic of the fused mix-and-step kernels, written once for the CPU (scalar
// and at::vec paths) and CUDA: the mix, the gradient factor (unscale / clip / found-inf), and each
// optimizer's update. Also the one place that derives the per-step constants from a group's
// hyper-parameters (bias corrections, step size, decay).
//
// No torch types: the element type V is `float` (CPU scalar path, CUDA) or a vector type (the CPU
// kernels' at::vec::Vectorized<float>), and the primitive operations (fused multiply-add, IEEE
// division and square root) come from a math policy M:
//   M::fma(a, b, c) = a * b + c rounded once;  M::div(a, b), M::sqrt(a): IEEE round-to-nearest.
// ScalarMath below is the policy for `float` (host and device). With one definition and one
// rounding order, the CPU tests exercise the exact arithmetic the GPU runs.
//
// The functions here have internal linkage (an unnamed namespace): the CPU kernels include this header
// once per instruction set (baseline, AVX2, AVX-512 translation units), and each must keep its own
// copy rather than share one the linker picked from another ISA.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/mix_and_step.h"

#if defined(__CUDACC__)
#define DECENTPY_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define DECENTPY_HD inline __attribute__((always_inline))
#else
#define DECENTPY_HD inline
#endif

namespace decentpy {

// Update variants, resolved per segment (a group's hyper-parameters plus the launch flags).
// Weight decay is applied unconditionally (wd = 0 adds exactly 0 to finite values), so it needs
// no variant.
enum UpdateFlags : int32_t {
  kHasMomentum = 1,  // SGD: momentum != 0 and a momentum buffer is given
  kNesterov = 2,     // SGD
  kMomentumInit = 4, // SGD: the first step initialises the buffer with g
  kDecoupled = 8,    // AdamW / AccumAdamW: p *= 1 - lr * wd instead of g += wd * p
  kBoundary = 16,    // AccumAdam: this step closes an accumulation block (writes M, V)
  kNoUpdate = 32,    // the group got no gradient this step: p and the state stay as they are
};

// Per-group constants of one step, derived once on the host from GroupHyper (see derive_step).
struct StepConstants {
  float lr = 0.f;
  float wd = 0.f;
  float momentum = 0.f;
  float one_minus_dampening = 1.f;
  float beta1 = 0.f, one_minus_beta1 = 1.f;
  float beta2 = 0.f, one_minus_beta2 = 1.f;
  float eps = 0.f;
  float step_size = 0.f;   // lr / (1 - beta1^k)
  float bc2_sqrt = 1.f;    // sqrt(1 - beta2^k)
  float accum_scale = 1.f; // 1 / accum_iter
  float decay = 1.f;       // 1 - lr * wd
  int32_t flags = 0;       // UpdateFlags of this group for this launch
};

// What the gradients of a bucket are multiplied by, and whether the update is skipped.
struct GradFactor {
  float factor;
  bool skip;
};

namespace {

// The one derivation of the per-step constants (host only; double precision, then rounded).
// `bias_step` k >= 1 is the bias-correction step of Adam-family updates (AccumAdam: the block
// index ceil(t / accum_iter)); launch-wide flags (momentum_init, boundary, decoupled) are or-ed in.
inline StepConstants derive_step(const MixStepArgs& a, const GroupHyper& g) {
  StepConstants c;
  const double b1 = g.beta1, b2 = g.beta2, lr = g.lr, wd = g.weight_decay;
  c.lr = g.lr;
  c.wd = g.weight_decay;
  c.momentum = g.momentum;
  c.one_minus_dampening = static_cast<float>(1.0 - static_cast<double>(g.dampening));
  c.beta1 = g.beta1;
  c.one_minus_beta1 = static_cast<float>(1.0 - b1);
  c.beta2 = g.beta2;
  c.one_minus_beta2 = static_cast<float>(1.0 - b2);
  c.eps = g.eps;
  c.accum_scale = static_cast<float>(1.0 / static_cast<double>(g.accum_iter > 0 ? g.accum_iter : 1));
  c.decay = static_cast<float>(1.0 - lr * wd);
  if (a.kind == OptKind::Adam || a.kind == OptKind::AccumAdam) {
    const double k = static_cast<double>(g.bias_step);
    c.step_size = static_cast<float>(lr / (1.0 - std::pow(b1, k)));
    c.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(b2, k)));
  }
  int32_t f = 0;
  if (a.kind == OptKind::SGD && g.momentum != 0.f && a.state0 != nullptr) {
    f |= kHasMomentum;
    if (g.nesterov) f |= kNesterov;
    if (a.momentum_init) f |= kMomentumInit;
  }
  if (a.decoupled_weight_decay) f |= kDecoupled;
  if (a.kind == OptKind::AccumAdam && a.accum_boundary) f |= kBoundary;
  if (g.no_update) f |= kNoUpdate;
  c.flags = f;
  return c;
}

// The constants of group g when a deferred verdict says the previous update was skipped
// (MixStepArgs::prev_skip): the same group with alt_bias_step[g] as its bias-correction step.
inline StepConstants derive_step_alt(const MixStepArgs& a, int g) {
  GroupHyper h = a.groups[g];
  h.bias_step = a.alt_bias_step[g];
  return derive_step(a, h);
}

// Scalar math policy (host and device): fused multiply-add, IEEE division and square root (also
// under nvcc's fast-math flags), and a product that is never contracted into a neighbouring add
// (nvcc fuses a * b + c on its own; the CPU builds, ISO C++, do not: where CPU and CUDA results must
// agree bit for bit, such a product is written with mul).
struct ScalarMath {
  static DECENTPY_HD float splat(float x) { return x; }
  static DECENTPY_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
  }
  static DECENTPY_HD float fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
    return __fmaf_rn(a, b, c);
#else
    return std::fma(a, b, c);
#endif
  }
  static DECENTPY_HD float div(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
  }
  static DECENTPY_HD float sqrt(float a) {
#if defined(__CUDA_ARCH__)
    return __fsqrt_rn(a);
#else
    return std::sqrt(a);
#endif
  }
  // Round to the nearest integer, ties to even.
  static DECENTPY_HD float rint(float a) {
#if defined(__CUDA_ARCH__)
    return rintf(a);
#else
    return std::nearbyint(a);
#endif
  }
};

// From the bucket's gradient norm (as computed from the stored, still scaled gradients), the
// GradScaler's scale (1 without a scaler) and the clip norm (0: no clipping):
//   n = norm / scale;  skip when n is not finite;  factor = (1 / scale) * min(1, clip / (n + 1e-6)).
DECENTPY_HD GradFactor grad_factor(float norm, float scale, float clip) {
  const float inv = ScalarMath::div(1.f, scale);
  const float n = norm * inv;
  if (!(n - n == 0.f)) return {0.f, true};  // inf or nan (no <cmath> isfinite on the device)
  float f = inv;
  if (clip > 0.f && n > clip) f = inv * ScalarMath::div(clip, n + 1e-6f);
  return {f, false};
}

// p <- a * p + b * c  (the mix with the received buffer).
template <class M, class V>
DECENTPY_HD V mix(const V& a, const V& b, const V& p, const V& c) {
  return M::fma(b, c, a * p);
}

// The mix coefficients under the peer check's factor f (MixStepArgs::mix_factor): the mix as given
// for f >= 1 (the same a and b: an accepted contribution mixes bit for bit as without the check);
// for 0 < f < 1 the peer's difference scaled by f, p + f (c - p) in place of c:
//   a' = a + b (1 - f),  b' = b f;
// for f <= 0 or NaN, c is not read and p stays as it is (reads_comm false).
struct PeerMix {
  float a;
  float b;
  bool reads_comm;
};
DECENTPY_HD PeerMix peer_mix(float a, float b, float f) {
  if (!(f > 0.f)) return {1.f, 0.f, false};
  if (f >= 1.f) return {a, b, true};
  return {ScalarMath::fma(b, 1.f - f, a), ScalarMath::mul(b, f), true};
}

// The optimizer update of one element (or vector of elements) of a mixed parameter p.
// g: the raw gradient (multiplied by gs here); m, v, acc: state0..2 (unused ones are ignored).
// `flags` are UpdateFlags; callers pass a compile-time constant where they can (the CPU kernels)
// and a launch-uniform value otherwise (the CUDA kernel).
template <OptKind K, class M, class V>
DECENTPY_HD void update(const StepConstants& h, int32_t flags, const V& gs, V& p, V g, V& m, V& v,
                        V& acc) {
  if (flags & kNoUpdate) return;  // (the CPU kernels route such a group to the None path instead)
  g = g * gs;
  if constexpr (K == OptKind::SGD) {
    g = M::fma(M::splat(h.wd), p, g);
    if (flags & kHasMomentum) {
      m = (flags & kMomentumInit) ? g : M::fma(M::splat(h.momentum), m, M::splat(h.one_minus_dampening) * g);
      g = (flags & kNesterov) ? M::fma(M::splat(h.momentum), m, g) : m;
    }
    p = M::fma(M::splat(-h.lr), g, p);
  } else if constexpr (K == OptKind::Adam || K == OptKind::AccumAdam) {
    if (flags & kDecoupled) p = p * M::splat(h.decay);
    else g = M::fma(M::splat(h.wd), p, g);
    if constexpr (K == OptKind::AccumAdam) acc = M::fma(M::splat(h.accum_scale), g, acc);
    const V mt = M::fma(M::splat(h.beta1), m, M::splat(h.one_minus_beta1) * g);
    const V vt = M::fma(M::splat(h.beta2), v, M::splat(h.one_minus_beta2) * (g * g));
    const V denom = M::div(M::sqrt(vt), M::splat(h.bc2_sqrt)) + M::splat(h.eps);
    p = M::fma(M::splat(-h.step_size), M::div(mt, denom), p);
    if constexpr (K == OptKind::Adam) {
      m = mt;
      v = vt;
    } else {
      if (flags & kBoundary) {
        m = M::fma(M::splat(h.beta1), m, M::splat(h.one_minus_beta1) * acc);
        v = M::fma(M::splat(h.beta2), v, M::splat(h.one_minus_beta2) * (acc * acc));
        acc = M::splat(0.f);
      }
    }
  }
}

// Which state buffers an update reads and writes (AccumAdam writes M and V only at a boundary).
template <OptKind K>
DECENTPY_HD bool reads_state0(int32_t flags) {
  return K == OptKind::Adam || K == OptKind::AccumAdam || (K == OptKind::SGD && (flags & kHasMomentum));
}
template <OptKind K>
DECENTPY_HD bool writes_state01(int32_t flags) {
  return K == OptKind::Adam || (K == OptKind::AccumAdam && (flags & kBoundary));
}

}  // namespace
}  // namespace decentpy
