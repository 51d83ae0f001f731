// CPU fused mix-and-step, AVX-512 build of the shared body (see mix_and_step_cpu_isa_variant.h).
#define DECENTPY_CPU_NS isa_avx512
#define DECENTPY_ISA_AVX512 1
#include "cpu/mix_and_step_cpu_isa_variant.h"
