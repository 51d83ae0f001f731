// Error checking for the CUDA sources (host side). Include only from .cu / CUDA-aware sources.
//
// DECENTPY_CUDA_CHECK(expr) turns any cudaError_t other than cudaSuccess into a thrown
// std::runtime_error naming the expression, file, line and cudaGetErrorString; the launchers run
// inside a pybind call, whose binding layer converts the exception into a Python RuntimeError.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace decentpy {
namespace cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* expr, const char* file,
                                          int line) {
  std::string msg = "decentpy CUDA error: ";
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
