// Internal: entry points of the ISA-specific CPU kernel variants (see mix_and_step_cpu.cpp).
#pragma once

#include "kernels/mix_and_step.h"

namespace decentpy {
namespace cpu_detail {
namespace isa_avx2 {
bool compiled();      // this build has the variant (GCC on x86-64)
bool cpu_supports();  // this CPU has its instructions (false where the variant is not compiled)
void mix_and_step_entry(const MixStepArgs& args);
void scale_copy_entry(const ScaleCopyArgs& args);
void outer_pack_entry(const OuterPackArgs& args);
void outer_apply_entry(const OuterApplyArgs& args);
void outer_decode_entry(Compressor c, const void* wire, float* out, int64_t n);
void peer_stats_entry(const PeerStatsArgs& args);
void peer_sketch_entry(const PeerSketchArgs& args);
int vec_width();  // fp32 lanes of at::vec::Vectorized<float> in this variant
}  // namespace isa_avx2
namespace isa_avx512 {
bool compiled();
bool cpu_supports();
void mix_and_step_entry(const MixStepArgs& args);
void scale_copy_entry(const ScaleCopyArgs& args);
void outer_pack_entry(const OuterPackArgs& args);
void outer_apply_entry(const OuterApplyArgs& args);
void outer_decode_entry(Compressor c, const void* wire, float* out, int64_t n);
void peer_stats_entry(const PeerStatsArgs& args);
void peer_sketch_entry(const PeerSketchArgs& args);
int vec_width();
}  // namespace isa_avx512
}  // namespace cpu_detail
}  // namespace decentpy
