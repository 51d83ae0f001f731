// C++ unit tests of the kernel layer (no gtest): bucket plan, aligned offsets, and the CPU
// mix-and-step kernel for every OptKind on fp32 against a scalar double-precision re-computation;
// the peer check's passes, verdicts, mix factor and element guard.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "bucket/bucket_plan.h"
#include "cpu/mix_and_step_cpu.h"
#include "kernels/mix_and_step.h"
#include "kernels/peer_check.h"

static int g_failures = 0;
static int g_checks = 0;

#define CHECK(cond)                                                          \
  do {                                                                       \
    ++g_checks;                                                              \
    if (!(cond)) {                                                           \
      ++g_failures;                                                          \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                        \
  } while (0)

#define CHECK_NEAR(a, b, rtol, atol)                                                        \
  do {                                                                                      \
    ++g_checks;                                                                             \
    const double va_ = (a), vb_ = (b);                                                      \
    if (!(std::fabs(va_ - vb_) <= (atol) + (rtol) * std::fabs(vb_))) {                      \
      ++g_failures;                                                                         \
      if (g_failures < 20)                                                                  \
        std::fprintf(stderr, "%s:%d: CHECK_NEAR failed: %s = %.9g vs %s = %.9g\n", __FILE__, \
                     __LINE__, #a, va_, #b, vb_);                                           \
    }                                                                                       \
  } while (0)

using namespace decentpy;
using Buckets = std::vector<std::vector<int64_t>>;

static void test_assign_buckets() {
  CHECK((assign_buckets({10, 10, 10, 10}, {0, 0, 0, 0}, 20) == Buckets{{0, 1}, {2, 3}}));
  CHECK((assign_buckets({30, 1, 1}, {0, 0, 0}, 20) == Buckets{{0}, {1, 2}}));
  CHECK((assign_buckets({8, 4, 8, 4, 4, 1}, {0, 1, 0, 1, 1, 2}, 12) ==
         Buckets{{0, 2}, {1, 3, 4}, {5}}));
  CHECK((assign_buckets({1, 1, 1}, {2, 1, 0}, 100) == Buckets{{0}, {1}, {2}}));
  CHECK((assign_buckets({1, 2, 3}, {0, 1, 0}, 0) == Buckets{{0}, {1}, {2}}));
  CHECK(assign_buckets({}, {}, 10).empty());
  bool threw = false;
  try {
    assign_buckets({1, 2}, {0}, 10);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
}

static void test_aligned_offsets() {
  auto r = aligned_offsets({3, 5, 32, 1}, 4, 128);
  CHECK((r.first == std::vector<int64_t>{0, 32, 64, 96}));
  CHECK(r.second == 128);
  r = aligned_offsets({3, 5}, 2, 128);
  CHECK((r.first == std::vector<int64_t>{0, 64}));
  CHECK(r.second == 128);
  r = aligned_offsets({}, 4, 128);
  CHECK(r.first.empty() && r.second == 0);
  r = aligned_offsets({3, 3}, 4, 0);
  CHECK((r.first == std::vector<int64_t>{0, 3}) && r.second == 6);
}

// Scalar double re-computation of the contract.
static void reference(const MixStepArgs& a, std::vector<double>& p, const std::vector<double>& g,
                      const std::vector<double>& c, std::vector<double>& s0,
                      std::vector<double>& s1, std::vector<double>& s2, std::vector<double>& send) {
  for (int64_t i = 0; i < a.numel; ++i) {
    double x = p[i];
    if (a.comm) x = double(a.mix_a) * x + double(a.mix_b) * c[i];
    if (a.kind != OptKind::None && !a.skip_update) {
      const Segment* sg = a.segments;
      while (!(i >= sg->begin && i < sg->end)) ++sg;
      const GroupHyper& h = a.groups[sg->group];
      double gg = g[i] * double(a.grad_scale);
      if (a.kind == OptKind::SGD) {
        gg += double(h.weight_decay) * x;
        if (a.state0 && h.momentum != 0.f) {
          s0[i] = a.momentum_init ? gg : double(h.momentum) * s0[i] + (1.0 - double(h.dampening)) * gg;
          gg = h.nesterov ? gg + double(h.momentum) * s0[i] : s0[i];
        }
        x -= double(h.lr) * gg;
      } else {
        if (a.decoupled_weight_decay) x *= 1.0 - double(h.lr) * double(h.weight_decay);
        else gg += double(h.weight_decay) * x;
        const double b1 = h.beta1, b2 = h.beta2;
        double mt, vt;
        if (a.kind == OptKind::Adam) {
          s0[i] = b1 * s0[i] + (1 - b1) * gg;
          s1[i] = b2 * s1[i] + (1 - b2) * gg * gg;
          mt = s0[i];
          vt = s1[i];
        } else {
          s2[i] += gg / double(h.accum_iter);
          mt = b1 * s0[i] + (1 - b1) * gg;
          vt = b2 * s1[i] + (1 - b2) * gg * gg;
        }
        const double k = double(h.bias_step);
        x -= (double(h.lr) / (1.0 - std::pow(b1, k))) * mt /
             (std::sqrt(vt) / std::sqrt(1.0 - std::pow(b2, k)) + double(h.eps));
        if (a.kind == OptKind::AccumAdam && a.accum_boundary) {
          s0[i] = b1 * s0[i] + (1 - b1) * s2[i];
          s1[i] = b2 * s1[i] + (1 - b2) * s2[i] * s2[i];
          s2[i] = 0;
        }
      }
    }
    p[i] = x;
    if (a.send) send[i] = double(a.send_scale) * x;
  }
}

static void run_kind(OptKind kind, int64_t n, bool comm, bool send, bool alias, int variant,
                     bool zero_grad = false, bool skip = false) {
  std::mt19937 rng(static_cast<unsigned>(n * 31 + int(kind) * 7 + variant));
  std::normal_distribution<float> nd(0.f, 1.f);
  auto vec = [&](float scale, bool pos) {
    std::vector<float> v(n);
    for (auto& x : v) x = pos ? std::fabs(nd(rng)) * scale : nd(rng) * scale;
    return v;
  };
  std::vector<float> p = vec(1, false), g = vec(0.5f, false), c = vec(1, false);
  std::vector<float> s0 = vec(0.1f, false), s1 = vec(0.01f, true), s2 = vec(0.2f, false);
  std::vector<float> sendbuf(n, 0.f);

  MixStepArgs a;
  a.kind = kind;
  a.param_dtype = DType::Float32;
  a.numel = n;
  a.param = p.data();
  a.grad = g.data();
  a.comm = comm ? c.data() : nullptr;
  a.send = send ? (alias ? static_cast<void*>(c.data()) : sendbuf.data()) : nullptr;
  const bool sgd_buf = kind == OptKind::SGD && variant != 1;
  a.state0 = (kind == OptKind::SGD && !sgd_buf) || kind == OptKind::None ? nullptr : s0.data();
  a.state1 = (kind == OptKind::Adam || kind == OptKind::AccumAdam) ? s1.data() : nullptr;
  a.state2 = kind == OptKind::AccumAdam ? s2.data() : nullptr;
  a.mix_a = 0.7f;
  a.mix_b = 0.3f;
  a.send_scale = 0.5f;
  a.grad_scale = 0.25f;
  a.decoupled_weight_decay = variant & 1;
  a.momentum_init = variant == 2;
  a.accum_boundary = variant >= 1;
  a.skip_update = skip ? 1 : 0;
  if (skip)  // non-finite gradients: never read, so never propagated
    for (int64_t i = 0; i < n; i += 5) g[i] = i % 2 ? INFINITY : NAN;
  std::vector<Segment> segs;
  int64_t cuts[] = {0, n / 3, n / 3 + 1, (3 * n) / 4, n};
  for (int k = 1; k < 5; ++k) cuts[k] = std::min(n, std::max(cuts[k], cuts[k - 1]));
  for (int k = 0; k < 4; ++k)
    if (cuts[k + 1] > cuts[k]) segs.push_back({cuts[k], cuts[k + 1], k % 3});
  a.segments = segs.data();
  a.num_segments = static_cast<int64_t>(segs.size());
  a.num_groups = 3;
  for (int gi = 0; gi < 3; ++gi) {
    GroupHyper& h = a.groups[gi];
    h.lr = 0.05f * (gi + 1);
    h.weight_decay = 0.01f * gi;
    h.momentum = gi == 1 ? 0.f : 0.9f;
    h.dampening = 0.1f * gi;
    h.nesterov = gi == 2;
    h.beta1 = 0.9f - 0.05f * gi;
    h.beta2 = 0.999f - 0.01f * gi;
    h.eps = 1e-8f;
    h.bias_step = 3;
    h.accum_iter = 4;
  }

  auto to_d = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  std::vector<double> rp = to_d(p), rg = to_d(g), rc = to_d(c), r0 = to_d(s0), r1 = to_d(s1),
                      r2 = to_d(s2), rsend(n, 0.0);
  reference(a, rp, rg, rc, r0, r1, r2, rsend);

  // Same launch without zero_grad on copies: zero_grad must not change any result bit.
  std::vector<float> p2 = p, g2 = g, c2 = c, s02 = s0, s12 = s1, s22 = s2, send2 = sendbuf;
  MixStepArgs b = a;
  b.param = p2.data();
  b.grad = g2.data();
  b.comm = comm ? c2.data() : nullptr;
  b.send = send ? (alias ? static_cast<void*>(c2.data()) : send2.data()) : nullptr;
  b.state0 = a.state0 ? s02.data() : nullptr;
  b.state1 = a.state1 ? s12.data() : nullptr;
  b.state2 = a.state2 ? s22.data() : nullptr;
  b.zero_grad = 0;
  mix_and_step_cpu(b);

  a.zero_grad = zero_grad ? 1 : 0;
  mix_and_step_cpu(a);

  if (zero_grad) {
    bool all_zero = true;
    for (int64_t i = 0; i < n; ++i) all_zero &= g[i] == 0.f && !std::signbit(g[i]);
    CHECK(all_zero);
    CHECK(std::equal(p.begin(), p.end(), p2.begin()));
    CHECK(std::equal(c.begin(), c.end(), c2.begin()));
    CHECK(std::equal(sendbuf.begin(), sendbuf.end(), send2.begin()));
    CHECK(std::equal(s0.begin(), s0.end(), s02.begin()));
    CHECK(std::equal(s1.begin(), s1.end(), s12.begin()));
    CHECK(std::equal(s2.begin(), s2.end(), s22.begin()));
  } else {
    // grad is read only (bitwise: it may hold NaN)
    CHECK(std::memcmp(g.data(), g2.data(), n * sizeof(float)) == 0);
  }

  for (int64_t i = 0; i < n; ++i) {
    CHECK_NEAR(p[i], rp[i], 3e-6, 1e-6);
    if (a.state0) CHECK_NEAR(s0[i], r0[i], 3e-6, 1e-7);
    if (a.state1) CHECK_NEAR(s1[i], r1[i], 3e-6, 1e-9);
    if (a.state2) CHECK_NEAR(s2[i], r2[i], 3e-6, 1e-7);
    if (send) CHECK_NEAR(alias ? c[i] : sendbuf[i], rsend[i], 3e-6, 1e-6);
  }
}

static void test_mix_and_step() {
  const OptKind kinds[] = {OptKind::None, OptKind::SGD, OptKind::Adam, OptKind::AccumAdam};
  const int64_t sizes[] = {1, 7, 31, 1000, 100003};
  for (OptKind k : kinds)
    for (int64_t n : sizes)
      for (int variant = 0; variant < 3; ++variant) {
        run_kind(k, n, true, true, variant == 0, variant);
        run_kind(k, n, variant != 1, false, false, variant);
      }
}

// zero_grad: grad all zero afterwards, every other result bit-identical to zero_grad = false (and
// still matching the double reference); also with skip_update (NaN / inf gradients) and kind None.
static void test_zero_grad() {
  const OptKind kinds[] = {OptKind::None, OptKind::SGD, OptKind::Adam, OptKind::AccumAdam};
  const int64_t sizes[] = {1, 7, 33, 1000, 100003};
  for (OptKind k : kinds)
    for (int64_t n : sizes)
      for (int variant = 0; variant < 3; ++variant) {
        run_kind(k, n, true, true, variant == 0, variant, true);
        run_kind(k, n, variant != 1, false, false, variant, true);
        run_kind(k, n, true, true, false, variant, true, /*skip=*/true);
        run_kind(k, n, false, false, false, variant, true, /*skip=*/true);
      }
}

static void test_scale_copy() {
  std::vector<float> src(1037), dst(1037);
  for (size_t i = 0; i < src.size(); ++i) src[i] = 0.5f * float(i) - 3.f;
  ScaleCopyArgs a;
  a.numel = static_cast<int64_t>(src.size());
  a.src = src.data();
  a.dst = dst.data();
  a.alpha = 0.25f;
  scale_copy_cpu(a);
  for (size_t i = 0; i < src.size(); ++i) CHECK(dst[i] == 0.25f * src[i]);
}

// The group reduction (int8): two members' q on the chunk [256, 300) of a 300-element bucket; the
// result's codes against round(mu / s), the owner's copy against m (D(r) - mu), nothing outside the chunk.
static void test_group_reduce() {
  const int64_t n = 300, lo = 256, hi = 300, nb = 2;
  const int64_t wire = compressed_bytes(Compressor::Int8, n);
  CHECK(wire == 4 * nb + n);
  std::vector<uint8_t> q0(wire, 0), q1(wire, 0), out(wire, 0xAB);
  const float s0 = 0.5f, s1 = 0.25f;
  std::memcpy(q0.data() + 4, &s0, 4);
  std::memcpy(q1.data() + 4, &s1, 4);
  for (int64_t i = lo; i < hi; ++i) {
    q0[4 * nb + i] = static_cast<uint8_t>(static_cast<int8_t>((i * 7) % 255 - 127));
    q1[4 * nb + i] = static_cast<uint8_t>(static_cast<int8_t>(100 - (i * 3) % 201));
  }
  std::vector<float> copy(n, 1.f);
  GroupReduceArgs a;
  a.compressor = Compressor::Int8;
  a.numel = n;
  a.lo = lo;
  a.hi = hi;
  a.num_inputs = 2;
  a.inputs[0] = q0.data();
  a.inputs[1] = q1.data();
  a.out = out.data();
  a.self_copy = copy.data();
  choco_group_reduce_cpu(a);
  double amax = 0;
  std::vector<double> mu(n, 0.0);
  for (int64_t i = lo; i < hi; ++i) {
    mu[i] = (static_cast<int8_t>(q0[4 * nb + i]) * 0.5 + static_cast<int8_t>(q1[4 * nb + i]) * 0.25) / 2;
    amax = std::max(amax, std::fabs(mu[i]));
  }
  float s;
  std::memcpy(&s, out.data() + 4, 4);
  CHECK_NEAR(s, amax / 127, 1e-6, 0);
  for (int64_t i = lo; i < hi; ++i) {
    const double dr = static_cast<int8_t>(out[4 * nb + i]) * static_cast<double>(s);
    CHECK(std::fabs(dr - mu[i]) <= 0.5 * s + 1e-6);
    CHECK_NEAR(copy[i], 1.0 + 2 * (dr - mu[i]), 0, 2e-5);  // fp32 rounding of mu (|mu| < 64)
  }
  for (int64_t i = 0; i < lo; ++i) CHECK(copy[i] == 1.f && out[4 * nb + i] == 0xAB);
  for (int k = 0; k < 4; ++k) CHECK(out[k] == 0xAB);  // block 0's scale is not this chunk's
}

// The fused outer step: an int8 pack of d = theta - x - excess (codes against round(d / s), the
// excess against D(q) - d), then a Nesterov SGD apply (torch's first step: the buffer is the
// gradient) against the scalar formula, the parameters reset to the new global copy.
static void test_outer_step() {
  const int64_t n = 300, nb = 2;
  std::vector<float> x(n), theta(n), excess(n, 0.001f);
  for (int64_t i = 0; i < n; ++i) {
    theta[i] = 0.01f * static_cast<float>(i % 17);
    x[i] = theta[i] - 0.003f * static_cast<float>((i * 5) % 11) + 0.01f;
  }
  std::vector<uint8_t> wire(compressed_bytes(Compressor::Int8, n));
  std::vector<float> d(n);
  for (int64_t i = 0; i < n; ++i) d[i] = (theta[i] - x[i]) - excess[i];
  OuterPackArgs p;
  p.numel = n;
  p.param = x.data();
  p.theta = theta.data();
  p.compressor = Compressor::Int8;
  p.excess = excess.data();
  p.out = wire.data();
  outer_pack_cpu(p);
  std::vector<float> dq(n);
  for (int64_t b = 0; b < nb; ++b) {
    float amax = 0.f, s;
    for (int64_t i = b * 256; i < std::min(n, (b + 1) * 256); ++i) amax = std::max(amax, std::fabs(d[i]));
    std::memcpy(&s, wire.data() + 4 * b, 4);
    CHECK(s == amax / 127.f);
    for (int64_t i = b * 256; i < std::min(n, (b + 1) * 256); ++i) {
      const float c = static_cast<int8_t>(wire[4 * nb + i]);
      CHECK(c == std::nearbyint(d[i] / s));
      dq[i] = c * s;
      CHECK(excess[i] == std::fma(c, s, -d[i]));
    }
  }
  std::vector<float> mom(n, 0.f);
  OuterApplyArgs a;
  a.numel = n;
  a.param = x.data();
  a.theta = theta.data();
  a.compressor = Compressor::Int8;
  a.delta = wire.data();
  a.kind = OptKind::SGD;
  a.hyper.lr = 0.7f;
  a.hyper.momentum = 0.9f;
  a.hyper.nesterov = 1;
  a.momentum_init = 1;
  a.state0 = mom.data();
  const std::vector<float> theta0 = theta;
  outer_apply_cpu(a);
  for (int64_t i = 0; i < n; ++i) {
    CHECK(mom[i] == dq[i]);
    CHECK_NEAR(theta[i], theta0[i] - 0.7 * (dq[i] + 0.9 * dq[i]), 0, 1e-6);
    CHECK(x[i] == theta[i]);
  }
}

// The peer check (kernels/peer_check.h): the stats pass against double sums (whole and sampled), the
// pair verdict's rule, and the fused kernel's mix factor and element guard against the plain mix.
static void test_peer_check() {
  const int64_t n = 100003;
  std::vector<float> p(n), c(n);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < n; ++i) {
    p[i] = nd(rng);
    c[i] = p[i] + 0.01f * nd(rng);
  }
  std::vector<double> out((kPeerParts + 1) * kPeerStats);
  for (int64_t sample : {int64_t(1), int64_t(5)}) {
    PeerStatsArgs a;
    a.numel = n;
    a.param = p.data();
    a.comm = c.data();
    a.sample = sample;
    a.out = out.data();
    peer_stats_cpu(a);
    double d2 = 0, p2 = 0;
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) {
      if ((i / kSampleUnit) % sample != 0) continue;
      const double x = double(c[i]) - double(p[i]);
      d2 += x * x;
      p2 += double(p[i]) * p[i];
      ++count;
    }
    const double* r = out.data() + kPeerParts * kPeerStats;
    CHECK(count == sampled_count(n, sample));
    CHECK_NEAR(r[kDistSq], d2, 1e-4, 0.0);
    CHECK_NEAR(r[kSelfSq], p2, 1e-4, 0.0);
    CHECK(r[kPeerNf] == 0.0 && r[kSelfNf] == 0.0);
  }
  // the pair verdict: within, beyond (skip / clip), not finite, the first bound
  double v[5];
  const double st[4] = {4.0, 100.0, 0.0, 0.0};  // d = 2, ||p|| = 10
  pair_verdict(st, 1.0, 3.0, 1.0, false, v);
  CHECK(v[0] == 1.0 && v[1] == 2.0 && v[2] == 3.0);
  pair_verdict(st, 1.0, 1.0, 1.0, false, v);
  CHECK(v[0] == 0.0);
  pair_verdict(st, 1.0, 1.0, 1.0, true, v);
  CHECK(v[0] == 0.5);
  pair_verdict(st, 1.0, std::nan(""), 0.1, false, v);  // first bound 0.1 x 10 = 1 < 2
  CHECK(v[0] == 0.0 && v[2] == 1.0);
  const double bad[4] = {4.0, 100.0, std::nan(""), 0.0};
  pair_verdict(bad, 1.0, 3.0, 1.0, true, v);
  CHECK(v[0] == 0.0 && v[3] == 0.0);
  // the mix factor and the guard in the fused pass (kind None)
  std::vector<float> q(p), ref(p), cc(c);
  cc[5] = std::nanf("");
  cc[77] = 1e30f;
  MixStepArgs m;
  m.numel = n;
  m.param = q.data();
  m.comm = cc.data();
  m.mix_a = 0.5f;
  m.mix_b = 0.5f;
  int64_t kept = 0;
  m.mix_guard = 1.0f;
  m.mix_guarded = &kept;
  mix_and_step_cpu(m);
  CHECK(kept == 2 && q[5] == p[5] && q[77] == p[77]);
  for (int64_t i = 0; i < n; ++i)
    if (i != 5 && i != 77) CHECK(q[i] == std::fma(0.5f, c[i], 0.5f * p[i]));
  const float f = 0.0f;  // a factor 0 never reads comm
  q = p;
  m.mix_guard = 0.f;
  m.mix_guarded = nullptr;
  m.mix_factor = &f;
  mix_and_step_cpu(m);
  CHECK(std::memcmp(q.data(), p.data(), sizeof(float) * n) == 0);
  const PeerMix pm = peer_mix(0.5f, 0.5f, 0.25f);
  CHECK(pm.reads_comm && pm.a == 0.875f && pm.b == 0.125f);
}

int main() {
  test_assign_buckets();
  test_aligned_offsets();
  test_mix_and_step();
  test_zero_grad();
  test_scale_copy();
  test_group_reduce();
  test_outer_step();
  test_peer_check();
  std::printf("decentpy_cpp_tests: %d checks, %d failures (cpu kernels: %s)\n", g_checks,
              g_failures, cpu_kernel_isa());
  return g_failures == 0 ? 0 : 1;
}
