// Queries of the installed driver and of the linked CUDA runtime (see cuda_driver.h).
#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/cuda_driver.h"

namespace decentpy {
namespace cuda {

int driver_version() {
  int v = 0;
  DECENTPY_CUDA_CHECK(cudaDriverGetVersion(&v));
  return v;
}

int runtime_version() { return CUDART_VERSION; }

int device_count() {
  int n = 0;
  DECENTPY_CUDA_CHECK(cudaGetDeviceCount(&n));
  return n;
}

}  // namespace cuda
}  // namespace decentpy
