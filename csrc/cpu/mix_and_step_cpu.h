// CPU implementation of the fused mix-and-step kernel and of the scale-copy helper.
// See csrc/kernels/mix_and_step.h for the per-element contract. Raw pointers only (no at::Tensor).
#pragma once

#include <string>

#include "kernels/mix_and_step.h"

namespace decentpy {

// One pass over args.numel elements, vectorized (at::vec) and parallel (at::parallel_for).
// The instruction set (DEFAULT / AVX2 / AVX512) is chosen at run time, following torch's own
// choice (at::native::get_cpu_capability(), i.e. the ATEN_CPU_CAPABILITY environment variable)
// within what this CPU has (choose_cpu_isa below).
void mix_and_step_cpu(const MixStepArgs& args);

// The group reduction of compressed gossip over [args.lo, args.hi) (csrc/cpu/choco_group_cpu.cpp).
void choco_group_reduce_cpu(const GroupReduceArgs& args);

// The two passes of the fused outer step (kernels/outer_step.h; csrc/cpu/outer_step_cpu_impl.h, per ISA).
void outer_pack_cpu(const OuterPackArgs& args);
void outer_apply_cpu(const OuterApplyArgs& args);
// out = D(wire) for a wire of n elements (the values the apply reads).
void outer_decode_cpu(Compressor c, const void* wire, float* out, int64_t n);

// dst = alpha * src (dst may equal src).
void scale_copy_cpu(const ScaleCopyArgs& args);

// The peer check's two passes (kernels/peer_check.h; csrc/cpu/peer_check_cpu_impl.h, per ISA).
void peer_stats_cpu(const PeerStatsArgs& args);
void peer_sketch_cpu(const PeerSketchArgs& args);

// Name of the instruction set the CPU kernels use on this machine: "default", "avx2" or "avx512".
const char* cpu_kernel_isa();

// Why cpu_kernel_isa() is not the instruction set torch chose (at::get_cpu_capability(), which
// ATEN_CPU_CAPABILITY sets without asking the CPU), or "" when it is.
std::string cpu_kernel_isa_note();

// The one rule of the run-time pick: torch's choice `torch_capability` ("DEFAULT", "AVX2",
// "AVX512") where this build has kernels for it and the CPU has the instructions, else the best
// lower one that both have. A CPU without AVX-512 never runs the AVX-512 kernels, whatever torch
// was told. `note` is "" when the pick is torch's choice, else why not.
struct CpuIsaChoice {
  const char* isa;  // "default", "avx2" or "avx512"
  std::string note;
};
CpuIsaChoice choose_cpu_isa(const std::string& torch_capability, bool variants_compiled, bool cpu_avx2,
                            bool cpu_avx512);

// The same pick, for what this build compiled and this CPU has (for tests and the report, which
// feed other CPUs to it).
CpuIsaChoice choose_cpu_isa_here(const std::string& torch_capability, bool cpu_avx2, bool cpu_avx512);

// fp32 lanes per vector of the kernels in use (8 for default and AVX2, 16 for AVX512).
int cpu_kernel_vector_width();

}  // namespace decentpy
