// CPU fused mix-and-step: baseline-ISA variant plus the run-time ISA dispatcher.
// The AVX2 / AVX512 variants are the same body (mix_and_step_cpu_impl.h) compiled in
// mix_and_step_cpu_avx2.cpp / mix_and_step_cpu_avx512.cpp under a GCC target pragma, so the
// package needs no per-file compiler flags and never runs AVX code on a CPU without it, even when
// ATEN_CPU_CAPABILITY asks for it (choose_cpu_isa).
#include "cpu/mix_and_step_cpu.h"

#include <ATen/Version.h>

#include <string>

#define DECENTPY_CPU_NS isa_default
#include "cpu/mix_and_step_cpu_impl.h"
#undef DECENTPY_CPU_NS

#include "cpu/mix_and_step_cpu_variants.h"

namespace decentpy {
namespace {

enum class Isa { Default, Avx2, Avx512 };

Isa isa_of(const char* name) {
  const std::string n = name;
  return n == "avx512" ? Isa::Avx512 : n == "avx2" ? Isa::Avx2 : Isa::Default;
}

CpuIsaChoice pick() {
#if defined(__x86_64__) || defined(_M_X64)
  return choose_cpu_isa_here(at::get_cpu_capability(), cpu_detail::isa_avx2::cpu_supports(),
                             cpu_detail::isa_avx512::cpu_supports());
#else
  return {"default", ""};
#endif
}

const CpuIsaChoice& choice() {
  static const CpuIsaChoice chosen = pick();
  return chosen;
}

Isa isa() {
  static const Isa chosen = isa_of(choice().isa);
  return chosen;
}

}  // namespace

CpuIsaChoice choose_cpu_isa(const std::string& torch_capability, bool variants_compiled, bool cpu_avx2,
                            bool cpu_avx512) {
  const bool want512 = torch_capability == "AVX512";
  if (!want512 && torch_capability != "AVX2") return {"default", ""};
  if (variants_compiled && want512 && cpu_avx512) return {"avx512", ""};
  if (variants_compiled && cpu_avx2 && !want512) return {"avx2", ""};
  const char* isa = variants_compiled && cpu_avx2 ? "avx2" : "default";
  std::string why;
  if (!variants_compiled) {
    why = "this build has no AVX2/AVX-512 kernels (GCC on x86-64 compiles them)";
  } else if (want512 && cpu_avx2) {
    why = "this CPU lacks AVX-512 (avx512f, avx512bw, avx512vl, avx512dq)";
  } else {
    why = std::string("this CPU lacks ") + (want512 ? "AVX-512 and " : "") + "AVX2 (avx2, fma)";
  }
  std::string note = "torch's CPU capability is " + torch_capability + ", but " + why +
                     ": decentpy's CPU kernels use " +
                     (std::string(isa) == "avx2" ? "AVX2" : "the baseline instructions");
  if (variants_compiled) {
    note += ". ATEN_CPU_CAPABILITY sets torch's capability without asking the CPU, and torch's own kernels "
            "for " + torch_capability + " may stop the process (SIGILL): unset ATEN_CPU_CAPABILITY";
  }
  return {isa, note};
}

CpuIsaChoice choose_cpu_isa_here(const std::string& torch_capability, bool cpu_avx2, bool cpu_avx512) {
  const bool compiled = cpu_detail::isa_avx2::compiled() && cpu_detail::isa_avx512::compiled();
  return choose_cpu_isa(torch_capability, compiled, cpu_avx2, cpu_avx512);
}

std::string cpu_kernel_isa_note() { return choice().note; }

void mix_and_step_cpu(const MixStepArgs& args) {
  switch (isa()) {
    case Isa::Avx512: return cpu_detail::isa_avx512::mix_and_step_entry(args);
    case Isa::Avx2: return cpu_detail::isa_avx2::mix_and_step_entry(args);
    default: return cpu_detail::isa_default::mix_and_step(args);
  }
}

void scale_copy_cpu(const ScaleCopyArgs& args) {
  switch (isa()) {
    case Isa::Avx512: return cpu_detail::isa_avx512::scale_copy_entry(args);
    case Isa::Avx2: return cpu_detail::isa_avx2::scale_copy_entry(args);
    default: return cpu_detail::isa_default::scale_copy(args);
  }
}

void outer_pack_cpu(const OuterPackArgs& args) {
  switch (isa()) {
    case Isa::Avx512: return cpu_detail::isa_avx512::outer_pack_entry(args);
    case Isa::Avx2: return cpu_detail::isa_avx2::outer_pack_entry(args);
    default: return cpu_detail::isa_default::outer_pack(args);
  }
}

void outer_apply_cpu(const OuterApplyArgs& args) {
  switch (isa()) {
    case Isa::Avx512: return cpu_detail::isa_avx512::outer_apply_entry(args);
    case Isa::Avx2: return cpu_detail::isa_avx2::outer_apply_entry(args);
    default: return cpu_detail::isa_default::outer_apply(args);
  }
}

void outer_decode_cpu(Compressor c, const void* wire, float* out, int64_t n) {
  switch (isa()) {
    case Isa::Avx512: return cpu_detail::isa_avx512::outer_decode_entry(c, wire, out, n);
    case Isa::Avx2: return cpu_detail::isa_avx2::outer_decode_entry(c, wire, out, n);
    default: return cpu_detail::isa_default::outer_decode(c, wire, out, n);
  }
}

void peer_stats_cpu(const PeerStatsArgs& args) {
  switch (isa()) {
    case Isa::Avx512: return cpu_detail::isa_avx512::peer_stats_entry(args);
    case Isa::Avx2: return cpu_detail::isa_avx2::peer_stats_entry(args);
    default: return cpu_detail::isa_default::peer_stats(args);
  }
}

void peer_sketch_cpu(const PeerSketchArgs& args) {
  switch (isa()) {
    case Isa::Avx512: return cpu_detail::isa_avx512::peer_sketch_entry(args);
    case Isa::Avx2: return cpu_detail::isa_avx2::peer_sketch_entry(args);
    default: return cpu_detail::isa_default::peer_sketch(args);
  }
}

int cpu_kernel_vector_width() {
  switch (isa()) {
    case Isa::Avx512: return cpu_detail::isa_avx512::vec_width();
    case Isa::Avx2: return cpu_detail::isa_avx2::vec_width();
    default: return static_cast<int>(cpu_detail::isa_default::Vec::size());
  }
}

const char* cpu_kernel_isa() { return choice().isa; }

}  // namespace decentpy
