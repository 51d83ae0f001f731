// Fused mix-and-step CUDA kernel (contract: kernels/mix_and_step.h; the per-element arithmetic
// and the derived constants: kernels/update.h, shared with the CPU kernels).
//
// One pass over a bucket: read p (+comm, grad, optimizer state), write p (+state, send).
// - Templated on the storage type T (float, __nv_bfloat16, __half), the optimizer kind, and the
//   booleans that change the memory traffic: has comm, has send, several groups (segment lookup),
//   and a kind variant (SGD: has a momentum buffer; AccumAdam: accumulation boundary, the only
//   step that writes M and V). Other flags (decoupled, momentum_init, nesterov, wd != 0,
//   momentum != 0) are launch- or group-uniform branches, not per-element divergence.
// - skip_update launches the None kernel: mix and send only, state untouched, grad unread. With a
//   gradient norm in device memory (GradScaler / clipping) each thread derives the factor and the
//   found-inf skip from it (grad_factor) and takes the None path when skipping: no host sync.
// - zero_grad: grad is zeroed in the same pass, after the update (a vector store of zeros on the
//   vector path, scalar store on head/tail; storing right after the load stalls the state loads).
//   A launch-uniform run-time flag (no divergence, no extra specialisations). The None / skip_update kernel stores the zeros without reading grad;
//   with nothing else to do (no comm, no send) it is a cudaMemsetAsync of grad.
// - fp32 math; fused multiply-adds, IEEE round-to-nearest sqrt and division (also under fast math).
// - Vectors of 4 elements (16-byte accesses for fp32, 8-byte for bf16/fp16, so that the fp32 state
//   of a 2-byte bucket is read by each warp as one contiguous span) on the aligned middle of the
//   buffers, a scalar path for the unaligned head, the tail, and everything when the buffers are
//   not co-aligned; grid-stride loops over a grid that fills the chip once.
// - Groups: with one group there is no lookup at all. Otherwise each vector binary-searches the
//   (sorted) device segment table, with a per-thread cache of the last segment; a vector whose
//   elements lie in different segments is processed element by element.
// - send is computed from p as stored (rounded to T): with send_scale == 1 it equals p bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <stdexcept>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/kernel_utils.cuh"
#include "cuda/mix_and_step_cuda.h"
#include "kernels/update.h"

namespace decentpy {
namespace cuda {
namespace {

using detail::kThreads;

// Elements per vector, every storage type (see detail::load4).
constexpr int kStepVec = 4;

// Kernel argument (passed by value, __grid_constant__: lives in the constant bank, no copy).
struct KArgs {
  void* param;
  void* grad;        // read (kind != None), zeroed when zero_grad
  const void* comm;  // may alias send
  void* send;
  float* s0;
  float* s1;
  float* s2;
  const Segment* segs;
  int64_t num_segments;
  int64_t numel;
  int64_t head;  // elements [0, head) take the scalar path
  int64_t nvec;  // vectors [head + k*VEC, head + (k+1)*VEC), k < nvec
  float mix_a, mix_b, send_scale, grad_scale;
  const float* grad_norm;     // device: the bucket's gradient norm (null: factor = grad_scale)
  const float* scaler_scale;  // device: the GradScaler's scale (null: 1)
  const float* mix_factor;    // device: the peer check's factor on the mix (null: the mix as given)
  float mix_guard;            // the peer check's element guard (0: none)
  unsigned long long* mix_guarded;  // device: += elements the guard kept (null: not counted)
  float clip_norm;
  int32_t zero_grad;
  int32_t num_groups;
  StepConstants hyp[kMaxGroups];      // derive_step of each group
  const uint8_t* prev_skip;           // device: != 0 -> hyp_alt (a deferred skip verdict), null: hyp
  StepConstants hyp_alt[kMaxGroups];  // derive_step with the groups' alt_bias_step
};

// The peer check's element guard (MixStepArgs::mix_guard): the mixed value m of an element whose
// change from p is not <= the guard (NaN, inf, or beyond) is replaced by p, and counted if p is finite.
__device__ __forceinline__ float guard_mix(const KArgs& a, float p, float m, int& kept) {
  if (a.mix_guard > 0.f && !(fabsf(m - p) <= a.mix_guard)) {
    if (p - p == 0.f) ++kept;  // counted where p is finite (a non-finite p is this replica's own)
    return p;
  }
  return m;
}

// Per-thread cache of the last segment found: [begin, end) -> group.
struct SegCache {
  int64_t begin = 0;
  int64_t end = 0;
  int group = 0;
};

// Segment holding element i: the last segment whose begin <= i (segments sorted, cover [0, numel)).
__device__ __forceinline__ void find_segment(const KArgs& a, int64_t i, SegCache& c) {
  const Segment* __restrict__ segs = a.segs;
  const int64_t s = detail::segment_index(segs, a.num_segments, i);
  c.begin = __ldg(&segs[s].begin);
  c.end = __ldg(&segs[s].end);
  // the table is validated on the host (check_segments before it is copied to the device)
  c.group = detail::clamp_group(__ldg(&segs[s].group), a.num_groups);
  if (c.end <= c.begin || i < c.begin || i >= c.end) {
    // Malformed table (gap / empty segment): use the group for this element only.
    c.begin = i;
    c.end = i + 1;
  }
}

template <OptKind K, bool VAR> constexpr bool kUsesS0 = (K == OptKind::SGD && VAR) || K == OptKind::Adam || K == OptKind::AccumAdam;
template <OptKind K> constexpr bool kUsesS1 = K == OptKind::Adam || K == OptKind::AccumAdam;
template <OptKind K> constexpr bool kUsesS2 = K == OptKind::AccumAdam;
// Whether state0/1 are written back (AccumAdam: only at the boundary).
template <OptKind K, bool VAR> constexpr bool kWritesS01 = K == OptKind::Adam || (K == OptKind::AccumAdam && VAR);

// One element, scalar loads/stores (head, tail, unaligned buffers, straddling vectors).
template <typename T, OptKind K, bool HC, bool HS, bool MULTI, bool VAR>
__device__ __forceinline__ void process_one(const KArgs& a, const StepConstants* hyp, float gs, float ma, float mb,
                                            int64_t i, SegCache& cache, int& kept) {
  T* __restrict__ param = static_cast<T*>(a.param);
  float p = detail::to_f32<T>(param[i]);
  if constexpr (HC) {
    const T* comm = static_cast<const T*>(a.comm);
    p = guard_mix(a, p, mix<ScalarMath>(ma, mb, p, detail::to_f32<T>(comm[i])), kept);
  }
  if constexpr (K != OptKind::None) {
    int grp = 0;
    if constexpr (MULTI) {
      if (!(i >= cache.begin && i < cache.end)) find_segment(a, i, cache);
      grp = cache.group;
    }
    const StepConstants& h = hyp[grp];
    T* __restrict__ grad = static_cast<T*>(a.grad);
    const float g = detail::to_f32<T>(grad[i]);
    float m = 0.f, v = 0.f, acc = 0.f;
    if constexpr (kUsesS0<K, VAR>) m = a.s0[i];
    if constexpr (kUsesS1<K>) v = a.s1[i];
    if constexpr (kUsesS2<K>) acc = a.s2[i];
    update<K, ScalarMath>(h, h.flags, gs, p, g, m, v, acc);
    if (a.zero_grad) grad[i] = detail::from_f32<T>(0.f);  // after the update: see the vector path
    if constexpr (K == OptKind::SGD && VAR) a.s0[i] = m;
    if constexpr (kWritesS01<K, VAR>) { a.s0[i] = m; a.s1[i] = v; }
    if constexpr (kUsesS2<K>) a.s2[i] = acc;
  } else {
    if (a.zero_grad) static_cast<T*>(a.grad)[i] = detail::from_f32<T>(0.f);  // store only
  }
  const T pt = detail::from_f32<T>(p);
  param[i] = pt;
  if constexpr (HS) {
    T* send = static_cast<T*>(a.send);
    send[i] = detail::from_f32<T>(a.send_scale * detail::to_f32<T>(pt));
  }
}

// One vector's registers between its loads and its stores.
template <int VEC>
struct VecRegs {
  float p[VEC], g[VEC], m[VEC], v[VEC], acc[VEC];
};

// Vectors a thread keeps in flight per loop iteration (vector k and k + stride, so that each warp
// still reads every array as one contiguous span). Two only where the pass has the most streams
// per element at the narrowest accesses: AccumAdam at a boundary on a 2-byte type reads 6 and
// writes 5 arrays with 8-byte accesses to the 2-byte ones; with one vector a thread the H200 ran
// it at 78-81% of a copy (the fp32 row: 87%), every other row 88-94%. Single group only (a
// multi-group vector may straddle segments and go element by element).
template <typename T, OptKind K, bool MULTI, bool VAR>
constexpr int kVecsPerThread = (sizeof(T) == 2 && K == OptKind::AccumAdam && VAR && !MULTI) ? 2 : 1;

// Loads of one vector at `base` (p mixed with comm already: the mix needs no state).
template <typename T, OptKind K, bool HC, bool VAR, int VEC>
__device__ __forceinline__ void load_vec(const KArgs& a, float ma, float mb, int64_t base, VecRegs<VEC>& r,
                                         int& kept) {
  detail::load4(static_cast<const T*>(a.param) + base, r.p);
  if constexpr (HC) {
    float c[VEC];
    detail::load4(static_cast<const T*>(a.comm) + base, c);
#pragma unroll
    for (int e = 0; e < VEC; ++e) r.p[e] = guard_mix(a, r.p[e], mix<ScalarMath>(ma, mb, r.p[e], c[e]), kept);
  }
  if constexpr (K != OptKind::None) {
    detail::load4(static_cast<const T*>(a.grad) + base, r.g);
    if constexpr (kUsesS0<K, VAR>) detail::load_f32<VEC>(a.s0 + base, r.m);
    if constexpr (kUsesS1<K>) detail::load_f32<VEC>(a.s1 + base, r.v);
    if constexpr (kUsesS2<K>) detail::load_f32<VEC>(a.s2 + base, r.acc);
  }
}

// The update of one vector's registers, then p rounded to T (p as stored).
template <typename T, OptKind K, bool VAR, int VEC>
__device__ __forceinline__ void step_vec(const StepConstants& h, float gs, VecRegs<VEC>& r) {
  if constexpr (K != OptKind::None) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      if constexpr (!kUsesS0<K, VAR>) r.m[e] = 0.f;
      if constexpr (!kUsesS1<K>) r.v[e] = 0.f;
      if constexpr (!kUsesS2<K>) r.acc[e] = 0.f;
      update<K, ScalarMath>(h, h.flags, gs, r.p[e], r.g[e], r.m[e], r.v[e], r.acc[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) r.p[e] = detail::round_to<T>(r.p[e]);
}

template <typename T, OptKind K, bool HS, bool VAR, int VEC>
__device__ __forceinline__ void store_vec(const KArgs& a, int64_t base, VecRegs<VEC>& r) {
  if constexpr (K != OptKind::None) {
    if constexpr (K == OptKind::SGD && VAR) detail::store_f32<VEC>(a.s0 + base, r.m);
    if constexpr (kWritesS01<K, VAR>) {
      detail::store_f32<VEC>(a.s0 + base, r.m);
      detail::store_f32<VEC>(a.s1 + base, r.v);
    }
    if constexpr (kUsesS2<K>) detail::store_f32<VEC>(a.s2 + base, r.acc);
  }
  // grad zeroed only after its load completed (None: grad never read, store only): a store to the
  // address of a load still in flight holds the thread's later loads (state) behind that load's
  // latency; right after the load it cost 3.8x the pass on an H200 (0.47 vs 0.12 ms for a
  // 16.8M-element AdamW bucket).
  if (a.zero_grad) detail::store4_zero(static_cast<T*>(a.grad) + base);
  detail::store4(static_cast<T*>(a.param) + base, r.p);
  if constexpr (HS) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) r.p[e] = a.send_scale * r.p[e];
    detail::store4(static_cast<T*>(a.send) + base, r.p);
  }
}

template <typename T, OptKind K, bool HC, bool HS, bool MULTI, bool VAR>
__device__ __forceinline__ void mix_step_body(const KArgs& a, const StepConstants* hyp, float gs, float ma, float mb) {
  constexpr int VEC = kStepVec;
  constexpr int U = kVecsPerThread<T, K, MULTI, VAR>;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  SegCache cache;
  int kept = 0;  // elements the peer check's guard kept (added once per thread, at the end)

  // ---- vector path ----
  if constexpr (U == 2) {
    // vectors k and k + stride: both vectors' loads are issued before either's arithmetic
    const StepConstants& h = hyp[0];
    for (int64_t k = tid; k < a.nvec; k += 2 * stride) {
      const int64_t base0 = a.head + k * VEC;
      const int64_t base1 = base0 + stride * VEC;
      const bool second = k + stride < a.nvec;
      VecRegs<VEC> r0, r1;
      load_vec<T, K, HC, VAR, VEC>(a, ma, mb, base0, r0, kept);
      if (second) load_vec<T, K, HC, VAR, VEC>(a, ma, mb, base1, r1, kept);
      step_vec<T, K, VAR, VEC>(h, gs, r0);
      store_vec<T, K, HS, VAR, VEC>(a, base0, r0);
      if (second) {
        step_vec<T, K, VAR, VEC>(h, gs, r1);
        store_vec<T, K, HS, VAR, VEC>(a, base1, r1);
      }
    }
  } else {
    // (written out rather than through load_vec / step_vec / store_vec: built on those, one H200 run
    // had the fp32 boundary pass at 77% of a copy, against 87-90% for this loop in every other run)
    T* __restrict__ param = static_cast<T*>(a.param);
    T* __restrict__ grad = static_cast<T*>(a.grad);
    const T* comm = static_cast<const T*>(a.comm);  // not __restrict__: may alias send
    T* send = static_cast<T*>(a.send);
    float* __restrict__ s0 = a.s0;
    float* __restrict__ s1 = a.s1;
    float* __restrict__ s2 = a.s2;
    for (int64_t k = tid; k < a.nvec; k += stride) {
      const int64_t base = a.head + k * VEC;
      int grp = 0;
      if constexpr (MULTI && K != OptKind::None) {
        if (!(base >= cache.begin && base + VEC <= cache.end)) {
          if (!(base >= cache.begin && base < cache.end)) find_segment(a, base, cache);
          if (base + VEC > cache.end) {  // the vector straddles segments: element by element
#pragma unroll 1
            for (int e = 0; e < VEC; ++e)
              process_one<T, K, HC, HS, MULTI, VAR>(a, hyp, gs, ma, mb, base + e, cache, kept);
            continue;
          }
        }
        grp = cache.group;
      }

      float p[VEC];
      detail::load4(param + base, p);
      if constexpr (HC) {
        float c[VEC];
        detail::load4(comm + base, c);
#pragma unroll
        for (int e = 0; e < VEC; ++e) p[e] = guard_mix(a, p[e], mix<ScalarMath>(ma, mb, p[e], c[e]), kept);
      }
      if constexpr (K != OptKind::None) {
        const StepConstants& h = hyp[grp];
        float g[VEC];
        detail::load4(grad + base, g);
        float m[VEC], v[VEC], acc[VEC];
        if constexpr (kUsesS0<K, VAR>) detail::load_f32<VEC>(s0 + base, m);
        if constexpr (kUsesS1<K>) detail::load_f32<VEC>(s1 + base, v);
        if constexpr (kUsesS2<K>) detail::load_f32<VEC>(s2 + base, acc);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          if constexpr (!kUsesS0<K, VAR>) m[e] = 0.f;
          if constexpr (!kUsesS1<K>) v[e] = 0.f;
          if constexpr (!kUsesS2<K>) acc[e] = 0.f;
          update<K, ScalarMath>(h, h.flags, gs, p[e], g[e], m[e], v[e], acc[e]);
        }
        if constexpr (K == OptKind::SGD && VAR) detail::store_f32<VEC>(s0 + base, m);
        if constexpr (kWritesS01<K, VAR>) {
          detail::store_f32<VEC>(s0 + base, m);
          detail::store_f32<VEC>(s1 + base, v);
        }
        if constexpr (kUsesS2<K>) detail::store_f32<VEC>(s2 + base, acc);
        // Zeroed only now: a store to the address of a load still in flight holds the thread's later
        // loads (state) behind that load's latency; right after the load it cost 3.8x the pass on an
        // H200 (0.47 vs 0.12 ms for a 16.8M-element AdamW bucket).
        if (a.zero_grad) detail::store4_zero(grad + base);
      } else {
        if (a.zero_grad) detail::store4_zero(grad + base);  // grad not read: store only
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) p[e] = detail::round_to<T>(p[e]);  // p as stored
      detail::store4(param + base, p);
      if constexpr (HS) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) p[e] = a.send_scale * p[e];
        detail::store4(send + base, p);
      }
    }
  }

  // ---- scalar path: [0, head) and [head + nvec*VEC, numel) ----
  const int64_t tail_begin = a.head + a.nvec * VEC;
  const int64_t nscalar = a.head + (a.numel - tail_begin);
  for (int64_t t = tid; t < nscalar; t += stride) {
    const int64_t i = t < a.head ? t : tail_begin + (t - a.head);
    process_one<T, K, HC, HS, MULTI, VAR>(a, hyp, gs, ma, mb, i, cache, kept);
  }
  if (kept != 0 && a.mix_guarded != nullptr) atomicAdd(a.mix_guarded, static_cast<unsigned long long>(kept));
}

// The body for the gradient's verdict: skip (non-finite gradients) mixes, sends and zeroes them, no update.
template <typename T, OptKind K, bool HC, bool HS, bool MULTI, bool VAR>
__device__ __forceinline__ void step_or_skip(const KArgs& a, const StepConstants* hyp, float gs, bool skip, float ma,
                                             float mb) {
  if (skip) mix_step_body<T, OptKind::None, HC, HS, false, false>(a, hyp, 1.f, ma, mb);
  else mix_step_body<T, K, HC, HS, MULTI, VAR>(a, hyp, gs, ma, mb);
}

template <typename T, OptKind K, bool HC, bool HS, bool MULTI, bool VAR>
__global__ void __launch_bounds__(kThreads)
mix_step_kernel(const __grid_constant__ KArgs a) {
  float gs = a.grad_scale;
  bool skip = false;
  const StepConstants* hyp = a.hyp;
  if constexpr (K != OptKind::None) {
    if (a.grad_norm != nullptr) {  // every thread reads the same two floats (cached)
      const GradFactor f = grad_factor(__ldg(a.grad_norm), a.scaler_scale ? __ldg(a.scaler_scale) : 1.f,
                                       a.clip_norm);
      skip = f.skip;
      gs = f.skip ? 1.f : f.factor;
    }
    // a deferred verdict: the previous update was skipped -> the bias corrections of one step fewer
    if (!skip && a.prev_skip != nullptr && __ldg(a.prev_skip) != 0) hyp = a.hyp_alt;
  }
  if constexpr (HC) {
    if (a.mix_factor != nullptr) {  // the peer check's verdict (kernels/update.h peer_mix), one float for all
      const PeerMix m = peer_mix(a.mix_a, a.mix_b, __ldg(a.mix_factor));
      if (!m.reads_comm) {  // the received buffer is never read: a NaN there cannot reach p
        step_or_skip<T, K, false, HS, MULTI, VAR>(a, hyp, gs, skip, 1.f, 0.f);
        return;
      }
      step_or_skip<T, K, HC, HS, MULTI, VAR>(a, hyp, gs, skip, m.a, m.b);
      return;
    }
  }
  step_or_skip<T, K, HC, HS, MULTI, VAR>(a, hyp, gs, skip, a.mix_a, a.mix_b);
}

template <typename T, OptKind K, bool HC, bool HS, bool MULTI, bool VAR>
void launch_typed(const KArgs& a, cudaStream_t stream) {
  auto kernel = mix_step_kernel<T, K, HC, HS, MULTI, VAR>;
  static std::atomic<int> occupancy{0};  // one per instantiation
  const int64_t nscalar = a.numel - a.nvec * kStepVec;
  const int64_t work = a.nvec > nscalar ? a.nvec : nscalar;
  kernel<<<detail::occupancy_grid(kernel, occupancy, work), kThreads, 0, stream>>>(a);
  DECENTPY_CUDA_CHECK_LAUNCH();
}

template <typename T, OptKind K, bool HC, bool HS>
void launch_mv(const KArgs& a, bool multi, bool variant, cudaStream_t stream) {
  if constexpr (K == OptKind::None) {
    if constexpr (HC || HS) launch_typed<T, K, HC, HS, false, false>(a, stream);
  } else if constexpr (K == OptKind::Adam) {
    if (multi) launch_typed<T, K, HC, HS, true, false>(a, stream);
    else launch_typed<T, K, HC, HS, false, false>(a, stream);
  } else {
    if (multi) {
      if (variant) launch_typed<T, K, HC, HS, true, true>(a, stream);
      else launch_typed<T, K, HC, HS, true, false>(a, stream);
    } else {
      if (variant) launch_typed<T, K, HC, HS, false, true>(a, stream);
      else launch_typed<T, K, HC, HS, false, false>(a, stream);
    }
  }
}

template <typename T, OptKind K>
void launch_kind(const KArgs& a, bool has_comm, bool has_send, bool multi, bool variant,
                 cudaStream_t stream) {
  if (has_comm) {
    if (has_send) launch_mv<T, K, true, true>(a, multi, variant, stream);
    else launch_mv<T, K, true, false>(a, multi, variant, stream);
  } else {
    if (has_send) launch_mv<T, K, false, true>(a, multi, variant, stream);
    else launch_mv<T, K, false, false>(a, multi, variant, stream);
  }
}

template <typename T>
void launch_dtype(const KArgs& a, OptKind kind, bool has_comm, bool has_send, bool multi,
                  bool variant, cudaStream_t stream) {
  switch (kind) {
    case OptKind::None: launch_kind<T, OptKind::None>(a, has_comm, has_send, false, false, stream); break;
    case OptKind::SGD: launch_kind<T, OptKind::SGD>(a, has_comm, has_send, multi, variant, stream); break;
    case OptKind::Adam: launch_kind<T, OptKind::Adam>(a, has_comm, has_send, multi, false, stream); break;
    case OptKind::AccumAdam: launch_kind<T, OptKind::AccumAdam>(a, has_comm, has_send, multi, variant, stream); break;
  }
}

int elem_size(DType d) {
  switch (d) {
    case DType::Float32: return 4;
    case DType::BFloat16: return 2;
    case DType::Float16: return 2;
  }
  throw std::invalid_argument("decentpy mix_and_step (CUDA): unknown param dtype " +
                              std::to_string(static_cast<int>(d)));
}

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("decentpy mix_and_step (CUDA): ") + what);
}

}  // namespace

void launch_mix_and_step(const MixStepArgs& args, void* stream_ptr) {
  if (args.compressor != Compressor::None) return launch_choco_mix_and_step(args, stream_ptr);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int esize = elem_size(args.param_dtype);
  require(args.numel >= 0, "numel must be >= 0");
  if (args.numel == 0) return;
  require(args.param != nullptr, "param is required");
  require(args.send == nullptr || args.send != args.param, "send must not alias param");
  const int k = static_cast<int>(args.kind);
  require(k >= 0 && k <= 3, "unknown optimizer kind");

  // skip_update (non-finite gradients): mix and send only, state untouched, grad not read.
  const OptKind kind = args.skip_update ? OptKind::None : args.kind;
  const bool has_comm = args.comm != nullptr;
  const bool has_send = args.send != nullptr;
  const bool zero_grad = args.zero_grad != 0;
  if (zero_grad) {
    require(args.grad != nullptr, "zero_grad needs grad");
    require(args.grad != args.param && args.grad != args.comm && args.grad != args.send,
            "grad must not alias param, comm or send when zero_grad is set");
  }
  if (kind == OptKind::None && !has_comm && !has_send) {
    // Nothing to mix or step: at most a store-only pass over grad.
    if (zero_grad) {
      DECENTPY_CUDA_CHECK(cudaMemsetAsync(args.grad, 0, static_cast<size_t>(args.numel) * esize, stream));
    }
    return;
  }

  const bool sgd_momentum = detail::check_optimizer_args(args, kind, "decentpy mix_and_step (CUDA)");
  const bool multi = kind != OptKind::None && args.num_groups > 1;
  // the kind's variant: SGD with a momentum buffer; AccumAdam at an accumulation boundary
  const bool variant = (kind == OptKind::SGD && args.state0 != nullptr && sgd_momentum) ||
                       (kind == OptKind::AccumAdam && args.accum_boundary != 0);

  KArgs a{};
  a.param = args.param;
  a.grad = (kind != OptKind::None || zero_grad) ? args.grad : nullptr;
  a.comm = args.comm;
  a.send = args.send;
  a.s0 = nullptr;
  a.s1 = nullptr;
  a.s2 = nullptr;
  if (kind == OptKind::SGD && variant) a.s0 = args.state0;
  if (kind == OptKind::Adam || kind == OptKind::AccumAdam) { a.s0 = args.state0; a.s1 = args.state1; }
  if (kind == OptKind::AccumAdam) a.s2 = args.state2;
  a.segs = multi ? args.segments : nullptr;
  a.num_segments = multi ? args.num_segments : 0;
  a.numel = args.numel;
  a.mix_a = args.mix_a;
  a.mix_b = args.mix_b;
  a.send_scale = args.send_scale;
  a.grad_scale = args.grad_scale;
  a.grad_norm = args.grad_norm;
  a.scaler_scale = args.scaler_scale;
  a.mix_factor = has_comm ? args.mix_factor : nullptr;
  a.mix_guard = has_comm ? args.mix_guard : 0.f;
  static_assert(sizeof(unsigned long long) == sizeof(int64_t), "the guard's count is added as a 64-bit integer");
  a.mix_guarded = has_comm ? reinterpret_cast<unsigned long long*>(args.mix_guarded) : nullptr;
  a.clip_norm = args.clip_norm;
  a.zero_grad = zero_grad ? 1 : 0;
  a.num_groups = kind != OptKind::None ? args.num_groups : 0;
  for (int g = 0; g < args.num_groups && g < kMaxGroups; ++g) a.hyp[g] = derive_step(args, args.groups[g]);
  a.prev_skip = kind != OptKind::None ? args.prev_skip : nullptr;
  if (a.prev_skip != nullptr) {
    for (int g = 0; g < args.num_groups && g < kMaxGroups; ++g) a.hyp_alt[g] = derive_step_alt(args, g);
  }

  // Vector split, anchored on param; every buffer the kernel touches must be co-aligned.
  const void* ptrs[6] = {a.grad, a.comm, a.send, a.s0, a.s1, a.s2};
  const int sizes[6] = {esize, esize, esize, 4, 4, 4};
  const detail::VecSplit split = detail::vec_split(a.numel, kStepVec, a.param, esize, ptrs, sizes, 6);
  a.head = split.head;
  a.nvec = split.nvec;

  switch (args.param_dtype) {
    case DType::Float32: launch_dtype<float>(a, kind, has_comm, has_send, multi, variant, stream); break;
    case DType::BFloat16: launch_dtype<__nv_bfloat16>(a, kind, has_comm, has_send, multi, variant, stream); break;
    case DType::Float16: launch_dtype<__half>(a, kind, has_comm, has_send, multi, variant, stream); break;
  }
}

// ---- compiled_archs -------------------------------------------------------------------------
#define DECENTPY_STR2(...) #__VA_ARGS__
#define DECENTPY_STR(...) DECENTPY_STR2(__VA_ARGS__)

namespace {
std::string make_arch_string() {
#if defined(DECENTPY_CUDA_ARCHS)
  // nvcc splits an unquoted -D value at commas, so pass the list quoted, as one argv entry
  // -DDECENTPY_CUDA_ARCHS="sm_80,sm_90,compute_90" (a string literal), or with '+' / ';' / ':'
  // separators unquoted (-DDECENTPY_CUDA_ARCHS=sm_80+sm_90); both give "sm_80,sm_90".
  const std::string s = DECENTPY_STR(DECENTPY_CUDA_ARCHS);
  std::string out;
  for (char ch : s) {
    if (ch == '"' || ch == '\\' || ch == ' ') continue;
    out += (ch == '+' || ch == ';' || ch == ':') ? ',' : ch;
  }
  return out.empty() ? std::string("unknown") : out;
#elif defined(__CUDA_ARCH_LIST__)
  // nvcc's list of the virtual architectures compiled, e.g. "800,900".
  const std::string s = DECENTPY_STR(__CUDA_ARCH_LIST__);
  std::string out, num;
  auto flush = [&]() {
    if (num.empty()) return;
    int v = std::stoi(num);
    if (!out.empty()) out += ',';
    out += "sm_" + std::to_string(v / 10);
    num.clear();
  };
  for (char ch : s) {
    if (ch >= '0' && ch <= '9') num += ch; else flush();
  }
  flush();
  return out.empty() ? std::string("unknown") : out;
#else
  return "unknown";
#endif
}
}  // namespace

const char* compiled_archs() {
  static const std::string archs = make_arch_string();
  return archs.c_str();
}

}  // namespace cuda
}  // namespace decentpy
