// The driver-versus-runtime decision (see cuda_driver.h): plain C++, compiled in every build.
#include "cuda/cuda_driver.h"

#include <string>

namespace decentpy {
namespace cuda {

namespace {

std::string release(int version) {
  return std::to_string(version / 1000) + "." + std::to_string((version % 1000) / 10);
}

}  // namespace

std::string driver_problem(int driver_version, int runtime_version) {
  if (driver_version >= runtime_version && driver_version > 0) return "";
  const std::string built = "this decentpy was built with CUDA " + release(runtime_version) +
                            " (CUDART_VERSION " + std::to_string(runtime_version) +
                            "; its CUDA runtime is linked into decentpy._C)";
  if (driver_version <= 0) {
    return "decentpy: no NVIDIA driver was found (cudaDriverGetVersion reports none), and " + built +
           ": install an NVIDIA driver that supports CUDA " + release(runtime_version) +
           " or newer, or use a CPU build of decentpy (DECENTPY_NO_CUDA=1 make build)";
  }
  std::string msg = "decentpy: the NVIDIA driver supports CUDA " + release(driver_version) + ", but " + built +
                    ": update the NVIDIA driver to one that supports CUDA " + release(runtime_version) +
                    " or newer, or use a decentpy built for CUDA " + release(driver_version) +
                    " or older (build it with that CUDA toolkit: CUDA_HOME=<toolkit> make build; docs/wheels.md)";
  if (driver_version / 1000 == runtime_version / 1000) {
    msg += ". Within CUDA " + std::to_string(driver_version / 1000) +
           " such a driver runs most code (CUDA's minor version compatibility), but not what needs the newer "
           "driver, such as PTX compiled for a GPU this build has no SASS for";
  }
  return msg;
}

}  // namespace cuda
}  // namespace decentpy
