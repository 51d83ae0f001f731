#include "ops/mix_and_step_op.h"

#include <ATen/MemoryOverlap.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cpu/mix_and_step_cpu.h"
#include "cpu/sparse_cpu.h"
#include "kernels/compress.h"
#include "kernels/mix_and_step.h"
#include "kernels/peer_check.h"
#ifdef DECENTPY_WITH_CUDA
#include "cuda/mix_and_step_cuda.h"
#include "cuda/sparse_cuda.h"
#endif

namespace decentpy {
namespace {

static_assert(sizeof(Segment) == 3 * sizeof(int64_t), "Segment must match an int64 [nseg, 3] row");

const char* kind_name(OptKind kind) {
  switch (kind) {
    case OptKind::None: return "None";
    case OptKind::SGD: return "SGD";
    case OptKind::Adam: return "Adam";
    case OptKind::AccumAdam: return "AccumAdam";
  }
  return "?";
}

// An optional one-element float32 tensor on param's device that the kernel reads.
const float* scalar_on_device(const c10::optional<at::Tensor>& t, const at::Tensor& param, const char* what) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == 1, what,
              " must be a one-element float32 tensor, got ", t->scalar_type(), " ", t->sizes());
  TORCH_CHECK(t->device() == param.device(), what, " is on ", t->device(), " but param is on ",
              param.device(), "; the kernel reads it where it runs");
  return t->data_ptr<float>();
}

DType to_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::Float32;
    case at::kBFloat16: return DType::BFloat16;
    case at::kHalf: return DType::Float16;
    default:
      TORCH_CHECK(false, what, " has dtype ", t.scalar_type(),
                  "; valid dtypes are float32, bfloat16 and float16");
  }
  return DType::Float32;
}

void check_device_supported(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), what, " is on ", t.device(),
              "; decentpy kernels run on CPU and CUDA tensors");
}

// A tensor that must match param: same dtype, numel and device, contiguous.
void check_like_param(const at::Tensor& t, const at::Tensor& param, const char* what,
                      const char* ref = "param") {
  TORCH_CHECK(t.defined(), what, " is undefined");
  TORCH_CHECK(t.scalar_type() == param.scalar_type(), what, " has dtype ", t.scalar_type(),
              " but ", ref, " has dtype ", param.scalar_type(), "; they must match");
  TORCH_CHECK(t.numel() == param.numel(), what, " has ", t.numel(), " elements (sizes ",
              t.sizes(), ") but ", ref, " has ", param.numel(), "; they must match");
  TORCH_CHECK(t.device() == param.device(), what, " is on ", t.device(), " but ", ref, " is on ",
              param.device(), "; they must be on the same device");
  TORCH_CHECK(t.is_contiguous(), what, " (sizes ", t.sizes(), ", strides ", t.strides(),
              ") must be contiguous");
}

void check_no_overlap(const at::Tensor& a, const char* an, const at::Tensor& b, const char* bn) {
  const auto st = at::get_overlap_status(a, b);
  TORCH_CHECK(st == at::MemOverlapStatus::No, an, " must not share memory with ", bn,
              " (they overlap", st == at::MemOverlapStatus::Full ? " fully" : " partially", ")");
}

void bump(const at::Tensor& t) {
  if (t.defined() && !t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

void* cuda_stream_of(const at::Tensor& t) {
  return c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(t.device()).native_handle();
}

// The error of every launcher asked to run `op` on a non-CPU device in a build without the CUDA
// kernels (the launch itself stays behind DECENTPY_WITH_CUDA at each call site).
[[maybe_unused]] void no_cuda_kernels(const at::Device& device, const char* op) {
  TORCH_CHECK(false, "decentpy was built without CUDA kernels (no nvcc at build time, or "
              "DECENTPY_NO_CUDA=1); cannot run ", op, " on ", device, ". Rebuild with nvcc available.");
}

}  // namespace

void check_segments(const at::Tensor& segments, int64_t numel, int64_t num_groups) {
  TORCH_CHECK(segments.defined() && segments.device().is_cpu(),
              "check_segments: segments must be a CPU tensor (check it before moving it to the GPU)");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 3 &&
                  segments.is_contiguous(),
              "check_segments: segments must be a contiguous int64 [nseg, 3] tensor, got ",
              segments.scalar_type(), " ", segments.sizes());
  const int64_t nseg = segments.size(0);
  TORCH_CHECK(nseg >= 1 || numel == 0, "segments is empty; it must cover [0, ", numel, ")");
  const int64_t* sp = segments.data_ptr<int64_t>();
  int64_t expect = 0;
  for (int64_t i = 0; i < nseg; ++i) {
    const int64_t b = sp[3 * i], e = sp[3 * i + 1], grp = sp[3 * i + 2];
    TORCH_CHECK(b == expect && e >= b, "mix_and_step: segments[", i, "] = (", b, ", ", e, ", ",
                grp, ") does not continue at ", expect,
                "; segments must be sorted, disjoint and cover [0, ", numel, ")");
    TORCH_CHECK(grp >= 0 && grp < num_groups, "mix_and_step: segments[", i, "] uses group ", grp,
                " but there are ", num_groups, " parameter groups");
    expect = e;
  }
  TORCH_CHECK(expect == numel, "mix_and_step: segments end at ", expect, " but param has ", numel,
              " elements");
}

namespace {

const char* compressor_name(Compressor c) {
  switch (c) {
    case Compressor::None: return "none";
    case Compressor::BF16: return "bf16";
    case Compressor::Int8: return "int8";
    case Compressor::Int4: return "int4";
  }
  return "?";
}

// A tracked copy: fp32, like param (numel, device), contiguous, overlapping none of param, grad and
// the optimizer state.
void check_copy(const at::Tensor& t, const at::Tensor& param, const at::Tensor& g,
                const std::vector<at::Tensor>& states, const char* what) {
  check_like_param(t, param, what);
  check_no_overlap(t, what, param, "param");
  if (g.defined()) check_no_overlap(t, what, g, "grad");
  for (const auto& st : states) check_no_overlap(t, what, st, "an optimizer state tensor");
}

// Wire bytes: a contiguous uint8 tensor of compressed_bytes(c, numel) bytes on param's device.
void check_wire(const at::Tensor& t, const at::Tensor& param, Compressor c, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kByte, what, " must be a uint8 tensor (the wire bytes), got ",
              t.scalar_type());
  TORCH_CHECK(t.numel() == compressed_bytes(c, param.numel()), what, " has ", t.numel(),
              " bytes but ", param.numel(), " elements compressed with ", compressor_name(c), " take ",
              compressed_bytes(c, param.numel()));
  TORCH_CHECK(t.device() == param.device(), what, " is on ", t.device(), " but param is on ",
              param.device());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0, what,
              " must be 4-byte aligned (its int8 / int4 block scales are fp32)");
}

void mix_and_step_impl(const StepCall& call) {
  // the fields under the names the checks below use
  const OptKind k = call.kind;
  const at::Tensor& param = call.param;
  const c10::optional<at::Tensor>& grad = call.grad;
  const std::vector<at::Tensor>& states = call.states;
  const c10::optional<at::Tensor>& comm = call.comm;
  const c10::optional<at::Tensor>& send = call.send;
  const c10::optional<at::Tensor>& segments_opt = call.segments;
  const std::vector<GroupHyper>& groups = call.groups;
  const double mix_a = call.mix_a, mix_b = call.mix_b, send_scale = call.send_scale, grad_scale = call.grad_scale;
  const c10::optional<at::Tensor>& grad_norm = call.grad_norm;
  const c10::optional<at::Tensor>& scaler_scale = call.scaler_scale;
  const double clip_norm = call.clip_norm;
  const bool decoupled_weight_decay = call.decoupled_weight_decay, momentum_init = call.momentum_init;
  const bool accum_boundary = call.accum_boundary, skip_update = call.skip_update, zero_grad = call.zero_grad;
  const c10::optional<at::Tensor>& prev_skip = call.prev_skip;
  const std::vector<int64_t>& alt_bias_steps = call.alt_bias_steps;
  const bool compressed = call.compressor != Compressor::None;
  auto get = [](const c10::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); };
  const int kind_int = static_cast<int>(k);
  TORCH_CHECK(kind_int >= 0 && kind_int <= 3, "mix_and_step: unknown optimizer kind ", kind_int);
  TORCH_CHECK(param.defined(), "mix_and_step: param is undefined");
  const DType dt = to_dtype(param, "mix_and_step: param");
  check_device_supported(param, "mix_and_step: param");
  TORCH_CHECK(param.dim() == 1, "mix_and_step: param must be 1-D (a flat bucket), got sizes ",
              param.sizes());
  TORCH_CHECK(param.is_contiguous(), "mix_and_step: param must be contiguous, got strides ",
              param.strides());

  const bool needs_grad = k != OptKind::None && !skip_update;
  const at::Tensor g = grad.has_value() ? *grad : at::Tensor();
  const at::Tensor c = comm.has_value() ? *comm : at::Tensor();
  const at::Tensor s = send.has_value() ? *send : at::Tensor();
  TORCH_CHECK(!needs_grad || g.defined(), "mix_and_step: grad is required for kind ",
              kind_name(k), " unless skip_update is set");
  TORCH_CHECK(!zero_grad || g.defined(), "mix_and_step: zero_grad=True needs grad (the tensor to "
              "zero), got None");
  if (g.defined()) {
    check_like_param(g, param, "mix_and_step: grad");
    check_no_overlap(g, "mix_and_step: grad", param, "param");
    if (zero_grad) {  // grad is written: it must not share memory with anything else
      if (c.defined()) check_no_overlap(g, "mix_and_step: grad (zero_grad=True)", c, "comm");
      if (s.defined()) check_no_overlap(g, "mix_and_step: grad (zero_grad=True)", s, "send");
    }
  }
  if (c.defined()) {
    check_like_param(c, param, "mix_and_step: comm");
    check_no_overlap(c, "mix_and_step: comm", param, "param");
  }
  if (s.defined()) {
    check_like_param(s, param, "mix_and_step: send");
    check_no_overlap(s, "mix_and_step: send", param, "param (send the parameter itself by passing "
                     "send=None)");
    if (c.defined()) {
      const auto st = at::get_overlap_status(s, c);
      TORCH_CHECK(st == at::MemOverlapStatus::No || (st == at::MemOverlapStatus::Full &&
                                                     s.data_ptr() == c.data_ptr()),
                  "mix_and_step: send must either be exactly comm or not overlap it (partial "
                  "overlap)");
    }
  }

  size_t want_lo = 0, want_hi = 0;
  switch (k) {
    case OptKind::None: want_lo = want_hi = 0; break;
    case OptKind::SGD: want_lo = 0; want_hi = 1; break;
    case OptKind::Adam: want_lo = want_hi = 2; break;
    case OptKind::AccumAdam: want_lo = want_hi = 3; break;
  }
  TORCH_CHECK(states.size() >= want_lo && states.size() <= want_hi, "mix_and_step: kind ",
              kind_name(k), " takes ",
              k == OptKind::SGD ? std::string("0 or 1 state tensors ([] or [momentum_buffer])")
              : k == OptKind::Adam ? std::string("2 state tensors ([exp_avg, exp_avg_sq])")
              : k == OptKind::AccumAdam ? std::string("3 state tensors ([exp_avg, exp_avg_sq, grad_acc])")
              : std::string("no state tensors"),
              ", got ", states.size());
  for (size_t i = 0; i < states.size(); ++i) {
    const at::Tensor& t = states[i];
    const std::string what = "mix_and_step: states[" + std::to_string(i) + "]";
    TORCH_CHECK(t.defined(), what, " is undefined");
    TORCH_CHECK(t.scalar_type() == at::kFloat, what, " has dtype ", t.scalar_type(),
                "; optimizer state must be float32");
    TORCH_CHECK(t.numel() == param.numel(), what, " has ", t.numel(),
                " elements but param has ", param.numel());
    TORCH_CHECK(t.device() == param.device(), what, " is on ", t.device(), " but param is on ",
                param.device());
    TORCH_CHECK(t.is_contiguous(), what, " must be contiguous, got strides ", t.strides());
    check_no_overlap(t, what.c_str(), param, "param");
    if (c.defined()) check_no_overlap(t, what.c_str(), c, "comm");
    if (s.defined()) check_no_overlap(t, what.c_str(), s, "send");
    if (g.defined() && !zero_grad) check_no_overlap(t, what.c_str(), g, "grad");
    for (size_t j = 0; j < i; ++j) {
      const std::string other = "states[" + std::to_string(j) + "]";
      check_no_overlap(t, what.c_str(), states[j], other.c_str());
    }
    if (zero_grad) {
      const std::string sn = "states[" + std::to_string(i) + "]";
      check_no_overlap(g, "mix_and_step: grad (zero_grad=True)", t, sn.c_str());
    }
  }

  TORCH_CHECK(groups.size() <= static_cast<size_t>(kMaxGroups), "mix_and_step: ", groups.size(),
              " parameter groups; at most ", kMaxGroups, " groups may share one bucket");
  TORCH_CHECK(k == OptKind::None || !groups.empty(), "mix_and_step: groups is empty; kind ",
              kind_name(k), " needs at least one parameter group");

  MixStepArgs a;
  a.kind = k;
  a.param_dtype = dt;
  a.numel = param.numel();
  a.param = param.data_ptr();
  a.grad = g.defined() ? g.data_ptr() : nullptr;
  a.comm = c.defined() ? c.data_ptr() : nullptr;
  a.send = s.defined() ? s.data_ptr() : nullptr;
  a.state0 = states.size() > 0 ? states[0].data_ptr<float>() : nullptr;
  a.state1 = states.size() > 1 ? states[1].data_ptr<float>() : nullptr;
  a.state2 = states.size() > 2 ? states[2].data_ptr<float>() : nullptr;
  a.mix_a = static_cast<float>(mix_a);
  a.mix_b = static_cast<float>(mix_b);
  a.send_scale = static_cast<float>(send_scale);
  a.grad_scale = static_cast<float>(grad_scale);
  a.grad_norm = scalar_on_device(grad_norm, param, "mix_and_step: grad_norm");
  a.scaler_scale = scalar_on_device(scaler_scale, param, "mix_and_step: scaler_scale");
  a.clip_norm = static_cast<float>(clip_norm);
  TORCH_CHECK(a.grad_norm != nullptr || a.scaler_scale == nullptr,
              "mix_and_step: scaler_scale is only read together with grad_norm");
  TORCH_CHECK(a.grad_norm == nullptr || grad_scale == 1.0, "mix_and_step: with grad_norm the kernel "
              "derives the gradient factor itself; grad_scale must be 1, got ", grad_scale);
  TORCH_CHECK(clip_norm >= 0.0, "mix_and_step: clip_norm must be >= 0 (0: no clipping), got ", clip_norm);
  a.decoupled_weight_decay = decoupled_weight_decay ? 1 : 0;
  a.momentum_init = momentum_init ? 1 : 0;
  a.accum_boundary = accum_boundary ? 1 : 0;
  a.skip_update = skip_update ? 1 : 0;
  a.zero_grad = zero_grad ? 1 : 0;
  a.num_groups = static_cast<int32_t>(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) {
    const GroupHyper& h = groups[i];
    a.groups[i] = h;
    if (k == OptKind::SGD && needs_grad) {
      TORCH_CHECK(h.momentum == 0.f || states.size() == 1, "mix_and_step: groups[", i,
                  "] has momentum ", h.momentum,
                  " but no momentum buffer was given (states must be [momentum_buffer])");
    }
    if ((k == OptKind::Adam || k == OptKind::AccumAdam) && needs_grad) {
      TORCH_CHECK(h.bias_step >= 1, "mix_and_step: groups[", i, "] has bias_step ", h.bias_step,
                  "; bias-correction steps are 1-based");
    }
    if (k == OptKind::AccumAdam && needs_grad) {
      TORCH_CHECK(h.accum_iter >= 1, "mix_and_step: groups[", i, "] has accum_iter ", h.accum_iter,
                  "; it must be >= 1");
    }
  }

  a.mix_factor = scalar_on_device(call.mix_factor, param, "mix_and_step: mix_factor");
  TORCH_CHECK(a.mix_factor == nullptr || !compressed, "mix_and_step: mix_factor scales the plain mix with comm; "
              "a compressed pass takes none");
  TORCH_CHECK(a.mix_factor == nullptr || c.defined(), "mix_and_step: mix_factor scales the mix with comm, but no "
              "comm was given");
  TORCH_CHECK(call.mix_guard >= 0.0, "mix_and_step: mix_guard must be >= 0 (0: no guard), got ", call.mix_guard);
  TORCH_CHECK(call.mix_guard == 0.0 || (c.defined() && !compressed), "mix_and_step: mix_guard guards the plain "
              "mix with comm; give comm (and no compressor)");
  a.mix_guard = static_cast<float>(call.mix_guard);
  if (call.mix_guarded.has_value() && call.mix_guarded->defined()) {
    const at::Tensor& t = *call.mix_guarded;
    TORCH_CHECK(t.scalar_type() == at::kLong && t.numel() == 1, "mix_and_step: mix_guarded must be a one-element "
                "int64 tensor, got ", t.scalar_type(), " ", t.sizes());
    TORCH_CHECK(t.device() == param.device(), "mix_and_step: mix_guarded is on ", t.device(), " but param is on ",
                param.device(), "; the kernel adds to it where it runs");
    a.mix_guarded = t.data_ptr<int64_t>();
  }

  if (prev_skip.has_value() && prev_skip->defined()) {
    const at::Tensor& f = *prev_skip;
    TORCH_CHECK(!compressed, "mix_and_step: a deferred verdict (prev_skip) is not supported with a compressor");
    TORCH_CHECK((f.scalar_type() == at::kBool || f.scalar_type() == at::kByte) && f.numel() == 1,
                "mix_and_step: prev_skip must be a one-element bool or uint8 tensor, got ", f.scalar_type(), " ",
                f.sizes());
    TORCH_CHECK(f.device() == param.device(), "mix_and_step: prev_skip is on ", f.device(), " but param is on ",
                param.device(), "; the kernel reads it where it runs");
    TORCH_CHECK(alt_bias_steps.size() == groups.size(), "mix_and_step: prev_skip needs one alt_bias_steps entry "
                "per parameter group: ", groups.size(), " groups, got ", alt_bias_steps.size());
    for (size_t i = 0; i < alt_bias_steps.size(); ++i) {
      TORCH_CHECK(alt_bias_steps[i] >= 1 || !(k == OptKind::Adam || k == OptKind::AccumAdam),
                  "mix_and_step: alt_bias_steps[", i, "] is ", alt_bias_steps[i], "; bias-correction steps are 1-based");
      a.alt_bias_step[i] = alt_bias_steps[i];
    }
    a.prev_skip = static_cast<const uint8_t*>(f.data_ptr());
  } else {
    TORCH_CHECK(alt_bias_steps.empty(), "mix_and_step: alt_bias_steps is only read together with prev_skip");
  }

  // Segments.
  const at::Tensor segments = segments_opt.has_value() ? *segments_opt : at::Tensor();
  const bool uses_segments = needs_grad && param.numel() > 0;
  TORCH_CHECK(segments.defined() || !uses_segments, "mix_and_step: segments is required for kind ",
              kind_name(k), " (int64 rows (begin, end, group) covering the bucket)");
  if (segments.defined() && (uses_segments || segments.numel() > 0)) {
    TORCH_CHECK(segments.scalar_type() == at::kLong, "mix_and_step: segments has dtype ",
                segments.scalar_type(), "; expected int64 rows (begin, end, group)");
    TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 3,
                "mix_and_step: segments must have shape [nseg, 3], got ", segments.sizes());
    TORCH_CHECK(segments.is_contiguous(), "mix_and_step: segments must be contiguous");
    TORCH_CHECK(segments.device() == param.device(), "mix_and_step: segments is on ",
                segments.device(), " but param is on ", param.device());
  }
  if (uses_segments) {
    const int64_t nseg = segments.size(0);
    TORCH_CHECK(nseg >= 1, "mix_and_step: segments is empty; it must cover [0, ", param.numel(),
                ")");
    // A device table is not read back here (that would synchronise every call): it is checked
    // with check_segments on the host before it is copied over (decentpy/bucket.py does).
    if (segments.device().is_cpu()) {
      check_segments(segments, param.numel(), static_cast<int64_t>(groups.size()));
    }
    a.segments = reinterpret_cast<const Segment*>(segments.data_ptr<int64_t>());
    a.num_segments = nseg;
  }

  if (compressed) {
    struct {
      Compressor compressor;
      at::Tensor q_recv, peer_copy, self_copy_mix, q_send, self_copy_next;
      double choco_mix;
    } ch{call.compressor, get(call.q_recv), get(call.peer_copy), get(call.self_copy_mix), get(call.q_send),
         get(call.self_copy_next), call.choco_mix};
    const int ci = static_cast<int>(ch.compressor);
    TORCH_CHECK(ci == 1 || ci == 2 || ci == 3, "compressed_mix_and_step: unknown compressor ", ci,
                "; valid compressors are BF16 = 1, INT8 = 2 and INT4 = 3");
    TORCH_CHECK(dt == DType::Float32, "compressed_mix_and_step: param has dtype ", param.scalar_type(),
                "; compressed gossip steps float32 parameters only");
    TORCH_CHECK(!c.defined() && !s.defined(), "compressed_mix_and_step: internal error: comm / send given");
    a.compressor = ch.compressor;
    if (ch.q_recv.defined()) {
      check_wire(ch.q_recv, param, ch.compressor, "compressed_mix_and_step: q_recv");
      TORCH_CHECK(ch.peer_copy.defined() && ch.self_copy_mix.defined(),
                  "compressed_mix_and_step: q_recv needs peer_copy and self_copy_mix");
      check_copy(ch.peer_copy, param, g, states, "compressed_mix_and_step: peer_copy");
      check_copy(ch.self_copy_mix, param, g, states, "compressed_mix_and_step: self_copy_mix");
      check_no_overlap(ch.peer_copy, "compressed_mix_and_step: peer_copy", ch.self_copy_mix, "self_copy_mix");
      check_no_overlap(ch.q_recv, "compressed_mix_and_step: q_recv", param, "param");
      a.q_recv = ch.q_recv.data_ptr();
      a.peer_copy = ch.peer_copy.data_ptr<float>();
      a.self_copy_mix = ch.self_copy_mix.data_ptr<float>();
      a.choco_mix = static_cast<float>(ch.choco_mix);
    }
    if (ch.q_send.defined()) {
      check_wire(ch.q_send, param, ch.compressor, "compressed_mix_and_step: q_send");
      TORCH_CHECK(ch.self_copy_next.defined(), "compressed_mix_and_step: q_send needs self_copy_next");
      check_copy(ch.self_copy_next, param, g, states, "compressed_mix_and_step: self_copy_next");
      if (ch.peer_copy.defined())
        check_no_overlap(ch.self_copy_next, "compressed_mix_and_step: self_copy_next", ch.peer_copy, "peer_copy");
      if (ch.self_copy_mix.defined()) {
        const auto st = at::get_overlap_status(ch.self_copy_next, ch.self_copy_mix);
        TORCH_CHECK(st == at::MemOverlapStatus::No || (st == at::MemOverlapStatus::Full &&
                                                       ch.self_copy_next.data_ptr() == ch.self_copy_mix.data_ptr()),
                    "compressed_mix_and_step: self_copy_next must either be self_copy_mix or not overlap it");
      }
      if (ch.q_recv.defined())
        check_no_overlap(ch.q_send, "compressed_mix_and_step: q_send", ch.q_recv, "q_recv");
      a.q_send = ch.q_send.data_ptr();
      a.self_copy_next = ch.self_copy_next.data_ptr<float>();
    }
  }

  if (param.numel() == 0) return;

  if (param.device().is_cpu()) {
    mix_and_step_cpu(a);
  } else {
#ifdef DECENTPY_WITH_CUDA
    c10::DeviceGuard guard(param.device());
    decentpy::cuda::launch_mix_and_step(a, cuda_stream_of(param));
#else
    no_cuda_kernels(param.device(), "mix_and_step");
#endif
  }
  bump(param);
  if (needs_grad) for (const auto& t : states) bump(t);
  if (s.defined()) bump(s);
  if (zero_grad) bump(g);
  if (a.mix_guarded != nullptr) bump(*call.mix_guarded);
  if (compressed) {
    bump(get(call.peer_copy));
    bump(get(call.q_send));
    bump(get(call.self_copy_next));
  }
}

}  // namespace

void mix_and_step(const StepCall& call) { mix_and_step_impl(call); }

void compressed_group_reduce(Compressor compressor, const std::vector<at::Tensor>& inputs, const at::Tensor& out,
                             const at::Tensor& self_copy, int64_t lo, int64_t hi) {
  const int ci = static_cast<int>(compressor);
  TORCH_CHECK(ci == 1 || ci == 2 || ci == 3, "compressed_group_reduce: unknown compressor ", ci,
              "; valid compressors are BF16 = 1, INT8 = 2 and INT4 = 3");
  TORCH_CHECK(self_copy.defined() && self_copy.scalar_type() == at::kFloat && self_copy.is_contiguous(),
              "compressed_group_reduce: self_copy must be a contiguous float32 tensor");
  check_device_supported(self_copy, "compressed_group_reduce: self_copy");
  const int64_t n = self_copy.numel();
  TORCH_CHECK(lo >= 0 && lo <= hi && hi <= n && lo % kInt8Block == 0, "compressed_group_reduce: the chunk [", lo,
              ", ", hi, ") must start at a multiple of ", kInt8Block, " and lie within [0, ", n, ")");
  const int64_t m = static_cast<int64_t>(inputs.size());
  TORCH_CHECK(m >= 1 && m <= kMaxGroupInputs, "compressed_group_reduce: ", m, " inputs; a group reduces 1 to ",
              kMaxGroupInputs, " members' q");
  check_wire(out, self_copy, compressor, "compressed_group_reduce: out");
  check_no_overlap(out, "compressed_group_reduce: out", self_copy, "self_copy");
  GroupReduceArgs a;
  a.compressor = compressor;
  a.numel = n;
  a.lo = lo;
  a.hi = hi;
  a.num_inputs = static_cast<int32_t>(m);
  for (int64_t t = 0; t < m; ++t) {
    check_wire(inputs[t], self_copy, compressor, "compressed_group_reduce: an input");
    check_no_overlap(inputs[t], "compressed_group_reduce: an input", out, "out");
    a.inputs[t] = inputs[t].data_ptr();
  }
  a.out = out.data_ptr();
  a.self_copy = self_copy.data_ptr<float>();
  if (hi == lo) return;
  if (self_copy.device().is_cpu()) {
    choco_group_reduce_cpu(a);
  } else {
#ifdef DECENTPY_WITH_CUDA
    c10::DeviceGuard guard(self_copy.device());
    decentpy::cuda::launch_choco_group_reduce(a, cuda_stream_of(self_copy));
#else
    no_cuda_kernels(self_copy.device(), "compressed_group_reduce");
#endif
  }
  bump(out);
  bump(self_copy);
}

namespace {

// A float32 buffer of the outer step: contiguous, like `x` in numel and device.
void check_outer_f32(const at::Tensor& t, const at::Tensor& x, const char* what) {
  TORCH_CHECK(t.defined() && t.scalar_type() == at::kFloat, what, " must be a float32 tensor",
              t.defined() ? ", got " : "", t.defined() ? c10::toString(t.scalar_type()) : "");
  TORCH_CHECK(t.numel() == x.numel(), what, " has ", t.numel(), " elements but param has ", x.numel());
  TORCH_CHECK(t.device() == x.device(), what, " is on ", t.device(), " but param is on ", x.device());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
  check_no_overlap(t, what, x, "param");
}

void check_outer_param(const at::Tensor& param, const char* op) {
  TORCH_CHECK(param.defined() && param.is_contiguous(), op, ": param must be a contiguous tensor");
  check_device_supported(param, op);
}

// The pseudo-gradient buffer: fp32 like param without a compressor, else its wire bytes.
void check_outer_delta(const at::Tensor& t, const at::Tensor& param, Compressor c, const char* what) {
  const int ci = static_cast<int>(c);
  TORCH_CHECK(ci >= 0 && ci <= 3, what, ": unknown compressor ", ci,
              "; valid compressors are NONE = 0, BF16 = 1, INT8 = 2 and INT4 = 3");
  if (c == Compressor::None) check_outer_f32(t, param, what);
  else {
    check_wire(t, param, c, what);
    check_no_overlap(t, what, param, "param");
  }
}

}  // namespace

void outer_pack(const at::Tensor& param, const at::Tensor& theta, Compressor compressor,
                const c10::optional<at::Tensor>& excess, const at::Tensor& out) {
  check_outer_param(param, "outer_pack");
  OuterPackArgs a;
  a.param_dtype = to_dtype(param, "outer_pack: param");
  a.numel = param.numel();
  check_outer_f32(theta, param, "outer_pack: theta");
  check_outer_delta(out, param, compressor, "outer_pack: out");
  check_no_overlap(out, "outer_pack: out", theta, "theta");
  const bool ef = excess.has_value() && excess->defined();
  TORCH_CHECK(ef == (compressor != Compressor::None), "outer_pack: ",
              compressor == Compressor::None ? "excess is for a compressor's error feedback; pass none without one"
                                             : "a compressor needs excess (its error feedback, float32 like param)");
  a.param = param.data_ptr();
  a.theta = theta.data_ptr<float>();
  a.compressor = compressor;
  if (ef) {
    check_outer_f32(*excess, param, "outer_pack: excess");
    check_no_overlap(*excess, "outer_pack: excess", theta, "theta");
    check_no_overlap(*excess, "outer_pack: excess", out, "out");
    a.excess = excess->data_ptr<float>();
  }
  a.out = out.data_ptr();
  if (a.numel == 0) return;
  if (param.device().is_cpu()) {
    outer_pack_cpu(a);
  } else {
#ifdef DECENTPY_WITH_CUDA
    c10::DeviceGuard guard(param.device());
    decentpy::cuda::launch_outer_pack(a, cuda_stream_of(param));
#else
    no_cuda_kernels(param.device(), "outer_pack");
#endif
  }
  bump(out);
  if (ef) bump(*excess);
}

void outer_apply(const at::Tensor& param, const at::Tensor& theta, const c10::optional<at::Tensor>& theta_mix,
                 Compressor compressor, const at::Tensor& delta, OptKind kind, const GroupHyper& hyper,
                 const std::vector<at::Tensor>& states, bool decoupled_weight_decay, bool momentum_init,
                 double alpha) {
  check_outer_param(param, "outer_apply");
  TORCH_CHECK(kind == OptKind::SGD || kind == OptKind::Adam, "outer_apply: the outer optimizer is SGD or Adam, got ",
              kind_name(kind));
  OuterApplyArgs a;
  a.param_dtype = to_dtype(param, "outer_apply: param");
  a.numel = param.numel();
  check_outer_f32(theta, param, "outer_apply: theta");
  check_outer_delta(delta, param, compressor, "outer_apply: delta");
  check_no_overlap(delta, "outer_apply: delta", theta, "theta");
  const size_t want = kind == OptKind::Adam ? 2 : (hyper.momentum != 0.f ? 1 : 0);
  TORCH_CHECK(states.size() == want, "outer_apply: ", kind_name(kind),
              kind == OptKind::Adam ? " takes [exp_avg, exp_avg_sq]"
                                    : (want ? " with momentum takes [momentum_buffer]" : " without momentum takes []"),
              ", got ", states.size(), " state tensors");
  for (const auto& st : states) {
    check_outer_f32(st, param, "outer_apply: an optimizer state tensor");
    check_no_overlap(st, "outer_apply: an optimizer state tensor", theta, "theta");
  }
  TORCH_CHECK(alpha >= 0.0 && alpha <= 1.0, "outer_apply: alpha must be in [0, 1], got ", alpha);
  a.param = param.data_ptr();
  a.theta = theta.data_ptr<float>();
  if (theta_mix.has_value() && theta_mix->defined()) {
    check_outer_f32(*theta_mix, param, "outer_apply: theta_mix");
    a.theta_mix = theta_mix->data_ptr<float>();
  }
  a.compressor = compressor;
  a.delta = delta.data_ptr();
  a.kind = kind;
  a.hyper = hyper;
  a.decoupled_weight_decay = decoupled_weight_decay ? 1 : 0;
  a.momentum_init = momentum_init ? 1 : 0;
  a.state0 = states.size() > 0 ? states[0].data_ptr<float>() : nullptr;
  a.state1 = states.size() > 1 ? states[1].data_ptr<float>() : nullptr;
  a.alpha = static_cast<float>(alpha);
  if (a.numel == 0) return;
  if (param.device().is_cpu()) {
    outer_apply_cpu(a);
  } else {
#ifdef DECENTPY_WITH_CUDA
    c10::DeviceGuard guard(param.device());
    decentpy::cuda::launch_outer_apply(a, cuda_stream_of(param));
#else
    no_cuda_kernels(param.device(), "outer_apply");
#endif
  }
  bump(param);
  bump(theta);
  for (const auto& st : states) bump(st);
}

void outer_decode(Compressor compressor, const at::Tensor& wire, const at::Tensor& out) {
  TORCH_CHECK(out.defined() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "outer_decode: out must be a contiguous float32 tensor");
  check_device_supported(out, "outer_decode: out");
  check_outer_delta(wire, out, compressor, "outer_decode: wire");
  TORCH_CHECK(compressor != Compressor::None, "outer_decode: a wire of a compressor (BF16, INT8 or INT4), got NONE");
  if (out.numel() == 0) return;
  if (out.device().is_cpu()) {
    outer_decode_cpu(compressor, wire.data_ptr(), out.data_ptr<float>(), out.numel());
  } else {
#ifdef DECENTPY_WITH_CUDA
    c10::DeviceGuard guard(out.device());
    decentpy::cuda::launch_outer_decode(compressor, wire.data_ptr(), out.data_ptr<float>(), out.numel(),
                                        cuda_stream_of(out));
#else
    no_cuda_kernels(out.device(), "outer_decode");
#endif
  }
  bump(out);
}

namespace {

// A SparseLoCo buffer's layout: chunk a power of two in [4, kSparseMaxChunk], k a multiple of 4 in [4, chunk].
void check_sparse_layout(int64_t chunk, int64_t k, const char* who) {
  TORCH_CHECK(chunk >= 4 && chunk <= kSparseMaxChunk && (chunk & (chunk - 1)) == 0, who,
              ": chunk must be a power of two in [4, ", kSparseMaxChunk, "], got ", chunk);
  TORCH_CHECK(k >= 4 && k <= chunk && k % 4 == 0, who, ": k must be a multiple of 4 in [4, chunk=", chunk, "], got ", k);
}

// A flat contiguous float32 tensor of n elements on `like`'s device.
void check_sparse_f32(const at::Tensor& t, const at::Tensor& like, int64_t n, const char* what) {
  TORCH_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n &&
                  t.device() == like.device(),
              what, " must be a contiguous float32 tensor of ", n, " elements on ", like.device(), ", got ",
              t.defined() ? t.toString() : std::string("undefined"), " of ", t.defined() ? t.numel() : 0,
              " elements on ", t.defined() ? t.device().str() : std::string("-"));
}

void check_sparse_wire(const at::Tensor& w, const at::Tensor& like, int64_t n, int64_t chunk, int64_t k,
                       const char* what) {
  const int64_t bytes = sparse_wire_bytes(n, chunk, k);
  TORCH_CHECK(w.defined() && w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == bytes &&
                  w.device() == like.device(),
              what, " must be a contiguous uint8 tensor of sparse_wire_bytes(", n, ", ", chunk, ", ", k, ") = ", bytes,
              " bytes on ", like.device(), ", got ", w.defined() ? w.toString() : std::string("undefined"), " of ",
              w.defined() ? w.numel() : 0, " bytes");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 4 == 0, what, " must be 4-byte aligned (its scales are fp32)");
}

}  // namespace

void sparse_pack(const at::Tensor& param, const at::Tensor& theta, const at::Tensor& error, const at::Tensor& wire,
                 int64_t chunk, int64_t k, double decay) {
  TORCH_CHECK(param.defined(), "sparse_pack: param is undefined");
  check_device_supported(param, "sparse_pack: param");
  const int64_t n = param.numel();
  check_sparse_layout(chunk, k, "sparse_pack");
  TORCH_CHECK(std::isfinite(decay) && decay >= 0.0 && decay <= 1.0, "sparse_pack: decay must be in [0, 1], got ", decay);
  check_sparse_f32(param, param, n, "sparse_pack: param");
  check_sparse_f32(theta, param, n, "sparse_pack: theta");
  check_sparse_f32(error, param, n, "sparse_pack: error");
  check_sparse_wire(wire, param, n, chunk, k, "sparse_pack: wire");
  check_no_overlap(error, "sparse_pack: error", theta, "theta");
  check_no_overlap(error, "sparse_pack: error", param, "param");
  check_no_overlap(wire, "sparse_pack: wire", error, "error");
  SparsePackArgs a;
  a.numel = n;
  a.chunk = static_cast<int32_t>(chunk);
  a.k = static_cast<int32_t>(k);
  a.decay = static_cast<float>(decay);
  a.param = param.data_ptr<float>();
  a.theta = theta.data_ptr<float>();
  a.error = error.data_ptr<float>();
  a.wire = wire.data_ptr();
  if (n == 0) return;
  if (param.device().is_cpu()) {
    sparse_pack_cpu(a);
  } else {
#ifdef DECENTPY_WITH_CUDA
    c10::DeviceGuard guard(param.device());
    decentpy::cuda::launch_sparse_pack(a, cuda_stream_of(param));
#else
    no_cuda_kernels(param.device(), "sparse_pack");
#endif
  }
  bump(error);
  bump(wire);
}

void sparse_mean(const std::vector<at::Tensor>& inputs, const at::Tensor& out, int64_t chunk, int64_t k) {
  TORCH_CHECK(out.defined(), "sparse_mean: out is undefined");
  check_device_supported(out, "sparse_mean: out");
  check_sparse_layout(chunk, k, "sparse_mean");
  const int64_t n = out.numel();
  check_sparse_f32(out, out, n, "sparse_mean: out");
  TORCH_CHECK(!inputs.empty() && static_cast<int64_t>(inputs.size()) <= kSparseMaxMembers,
              "sparse_mean: 1 to ", kSparseMaxMembers, " input messages, got ", inputs.size());
  SparseMeanArgs a;
  a.numel = n;
  a.chunk = static_cast<int32_t>(chunk);
  a.k = static_cast<int32_t>(k);
  a.num_inputs = static_cast<int32_t>(inputs.size());
  for (size_t t = 0; t < inputs.size(); ++t) {
    check_sparse_wire(inputs[t], out, n, chunk, k, "sparse_mean: an input message");
    check_no_overlap(inputs[t], "sparse_mean: an input message", out, "out");
    a.inputs[t] = inputs[t].data_ptr();
  }
  a.out = out.data_ptr<float>();
  if (n == 0) return;
  if (out.device().is_cpu()) {
    sparse_mean_cpu(a);
  } else {
#ifdef DECENTPY_WITH_CUDA
    c10::DeviceGuard guard(out.device());
    decentpy::cuda::launch_sparse_mean(a, cuda_stream_of(out));
#else
    no_cuda_kernels(out.device(), "sparse_mean");
#endif
  }
  bump(out);
}

std::vector<std::pair<int64_t, int64_t>> compressed_wire_regions(Compressor compressor, int64_t n, int64_t lo,
                                                                 int64_t hi) {
  const int ci = static_cast<int>(compressor);
  TORCH_CHECK(ci == 1 || ci == 2 || ci == 3, "compressed_wire_regions: unknown compressor ", ci);
  TORCH_CHECK(lo >= 0 && lo <= hi && hi <= n && lo % kInt8Block == 0, "compressed_wire_regions: the range [", lo,
              ", ", hi, ") must start at a multiple of ", kInt8Block, " and lie within [0, ", n, ")");
  int64_t r[4];
  const int k = wire_regions(compressor, n, lo, hi, r);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int i = 0; i < k; ++i) out.emplace_back(r[2 * i], r[2 * i + 1]);
  return out;
}

namespace {

// A flat buffer the peer check reads: fp32 / bf16 / fp16, 1-D, contiguous, on a CPU or CUDA device.
DType check_peer_buffer(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), what, " is undefined");
  const DType dt = to_dtype(t, what);
  check_device_supported(t, what);
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), what, " must be a flat contiguous tensor, got sizes ", t.sizes(),
              " strides ", t.strides());
  return dt;
}

// `out`: float64, contiguous, (kPeerParts + 1) * width elements, on `like`'s device.
double* check_peer_out(const at::Tensor& out, const at::Tensor& like, int64_t width, const char* what) {
  TORCH_CHECK(out.defined() && out.scalar_type() == at::kDouble && out.is_contiguous(), what,
              ": out must be a contiguous float64 tensor", out.defined() ? ", got " : "",
              out.defined() ? c10::toString(out.scalar_type()) : "");
  TORCH_CHECK(out.numel() == (kPeerParts + 1) * width, what, ": out has ", out.numel(), " elements; it needs (",
              kPeerParts, " parts + 1) x ", width, " = ", (kPeerParts + 1) * width);
  TORCH_CHECK(out.device() == like.device(), what, ": out is on ", out.device(), " but the buffer is on ",
              like.device());
  check_no_overlap(out, "out", like, "the buffer");
  return out.data_ptr<double>();
}

}  // namespace

void peer_stats(const at::Tensor& param, const c10::optional<at::Tensor>& comm, int64_t sample, const at::Tensor& out) {
  TORCH_CHECK(sample >= 1, "peer_stats: sample must be >= 1 (1: every element), got ", sample);
  PeerStatsArgs a;
  a.sample = sample;
  a.dtype = check_peer_buffer(param, "peer_stats: param");
  a.numel = param.numel();
  a.param = param.data_ptr();
  if (comm.has_value() && comm->defined()) {
    check_like_param(*comm, param, "peer_stats: comm");
    a.comm = comm->data_ptr();
  }
  a.out = check_peer_out(out, param, kPeerStats, "peer_stats");
  if (param.device().is_cpu()) {
    peer_stats_cpu(a);
  } else {
#ifdef DECENTPY_WITH_CUDA
    c10::DeviceGuard guard(param.device());
    decentpy::cuda::launch_peer_stats(a, cuda_stream_of(param));
#else
    no_cuda_kernels(param.device(), "peer_stats");
#endif
  }
  bump(out);
}

void peer_sketch(const at::Tensor& src, int64_t seed, int64_t slots, int64_t sample, const at::Tensor& out) {
  TORCH_CHECK(slots >= 1 && slots <= kSketchMaxSlots, "peer_sketch: slots must be in [1, ", kSketchMaxSlots,
              "], got ", slots);
  TORCH_CHECK(sample >= 1, "peer_sketch: sample must be >= 1 (1: every element), got ", sample);
  PeerSketchArgs a;
  a.sample = sample;
  a.dtype = check_peer_buffer(src, "peer_sketch: src");
  a.numel = src.numel();
  a.src = src.data_ptr();
  a.seed = static_cast<uint64_t>(seed);
  a.slots = static_cast<int32_t>(slots);
  a.out = check_peer_out(out, src, slots + 2, "peer_sketch");
  if (src.device().is_cpu()) {
    peer_sketch_cpu(a);
  } else {
#ifdef DECENTPY_WITH_CUDA
    c10::DeviceGuard guard(src.device());
    decentpy::cuda::launch_peer_sketch(a, cuda_stream_of(src));
#else
    no_cuda_kernels(src.device(), "peer_sketch");
#endif
  }
  bump(out);
}

namespace {

// A float64 vector of the verdicts: contiguous, `numel` values, on `like`'s device.
double* verdict_buffer(const at::Tensor& t, int64_t numel, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.defined() && t.scalar_type() == at::kDouble && t.is_contiguous() && t.numel() == numel, what,
              " must be a contiguous float64 tensor of ", numel, " values, got ",
              t.defined() ? c10::toString(t.scalar_type()) : "undefined", " ", t.defined() ? t.sizes() : at::IntArrayRef{});
  TORCH_CHECK(t.device() == like.device(), what, " is on ", t.device(), " but the inputs are on ", like.device());
  check_device_supported(t, what);
  return t.data_ptr<double>();
}

}  // namespace

void peer_pair_verdict(const at::Tensor& stats, double expand, double tau, double first, bool clip,
                       const at::Tensor& out) {
  const double* st = verdict_buffer(stats, kPeerStats, stats, "peer_pair_verdict: stats");
  double* o = verdict_buffer(out, 5, stats, "peer_pair_verdict: out");
  TORCH_CHECK(expand >= 1.0 && first > 0.0, "peer_pair_verdict: expand must be >= 1 and first > 0, got ", expand,
              " and ", first);
  if (stats.device().is_cpu()) {
    pair_verdict(st, expand, tau, first, clip, o);
  } else {
#ifdef DECENTPY_WITH_CUDA
    c10::DeviceGuard guard(stats.device());
    decentpy::cuda::launch_peer_pair_verdict(st, expand, tau, first, clip, o, cuda_stream_of(stats));
#else
    no_cuda_kernels(stats.device(), "peer_pair_verdict");
#endif
  }
  bump(out);
}

void peer_group_verdict(const at::Tensor& fingerprints, const at::Tensor& recv, double scale, double unit_roundoff,
                        double tau, double first, double expand, const at::Tensor& out) {
  TORCH_CHECK(fingerprints.defined() && fingerprints.dim() == 2 && fingerprints.size(1) >= 3,
              "peer_group_verdict: fingerprints must be [members, slots + 2], got ",
              fingerprints.defined() ? fingerprints.sizes() : at::IntArrayRef{});
  const int64_t m = fingerprints.size(0), k = fingerprints.size(1) - 2;
  TORCH_CHECK(m >= 1 && m <= kVerdictMaxMembers && k <= kSketchMaxSlots, "peer_group_verdict: ", m, " members of ",
              k, " slots; at most ", kVerdictMaxMembers, " members and ", kSketchMaxSlots, " slots");
  const double* fp = verdict_buffer(fingerprints, m * (k + 2), fingerprints, "peer_group_verdict: fingerprints");
  const double* rv = verdict_buffer(recv, k + 2, fingerprints, "peer_group_verdict: recv");
  double* o = verdict_buffer(out, 4 + 2 * m, fingerprints, "peer_group_verdict: out");
  TORCH_CHECK(scale > 0.0 && expand >= 1.0 && first > 0.0 && unit_roundoff > 0.0, "peer_group_verdict: scale, first "
              "and unit_roundoff must be > 0 and expand >= 1");
  if (fingerprints.device().is_cpu()) {
    group_verdict(fp, static_cast<int>(m), static_cast<int>(k), rv, scale, unit_roundoff, tau, first, expand, o);
  } else {
#ifdef DECENTPY_WITH_CUDA
    c10::DeviceGuard guard(fingerprints.device());
    decentpy::cuda::launch_peer_group_verdict(fp, static_cast<int>(m), static_cast<int>(k), rv, scale, unit_roundoff,
                                              tau, first, expand, o, cuda_stream_of(fingerprints));
#else
    no_cuda_kernels(fingerprints.device(), "peer_group_verdict");
#endif
  }
  bump(out);
}

void scale_copy_(const at::Tensor& dst, const at::Tensor& src, double alpha,
                 const c10::optional<at::Tensor>& sumsq) {
  TORCH_CHECK(dst.defined() && src.defined(), "scale_copy_: dst and src must be tensors");
  const DType dt = to_dtype(dst, "scale_copy_: dst");
  check_device_supported(dst, "scale_copy_: dst");
  TORCH_CHECK(dst.is_contiguous(), "scale_copy_: dst (sizes ", dst.sizes(), ", strides ",
              dst.strides(), ") must be contiguous");
  check_like_param(src, dst, "scale_copy_: src", "dst");
  const auto st = at::get_overlap_status(dst, src);
  TORCH_CHECK(st == at::MemOverlapStatus::No ||
                  (st == at::MemOverlapStatus::Full && dst.data_ptr() == src.data_ptr()),
              "scale_copy_: dst must either be src or not overlap it (partial overlap)");
  ScaleCopyArgs a;
  a.dtype = dt;
  a.numel = dst.numel();
  a.dst = dst.data_ptr();
  a.src = src.data_ptr();
  a.alpha = static_cast<float>(alpha);
  if (sumsq.has_value()) {
    const at::Tensor& s = *sumsq;
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() == kNormSlots,
                "scale_copy_: sumsq must be a contiguous float32 tensor of ", kNormSlots, " elements, got ",
                s.scalar_type(), " with ", s.numel(), " elements");
    TORCH_CHECK(s.device() == dst.device(), "scale_copy_: sumsq is on ", s.device(), ", dst on ", dst.device());
    TORCH_CHECK(at::get_overlap_status(s, dst) == at::MemOverlapStatus::No &&
                    at::get_overlap_status(s, src) == at::MemOverlapStatus::No,
                "scale_copy_: sumsq must not overlap dst or src");
    a.sumsq = s.data_ptr<float>();
  } else if (a.numel == 0) {
    return;
  }
  if (dst.device().is_cpu()) {
    scale_copy_cpu(a);
  } else {
#ifdef DECENTPY_WITH_CUDA
    c10::DeviceGuard guard(dst.device());
    decentpy::cuda::launch_scale_copy(a, cuda_stream_of(dst));
#else
    no_cuda_kernels(dst.device(), "scale_copy_");
#endif
  }
  bump(dst);
  if (sumsq.has_value()) bump(*sumsq);
}

}  // namespace decentpy
