// Tensor-level launchers of the fused kernels: argument checks, MixStepArgs filling, and dispatch
// to the CPU kernels or (when built with nvcc) the CUDA launchers.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <vector>

#include "kernels/mix_and_step.h"

namespace decentpy {

// Raises unless `segments` (a CPU int64 [nseg, 3] table) is sorted, disjoint, covers [0, numel)
// and names groups in [0, num_groups). mix_and_step checks CPU tables itself; a table meant for
// the GPU is checked with this before it is copied there (reading it back would synchronise).
void check_segments(const at::Tensor& segments, int64_t numel, int64_t num_groups);

// One fused mix-and-step pass over a flat bucket (see kernels/mix_and_step.h).
// states: SGD [] or [momentum_buffer]; Adam [exp_avg, exp_avg_sq]; AccumAdam [M, V, acc]; None [].
// segments: int64 [nseg, 3] rows (begin, end, group), sorted, covering [0, numel); groups: one
// GroupHyper per parameter group (at most kMaxGroups).
// grad_norm / scaler_scale: optional one-element float32 tensors on param's device that the
// kernel reads itself (the gradient factor and found-inf skip, see kernels/update.h grad_factor);
// grad_scale must then be 1.
// zero_grad: grad is zeroed in the same pass, right after it is read (also with skip_update /
// kind None, where it is not read); grad is then required and must not overlap any other buffer.
// prev_skip / alt_bias_steps: a deferred skip verdict (MixStepArgs): a one-element bool / uint8
// tensor on param's device; when it is set the groups' bias-correction steps are alt_bias_steps.
void mix_and_step(OptKind kind, const at::Tensor& param, const c10::optional<at::Tensor>& grad,
                  const std::vector<at::Tensor>& states, const c10::optional<at::Tensor>& comm,
                  const c10::optional<at::Tensor>& send, const c10::optional<at::Tensor>& segments,
                  const std::vector<GroupHyper>& groups, double mix_a, double mix_b,
                  double send_scale, double grad_scale, const c10::optional<at::Tensor>& grad_norm,
                  const c10::optional<at::Tensor>& scaler_scale, double clip_norm,
                  bool decoupled_weight_decay, bool momentum_init, bool accum_boundary,
                  bool skip_update, bool zero_grad, const c10::optional<at::Tensor>& prev_skip = c10::nullopt,
                  const std::vector<int64_t>& alt_bias_steps = {});

// One fused compressed-gossip pass over a flat fp32 bucket (kernels/mix_and_step.h, "Compressed
// gossip"): the received q into peer_copy and the mix p += choco_mix * (peer_copy - self_copy_mix),
// the optimizer update (arguments as mix_and_step), then the next q = Q(p - self_copy_next) into
// q_send with self_copy_next += D(q). q_recv / q_send: uint8 wire bytes of compressed_bytes(...)
// (None: nothing received / nothing to send).
void compressed_mix_and_step(OptKind kind, Compressor compressor, const at::Tensor& param,
                             const c10::optional<at::Tensor>& grad, const std::vector<at::Tensor>& states,
                             const c10::optional<at::Tensor>& segments, const std::vector<GroupHyper>& groups,
                             const c10::optional<at::Tensor>& q_recv, const c10::optional<at::Tensor>& peer_copy,
                             const c10::optional<at::Tensor>& self_copy_mix, double choco_mix,
                             const c10::optional<at::Tensor>& q_send,
                             const c10::optional<at::Tensor>& self_copy_next, double grad_scale,
                             const c10::optional<at::Tensor>& grad_norm,
                             const c10::optional<at::Tensor>& scaler_scale, double clip_norm,
                             bool decoupled_weight_decay, bool momentum_init, bool accum_boundary,
                             bool skip_update, bool zero_grad);

// The group reduction of compressed gossip (kernels/mix_and_step.h, GroupReduceArgs) over the
// chunk [lo, hi) of a bucket of self_copy.numel() elements: inputs are the m members' q (wire bytes
// of the whole bucket), r goes into out (the same layout), self_copy (fp32) keeps the rounding.
void compressed_group_reduce(Compressor compressor, const std::vector<at::Tensor>& inputs, const at::Tensor& out,
                             const at::Tensor& self_copy, int64_t lo, int64_t hi);

// The byte ranges [start, stop) of elements [lo, hi) in the wire of n elements (kernels/compress.h).
std::vector<std::pair<int64_t, int64_t>> compressed_wire_regions(Compressor compressor, int64_t n, int64_t lo,
                                                                 int64_t hi);

// dst = alpha * src, flat contiguous tensors of the same dtype (fp32/bf16/fp16), numel and device.
// dst = alpha * src; with sumsq (fp32, kNormSlots elements, dst's device) also the partial sums of
// the squares of src (kernels/mix_and_step.h, ScaleCopyArgs).
void scale_copy_(const at::Tensor& dst, const at::Tensor& src, double alpha,
                 const c10::optional<at::Tensor>& sumsq = c10::nullopt);

}  // namespace decentpy
