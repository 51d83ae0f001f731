// The contract of the fused mix-and-step kernels, shared by the CPU and CUDA implementations.
//
// Plain C++ only: no torch, no Python, no CUDA headers. The launchers (csrc/ops) turn tensors into
// these structs; the kernels (csrc/cpu, csrc/cuda) only see raw pointers and scalars.
//
// Per element i of a bucket (one pass, fp32 math whatever the storage dtype):
//   if comm:            p = mix_a * p + mix_b * c                     (mix)
//   if !skip_update:    g = grad[i] * grad_scale                      (unscale / clip factor)
//                       p, state = optimizer update (group hyper of the segment holding i)
//   if send:            send[i] = send_scale * p   (p as stored: rounded to the param dtype first)
//   if zero_grad:       grad[i] = 0 after it is read (gradients accumulate into the flat block, so
//                       the next backward starts from zero). Also with skip_update / kind None,
//                       where grad is not read: the kernel then only stores the zeros.
// Optimizer updates (torch semantics for SGD/Adam/AdamW):
//   SGD:        g += wd * p;  if momentum != 0: buf = momentum_init ? g : momentum*buf + (1-dampening)*g
//               g = nesterov ? g + momentum*buf : buf;   p -= lr * g
//   Adam:       decoupled ? p *= (1 - lr*wd) : g += wd * p
//               m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
//               p -= (lr / bc1) * m / (sqrt(v) / bc2_sqrt + eps)
//   AccumAdam:  decoupled ? p *= (1 - lr*wd) : g += wd * p
//               acc += accum_scale * g
//               mt = b1*M + (1-b1)*g;  vt = b2*V + (1-b2)*g*g
//               p -= (lr / bc1) * mt / (sqrt(vt) / bc2_sqrt + eps)
//               if accum_boundary: M = b1*M + (1-b1)*acc; V = b2*V + (1-b2)*acc*acc; acc = 0
//   None:       no update (mix and send only).
#pragma once

#include <cstdint>

namespace decentpy {

enum class OptKind : int32_t { None = 0, SGD = 1, Adam = 2, AccumAdam = 3 };

enum class DType : int32_t { Float32 = 0, BFloat16 = 1, Float16 = 2 };

// Most parameter groups one bucket may mix (the CUDA launcher passes them by value).
constexpr int kMaxGroups = 8;

// Hyper-parameters of one optimizer parameter group for the current step.
struct GroupHyper {
  float lr = 0.f;
  float weight_decay = 0.f;
  // SGD
  float momentum = 0.f;
  float dampening = 0.f;
  int32_t nesterov = 0;
  // Adam family: bc1 = 1 - b1^k, bc2_sqrt = sqrt(1 - b2^k)
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float bias_correction1 = 1.f;
  float bias_correction2_sqrt = 1.f;
  // AccumAdam: 1 / accum_iter
  float accum_scale = 1.f;
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
  float send_scale = 1.f;
  float grad_scale = 1.f;

  int32_t decoupled_weight_decay = 0;  // AdamW / AccumAdamW
  int32_t momentum_init = 0;           // SGD: first step initialises the momentum buffer with g
  int32_t accum_boundary = 0;          // AccumAdam: t mod A == 0 this step
  int32_t skip_update = 0;             // non-finite gradients: mix and send only
  int32_t zero_grad = 0;               // grad[i] = 0 after it is read (needs grad)

  const Segment* segments = nullptr;   // host memory for CPU, device memory for CUDA
  int64_t num_segments = 0;
  GroupHyper groups[kMaxGroups];
  int32_t num_groups = 0;
};

// Elementwise helpers on flat buffers of `dtype`, used around the exchanges.
// dst = alpha * src  (dst may equal src)
struct ScaleCopyArgs {
  DType dtype = DType::Float32;
  int64_t numel = 0;
  void* dst = nullptr;
  const void* src = nullptr;
  float alpha = 1.f;
};

}  // namespace decentpy
