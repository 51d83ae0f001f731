// Body of the CPU passes of the peer check (contract and arithmetic: kernels/peer_check.h, shared
// with csrc/cuda/peer_check.cu), compiled once per instruction set with the mix-and-step kernels:
// included at the end of mix_and_step_cpu_impl.h, inside its ISA namespace, so it uses that file's
// vectors (Vec, Io, VecMath). Not a public header.
//
// Both passes run their kPeerParts parts in parallel, each over its share of the sampled units (every
// unit when sample is 1). Stats: fp32 vector lanes over kStatRun elements (the lanes summed in a fixed
// order), each run's sums added to float64 accumulators. Sketch: each part's chunks in order, a
// chunk's signed sum in float64 over kLanes interleaved accumulators (a fixed association: the same
// bits whatever the vector width).

namespace peer_detail {

static_assert(kSampleUnit % (2 * 16) == 0, "a sampled unit holds whole vector blocks of every ISA");
static_assert(kStatRun % kSampleUnit == 0, "a stats run holds whole sampled units");

// Lanes of v summed in lane order.
inline float lane_sum(const Vec& v) {
  alignas(64) float lanes[Vec::size()];
  v.store(lanes);
  float s = 0.f;
  for (int k = 0; k < Vec::size(); ++k) s += lanes[k];
  return s;
}

// The stats' fp32 accumulators of one run (two of each sum: no chain of dependent adds).
struct StatLanes {
  Vec d0{0.f}, d1{0.f}, p0{0.f}, p1{0.f}, c0{0.f}, c1{0.f}, n0{0.f}, n1{0.f};
  float sd = 0.f, sp = 0.f, sc = 0.f, sn = 0.f;  // the scalar tail's
};

template <typename T, bool HasComm>
inline void stats_elems(const T* P, const T* C, int64_t lo, int64_t hi, StatLanes& L) {
  using IoT = Io<T>;
  int64_t i = lo;
  for (; i + IoT::kBlock <= hi; i += IoT::kBlock) {
    Vec p0, p1;
    IoT::load(P + i, p0, p1);
    L.p0 = VecMath::fma(p0, p0, L.p0);
    L.p1 = VecMath::fma(p1, p1, L.p1);
    L.n0 = L.n0 + (p0 - p0);
    L.n1 = L.n1 + (p1 - p1);
    if constexpr (HasComm) {
      Vec c0, c1;
      IoT::load(C + i, c0, c1);
      const Vec x0 = c0 - p0, x1 = c1 - p1;
      L.d0 = VecMath::fma(x0, x0, L.d0);
      L.d1 = VecMath::fma(x1, x1, L.d1);
      L.c0 = L.c0 + (c0 - c0);
      L.c1 = L.c1 + (c1 - c1);
    }
  }
  for (; i < hi; ++i) {
    const float p = IoT::load1(P + i);
    L.sp = std::fma(p, p, L.sp);
    L.sn += p - p;
    if constexpr (HasComm) {
      const float c = IoT::load1(C + i);
      const float x = c - p;
      L.sd = std::fma(x, x, L.sd);
      L.sc += c - c;
    }
  }
}

// Sampled units [u0, u1) of part `row`: runs of kStatRun / kSampleUnit units in fp32, added in float64.
template <typename T, bool HasComm>
void stats_part(const PeerStatsArgs& A, int64_t u0, int64_t u1, double* row) {
  const T* P = static_cast<const T*>(A.param);
  const T* C = static_cast<const T*>(A.comm);
  const int64_t n = A.numel, step = A.sample * kSampleUnit;
  constexpr int64_t kUnitsPerRun = kStatRun / kSampleUnit;
  double d2 = 0.0, p2 = 0.0, cnf = 0.0, pnf = 0.0;
  for (int64_t r = u0; r < u1; r += kUnitsPerRun) {
    StatLanes L;
    for (int64_t u = r; u < std::min(u1, r + kUnitsPerRun); ++u) {
      const int64_t lo = u * step;
      if (A.sample == 1) {  // contiguous: the run at once
        stats_elems<T, HasComm>(P, C, lo, std::min(n, std::min(u1, r + kUnitsPerRun) * step), L);
        break;
      }
      stats_elems<T, HasComm>(P, C, lo, std::min(n, lo + kSampleUnit), L);
    }
    d2 += lane_sum(L.d0 + L.d1) + L.sd;
    p2 += lane_sum(L.p0 + L.p1) + L.sp;
    cnf += lane_sum(L.c0 + L.c1) + L.sc;
    pnf += lane_sum(L.n0 + L.n1) + L.sn;
  }
  row[kDistSq] = d2;
  row[kSelfSq] = p2;
  row[kPeerNf] = cnf;
  row[kSelfNf] = pnf;
}

// The rows' sum, in row order, into row kPeerParts.
inline void sum_rows(double* out, int width) {
  double* total = out + kPeerParts * width;
  for (int w = 0; w < width; ++w) total[w] = 0.0;
  for (int64_t p = 0; p < kPeerParts; ++p)
    for (int w = 0; w < width; ++w) total[w] += out[p * width + w];
}

// Parallel over the parts only for buffers worth a thread (a small bucket runs inline).
constexpr int64_t kParallelElems = 1 << 16;

template <typename T>
void stats_t(const PeerStatsArgs& A) {
  const int64_t units = sampled_units(A.numel, A.sample);
  const int64_t per = peer_part_size(units);
  const int64_t work = sampled_count(A.numel, A.sample);
  at::parallel_for(0, kPeerParts, work >= kParallelElems ? 1 : kPeerParts, [&](int64_t pb, int64_t pe) {
    for (int64_t p = pb; p < pe; ++p) {
      const int64_t u0 = std::min(units, p * per), u1 = std::min(units, (p + 1) * per);
      double* row = A.out + p * kPeerStats;
      if (A.comm != nullptr) stats_part<T, true>(A, u0, u1, row);
      else stats_part<T, false>(A, u0, u1, row);
    }
  });
  sum_rows(A.out, kPeerStats);
}

// Lanes of the sketch pass's float64 accumulators: independent sums of positions j mod kLanes (a
// fixed association, so the compiler may keep them in vector registers without changing a bit).
constexpr int kLanes = 16;

// The kLanes-interleaved sums of sig[j] * y[j], y[j]^2 and y[j] - y[j] over j in [0, len).
template <typename T>
inline void sketch_run(const T* y, const double* sig, int64_t len, double* acc, double* sq, double* nf) {
  using IoT = Io<T>;
  int64_t j = 0;
  for (; j + kLanes <= len; j += kLanes) {
    for (int u = 0; u < kLanes; ++u) {
      const double v = IoT::load1(y + j + u);
      acc[u] += sig[j + u] * v;
      sq[u] += v * v;
      nf[u] += v - v;
    }
  }
  for (int u = 0; j < len; ++j, ++u) {
    const double v = IoT::load1(y + j);
    acc[u] += sig[j] * v;
    sq[u] += v * v;
    nf[u] += v - v;
  }
}

// Chunks [c0, c1) of the sampled subsequence z (m elements), chunk length L, into `row`.
template <typename T>
void sketch_part(const PeerSketchArgs& A, const double* sig, int64_t L, int64_t m, int64_t c0, int64_t c1,
                 double* row) {
  const T* Y = static_cast<const T*>(A.src);
  const int k = A.slots;
  for (int w = 0; w < k + 2; ++w) row[w] = 0.0;
  double sq[kLanes] = {}, nf[kLanes] = {};
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t t0 = c * L, t1 = std::min(m, t0 + L);
    double acc[kLanes] = {};
    if (A.sample == 1) {
      sketch_run<T>(Y + t0, sig, t1 - t0, acc, sq, nf);
    } else {  // the chunk's contiguous pieces: within one sampled unit each
      for (int64_t t = t0; t < t1;) {
        const int64_t len = std::min(kSampleUnit - t % kSampleUnit, t1 - t);
        sketch_run<T>(Y + sampled_index(t, A.sample), sig + (t - t0), len, acc, sq, nf);
        t += len;
      }
    }
    double sum = 0.0;
    for (int u = 0; u < kLanes; ++u) sum += acc[u];
    int32_t slot;
    double t;
    sketch_slot(static_cast<uint64_t>(c), A.seed, k, slot, t);
    row[slot] += t * sum;
  }
  for (int u = 0; u < kLanes; ++u) {
    row[k] += sq[u];
    row[k + 1] += nf[u];
  }
}

template <typename T>
void sketch_t(const PeerSketchArgs& A) {
  const int64_t m = sampled_count(A.numel, A.sample);
  const int k = A.slots;
  const int64_t L = sketch_chunk(m, k);
  double sig[kSketchMaxChunk];
  for (int64_t j = 0; j < L; ++j) sig[j] = sketch_position_sign(j, A.seed);
  const int64_t chunks = (m + L - 1) / L;
  const int64_t per = peer_part_size(chunks);
  at::parallel_for(0, kPeerParts, m >= kParallelElems ? 1 : kPeerParts, [&](int64_t pb, int64_t pe) {
    for (int64_t p = pb; p < pe; ++p) {
      const int64_t c0 = std::min(chunks, p * per), c1 = std::min(chunks, (p + 1) * per);
      sketch_part<T>(A, sig, L, m, c0, c1, A.out + p * (k + 2));
    }
  });
  sum_rows(A.out, k + 2);
}

}  // namespace peer_detail

inline void peer_stats(const PeerStatsArgs& A) {
  switch (A.dtype) {
    case DType::Float32: return peer_detail::stats_t<float>(A);
    case DType::BFloat16: return peer_detail::stats_t<c10::BFloat16>(A);
    case DType::Float16: return peer_detail::stats_t<c10::Half>(A);
  }
}

inline void peer_sketch(const PeerSketchArgs& A) {
  switch (A.dtype) {
    case DType::Float32: return peer_detail::sketch_t<float>(A);
    case DType::BFloat16: return peer_detail::sketch_t<c10::BFloat16>(A);
    case DType::Float16: return peer_detail::sketch_t<c10::Half>(A);
  }
}
