// One ISA-specific build of the CPU kernels: included once by each variant translation unit
// (mix_and_step_cpu_avx2.cpp, mix_and_step_cpu_avx512.cpp) after it defines DECENTPY_CPU_NS and,
// for the AVX-512 build, DECENTPY_ISA_AVX512. Compiles the shared body
// (mix_and_step_cpu_impl.h) under a GCC target pragma, on GCC/x86-64 only; elsewhere the variant
// is a stub that reports itself unavailable. Not a normal header: no include guard on purpose.
#include "cpu/mix_and_step_cpu_variants.h"

#ifndef DECENTPY_CPU_NS
#error "define DECENTPY_CPU_NS (the variant's namespace) before including this file"
#endif

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

#include "kernels/mix_and_step.h"  // types only; kernels/update.h is included below, per ISA
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>

#pragma GCC push_options
#if defined(DECENTPY_ISA_AVX512)
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt,avx512f,avx512bw,avx512vl,avx512dq")
#else
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif

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
#if defined(DECENTPY_ISA_AVX512)
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
#else
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif

#include "cpu/mix_and_step_cpu_impl.h"

namespace decentpy {
namespace cpu_detail {
namespace DECENTPY_CPU_NS {
void mix_and_step_entry(const MixStepArgs& args) { mix_and_step(args); }
void scale_copy_entry(const ScaleCopyArgs& args) { scale_copy(args); }
void outer_pack_entry(const OuterPackArgs& args) { outer_pack(args); }
void outer_apply_entry(const OuterApplyArgs& args) { outer_apply(args); }
void outer_decode_entry(Compressor c, const void* wire, float* out, int64_t n) { outer_decode(c, wire, out, n); }
void peer_stats_entry(const PeerStatsArgs& args) { peer_stats(args); }
void peer_sketch_entry(const PeerSketchArgs& args) { peer_sketch(args); }
int vec_width() { return static_cast<int>(Vec::size()); }
}  // namespace DECENTPY_CPU_NS
}  // namespace cpu_detail
}  // namespace decentpy

#pragma GCC pop_options
#ifdef DECENTPY_UNDEF__AVX__
#undef __AVX__
#endif
#ifdef DECENTPY_UNDEF__AVX2__
#undef __AVX2__
#endif
#ifdef DECENTPY_UNDEF__FMA__
#undef __FMA__
#endif
#ifdef DECENTPY_UNDEF__F16C__
#undef __F16C__
#endif
#ifdef DECENTPY_UNDEF__AVX512F__
#undef __AVX512F__
#endif
#ifdef DECENTPY_UNDEF__AVX512BW__
#undef __AVX512BW__
#endif
#ifdef DECENTPY_UNDEF__AVX512VL__
#undef __AVX512VL__
#endif
#ifdef DECENTPY_UNDEF__AVX512DQ__
#undef __AVX512DQ__
#endif
#endif  // GCC on x86-64

namespace decentpy {
namespace cpu_detail {
namespace DECENTPY_CPU_NS {
#if defined(DECENTPY_VARIANT_ENABLED)
bool compiled() { return true; }
bool cpu_supports() {
  __builtin_cpu_init();
  bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#if defined(DECENTPY_ISA_AVX512)
  ok = ok && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
  return ok;
}
#else
bool compiled() { return false; }
bool cpu_supports() { return false; }
void mix_and_step_entry(const MixStepArgs&) {}
void scale_copy_entry(const ScaleCopyArgs&) {}
void outer_pack_entry(const OuterPackArgs&) {}
void outer_apply_entry(const OuterApplyArgs&) {}
void outer_decode_entry(Compressor, const void*, float*, int64_t) {}
void peer_stats_entry(const PeerStatsArgs&) {}
void peer_sketch_entry(const PeerSketchArgs&) {}
int vec_width() { return 0; }
#endif
}  // namespace DECENTPY_CPU_NS
}  // namespace cpu_detail
}  // namespace decentpy
