// Run-time bound NCCL API (internal to csrc/nccl; includes nccl.h and so cuda_runtime.h).
//
// The extension never links libnccl: nccl.h is needed at build time only, for the types and
// constants. The library is dlopen'ed on first use and the few entry points decentpy calls are
// resolved with dlsym into the table below. Include only from sources compiled when
// DECENTPY_HAVE_NCCL_COMM is defined.
#pragma once

#include "nccl/nccl_communicator.h"

#ifdef DECENTPY_HAVE_NCCL_COMM

#include <nccl.h>

#include <string>
#include <vector>

#ifndef NCCL_VERSION
#define NCCL_VERSION(X, Y, Z) \
  (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) : (X) * 10000 + (Y) * 100 + (Z))
#endif

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "decentpy needs nccl.h from NCCL >= 2.14 (ncclConfig_t, non-blocking communicators)"
#endif

namespace decentpy {
namespace nccl {

struct NcclApi {
  void* handle = nullptr;
  std::string path;
  int version = 0;

  ncclResult_t (*GetVersion)(int*) = nullptr;
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*) = nullptr;
  ncclResult_t (*CommSplit)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*) = nullptr;  // >= 2.18
  ncclResult_t (*CommFinalize)(ncclComm_t) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*CommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*CommCount)(const ncclComm_t, int*) = nullptr;
  ncclResult_t (*CommUserRank)(const ncclComm_t, int*) = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  const char* (*GetLastError)(ncclComm_t) = nullptr;  // optional (>= 2.13)
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t) = nullptr;
};

// The loaded API (loads with no extra candidates on first use). Throws std::runtime_error.
const NcclApi& api();

// "ncclInvalidUsage (invalid usage): <last error>" for messages.
std::string describe_result(ncclResult_t r, ncclComm_t comm);

}  // namespace nccl
}  // namespace decentpy

#endif  // DECENTPY_HAVE_NCCL_COMM
