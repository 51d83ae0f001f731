// Error checking for the CUDA sources (host side). Include only from .cu / CUDA-aware sources.
//
// DECENTPY_CUDA_CHECK(expr) turns any cudaError_t other than cudaSuccess into a thrown
// std::runtime_error naming the expression, file, line and cudaGetErrorString; the launchers run
// inside a pybind call, whose binding layer converts the exception into a Python RuntimeError.
// Every CUDA error decentpy raises passes here, the first CUDA call of a process included: an
// error that a driver too old for the linked CUDA runtime causes is explained first
// (cuda_driver.h: the driver's CUDA release, the runtime's, what to do).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/cuda_driver.h"

namespace decentpy {
namespace cuda {

// The errors the runtime returns when the driver is older than it (or absent).
inline bool is_driver_error(cudaError_t err) {
  return err == cudaErrorInsufficientDriver || err == cudaErrorCallRequiresNewerDriver ||
         err == cudaErrorUnsupportedPtxVersion;
}

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* expr, const char* file,
                                          int line) {
  std::string msg;
  int driver = 0;
  // Not checked by DECENTPY_CUDA_CHECK (this is its error path): on failure no explanation is added.
  if (is_driver_error(err) && cudaDriverGetVersion(&driver) == cudaSuccess) {
    msg = driver_problem(driver, CUDART_VERSION);
    if (!msg.empty()) msg += ". ";
  }
  msg += "decentpy CUDA error: ";
  msg += cudaGetErrorName(err);
  msg += " (";
  msg += cudaGetErrorString(err);
  msg += ") at ";
  msg += file;
  msg += ":";
  msg += std::to_string(line);
  msg += " in `";
  msg += expr;
  msg += "`";
  throw std::runtime_error(msg);
}

}  // namespace cuda
}  // namespace decentpy

#define DECENTPY_CUDA_CHECK(expr)                                                   \
  do {                                                                              \
    const cudaError_t decentpy_err__ = (expr);                                      \
    if (decentpy_err__ != cudaSuccess) {                                            \
      ::decentpy::cuda::throw_cuda_error(decentpy_err__, #expr, __FILE__, __LINE__); \
    }                                                                               \
  } while (0)

// After a <<<...>>> launch: configuration errors (and sticky errors of earlier work) surface here.
#define DECENTPY_CUDA_CHECK_LAUNCH() DECENTPY_CUDA_CHECK(cudaGetLastError())
