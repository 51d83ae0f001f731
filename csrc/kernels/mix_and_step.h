// The contract of the fused mix-and-step kernels, shared by the CPU and CUDA implementations.
//
// Plain C++ only: no torch, no Python, no CUDA headers. The launchers (csrc/ops) turn tensors into
// these structs; the kernels (csrc/cpu, csrc/cuda) only see raw pointers and scalars. The
// per-element arithmetic lives in one place, kernels/update.h, used by both kernels.
//
// Per element i of a bucket (one pass, fp32 math whatever the storage dtype):
//   if comm:            p = mix_a * p + mix_b * c                     (mix)
//                       with mix_factor (a float in the kernel's memory, like grad_norm; the peer
//                       check's verdict, decentpy/engine/peer_check.py): f = *mix_factor and
//                       (mix_a, mix_b) -> peer_mix(mix_a, mix_b, f) of update.h: f >= 1 the mix as
//                       given; 0 < f < 1 p = (mix_a + mix_b (1 - f)) p + (mix_b f) c, a pair's mix
//                       with the peer's difference c - p scaled by f (ClippedGossip); f <= 0 or not
//                       a number: c is not read at all (a non-finite c cannot reach p through
//                       0 * NaN) and p is kept as it is (no mix).
//                       with mix_guard g > 0 (the peer check's element guard): an element whose change
//                       |mixed - p| is not <= g (NaN, inf, or beyond g) keeps p, and is counted into
//                       *mix_guarded (int64, the kernel's memory; may be null) when p is finite. A contribution within the
//                       peer check's bound never trips it (no element of a vector is longer than the
//                       vector): then p is mixed bit for bit as without the guard.
//   if !skip:           g = grad[i] * factor                          (unscale / clip factor)
//                       p, state = optimizer update (group hyper of the segment holding i)
//   if send:            send[i] = send_scale * p   (p as stored: rounded to the param dtype first)
//   if zero_grad:       grad[i] = 0 after it is read (gradients accumulate into the flat block, so
//                       the next backward starts from zero). Also when the update is skipped or
//                       kind is None, where grad is not read: the kernel then only stores zeros.
// factor and skip: with grad_norm set (a float in the kernel's memory: device memory for CUDA, so
// nothing is read back to the host), grad_factor(*grad_norm, scale, clip_norm) of update.h, with
// scale = *scaler_scale (1 when null): skip when the unscaled norm is not finite. Otherwise factor
// = grad_scale and skip = skip_update. skip_update (host) always skips.
// Optimizer updates (torch semantics for SGD/Adam/AdamW), k = bias_step, A = accum_iter:
//   SGD:        g += wd * p;  if momentum != 0: buf = momentum_init ? g : momentum*buf + (1-dampening)*g
//               g = nesterov ? g + momentum*buf : buf;   p -= lr * g
//   Adam:       decoupled ? p *= (1 - lr*wd) : g += wd * p
//               m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
//               p -= lr / (1 - b1^k) * m / (sqrt(v) / sqrt(1 - b2^k) + eps)
//   AccumAdam:  decoupled ? p *= (1 - lr*wd) : g += wd * p
//               acc += g / A
//               mt = b1*M + (1-b1)*g;  vt = b2*V + (1-b2)*g*g
//               p -= lr / (1 - b1^k) * mt / (sqrt(vt) / sqrt(1 - b2^k) + eps)
//               if accum_boundary: M = b1*M + (1-b1)*acc; V = b2*V + (1-b2)*acc*acc; acc = 0
//   None:       no update (mix and send only); also the elements of a group with no_update set.
//
// Compressed gossip (compressor != None; CHOCO-style, kernels/compress.h has the arithmetic). The
// plain comm / send buffers are then unused (null) and param is fp32. Per element i, in blocks of
// kInt8Block elements (the int8 / int4 scale blocks, also the unit of work):
//   if q_recv:   xp[i] += D(q_recv)[i]                     (peer_copy: the peer's public copy)
//                p = p + choco_mix * (xp[i] - xs[i])       (xs: self_copy_mix, this rank's public
//                                                           copy as that peer knows it)
//   optimizer update of p as above (skip / factor / zero_grad as above)
//   if q_send:   d = p - xn[i]  (xn: self_copy_next, this rank's copy as the NEXT peer knows it)
//                q = Q(d), written into q_send (wire bytes);  xn[i] += D(q)
// self_copy_mix may be self_copy_next (the same peer twice in a row); peer_copy aliases neither.
// Wire layout of q for n elements: BF16: n x bf16 (round to nearest even) = 2n bytes; Int8:
// ceil(n / kInt8Block) fp32 scales, then n int8 codes (4 * ceil(n / 256) + n bytes); Int4: the
// same scales, then ceil(n / 2) bytes of 4-bit two's-complement codes in [-7, 7], element 2k in
// the low nibble of byte k, 2k + 1 in the high one, the last high nibble 0 for odd n
// (4 * ceil(n / 256) + ceil(n / 2) bytes).
#pragma once

#include <cstdint>

namespace decentpy {

enum class OptKind : int32_t { None = 0, SGD = 1, Adam = 2, AccumAdam = 3 };

enum class DType : int32_t { Float32 = 0, BFloat16 = 1, Float16 = 2 };

// Compressors of the gossip exchange (see the header comment).
enum class Compressor : int32_t { None = 0, BF16 = 1, Int8 = 2, Int4 = 3 };

// Elements per int8 / int4 scale block (one fp32 scale each; even, so an int4 byte never straddles
// two blocks) and per unit of the compressed pass.
constexpr int64_t kInt8Block = 256;
static_assert(kInt8Block % 2 == 0, "int4 packs two codes per byte within a block");

// Bytes on the wire for n elements compressed with c (None: fp32, 4n).
inline constexpr int64_t compressed_bytes(Compressor c, int64_t n) {
  return c == Compressor::BF16   ? 2 * n
         : c == Compressor::Int8 ? 4 * ((n + kInt8Block - 1) / kInt8Block) + n
         : c == Compressor::Int4 ? 4 * ((n + kInt8Block - 1) / kInt8Block) + (n + 1) / 2
                                 : 4 * n;
}

// Most parameter groups one bucket may mix (the CUDA launcher passes them by value).
constexpr int kMaxGroups = 8;

// Hyper-parameters of one optimizer parameter group for the current step (what the optimizer
// knows; the derived constants are computed from it in one place, derive_step in update.h).
struct GroupHyper {
  float lr = 0.f;
  float weight_decay = 0.f;
  // SGD
  float momentum = 0.f;
  float dampening = 0.f;
  int32_t nesterov = 0;
  // Adam family
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  int64_t bias_step = 1;   // k >= 1 of the bias corrections 1 - beta^k (AccumAdam: ceil(t / A))
  int32_t accum_iter = 1;  // AccumAdam: A
  // The group's elements got no gradient this step: mixed and sent, never updated (no weight
  // decay, optimizer state untouched), as torch's optimizers skip a parameter whose .grad is None.
  int32_t no_update = 0;
};

// One contiguous run of elements [begin, end) that uses hyper-parameters groups[group].
// Segments are sorted, disjoint and cover [0, numel) exactly.
struct Segment {
  int64_t begin;
  int64_t end;
  int64_t group;
};

// Everything one launch needs. Pointers to `param_dtype` storage are void*; state is always fp32.
struct MixStepArgs {
  OptKind kind = OptKind::None;
  DType param_dtype = DType::Float32;
  int64_t numel = 0;

  void* param = nullptr;         // in/out, required
  void* grad = nullptr;          // required unless kind == None or skip_update (and !zero_grad);
                                 // written (zeros) when zero_grad; never aliases another buffer
  const void* comm = nullptr;    // optional: received / reduced buffer to mix in
  void* send = nullptr;          // optional: next send buffer (may alias comm, never param)
  float* state0 = nullptr;       // SGD: momentum buffer (null when momentum == 0); Adam*: exp_avg (M)
  float* state1 = nullptr;       // Adam*: exp_avg_sq (V)
  float* state2 = nullptr;       // AccumAdam: accumulated gradient

  float mix_a = 1.f;
  float mix_b = 0.f;
  // The peer check's factor on the mix (see the header comment); null: the mix as given. Same device
  // as param; read by the kernel (on CUDA never by the host). Only with comm, not with a compressor.
  const float* mix_factor = nullptr;
  // The peer check's element guard (see the header comment); 0: none. Only with comm.
  float mix_guard = 0.f;
  int64_t* mix_guarded = nullptr;      // += elements the guard kept (same device as param), or null
  float send_scale = 1.f;
  float grad_scale = 1.f;              // the gradient factor when grad_norm is null

  // Gradient factor and skip read from memory (see the header comment); same device as param.
  const float* grad_norm = nullptr;    // the bucket's gradient norm (scaled gradients)
  const float* scaler_scale = nullptr; // the GradScaler's scale; null: 1
  float clip_norm = 0.f;               // 0: no clipping

  int32_t decoupled_weight_decay = 0;  // AdamW / AccumAdamW
  int32_t momentum_init = 0;           // SGD: first step initialises the momentum buffer with g
  int32_t accum_boundary = 0;          // AccumAdam: t mod A == 0 this step
  int32_t skip_update = 0;             // mix and send only (e.g. a joined worker)
  int32_t zero_grad = 0;               // grad[i] = 0 after it is read (needs grad)

  // Compressed gossip (compressor != None): see the header comment. Same device as param.
  Compressor compressor = Compressor::None;
  const void* q_recv = nullptr;        // the peer's compressed difference (wire bytes), or null
  float* peer_copy = nullptr;          // xhat_{j|i}: required with q_recv
  const float* self_copy_mix = nullptr;// xhat_{i|j}: required with q_recv
  float choco_mix = 0.f;               // gamma * w_ij
  void* q_send = nullptr;              // wire bytes of the next compressed difference, or null
  float* self_copy_next = nullptr;     // xhat_{i|j'}: required with q_send

  const Segment* segments = nullptr;   // host memory for CPU, device memory for CUDA
  int64_t num_segments = 0;
  GroupHyper groups[kMaxGroups];
  int32_t num_groups = 0;

  // A deferred skip verdict (not with a compressor): whether the previous update of this bucket
  // happened is known only on the device when the kernel is launched. prev_skip (same device as
  // param; read by the kernel, never by the host for CUDA) != 0: it was skipped, and group g's bias
  // corrections are those of alt_bias_step[g] instead of groups[g].bias_step.
  const uint8_t* prev_skip = nullptr;
  int64_t alt_bias_step[kMaxGroups] = {};
};

// Compressed gossip in a group of m > 2 ranks (kernels/compress.h, "group reduction"): each member
// owns a chunk [lo, hi) of the bucket (whole scale blocks), receives every member's q on its chunk
// and reduces them into one message r = Q(mean_t D(q_t)), which all members then apply to their
// copy of the group's public mean. Per element i of the chunk:
//   mu = (sum_t D(inputs[t])[i]) / m;   r = Q(mu) (its own block scales for int8 / int4), into out;
//   self_copy[i] += m * (D(r)[i] - mu)  (what the re-quantisation dropped stays with the owner's
//                                        copy: the members' copies keep summing to m x the mean)
// Every wire (inputs, out) has the layout of `numel` elements; only the chunk's bytes are read or
// written. fp32 copies; host memory for CPU, device memory for CUDA.
constexpr int kMaxGroupInputs = 128;

struct GroupReduceArgs {
  Compressor compressor = Compressor::None;
  int64_t numel = 0;                           // elements of the whole bucket (the wire layout)
  int64_t lo = 0;                              // the chunk: a multiple of kInt8Block
  int64_t hi = 0;
  int32_t num_inputs = 0;                      // m: the members' q, this rank's own included
  const void* inputs[kMaxGroupInputs] = {};
  void* out = nullptr;                         // r's wire
  float* self_copy = nullptr;                  // this rank's public copy in the group
};

// Slots of the partial sums of squares that scale_copy writes with `sumsq` (one per CUDA block or
// CPU chunk of the pass; the unused ones are written 0). A fixed split: the sum of the slots, taken
// in a fixed order, is the same in every run.
constexpr int64_t kNormSlots = 1024;

// Elementwise helpers on flat buffers of `dtype`, used around the exchanges and to copy a gradient
// into its bucket.
// dst = alpha * src  (dst may equal src)
// sumsq (optional, fp32, kNormSlots, same device): partial sums of the squares of src (fp32), so
// that the copy of a gradient into its bucket also yields its norm (sqrt of the slots' sum)
// without a second pass over it.
struct ScaleCopyArgs {
  DType dtype = DType::Float32;
  int64_t numel = 0;
  void* dst = nullptr;
  const void* src = nullptr;
  float alpha = 1.f;
  float* sumsq = nullptr;
};

// The two passes of the peer check (the contract and the arithmetic: kernels/peer_check.h).
// Fixed parts of both passes (CUDA: one block each; CPU: the unit of at::parallel_for).
constexpr int64_t kPeerParts = 256;
// Columns of the stats pass.
constexpr int kDistSq = 0;
constexpr int kSelfSq = 1;
constexpr int kPeerNf = 2;
constexpr int kSelfNf = 3;
constexpr int kPeerStats = 4;
// Elements summed in fp32 before the float64 accumulator (CPU stats pass).
constexpr int64_t kStatRun = 4096;
// Sketch: most slots, longest chunk, and the chunks each slot should get at least (when numel allows).
constexpr int kSketchMaxSlots = 128;
constexpr int64_t kSketchMaxChunk = 256;
constexpr int64_t kSketchChunksPerSlot = 16;

// Both passes may read a sample of the buffers: units of kSampleUnit elements (four 64-byte lines of
// fp32), of which unit u is read when u % sample == 0 (sample 1: every element).
constexpr int64_t kSampleUnit = 64;

struct PeerStatsArgs {
  DType dtype = DType::Float32;
  int64_t numel = 0;
  const void* param = nullptr;  // this replica, required
  const void* comm = nullptr;   // what arrived, optional
  int64_t sample = 1;           // read one unit of kSampleUnit elements in every `sample`
  double* out = nullptr;        // (kPeerParts + 1) x kPeerStats
};

struct PeerSketchArgs {
  DType dtype = DType::Float32;
  int64_t numel = 0;
  const void* src = nullptr;  // y, required
  uint64_t seed = 0;
  int32_t slots = 0;          // k in [1, kSketchMaxSlots]
  int64_t sample = 1;         // sketch the sampled elements only (in order: the sketch of that subsequence)
  double* out = nullptr;      // (kPeerParts + 1) x (k + 2)
};

// The two passes of the fused outer step of local-steps training: the contract and the arithmetic
// are in kernels/outer_step.h.
struct OuterPackArgs {
  DType param_dtype = DType::Float32;
  int64_t numel = 0;
  const void* param = nullptr;   // x (param_dtype), required
  const float* theta = nullptr;  // the global copy, required
  Compressor compressor = Compressor::None;
  float* excess = nullptr;       // required with a compressor, unused without
  void* out = nullptr;           // fp32 pseudo-gradient (None) or wire bytes, required
};

struct OuterApplyArgs {
  DType param_dtype = DType::Float32;
  int64_t numel = 0;
  void* param = nullptr;            // x, required (reset / merged)
  float* theta = nullptr;           // in: this rank's global copy; out: the new one; required
  const float* theta_mix = nullptr; // optional: the mixed global copy to step from
  Compressor compressor = Compressor::None;
  const void* delta = nullptr;      // the mixed pseudo-gradient: fp32 (None) or a wire; required
  OptKind kind = OptKind::SGD;      // SGD or Adam
  GroupHyper hyper;                 // the outer optimizer's (one group per bucket)
  int32_t decoupled_weight_decay = 0;  // AdamW
  int32_t momentum_init = 0;        // SGD: the first outer step initialises the momentum buffer
  float* state0 = nullptr;          // SGD: momentum buffer (null when momentum == 0); Adam: exp_avg
  float* state1 = nullptr;          // Adam: exp_avg_sq
  float alpha = 0.f;                // the local parameters' share in the merge (0: reset)
};

}  // namespace decentpy
