// The outer step of local-steps training (DiLoCo), fused: the contract of its two passes per bucket
// and their per-element arithmetic, written once for the CPU (csrc/cpu/outer_step_cpu.cpp) and CUDA
// (csrc/cuda/outer_step.cu) kernels. Plain C++: no torch, no Python; host and device (DECENTPY_HD).
// The argument structs, OuterPackArgs and OuterApplyArgs, are types only and live with the other
// contracts in kernels/mix_and_step.h.
//
// The outer exchange sits between the two passes, so a bucket's outer step is two passes over its
// memory, not one: the pack before the exchange, the apply after it.
//
// Pack (OuterPackArgs), per element i, x the bucket's parameters (param dtype), theta its global
// copy (fp32):
//   d = theta[i] - x[i]                      the pseudo-gradient (DiLoCo's sign: the outer
//                                            optimizer descends it)
//   compressor None:  out[i] = d             (fp32)
//   compressor BF16 / Int8 / Int4, error feedback (EF-SGD / EF21-style):
//                     d = d - excess[i]      what earlier rounds sent beyond their true
//                                            pseudo-gradients is taken back
//                     q = Q(d) into out      (the wire layout of kernels/mix_and_step.h; int8 / int4
//                                            one scale per block of kInt8Block elements)
//                     excess[i] = D(q) - d   what this round sends beyond it (int8 / int4:
//                                            code * scale - d rounded once, a fused multiply-add)
//   Kept as an excess (not an error residual) so that the group reduction's owner adjustment of
//   kernels/compress.h (self_copy += m (D(r) - mu)) adds to it directly: the re-quantisation of
//   the group's mean is fed back by the chunk's owner.
//
// Apply (OuterApplyArgs), per element i, after the exchange:
//   g = delta[i]                   the mixed pseudo-gradient: fp32, or D(r) of a wire
//   t = theta_mix ? theta_mix[i] : theta[i]    (a gossip outer step steps from the mixed global
//                                               copy; an exact average keeps its own, equal on
//                                               every rank)
//   t, state = the outer optimizer's update of t with gradient g (kernels/update.h: SGD with
//              momentum / Nesterov / weight decay as torch.optim.SGD, or Adam / AdamW)
//   theta[i] = t                   the new global copy
//   x[i] = round(t + alpha (x[i] - t))   the local parameters restart from it (alpha = 0), or
//                                        merge the inner steps taken since the pack (Streaming
//                                        DiLoCo's fragment_update_alpha)
#pragma once

#include <cstdint>

#include "kernels/compress.h"
#include "kernels/mix_and_step.h"
#include "kernels/update.h"

namespace decentpy {

namespace {

// The outer optimizer's per-step constants: derive_step of update.h, the one derivation.
inline StepConstants derive_outer(const OuterApplyArgs& a) {
  MixStepArgs m;
  m.kind = a.kind;
  m.state0 = a.state0;
  m.state1 = a.state1;
  m.decoupled_weight_decay = a.decoupled_weight_decay;
  m.momentum_init = a.momentum_init;
  GroupHyper h = a.hyper;
  h.no_update = 0;
  return derive_step(m, h);
}

// The pseudo-gradient of one element less the excess sent before (no contraction: t - x exactly
// rounded once, then the subtraction).
DECENTPY_HD float outer_pseudo_gradient(float theta, float x, float excess) { return (theta - x) - excess; }

// What the wire sends beyond d: D(q) - d. For block codes c * s - d with one rounding (an explicit
// fused multiply-add: a compiler may contract c * s - d on its own where the target has FMA, and the
// CPU and CUDA passes must agree); for bf16 the value minus d.
DECENTPY_HD float outer_excess_code(float c, float s, float d) { return ScalarMath::fma(c, s, -d); }
DECENTPY_HD float outer_excess(float v, float d) { return v - d; }

// The merge of the local parameters with the new global copy t: t + alpha (x - t).
DECENTPY_HD float outer_merge(float t, float x, float alpha) {
  return alpha == 0.f ? t : ScalarMath::fma(alpha, x - t, t);
}

// D(delta)[i] of a pseudo-gradient wire (block value for int8 / int4, bf16 value), or the fp32 value.
template <Compressor C>
DECENTPY_HD float outer_delta_at(const void* delta, int64_t n, int64_t i) {
  constexpr int Bits = code_bits(C);
  if constexpr (C == Compressor::None) {
    return static_cast<const float*>(delta)[i];
  } else if constexpr (Bits != 0) {
    return block_value(block_code_at<Bits>(block_codes(delta, n), i), block_scales(delta)[i / kInt8Block]);
  } else {
    return bf16_value(static_cast<const uint16_t*>(delta)[i]);
  }
}

// The outer update of one element: t the global copy to step from, g the pseudo-gradient, m / v the
// optimizer's state (unused ones ignored). update<K> of update.h with a unit gradient factor.
template <OptKind K>
DECENTPY_HD void outer_update(const StepConstants& h, float& t, float g, float& m, float& v) {
  float acc = 0.f;
  update<K, ScalarMath, float>(h, h.flags, 1.f, t, g, m, v, acc);
}

}  // namespace
}  // namespace decentpy
