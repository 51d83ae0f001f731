// CUDA launchers of SparseLoCo's outer exchange (contract: kernels/sparse.h; csrc/cuda/sparse.cu).
// Plain C++ header (no CUDA, no torch), as mix_and_step_cuda.h: enqueue on `stream` (a cudaStream_t)
// on the current device, check the launch, throw std::invalid_argument / std::runtime_error; no sync.
#pragma once
#include "kernels/sparse.h"
namespace decentpy { namespace cuda {
void launch_sparse_pack(const SparsePackArgs& args, void* stream);
void launch_sparse_mean(const SparseMeanArgs& args, void* stream);
}  // namespace cuda
}  // namespace decentpy
