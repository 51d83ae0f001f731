// CPU fused mix-and-step, AVX512 variant (GCC on x86-64 only; elsewhere a stub that reports
// itself unavailable). Same body as the baseline variant, see mix_and_step_cpu_impl.h.
#include "cpu/mix_and_step_cpu_variants.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    !defined(DECENTPY_NO_CPU_VARIANTS)
#define DECENTPY_VARIANT_ENABLED 1

// Generic headers first, so their inline functions are compiled for the baseline ISA only.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/complex.h>
#include <c10/util/irange.h>
#include <immintrin.h>  // before the target pragma: its own push/pop_options would reset the ISA macros
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt,avx512f,avx512bw,avx512vl,avx512dq")
// The C++ front end lexes the whole file up front, so the target pragma does not define the
// ISA macros that sleef.h and at::vec test: define them by hand (undefined again below).
#ifndef __AVX__
#define __AVX__ 1
#define DECENTPY_UNDEF__AVX__
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#define DECENTPY_UNDEF__AVX2__
#endif
#ifndef __FMA__
#define __FMA__ 1
#define DECENTPY_UNDEF__FMA__
#endif
#ifndef __F16C__
#define __F16C__ 1
#define DECENTPY_UNDEF__F16C__
#endif
#ifndef __AVX512F__
#define __AVX512F__ 1
#define DECENTPY_UNDEF__AVX512F__
#endif
#ifndef __AVX512BW__
#define __AVX512BW__ 1
#define DECENTPY_UNDEF__AVX512BW__
#endif
#ifndef __AVX512VL__
#define __AVX512VL__ 1
#define DECENTPY_UNDEF__AVX512VL__
#endif
#ifndef __AVX512DQ__
#define __AVX512DQ__ 1
#define DECENTPY_UNDEF__AVX512DQ__
#endif
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#define DECENTPY_CPU_NS isa_avx512
#include "cpu/mix_and_step_cpu_impl.h"

namespace decentpy {
namespace cpu_detail {
namespace isa_avx512 {
void mix_and_step_entry(const MixStepArgs& args) { mix_and_step(args); }
void scale_copy_entry(const ScaleCopyArgs& args) { scale_copy(args); }
int vec_width() { return static_cast<int>(Vec::size()); }
}  // namespace isa_avx512
}  // namespace cpu_detail
}  // namespace decentpy

#pragma GCC pop_options
#ifdef DECENTPY_UNDEF__AVX__
#undef __AVX__
#undef DECENTPY_UNDEF__AVX__
#endif
#ifdef DECENTPY_UNDEF__AVX2__
#undef __AVX2__
#undef DECENTPY_UNDEF__AVX2__
#endif
#ifdef DECENTPY_UNDEF__FMA__
#undef __FMA__
#undef DECENTPY_UNDEF__FMA__
#endif
#ifdef DECENTPY_UNDEF__F16C__
#undef __F16C__
#undef DECENTPY_UNDEF__F16C__
#endif
#ifdef DECENTPY_UNDEF__AVX512F__
#undef __AVX512F__
#undef DECENTPY_UNDEF__AVX512F__
#endif
#ifdef DECENTPY_UNDEF__AVX512BW__
#undef __AVX512BW__
#undef DECENTPY_UNDEF__AVX512BW__
#endif
#ifdef DECENTPY_UNDEF__AVX512VL__
#undef __AVX512VL__
#undef DECENTPY_UNDEF__AVX512VL__
#endif
#ifdef DECENTPY_UNDEF__AVX512DQ__
#undef __AVX512DQ__
#undef DECENTPY_UNDEF__AVX512DQ__
#endif
#endif

namespace decentpy {
namespace cpu_detail {
namespace isa_avx512 {
#if defined(DECENTPY_VARIANT_ENABLED)
bool available() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#else
bool available() { return false; }
void mix_and_step_entry(const MixStepArgs&) {}
void scale_copy_entry(const ScaleCopyArgs&) {}
int vec_width() { return 0; }
#endif
}  // namespace isa_avx512
}  // namespace cpu_detail
}  // namespace decentpy
