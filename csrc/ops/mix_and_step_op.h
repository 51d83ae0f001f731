// Tensor-level launchers of the fused kernels: argument checks, MixStepArgs filling, and dispatch
// to the CPU kernels or (when built with nvcc) the CUDA launchers.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <vector>

namespace decentpy {

// Number of values in one row of `hyper`: the GroupHyper fields in declaration order
// [lr, weight_decay, momentum, dampening, nesterov, beta1, beta2, eps, bias_correction1,
//  bias_correction2_sqrt, accum_scale].
constexpr int kHyperFields = 11;

// Raises unless `segments` (a CPU int64 [nseg, 3] table) is sorted, disjoint, covers [0, numel)
// and names groups in [0, num_groups). mix_and_step checks CPU tables itself; a table meant for
// the GPU is checked with this before it is copied there (reading it back would synchronise).
void check_segments(const at::Tensor& segments, int64_t numel, int64_t num_groups);

// One fused mix-and-step pass over a flat bucket (see kernels/mix_and_step.h).
// kind: OptKind as int (0 None, 1 SGD, 2 Adam, 3 AccumAdam).
// states: SGD [] or [momentum_buffer]; Adam [exp_avg, exp_avg_sq]; AccumAdam [M, V, acc]; None [].
// segments: int64 [nseg, 3] rows (begin, end, group), sorted, covering [0, numel).
// zero_grad: grad is zeroed in the same pass, right after it is read (also with skip_update /
// kind None, where it is not read); grad is then required and must not overlap any other buffer.
void mix_and_step(int64_t kind, const at::Tensor& param, const c10::optional<at::Tensor>& grad,
                  const std::vector<at::Tensor>& states, const c10::optional<at::Tensor>& comm,
                  const c10::optional<at::Tensor>& send, const at::Tensor& segments,
                  const std::vector<std::vector<double>>& hyper, double mix_a, double mix_b,
                  double send_scale, double grad_scale, bool decoupled_weight_decay,
                  bool momentum_init, bool accum_boundary, bool skip_update,
                  bool zero_grad = false);

// dst = alpha * src, flat contiguous tensors of the same dtype (fp32/bf16/fp16), numel and device.
void scale_copy_(const at::Tensor& dst, const at::Tensor& src, double alpha);

}  // namespace decentpy
