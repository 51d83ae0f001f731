// Whether the NVIDIA driver can run this extension's CUDA runtime, and the message when it cannot.
//
// Plain C++ header (no CUDA headers): the decision is compiled in every build, so a CPU-only test
// can feed it version pairs; the queries are compiled with CUDA only (csrc/cuda/cuda_driver_query.cu).
// The CUDA runtime is linked into the extension statically, so the driver must support the CUDA
// release of the nvcc that built it, whatever CUDA torch was built with.
#pragma once

#include <string>

namespace decentpy {
namespace cuda {

// Why a driver that supports CUDA `driver_version` cannot be relied on to run code built with the
// CUDA runtime `runtime_version`, or "" when it can. Versions as CUDA encodes them (1000 * major +
// 10 * minor: 12080 is 12.8); a driver_version of 0 means no driver (cudaDriverGetVersion's answer
// then). The one place that words this for users: CUDA errors (cuda_check.h) and the report use it.
std::string driver_problem(int driver_version, int runtime_version);

#ifdef DECENTPY_WITH_CUDA
int driver_version();   // cudaDriverGetVersion: the newest CUDA the installed driver supports, 0 if none
int runtime_version();  // CUDART_VERSION of the runtime linked into this extension
int device_count();     // cudaGetDeviceCount through DECENTPY_CUDA_CHECK: throws driver_problem's message
#endif

}  // namespace cuda
}  // namespace decentpy
