// Tensor-level launchers of the fused kernels: argument checks, MixStepArgs filling, and dispatch
// to the CPU kernels or (when built with nvcc) the CUDA launchers.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <vector>

#include "kernels/mix_and_step.h"
#include "kernels/sparse.h"

namespace decentpy {

// Raises unless `segments` (a CPU int64 [nseg, 3] table) is sorted, disjoint, covers [0, numel)
// and names groups in [0, num_groups). mix_and_step checks CPU tables itself; a table meant for
// the GPU is checked with this before it is copied there (reading it back would synchronise).
void check_segments(const at::Tensor& segments, int64_t numel, int64_t num_groups);

// One fused pass over a flat bucket (kernels/mix_and_step.h) as tensors: the one list of the pass's
// arguments on the C++ side. Python builds it by name (`_C.StepArgs`, or keyword arguments to
// `_C.mix_and_step`, which sets these fields), so nothing else spells the list out.
//   states: SGD [] or [momentum_buffer]; Adam [exp_avg, exp_avg_sq]; AccumAdam [M, V, acc]; None [].
//   segments: int64 [nseg, 3] rows (begin, end, group), sorted, covering [0, numel); groups: one
//     GroupHyper per parameter group (at most kMaxGroups).
//   grad_norm / scaler_scale: one-element float32 tensors on param's device that the kernel reads
//     itself (the gradient factor and found-inf skip, kernels/update.h grad_factor); grad_scale must
//     then be 1.
//   zero_grad: grad is zeroed in the same pass, after it is read (also with skip_update / kind
//     None, where it is not read); grad is then required and must not overlap any other buffer.
//   compressor != None: a compressed-gossip pass over fp32 param ("Compressed gossip" in
//     kernels/mix_and_step.h): the received q into peer_copy and the mix p += choco_mix *
//     (peer_copy - self_copy_mix), the update, then q = Q(p - self_copy_next) into q_send with
//     self_copy_next += D(q); q_recv / q_send: uint8 wire bytes of compressed_bytes(...). comm and
//     send are then unused.
//   prev_skip / alt_bias_steps: a deferred skip verdict (MixStepArgs): a one-element bool / uint8
//     tensor on param's device; when it is set the groups' bias-correction steps are alt_bias_steps.
//   mix_factor: the peer check's factor on the mix with comm (MixStepArgs): a one-element float32
//     tensor on param's device that the kernel reads itself; only with comm, not with a compressor.
//   mix_guard / mix_guarded: the peer check's element guard (MixStepArgs): mix_guard >= 0 (0: none),
//     mix_guarded an optional one-element int64 tensor on param's device the kernel adds its count to.
struct StepCall {
  OptKind kind = OptKind::None;
  at::Tensor param;
  c10::optional<at::Tensor> grad;
  std::vector<at::Tensor> states;
  c10::optional<at::Tensor> comm;
  c10::optional<at::Tensor> send;
  c10::optional<at::Tensor> segments;
  std::vector<GroupHyper> groups;
  double mix_a = 1.0;
  double mix_b = 0.0;
  double send_scale = 1.0;
  double grad_scale = 1.0;
  c10::optional<at::Tensor> grad_norm;
  c10::optional<at::Tensor> scaler_scale;
  double clip_norm = 0.0;
  bool decoupled_weight_decay = false;
  bool momentum_init = false;
  bool accum_boundary = false;
  bool skip_update = false;
  bool zero_grad = false;
  Compressor compressor = Compressor::None;
  c10::optional<at::Tensor> q_recv;
  c10::optional<at::Tensor> peer_copy;
  c10::optional<at::Tensor> self_copy_mix;
  double choco_mix = 0.0;
  c10::optional<at::Tensor> q_send;
  c10::optional<at::Tensor> self_copy_next;
  c10::optional<at::Tensor> prev_skip;
  std::vector<int64_t> alt_bias_steps;
  c10::optional<at::Tensor> mix_factor;
  double mix_guard = 0.0;
  c10::optional<at::Tensor> mix_guarded;
};

void mix_and_step(const StepCall& call);

// The group reduction of compressed gossip (kernels/mix_and_step.h, GroupReduceArgs) over the
// chunk [lo, hi) of a bucket of self_copy.numel() elements: inputs are the m members' q (wire bytes
// of the whole bucket), r goes into out (the same layout), self_copy (fp32) keeps the rounding.
void compressed_group_reduce(Compressor compressor, const std::vector<at::Tensor>& inputs, const at::Tensor& out,
                             const at::Tensor& self_copy, int64_t lo, int64_t hi);

// The two passes of the fused outer step of local-steps training (kernels/outer_step.h), as tensors.
// outer_pack: the pseudo-gradient theta - param into out (float32, or with a compressor its wire bytes,
// error-fed through excess). outer_apply: the outer optimizer (SGD with momentum / Nesterov, or Adam /
// AdamW: states as mix_and_step's) steps theta (or theta_mix, the mixed global copy) with the
// pseudo-gradient delta; theta and param take the result (param merged with alpha).
void outer_pack(const at::Tensor& param, const at::Tensor& theta, Compressor compressor,
                const c10::optional<at::Tensor>& excess, const at::Tensor& out);
void outer_apply(const at::Tensor& param, const at::Tensor& theta, const c10::optional<at::Tensor>& theta_mix,
                 Compressor compressor, const at::Tensor& delta, OptKind kind, const GroupHyper& hyper,
                 const std::vector<at::Tensor>& states, bool decoupled_weight_decay, bool momentum_init,
                 double alpha);

// out = D(wire): a compressed pseudo-gradient's values (float32, out.numel() elements).
void outer_decode(Compressor compressor, const at::Tensor& wire, const at::Tensor& out);

// SparseLoCo's outer exchange (kernels/sparse.h): the error-fed chunk-wise top-k of theta - param in
// 2 bits into wire (uint8, sparse_wire_bytes), what it sends taken out of error; and out = the mean of
// the members' messages (inputs: their wires, this rank's own included, in the group's order).
void sparse_pack(const at::Tensor& param, const at::Tensor& theta, const at::Tensor& error, const at::Tensor& wire,
                 int64_t chunk, int64_t k, double decay);
void sparse_mean(const std::vector<at::Tensor>& inputs, const at::Tensor& out, int64_t chunk, int64_t k);

// The byte ranges [start, stop) of elements [lo, hi) in the wire of n elements (kernels/compress.h).
std::vector<std::pair<int64_t, int64_t>> compressed_wire_regions(Compressor compressor, int64_t n, int64_t lo,
                                                                 int64_t hi);

// The peer check's passes (kernels/peer_check.h) over flat contiguous fp32 / bf16 / fp16 tensors;
// `out` is a contiguous float64 tensor of (kPeerParts + 1) * width elements on their device (the
// parts' partial sums, then the result: its last `width` elements).
// peer_stats: width kPeerStats, comm optional (like param: dtype, numel, device).
// peer_sketch: width slots + 2, slots in [1, kSketchMaxSlots].
// sample >= 1: read one unit of kSampleUnit elements in every `sample` (kernels/peer_check.h).
void peer_stats(const at::Tensor& param, const c10::optional<at::Tensor>& comm, int64_t sample, const at::Tensor& out);
void peer_sketch(const at::Tensor& src, int64_t seed, int64_t slots, int64_t sample, const at::Tensor& out);
// The verdicts of kernels/peer_check.h on the passes' results (float64 tensors on one device; tau NaN:
// the first bound): pair_verdict into out (5 values), group_verdict of the [m, k + 2] fingerprints and
// the sum's sketch (k + 2 values) into out (4 + 2m values). On a GPU a one-thread kernel: nothing is
// read back.
void peer_pair_verdict(const at::Tensor& stats, double expand, double tau, double first, bool clip,
                       const at::Tensor& out);
void peer_group_verdict(const at::Tensor& fingerprints, const at::Tensor& recv, double scale, double unit_roundoff,
                        double tau, double first, double expand, const at::Tensor& out);

// dst = alpha * src, flat contiguous tensors of the same dtype (fp32/bf16/fp16), numel and device.
// dst = alpha * src; with sumsq (fp32, kNormSlots elements, dst's device) also the partial sums of
// the squares of src (kernels/mix_and_step.h, ScaleCopyArgs).
void scale_copy_(const at::Tensor& dst, const at::Tensor& src, double alpha,
                 const c10::optional<at::Tensor>& sumsq = c10::nullopt);

}  // namespace decentpy
