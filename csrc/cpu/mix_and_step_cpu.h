// CPU implementation of the fused mix-and-step kernel and of the scale-copy helper.
// See csrc/kernels/mix_and_step.h for the per-element contract. Raw pointers only (no at::Tensor).
#pragma once

#include "kernels/mix_and_step.h"

namespace decentpy {

// One pass over args.numel elements, vectorized (at::vec) and parallel (at::parallel_for).
// The instruction set (DEFAULT / AVX2 / AVX512) is chosen at run time, following torch's own
// choice (at::native::get_cpu_capability(), i.e. the ATEN_CPU_CAPABILITY environment variable).
void mix_and_step_cpu(const MixStepArgs& args);

// The group reduction of compressed gossip over [args.lo, args.hi) (csrc/cpu/choco_group_cpu.cpp).
void choco_group_reduce_cpu(const GroupReduceArgs& args);

// dst = alpha * src (dst may equal src).
void scale_copy_cpu(const ScaleCopyArgs& args);

// Name of the instruction set the CPU kernels use on this machine: "default", "avx2" or "avx512".
const char* cpu_kernel_isa();

// fp32 lanes per vector of the kernels in use (8 for default and AVX2, 16 for AVX512).
int cpu_kernel_vector_width();

}  // namespace decentpy
