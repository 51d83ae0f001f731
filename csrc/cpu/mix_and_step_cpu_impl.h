// Body of the CPU kernels, compiled once per instruction set (see mix_and_step_cpu*.cpp).
// The including translation unit defines DECENTPY_CPU_NS (a namespace name unique to the ISA)
// and, for the AVX variants, CPU_CAPABILITY / CPU_CAPABILITY_AVX2|AVX512 plus the matching target.
// Not a public header: include it from exactly one place per ISA.
#ifndef DECENTPY_CPU_NS
#error "define DECENTPY_CPU_NS before including mix_and_step_cpu_impl.h"
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>  // convert_to_float / convert_from_float definitions
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "kernels/mix_and_step.h"

namespace decentpy {
namespace cpu_detail {
namespace DECENTPY_CPU_NS {

using Vec = at::vec::Vectorized<float>;

// Elements per parallel_for work item (chunk boundaries stay multiples of this).
constexpr int64_t kUnit = 64;
// Minimum elements per thread.
constexpr int64_t kGrainElems = 32768;

inline float vsqrt(float x) { return std::sqrt(x); }
inline Vec vsqrt(const Vec& x) { return x.sqrt(); }

// Loads/stores 2 * Vec::size() elements of storage type T as two fp32 vectors.
template <typename T>
struct Io {
  using VT = at::vec::Vectorized<T>;
  static_assert(VT::size() == 2 * Vec::size(), "16-bit vector must hold two fp32 vectors");
  static constexpr int64_t kBlock = VT::size();
  static inline void load(const T* p, Vec& a, Vec& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(VT::loadu(p));
  }
  static inline void store(T* p, const Vec& a, const Vec& b) {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
  static inline float load1(const T* p) { return static_cast<float>(*p); }
  static inline void store1(T* p, float x) { *p = T(x); }
  // kBlock zeros (all-zero bits are +0 in every storage type): plain vector stores.
  static inline void zero(T* p) { std::memset(p, 0, kBlock * sizeof(T)); }
};

template <>
struct Io<float> {
  static constexpr int64_t kBlock = 2 * Vec::size();
  static inline void load(const float* p, Vec& a, Vec& b) {
    a = Vec::loadu(p);
    b = Vec::loadu(p + Vec::size());
  }
  static inline void store(float* p, const Vec& a, const Vec& b) {
    a.store(p);
    b.store(p + Vec::size());
  }
  static inline float load1(const float* p) { return *p; }
  static inline void store1(float* p, float x) { *p = x; }
  static inline void zero(float* p) { std::memset(p, 0, kBlock * sizeof(float)); }
};

// Flags resolved per segment (outside the element loops).
enum : int { kBuf = 1, kNesterov = 2, kInit = 4, kDecoupled = 8, kBoundary = 16 };

// Launch and group scalars, broadcast once per piece (V = Vec or float).
template <class V>
struct Hyper {
  V a, b, s, gs;
  V lr, wd, mom, damp1;
  V b1, omb1, b2, omb2, eps, step, bc2, accs, decay;
  Hyper(const MixStepArgs& A, const GroupHyper& g)
      : a(A.mix_a), b(A.mix_b), s(A.send_scale), gs(A.grad_scale),
        lr(g.lr), wd(g.weight_decay), mom(g.momentum), damp1(1.f - g.dampening),
        b1(g.beta1), omb1(1.f - g.beta1), b2(g.beta2), omb2(1.f - g.beta2), eps(g.eps),
        step(g.lr / g.bias_correction1), bc2(g.bias_correction2_sqrt), accs(g.accum_scale),
        decay(1.f - g.lr * g.weight_decay) {}
};

template <OptKind K, int F>
struct KindTraits {
  static constexpr bool uses_grad = K != OptKind::None;
  static constexpr bool uses_s0 =
      (K == OptKind::SGD && (F & kBuf)) || K == OptKind::Adam || K == OptKind::AccumAdam;
  static constexpr bool uses_s1 = K == OptKind::Adam || K == OptKind::AccumAdam;
  static constexpr bool uses_s2 = K == OptKind::AccumAdam;
};

// The optimizer update of one (vector of) element(s); p is the mixed parameter.
template <OptKind K, int F, class V>
inline void update(const Hyper<V>& h, V& p, V g, V& s0, V& s1, V& s2) {
  g = g * h.gs;
  if constexpr (K == OptKind::SGD) {
    g = g + h.wd * p;
    if constexpr ((F & kBuf) != 0) {
      if constexpr ((F & kInit) != 0) {
        s0 = g;
      } else {
        s0 = h.mom * s0 + h.damp1 * g;
      }
      if constexpr ((F & kNesterov) != 0) {
        g = g + h.mom * s0;
      } else {
        g = s0;
      }
    }
    p = p - h.lr * g;
  } else if constexpr (K == OptKind::Adam || K == OptKind::AccumAdam) {
    if constexpr ((F & kDecoupled) != 0) {
      p = p * h.decay;
    } else {
      g = g + h.wd * p;
    }
    V mt, vt;
    if constexpr (K == OptKind::Adam) {
      s0 = h.b1 * s0 + h.omb1 * g;
      s1 = h.b2 * s1 + h.omb2 * (g * g);
      mt = s0;
      vt = s1;
    } else {
      s2 = s2 + h.accs * g;
      mt = h.b1 * s0 + h.omb1 * g;
      vt = h.b2 * s1 + h.omb2 * (g * g);
    }
    p = p - h.step * (mt / (vsqrt(vt) / h.bc2 + h.eps));
    if constexpr (K == OptKind::AccumAdam && (F & kBoundary) != 0) {
      s0 = h.b1 * s0 + h.omb1 * s2;
      s1 = h.b2 * s1 + h.omb2 * (s2 * s2);
      s2 = V(0.f);
    }
  }
}

// Elements [lo, hi) that all use the group hyper-parameters g.
// zero_grad is a launch-uniform run-time flag (a perfectly predicted branch per block, not a
// template parameter: that would double every specialisation for one store).
template <typename T, OptKind K, int F, bool Comm, bool Send>
void run_piece(const MixStepArgs& A, const GroupHyper& grp, int64_t lo, int64_t hi) {
  using Tr = KindTraits<K, F>;
  using IoT = Io<T>;
  using IoF = Io<float>;
  T* __restrict P = static_cast<T*>(A.param);
  T* __restrict G = static_cast<T*>(A.grad);  // read, then zeroed when zero_grad
  const bool zg = A.zero_grad != 0 && G != nullptr;
  const T* C = static_cast<const T*>(A.comm);
  T* S = static_cast<T*>(A.send);  // may alias C (read before written, element by element)
  float* __restrict S0 = A.state0;
  float* __restrict S1 = A.state1;
  float* __restrict S2 = A.state2;

  int64_t i = lo;
  {
    const Hyper<Vec> h(A, grp);
    constexpr int64_t B = IoT::kBlock;
    constexpr int64_t H = Vec::size();
    for (; i + B <= hi; i += B) {
      Vec p0, p1;
      IoT::load(P + i, p0, p1);
      if constexpr (Comm) {
        Vec c0, c1;
        IoT::load(C + i, c0, c1);
        p0 = h.a * p0 + h.b * c0;
        p1 = h.a * p1 + h.b * c1;
      }
      if constexpr (Tr::uses_grad) {
        Vec g0, g1, m0, m1, v0, v1, r0, r1;
        IoT::load(G + i, g0, g1);
        if (zg) IoT::zero(G + i);
        if constexpr (Tr::uses_s0) IoF::load(S0 + i, m0, m1);
        if constexpr (Tr::uses_s1) IoF::load(S1 + i, v0, v1);
        if constexpr (Tr::uses_s2) IoF::load(S2 + i, r0, r1);
        update<K, F>(h, p0, g0, m0, v0, r0);
        update<K, F>(h, p1, g1, m1, v1, r1);
        if constexpr (Tr::uses_s0) IoF::store(S0 + i, m0, m1);
        if constexpr (Tr::uses_s1) IoF::store(S1 + i, v0, v1);
        if constexpr (Tr::uses_s2) IoF::store(S2 + i, r0, r1);
      } else {
        if (zg) IoT::zero(G + i);  // grad not read (kind None / skip_update): store only
      }
      (void)H;
      IoT::store(P + i, p0, p1);
      if constexpr (Send) {
        // send = s * p as stored (16-bit p is rounded first), as on CUDA: peers mix the
        // parameters this worker holds, not unrounded intermediates.
        if constexpr (!std::is_same<T, float>::value) IoT::load(P + i, p0, p1);
        IoT::store(S + i, h.s * p0, h.s * p1);
      }
    }
  }
  if (i < hi) {
    const Hyper<float> h(A, grp);
    for (; i < hi; ++i) {
      float p = IoT::load1(P + i);
      if constexpr (Comm) p = h.a * p + h.b * IoT::load1(C + i);
      if constexpr (Tr::uses_grad) {
        float m = 0.f, v = 0.f, r = 0.f;
        const float g = IoT::load1(G + i);
        if (zg) IoT::store1(G + i, 0.f);
        if constexpr (Tr::uses_s0) m = S0[i];
        if constexpr (Tr::uses_s1) v = S1[i];
        if constexpr (Tr::uses_s2) r = S2[i];
        update<K, F>(h, p, g, m, v, r);
        if constexpr (Tr::uses_s0) S0[i] = m;
        if constexpr (Tr::uses_s1) S1[i] = v;
        if constexpr (Tr::uses_s2) S2[i] = r;
      } else {
        if (zg) IoT::store1(G + i, 0.f);
      }
      IoT::store1(P + i, p);
      if constexpr (Send) IoT::store1(S + i, h.s * IoT::load1(P + i));  // p as stored
    }
  }
}

// Picks the specialisation for one segment piece (branches here, never per element).
template <typename T, bool Comm, bool Send>
void dispatch_piece(const MixStepArgs& A, const GroupHyper& g, int64_t lo, int64_t hi) {
  switch (A.kind) {
    case OptKind::SGD: {
      if (A.state0 == nullptr || g.momentum == 0.f)
        return run_piece<T, OptKind::SGD, 0, Comm, Send>(A, g, lo, hi);
      const int f = (g.nesterov ? kNesterov : 0) | (A.momentum_init ? kInit : 0);
      switch (f) {
        case 0: return run_piece<T, OptKind::SGD, kBuf, Comm, Send>(A, g, lo, hi);
        case kNesterov:
          return run_piece<T, OptKind::SGD, kBuf | kNesterov, Comm, Send>(A, g, lo, hi);
        case kInit: return run_piece<T, OptKind::SGD, kBuf | kInit, Comm, Send>(A, g, lo, hi);
        default:
          return run_piece<T, OptKind::SGD, kBuf | kNesterov | kInit, Comm, Send>(A, g, lo, hi);
      }
    }
    case OptKind::Adam:
      if (A.decoupled_weight_decay)
        return run_piece<T, OptKind::Adam, kDecoupled, Comm, Send>(A, g, lo, hi);
      return run_piece<T, OptKind::Adam, 0, Comm, Send>(A, g, lo, hi);
    case OptKind::AccumAdam: {
      const int f = (A.decoupled_weight_decay ? kDecoupled : 0) | (A.accum_boundary ? kBoundary : 0);
      switch (f) {
        case 0: return run_piece<T, OptKind::AccumAdam, 0, Comm, Send>(A, g, lo, hi);
        case kDecoupled:
          return run_piece<T, OptKind::AccumAdam, kDecoupled, Comm, Send>(A, g, lo, hi);
        case kBoundary:
          return run_piece<T, OptKind::AccumAdam, kBoundary, Comm, Send>(A, g, lo, hi);
        default:
          return run_piece<T, OptKind::AccumAdam, kDecoupled | kBoundary, Comm, Send>(A, g, lo,
                                                                                     hi);
      }
    }
    default: return run_piece<T, OptKind::None, 0, Comm, Send>(A, g, lo, hi);
  }
}

// Elements [begin, end): iterate over the segments intersecting the range.
template <typename T, bool Comm, bool Send>
void run_range(const MixStepArgs& A, int64_t begin, int64_t end) {
  if (A.kind == OptKind::None || A.skip_update || A.num_segments <= 0) {
    if constexpr (!Comm && !Send) {
      // p is left as it is: the only work is zeroing grad (a store-only pass), if asked.
      if (A.zero_grad && A.grad != nullptr && end > begin)
        std::memset(static_cast<T*>(A.grad) + begin, 0, (end - begin) * sizeof(T));
      return;
    }
    const GroupHyper none{};
    run_piece<T, OptKind::None, 0, Comm, Send>(A, none, begin, end);
    return;
  }
  const Segment* segs = A.segments;
  const Segment* last = segs + A.num_segments;
  // First segment whose end is past `begin`.
  const Segment* s = std::upper_bound(segs, last, begin,
                                      [](int64_t v, const Segment& sg) { return v < sg.end; });
  for (; s != last && s->begin < end; ++s) {
    const int64_t lo = std::max(begin, s->begin);
    const int64_t hi = std::min(end, s->end);
    if (lo < hi) dispatch_piece<T, Comm, Send>(A, A.groups[s->group], lo, hi);
  }
}

template <typename T, bool Comm, bool Send>
void run_all(const MixStepArgs& A) {
  const int64_t n = A.numel;
  const int64_t units = (n + kUnit - 1) / kUnit;
  at::parallel_for(0, units, kGrainElems / kUnit, [&](int64_t ub, int64_t ue) {
    run_range<T, Comm, Send>(A, ub * kUnit, std::min(n, ue * kUnit));
  });
}

template <typename T>
void run_dtype(const MixStepArgs& A) {
  const bool comm = A.comm != nullptr;
  const bool send = A.send != nullptr;
  if (comm && send) return run_all<T, true, true>(A);
  if (comm) return run_all<T, true, false>(A);
  if (send) return run_all<T, false, true>(A);
  return run_all<T, false, false>(A);
}

inline void mix_and_step(const MixStepArgs& A) {
  if (A.numel <= 0) return;
  switch (A.param_dtype) {
    case DType::Float32: return run_dtype<float>(A);
    case DType::BFloat16: return run_dtype<c10::BFloat16>(A);
    case DType::Float16: return run_dtype<c10::Half>(A);
  }
}

template <typename T>
void scale_copy_t(const ScaleCopyArgs& A) {
  using IoT = Io<T>;
  T* D = static_cast<T*>(A.dst);
  const T* Sr = static_cast<const T*>(A.src);
  const int64_t n = A.numel;
  const int64_t units = (n + kUnit - 1) / kUnit;
  at::parallel_for(0, units, kGrainElems / kUnit, [&](int64_t ub, int64_t ue) {
    const int64_t hi = std::min(n, ue * kUnit);
    int64_t i = ub * kUnit;
    const Vec al(A.alpha);
    for (; i + IoT::kBlock <= hi; i += IoT::kBlock) {
      Vec a, b;
      IoT::load(Sr + i, a, b);
      IoT::store(D + i, al * a, al * b);
    }
    for (; i < hi; ++i) IoT::store1(D + i, A.alpha * IoT::load1(Sr + i));
  });
}

inline void scale_copy(const ScaleCopyArgs& A) {
  if (A.numel <= 0) return;
  switch (A.dtype) {
    case DType::Float32: return scale_copy_t<float>(A);
    case DType::BFloat16: return scale_copy_t<c10::BFloat16>(A);
    case DType::Float16: return scale_copy_t<c10::Half>(A);
  }
}

}  // namespace DECENTPY_CPU_NS
}  // namespace cpu_detail
}  // namespace decentpy
