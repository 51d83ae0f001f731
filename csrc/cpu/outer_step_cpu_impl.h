// Body of the CPU passes of the fused outer step (contract and arithmetic: kernels/outer_step.h,
// shared with csrc/cuda/outer_step.cu), compiled once per instruction set with the mix-and-step
// kernels: included at the end of mix_and_step_cpu_impl.h, inside its ISA namespace, so it uses that
// file's vectors (Vec, Io, VecMath). Not a public header.
//
// Pack: one scale block of kInt8Block elements at a time (blocks in parallel): the block's
// pseudo-gradients in vectors into a block-local buffer with their max |d|, then the codes, the
// excess and the code bytes, as the compressed gossip pass does. Apply: vectors of Io<T>::kBlock
// elements (inside one scale block, so one scale each), the optimizer's update<K, VecMath> of
// update.h with its flags a compile-time constant, the scalar twin for the tail.

namespace outer_detail {

// The mixed pseudo-gradient of elements [i, i + Io<float>::kBlock) as two vectors: fp32 loads, or
// the wire's values D(q) written out first (int8: the codes times the block's scale, one rounding
// each, as block_value).
template <Compressor C>
inline void load_delta(const void* delta, int64_t n, int64_t i, Vec& g0, Vec& g1) {
  if constexpr (C == Compressor::None) {
    Io<float>::load(static_cast<const float*>(delta) + i, g0, g1);
  } else if constexpr (C == Compressor::Int8) {
    alignas(64) float c[2 * Vec::size()];
    const int8_t* codes = reinterpret_cast<const int8_t*>(block_codes(delta, n)) + i;
    for (int j = 0; j < 2 * Vec::size(); ++j) c[j] = static_cast<float>(codes[j]);
    const Vec s(block_scales(delta)[i / kInt8Block]);
    g0 = Vec::loadu(c) * s;
    g1 = Vec::loadu(c + Vec::size()) * s;
  } else {
    alignas(64) float c[2 * Vec::size()];
    for (int j = 0; j < 2 * Vec::size(); ++j) c[j] = outer_delta_at<C>(delta, n, i + j);
    g0 = Vec::loadu(c);
    g1 = Vec::loadu(c + Vec::size());
  }
}

template <typename T, Compressor C, OptKind K, int F>
void apply_range(const OuterApplyArgs& A, const StepConstants& h, int64_t lo, int64_t hi) {
  using IoT = Io<T>;
  using IoF = Io<float>;
  static_assert(IoT::kBlock == IoF::kBlock && kInt8Block % IoF::kBlock == 0, "a vector block within a scale block");
  constexpr bool kState0 = K == OptKind::Adam || (F & kHasMomentum);
  constexpr bool kState1 = K == OptKind::Adam;
  T* __restrict X = static_cast<T*>(A.param);
  float* __restrict TH = A.theta;
  const float* TM = A.theta_mix != nullptr ? A.theta_mix : A.theta;
  float* __restrict S0 = A.state0;
  float* __restrict S1 = A.state1;
  const bool reset = A.alpha == 0.f;
  const Vec one(1.f), alpha(A.alpha);
  int64_t i = lo;
  for (; i + IoF::kBlock <= hi; i += IoF::kBlock) {
    Vec g0, g1, t0, t1, m0, m1, v0, v1, r0, r1;
    load_delta<C>(A.delta, A.numel, i, g0, g1);
    IoF::load(TM + i, t0, t1);
    if constexpr (kState0) IoF::load(S0 + i, m0, m1);
    if constexpr (kState1) IoF::load(S1 + i, v0, v1);
    update<K, VecMath>(h, F, one, t0, g0, m0, v0, r0);
    update<K, VecMath>(h, F, one, t1, g1, m1, v1, r1);
    if constexpr (kState0) IoF::store(S0 + i, m0, m1);
    if constexpr (kState1) IoF::store(S1 + i, v0, v1);
    IoF::store(TH + i, t0, t1);
    if (reset) {
      IoT::store(X + i, t0, t1);
    } else {
      Vec x0, x1;
      IoT::load(X + i, x0, x1);
      IoT::store(X + i, VecMath::fma(alpha, x0 - t0, t0), VecMath::fma(alpha, x1 - t1, t1));
    }
  }
  for (; i < hi; ++i) {
    const float g = outer_delta_at<C>(A.delta, A.numel, i);
    float t = TM[i];
    float m = kState0 ? S0[i] : 0.f;
    float v = kState1 ? S1[i] : 0.f;
    float acc = 0.f;
    update<K, ScalarMath>(h, F, 1.f, t, g, m, v, acc);
    if constexpr (kState0) S0[i] = m;
    if constexpr (kState1) S1[i] = v;
    TH[i] = t;
    IoT::store1(X + i, reset ? t : outer_merge(t, IoT::load1(X + i), A.alpha));
  }
}

template <typename T, Compressor C, OptKind K, int F>
void apply_all(const OuterApplyArgs& A, const StepConstants& h) {
  const int64_t units = (A.numel + kInt8Block - 1) / kInt8Block;  // whole scale blocks per task
  at::parallel_for(0, units, std::max<int64_t>(1, kGrainElems / kInt8Block), [&](int64_t ub, int64_t ue) {
    apply_range<T, C, K, F>(A, h, ub * kInt8Block, std::min(A.numel, ue * kInt8Block));
  });
}

template <typename T, Compressor C>
void apply_flags(const OuterApplyArgs& A, const StepConstants& h) {
  constexpr int kSgdMask = kHasMomentum | kNesterov | kMomentumInit;
  if (A.kind == OptKind::Adam) {
    if (h.flags & kDecoupled) return apply_all<T, C, OptKind::Adam, kDecoupled>(A, h);
    return apply_all<T, C, OptKind::Adam, 0>(A, h);
  }
  switch (h.flags & kSgdMask) {
    case kHasMomentum: return apply_all<T, C, OptKind::SGD, kHasMomentum>(A, h);
    case kHasMomentum | kNesterov: return apply_all<T, C, OptKind::SGD, kHasMomentum | kNesterov>(A, h);
    case kHasMomentum | kMomentumInit: return apply_all<T, C, OptKind::SGD, kHasMomentum | kMomentumInit>(A, h);
    case kHasMomentum | kNesterov | kMomentumInit:
      return apply_all<T, C, OptKind::SGD, kHasMomentum | kNesterov | kMomentumInit>(A, h);
    default: return apply_all<T, C, OptKind::SGD, 0>(A, h);
  }
}

template <typename T>
void apply_dtype(const OuterApplyArgs& A, const StepConstants& h) {
  switch (A.compressor) {
    case Compressor::None: return apply_flags<T, Compressor::None>(A, h);
    case Compressor::BF16: return apply_flags<T, Compressor::BF16>(A, h);
    case Compressor::Int8: return apply_flags<T, Compressor::Int8>(A, h);
    case Compressor::Int4: return apply_flags<T, Compressor::Int4>(A, h);
  }
}

// Elements [lo, hi) of one scale block.
template <typename T, Compressor C>
void pack_block(const OuterPackArgs& A, int64_t lo, int64_t hi) {
  using IoT = Io<T>;
  using IoF = Io<float>;
  constexpr int Bits = code_bits(C);
  const T* X = static_cast<const T*>(A.param);
  const float* TH = A.theta;
  const int64_t m = hi - lo;
  if constexpr (C == Compressor::None) {
    float* OUT = static_cast<float*>(A.out);
    int64_t i = lo;
    for (; i + IoF::kBlock <= hi; i += IoF::kBlock) {
      Vec x0, x1, t0, t1;
      IoT::load(X + i, x0, x1);
      IoF::load(TH + i, t0, t1);
      IoF::store(OUT + i, t0 - x0, t1 - x1);
    }
    for (; i < hi; ++i) OUT[i] = outer_pseudo_gradient(TH[i], IoT::load1(X + i), 0.f);
    return;
  }
  float* E = A.excess;
  alignas(64) float d[kInt8Block];
  Vec vmax(0.f);
  int64_t e = 0;
  for (; e + IoF::kBlock <= m; e += IoF::kBlock) {
    Vec x0, x1, t0, t1, q0, q1;
    IoT::load(X + lo + e, x0, x1);
    IoF::load(TH + lo + e, t0, t1);
    IoF::load(E + lo + e, q0, q1);
    const Vec d0 = (t0 - x0) - q0, d1 = (t1 - x1) - q1;
    IoF::store(d + e, d0, d1);
    vmax = at::vec::maximum(vmax, at::vec::maximum(d0.abs(), d1.abs()));
  }
  alignas(64) float lanes[Vec::size()];
  vmax.store(lanes);
  float amax = 0.f;
  for (int k = 0; k < Vec::size(); ++k) amax = std::max(amax, lanes[k]);
  for (; e < m; ++e) {
    d[e] = outer_pseudo_gradient(TH[lo + e], IoT::load1(X + lo + e), E[lo + e]);
    amax = std::max(amax, std::fabs(d[e]));
  }
  if constexpr (Bits != 0) {
    constexpr int kPer = BlockCode<Bits>::kPerByte;
    const float s = block_scale<Bits>(amax);
    block_scales(A.out)[lo / kInt8Block] = s;
    float* Eb = E + lo;
    for (int64_t k = 0; k < m; ++k) {  // the codes in place of d, the excess D(q) - d
      const float c = block_code<Bits>(d[k], s);
      Eb[k] = outer_excess_code(c, s, d[k]);
      d[k] = c;
    }
    uint8_t* Q = block_codes(A.out, A.numel) + lo / kPer;
    for_each_code_byte<Bits>(m, [&](int64_t k, int count) {
      uint32_t byte = 0;  // a partial byte's missing codes are 0 (int4's padding nibble)
      for (int j = 0; j < count; ++j) byte |= block_code_field<Bits>(d[k * kPer + j], j);
      Q[k] = static_cast<uint8_t>(byte);
    });
  } else {
    uint16_t* Q = static_cast<uint16_t*>(A.out) + lo;
    float* Eb = E + lo;
    for (int64_t k = 0; k < m; ++k) {
      const uint16_t q = bf16_bits(d[k]);
      Q[k] = q;
      Eb[k] = outer_excess(bf16_value(q), d[k]);
    }
  }
}

template <typename T, Compressor C>
void pack_all(const OuterPackArgs& A) {
  const int64_t n = A.numel;
  at::parallel_for(0, num_scale_blocks(n), std::max<int64_t>(1, kGrainElems / kInt8Block), [&](int64_t bb, int64_t be) {
    for (int64_t b = bb; b < be; ++b) pack_block<T, C>(A, b * kInt8Block, std::min(n, (b + 1) * kInt8Block));
  });
}

template <typename T>
void pack_dtype(const OuterPackArgs& A) {
  switch (A.compressor) {
    case Compressor::None: return pack_all<T, Compressor::None>(A);
    case Compressor::BF16: return pack_all<T, Compressor::BF16>(A);
    case Compressor::Int8: return pack_all<T, Compressor::Int8>(A);
    case Compressor::Int4: return pack_all<T, Compressor::Int4>(A);
  }
}

template <Compressor C>
void decode_all(const void* wire, float* out, int64_t n) {
  at::parallel_for(0, n, kGrainElems, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) out[i] = outer_delta_at<C>(wire, n, i);
  });
}

}  // namespace outer_detail

inline void outer_pack(const OuterPackArgs& A) {
  if (A.numel <= 0) return;
  switch (A.param_dtype) {
    case DType::Float32: return outer_detail::pack_dtype<float>(A);
    case DType::BFloat16: return outer_detail::pack_dtype<c10::BFloat16>(A);
    case DType::Float16: return outer_detail::pack_dtype<c10::Half>(A);
  }
}

inline void outer_apply(const OuterApplyArgs& A) {
  if (A.numel <= 0) return;
  const StepConstants h = derive_outer(A);
  switch (A.param_dtype) {
    case DType::Float32: return outer_detail::apply_dtype<float>(A, h);
    case DType::BFloat16: return outer_detail::apply_dtype<c10::BFloat16>(A, h);
    case DType::Float16: return outer_detail::apply_dtype<c10::Half>(A, h);
  }
}

// out = D(wire): the values of a wire of n elements, as the apply reads them.
inline void outer_decode(Compressor c, const void* wire, float* out, int64_t n) {
  if (n <= 0) return;
  switch (c) {
    case Compressor::Int8: return outer_detail::decode_all<Compressor::Int8>(wire, out, n);
    case Compressor::Int4: return outer_detail::decode_all<Compressor::Int4>(wire, out, n);
    case Compressor::BF16: return outer_detail::decode_all<Compressor::BF16>(wire, out, n);
    case Compressor::None: return outer_detail::decode_all<Compressor::None>(wire, out, n);
  }
}
