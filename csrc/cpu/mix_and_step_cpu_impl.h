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
#include "kernels/update.h"
#include "kernels/compress.h"
#include "kernels/outer_step.h"
#include "kernels/peer_check.h"

namespace decentpy {
namespace cpu_detail {
namespace DECENTPY_CPU_NS {

using Vec = at::vec::Vectorized<float>;

// Elements per parallel_for work item (chunk boundaries stay multiples of this).
constexpr int64_t kUnit = 64;
// Minimum elements per thread.
constexpr int64_t kGrainElems = 32768;

// The math policy of update.h for at::vec vectors: fused multiply-add (exact on every ISA: the
// baseline build has no FMA instruction, so it fuses element by element), IEEE division and sqrt.
struct VecMath {
  static inline Vec splat(float x) { return Vec(x); }
  static inline Vec fma(const Vec& a, const Vec& b, const Vec& c) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    return at::vec::fmadd(a, b, c);
#else
    alignas(64) float x[Vec::size()], y[Vec::size()], z[Vec::size()];
    a.store(x);
    b.store(y);
    c.store(z);
    for (int k = 0; k < Vec::size(); ++k) x[k] = std::fma(x[k], y[k], z[k]);
    return Vec::loadu(x);
#endif
  }
  static inline Vec div(const Vec& a, const Vec& b) { return a / b; }
  static inline Vec sqrt(const Vec& a) { return a.sqrt(); }
};

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

// What one launch passes down to its pieces: the arguments, each group's derived constants (one
// derive_step per group and launch) and the gradient factor.
struct Launch {
  const MixStepArgs& A;
  StepConstants consts[kMaxGroups];
  float grad_factor;
  bool skip;
};

template <OptKind K, int F>
struct Uses {
  static constexpr bool grad = K != OptKind::None;
  static constexpr bool s0 = K == OptKind::Adam || K == OptKind::AccumAdam ||
                             (K == OptKind::SGD && (F & kHasMomentum));
  static constexpr bool s1 = K == OptKind::Adam || K == OptKind::AccumAdam;
  static constexpr bool s2 = K == OptKind::AccumAdam;
  static constexpr bool write01 = K == OptKind::Adam || (K == OptKind::AccumAdam && (F & kBoundary));
  static constexpr bool write0 = write01 || (K == OptKind::SGD && (F & kHasMomentum));
};

// Elements [lo, hi) that all use the constants h. F: the update flags, a compile-time constant
// here so that update() folds its branches. zero_grad is a launch-uniform run-time flag (a
// perfectly predicted branch per block, not a template parameter: that would double every
// specialisation for one store).
template <typename T, OptKind K, int F, bool Comm, bool Send>
void run_piece(const Launch& L, const StepConstants& h, int64_t lo, int64_t hi) {
  using U = Uses<K, F>;
  using IoT = Io<T>;
  using IoF = Io<float>;
  const MixStepArgs& A = L.A;
  T* __restrict P = static_cast<T*>(A.param);
  T* __restrict G = static_cast<T*>(A.grad);  // read, then zeroed when zero_grad
  const bool zg = A.zero_grad != 0 && G != nullptr;
  const T* C = static_cast<const T*>(A.comm);
  T* S = static_cast<T*>(A.send);  // may alias C (read before written, element by element)
  float* __restrict S0 = A.state0;
  float* __restrict S1 = A.state1;
  float* __restrict S2 = A.state2;

  // the peer check's element guard (a launch-uniform branch per block): an element whose change is not
  // <= the guard (NaN, inf, or beyond) keeps p; counted, and added to *mix_guarded once per piece
  const bool guarded = Comm && A.mix_guard > 0.f;
  int64_t kept = 0;
  int64_t i = lo;
  {
    const Vec a(A.mix_a), b(A.mix_b), s(A.send_scale), gs(L.grad_factor), g(A.mix_guard);
    constexpr int64_t B = IoT::kBlock;
    for (; i + B <= hi; i += B) {
      Vec p0, p1;
      IoT::load(P + i, p0, p1);
      if constexpr (Comm) {
        Vec c0, c1;
        IoT::load(C + i, c0, c1);
        const Vec m0 = mix<VecMath>(a, b, p0, c0);
        const Vec m1 = mix<VecMath>(a, b, p1, c1);
        if (guarded) {
          const Vec ok0 = (m0 - p0).abs() <= g, ok1 = (m1 - p1).abs() <= g;  // all-ones lanes where within
          // zero_mask: a bit per lane that is 0 (not within; p not finite); counted where p itself is finite
          // (a non-finite p is this replica's own fault, not the peer's)
          const Vec zero(0.f);
          kept += __builtin_popcount(static_cast<unsigned>(ok0.zero_mask() & ~((p0 - p0) == zero).zero_mask())) +
                  __builtin_popcount(static_cast<unsigned>(ok1.zero_mask() & ~((p1 - p1) == zero).zero_mask()));
          p0 = Vec::blendv(p0, m0, ok0);
          p1 = Vec::blendv(p1, m1, ok1);
        } else {
          p0 = m0;
          p1 = m1;
        }
      }
      if constexpr (U::grad) {
        Vec g0, g1, m0, m1, v0, v1, r0, r1;
        IoT::load(G + i, g0, g1);
        if (zg) IoT::zero(G + i);
        if constexpr (U::s0) IoF::load(S0 + i, m0, m1);
        if constexpr (U::s1) IoF::load(S1 + i, v0, v1);
        if constexpr (U::s2) IoF::load(S2 + i, r0, r1);
        update<K, VecMath>(h, F, gs, p0, g0, m0, v0, r0);
        update<K, VecMath>(h, F, gs, p1, g1, m1, v1, r1);
        if constexpr (U::write0) IoF::store(S0 + i, m0, m1);
        if constexpr (U::write01) IoF::store(S1 + i, v0, v1);
        if constexpr (U::s2) IoF::store(S2 + i, r0, r1);
      } else {
        if (zg) IoT::zero(G + i);  // grad not read (kind None / skipped update): store only
      }
      IoT::store(P + i, p0, p1);
      if constexpr (Send) {
        // send = s * p as stored (16-bit p is rounded first), as on CUDA: peers mix the
        // parameters this worker holds, not unrounded intermediates.
        if constexpr (!std::is_same<T, float>::value) IoT::load(P + i, p0, p1);
        IoT::store(S + i, s * p0, s * p1);
      }
    }
  }
  for (; i < hi; ++i) {
    float p = IoT::load1(P + i);
    if constexpr (Comm) {
      const float m = mix<ScalarMath>(A.mix_a, A.mix_b, p, IoT::load1(C + i));
      if (!guarded || std::fabs(m - p) <= A.mix_guard) p = m;
      else if (p - p == 0.f) ++kept;  // (a non-finite p is this replica's own)
    }
    if constexpr (U::grad) {
      float m = 0.f, v = 0.f, r = 0.f;
      const float g = IoT::load1(G + i);
      if (zg) IoT::store1(G + i, 0.f);
      if constexpr (U::s0) m = S0[i];
      if constexpr (U::s1) v = S1[i];
      if constexpr (U::s2) r = S2[i];
      update<K, ScalarMath>(h, F, L.grad_factor, p, g, m, v, r);
      if constexpr (U::write0) S0[i] = m;
      if constexpr (U::write01) S1[i] = v;
      if constexpr (U::s2) S2[i] = r;
    } else {
      if (zg) IoT::store1(G + i, 0.f);
    }
    IoT::store1(P + i, p);
    if constexpr (Send) IoT::store1(S + i, A.send_scale * IoT::load1(P + i));  // p as stored
  }
  if (kept != 0 && A.mix_guarded != nullptr) __atomic_fetch_add(A.mix_guarded, kept, __ATOMIC_RELAXED);
}

// Picks the specialisation for one segment piece from the group's flags (never per element).
template <typename T, bool Comm, bool Send>
void dispatch_piece(const Launch& L, const StepConstants& h, int64_t lo, int64_t hi) {
  constexpr int kSgdMask = kHasMomentum | kNesterov | kMomentumInit;
  if (h.flags & kNoUpdate) return run_piece<T, OptKind::None, 0, Comm, Send>(L, h, lo, hi);
  switch (L.A.kind) {
    case OptKind::SGD:
      switch (h.flags & kSgdMask) {
        case kHasMomentum: return run_piece<T, OptKind::SGD, kHasMomentum, Comm, Send>(L, h, lo, hi);
        case kHasMomentum | kNesterov:
          return run_piece<T, OptKind::SGD, kHasMomentum | kNesterov, Comm, Send>(L, h, lo, hi);
        case kHasMomentum | kMomentumInit:
          return run_piece<T, OptKind::SGD, kHasMomentum | kMomentumInit, Comm, Send>(L, h, lo, hi);
        case kHasMomentum | kNesterov | kMomentumInit:
          return run_piece<T, OptKind::SGD, kHasMomentum | kNesterov | kMomentumInit, Comm, Send>(L, h, lo, hi);
        default: return run_piece<T, OptKind::SGD, 0, Comm, Send>(L, h, lo, hi);
      }
    case OptKind::Adam:
      if (h.flags & kDecoupled) return run_piece<T, OptKind::Adam, kDecoupled, Comm, Send>(L, h, lo, hi);
      return run_piece<T, OptKind::Adam, 0, Comm, Send>(L, h, lo, hi);
    case OptKind::AccumAdam:
      switch (h.flags & (kDecoupled | kBoundary)) {
        case kDecoupled: return run_piece<T, OptKind::AccumAdam, kDecoupled, Comm, Send>(L, h, lo, hi);
        case kBoundary: return run_piece<T, OptKind::AccumAdam, kBoundary, Comm, Send>(L, h, lo, hi);
        case kDecoupled | kBoundary:
          return run_piece<T, OptKind::AccumAdam, kDecoupled | kBoundary, Comm, Send>(L, h, lo, hi);
        default: return run_piece<T, OptKind::AccumAdam, 0, Comm, Send>(L, h, lo, hi);
      }
    default: return run_piece<T, OptKind::None, 0, Comm, Send>(L, h, lo, hi);
  }
}

// Elements [begin, end): iterate over the segments intersecting the range.
template <typename T, bool Comm, bool Send>
void run_range(const Launch& L, int64_t begin, int64_t end) {
  const MixStepArgs& A = L.A;
  if (A.kind == OptKind::None || L.skip || A.num_segments <= 0) {
    if constexpr (!Comm && !Send) {
      // p is left as it is: the only work is zeroing grad (a store-only pass), if asked.
      if (A.zero_grad && A.grad != nullptr && end > begin)
        std::memset(static_cast<T*>(A.grad) + begin, 0, (end - begin) * sizeof(T));
      return;
    }
    const StepConstants none{};
    run_piece<T, OptKind::None, 0, Comm, Send>(L, none, begin, end);
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
    if (lo < hi) dispatch_piece<T, Comm, Send>(L, L.consts[s->group], lo, hi);
  }
}

template <typename T, bool Comm, bool Send>
void run_all(const Launch& L) {
  const int64_t n = L.A.numel;
  const int64_t units = (n + kUnit - 1) / kUnit;
  at::parallel_for(0, units, kGrainElems / kUnit, [&](int64_t ub, int64_t ue) {
    run_range<T, Comm, Send>(L, ub * kUnit, std::min(n, ue * kUnit));
  });
}

template <typename T>
void run_dtype(const Launch& L) {
  const bool comm = L.A.comm != nullptr;
  const bool send = L.A.send != nullptr;
  if (comm && send) return run_all<T, true, true>(L);
  if (comm) return run_all<T, true, false>(L);
  if (send) return run_all<T, false, true>(L);
  return run_all<T, false, false>(L);
}

// ---- compressed gossip (kernels/mix_and_step.h, kernels/compress.h) ------------------------
// Visits the code bytes of m elements (int8: one code a byte; int4: two): f(k, count) for code
// byte k, which holds the count elements from k * kPerByte on. The whole bytes first, where count
// is the constant kPerByte once f is inlined (so the compiler vectorises over the bytes), then the
// last, partial byte (int4 with an odd count: count 1, the high nibble 0).
template <int Bits, typename F>
inline void for_each_code_byte(int64_t m, F&& f) {
  constexpr int kPer = BlockCode<Bits>::kPerByte;
  const int64_t whole = m / kPer;
  for (int64_t k = 0; k < whole; ++k) f(k, kPer);
  if (m % kPer != 0) f(whole, static_cast<int>(m % kPer));
}

// Elements [lo, hi) of one scale block: the received difference into the peer's copy and the mix;
// the optimizer update (the uncompressed pass's own code, no comm, no send); then the next
// difference against the next peer's copy of this rank, quantised, into the send bytes. The block
// (1 KiB of p) stays in L1 between the three steps. Int8 and int4 share the block-scaled path
// (Bits = code_bits(C)): per-block max, scale, codes packed 8 / Bits to a byte.
template <Compressor C>
void choco_block(const Launch& L, int64_t lo, int64_t hi) {
  constexpr int Bits = code_bits(C);
  const MixStepArgs& A = L.A;
  float* __restrict P = static_cast<float*>(A.param);
  const int64_t n = A.numel;
  const int64_t m = hi - lo;
  if (A.q_recv != nullptr) {
    float* XP = A.peer_copy;
    const float* XS = A.self_copy_mix;
    const float gw = A.choco_mix;
    if constexpr (Bits != 0) {
      constexpr int kPer = BlockCode<Bits>::kPerByte;
      const float s = block_scales(A.q_recv)[lo / kInt8Block];
      // lo is a multiple of kInt8Block (even): the block's codes start on a byte.
      const uint8_t* Q = block_codes(A.q_recv, n) + lo / kPer;
      float* Pb = P + lo;
      float* XPb = XP + lo;
      const float* XSb = XS + lo;
      for_each_code_byte<Bits>(m, [&](int64_t k, int count) {
        const uint32_t byte = Q[k];
        for (int j = 0; j < count; ++j) {
          const int64_t e = k * kPer + j;
          const float xp = block_copy_update(XPb[e], block_code_of_byte<Bits>(byte, j), s);
          XPb[e] = xp;
          Pb[e] = choco_mix(Pb[e], xp, XSb[e], gw);
        }
      });
    } else {
      const uint16_t* Q = static_cast<const uint16_t*>(A.q_recv);
      for (int64_t i = lo; i < hi; ++i) {
        const float xp = bf16_copy_update(XP[i], Q[i]);
        XP[i] = xp;
        P[i] = choco_mix(P[i], xp, XS[i], gw);
      }
    }
  }
  run_range<float, false, false>(L, lo, hi);
  if (A.q_send != nullptr) {
    float* XN = A.self_copy_next;
    if constexpr (Bits != 0) {
      constexpr int kPer = BlockCode<Bits>::kPerByte;
      alignas(64) float d[kInt8Block];
      Vec vmax(0.f);
      int64_t e = 0;
      for (; e + Vec::size() <= m; e += Vec::size()) {
        const Vec v = Vec::loadu(P + lo + e) - Vec::loadu(XN + lo + e);
        v.store(d + e);
        vmax = at::vec::maximum(vmax, v.abs());
      }
      alignas(64) float lanes[Vec::size()];
      vmax.store(lanes);
      float amax = 0.f;
      for (int k = 0; k < Vec::size(); ++k) amax = std::max(amax, lanes[k]);
      for (; e < m; ++e) {
        d[e] = P[lo + e] - XN[lo + e];
        amax = std::max(amax, std::fabs(d[e]));
      }
      const float s = block_scale<Bits>(amax);
      block_scales(A.q_send)[lo / kInt8Block] = s;
      // The codes (in place of d) and the copy update, then the codes packed into their bytes.
      float* X = XN + lo;
      for (int64_t k = 0; k < m; ++k) {
        const float c = block_code<Bits>(d[k], s);
        d[k] = c;
        X[k] = block_copy_update(X[k], c, s);
      }
      uint8_t* Q = block_codes(A.q_send, n) + lo / kPer;
      for_each_code_byte<Bits>(m, [&](int64_t k, int count) {
        uint32_t byte = 0;  // a partial byte's missing codes are 0 (int4's padding nibble)
        for (int j = 0; j < count; ++j) byte |= block_code_field<Bits>(d[k * kPer + j], j);
        Q[k] = static_cast<uint8_t>(byte);
      });
    } else {
      uint16_t* Q = static_cast<uint16_t*>(A.q_send);
      for (int64_t i = lo; i < hi; ++i) {
        const uint16_t q = bf16_bits(P[i] - XN[i]);
        Q[i] = q;
        XN[i] = bf16_copy_update(XN[i], q);
      }
    }
  }
}

template <Compressor C>
void run_choco(const Launch& L) {
  const int64_t n = L.A.numel;
  const int64_t blocks = num_scale_blocks(n);
  at::parallel_for(0, blocks, std::max<int64_t>(1, kGrainElems / kInt8Block), [&](int64_t bb, int64_t be) {
    for (int64_t b = bb; b < be; ++b) choco_block<C>(L, b * kInt8Block, std::min(n, (b + 1) * kInt8Block));
  });
}

inline void mix_and_step(const MixStepArgs& A) {
  if (A.numel <= 0) return;
  if (A.mix_factor != nullptr && A.comm != nullptr) {  // host memory here: reading it costs nothing
    const PeerMix m = peer_mix(A.mix_a, A.mix_b, *A.mix_factor);
    MixStepArgs B = A;
    B.mix_factor = nullptr;
    B.mix_a = m.a;
    B.mix_b = m.b;
    if (!m.reads_comm) B.comm = nullptr;  // the received buffer is never read (a NaN in it stays there)
    return mix_and_step(B);
  }
  Launch L{A, {}, A.grad_scale, A.skip_update != 0};
  const bool alt = A.prev_skip != nullptr && *A.prev_skip != 0;  // host memory here
  for (int g = 0; g < A.num_groups && g < kMaxGroups; ++g) {
    L.consts[g] = alt ? derive_step_alt(A, g) : derive_step(A, A.groups[g]);
  }
  if (A.grad_norm != nullptr && !L.skip) {  // host memory here: reading it costs nothing
    const GradFactor f = grad_factor(*A.grad_norm, A.scaler_scale ? *A.scaler_scale : 1.f, A.clip_norm);
    L.grad_factor = f.factor;
    L.skip = f.skip;
  }
  if (A.compressor != Compressor::None) {  // fp32 parameters only (checked by the launcher)
    switch (A.compressor) {
      case Compressor::Int8: return run_choco<Compressor::Int8>(L);
      case Compressor::Int4: return run_choco<Compressor::Int4>(L);
      default: return run_choco<Compressor::BF16>(L);
    }
  }
  switch (A.param_dtype) {
    case DType::Float32: return run_dtype<float>(L);
    case DType::BFloat16: return run_dtype<c10::BFloat16>(L);
    case DType::Float16: return run_dtype<c10::Half>(L);
  }
}

// dst = alpha * src over [lo, hi), returning the sum of the squares of src there (fp32 lanes, summed
// in a fixed order) when SUMSQ.
template <typename T, bool SUMSQ>
float scale_copy_range(T* D, const T* Sr, float alpha, int64_t lo, int64_t hi) {
  using IoT = Io<T>;
  const Vec al(alpha);
  Vec acc(0.f);
  int64_t i = lo;
  for (; i + IoT::kBlock <= hi; i += IoT::kBlock) {
    Vec a, b;
    IoT::load(Sr + i, a, b);
    if constexpr (SUMSQ) acc = VecMath::fma(a, a, VecMath::fma(b, b, acc));
    IoT::store(D + i, al * a, al * b);
  }
  float s = 0.f;
  if constexpr (SUMSQ) {
    alignas(64) float lanes[Vec::size()];
    acc.store(lanes);
    for (int k = 0; k < Vec::size(); ++k) s += lanes[k];
  }
  for (; i < hi; ++i) {
    const float x = IoT::load1(Sr + i);
    if constexpr (SUMSQ) s = std::fma(x, x, s);
    IoT::store1(D + i, alpha * x);
  }
  return s;
}

// With a.sumsq: a fixed split into at most kNormSlots chunks (whole kUnit multiples, independent of
// the thread count), each chunk's sum of squares in its slot, the rest of the slots 0.
template <typename T>
void scale_copy_sumsq_t(const ScaleCopyArgs& A) {
  T* D = static_cast<T*>(A.dst);
  const T* Sr = static_cast<const T*>(A.src);
  const int64_t n = A.numel;
  int64_t chunks = std::min<int64_t>(kNormSlots, std::max<int64_t>(1, (n + kGrainElems - 1) / kGrainElems));
  const int64_t chunk = ((n + chunks - 1) / chunks + kUnit - 1) / kUnit * kUnit;
  chunks = (n + chunk - 1) / chunk;
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      A.sumsq[c] = scale_copy_range<T, true>(D, Sr, A.alpha, c * chunk, std::min(n, (c + 1) * chunk));
    }
  });
  for (int64_t c = chunks; c < kNormSlots; ++c) A.sumsq[c] = 0.f;
}

template <typename T>
void scale_copy_t(const ScaleCopyArgs& A) {
  if (A.sumsq != nullptr) return scale_copy_sumsq_t<T>(A);
  T* D = static_cast<T*>(A.dst);
  const T* Sr = static_cast<const T*>(A.src);
  const int64_t n = A.numel;
  const int64_t units = (n + kUnit - 1) / kUnit;
  at::parallel_for(0, units, kGrainElems / kUnit, [&](int64_t ub, int64_t ue) {
    scale_copy_range<T, false>(D, Sr, A.alpha, ub * kUnit, std::min(n, ue * kUnit));
  });
}

inline void scale_copy(const ScaleCopyArgs& A) {
  if (A.numel <= 0) {
    if (A.sumsq != nullptr) std::fill(A.sumsq, A.sumsq + kNormSlots, 0.f);
    return;
  }
  switch (A.dtype) {
    case DType::Float32: return scale_copy_t<float>(A);
    case DType::BFloat16: return scale_copy_t<c10::BFloat16>(A);
    case DType::Float16: return scale_copy_t<c10::Half>(A);
  }
}

#include "cpu/outer_step_cpu_impl.h"  // the outer step's passes, in this ISA's namespace
#include "cpu/peer_check_cpu_impl.h"  // the peer check's passes, in this ISA's namespace

}  // namespace DECENTPY_CPU_NS
}  // namespace cpu_detail
}  // namespace decentpy
