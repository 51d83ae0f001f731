// CUDA launchers of the fused mix-and-step and scale-copy kernels (contract: kernels/mix_and_step.h).
//
// Plain C++ header: no CUDA and no torch headers, so the torch binding (a CppExtension compiled by
// g++) can include it. The implementations live in csrc/cuda/*.cu (nvcc, linked with cudart).
//
// Both launchers enqueue on `stream` (a cudaStream_t; nullptr is the legacy default stream) on the
// CURRENT CUDA device: the caller sets the device of the tensors first (c10::DeviceGuard). They
// check the launch with cudaGetLastError() and throw std::runtime_error (CUDA errors) or
// std::invalid_argument (bad arguments). They do not synchronize.
#pragma once
#include "kernels/mix_and_step.h"
namespace decentpy { namespace cuda {
void launch_mix_and_step(const MixStepArgs& args, void* stream);   // stream is a cudaStream_t
// Compressed gossip (args.compressor != None; csrc/cuda/choco.cu).
void launch_choco_mix_and_step(const MixStepArgs& args, void* stream);
// The group reduction of compressed gossip (csrc/cuda/choco.cu).
void launch_choco_group_reduce(const GroupReduceArgs& args, void* stream);
// The two passes of the fused outer step (csrc/cuda/outer_step.cu).
void launch_outer_pack(const OuterPackArgs& args, void* stream);
void launch_outer_apply(const OuterApplyArgs& args, void* stream);
void launch_outer_decode(Compressor c, const void* wire, float* out, int64_t n, void* stream);
void launch_scale_copy(const ScaleCopyArgs& args, void* stream);
// The peer check's two passes (kernels/peer_check.h; csrc/cuda/peer_check.cu).
void launch_peer_stats(const PeerStatsArgs& args, void* stream);
void launch_peer_sketch(const PeerSketchArgs& args, void* stream);
// The verdicts of kernels/peer_check.h as one-thread kernels (device pointers; nothing read back).
void launch_peer_pair_verdict(const double* stats, double expand, double tau, double first, bool clip, double* out,
                              void* stream);
void launch_peer_group_verdict(const double* fingerprints, int members, int slots, const double* recv, double scale,
                               double unit_roundoff, double tau, double first, double expand, double* out,
                               void* stream);
const char* compiled_archs();   // e.g. "sm_80,sm_90,compute_90", from __CUDA_ARCH_LIST__ or a macro set at compile time
} }
