// CPU fused mix-and-step, AVX2 build of the shared body (see mix_and_step_cpu_isa_variant.h).
#define DECENTPY_CPU_NS isa_avx2
#include "cpu/mix_and_step_cpu_isa_variant.h"
