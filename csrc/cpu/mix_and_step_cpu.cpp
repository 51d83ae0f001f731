// CPU fused mix-and-step: baseline-ISA variant plus the run-time ISA dispatcher.
// The AVX2 / AVX512 variants are the same body (mix_and_step_cpu_impl.h) compiled in
// mix_and_step_cpu_avx2.cpp / mix_and_step_cpu_avx512.cpp under a GCC target pragma, so the
// package needs no per-file compiler flags and never runs AVX code on a CPU without it.
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

Isa pick_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  // Follow torch's own choice ("DEFAULT", "AVX2", "AVX512"; honours ATEN_CPU_CAPABILITY), and
  // check the CPU ourselves as well.
  const std::string cap = at::get_cpu_capability();
  if (cap == "AVX512" && cpu_detail::isa_avx512::available()) return Isa::Avx512;
  if ((cap == "AVX512" || cap == "AVX2") && cpu_detail::isa_avx2::available()) return Isa::Avx2;
#endif
  return Isa::Default;
}

Isa isa() {
  static const Isa chosen = pick_isa();
  return chosen;
}

}  // namespace

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

int cpu_kernel_vector_width() {
  switch (isa()) {
    case Isa::Avx512: return cpu_detail::isa_avx512::vec_width();
    case Isa::Avx2: return cpu_detail::isa_avx2::vec_width();
    default: return static_cast<int>(cpu_detail::isa_default::Vec::size());
  }
}

const char* cpu_kernel_isa() {
  switch (isa()) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "default";
  }
}

}  // namespace decentpy
