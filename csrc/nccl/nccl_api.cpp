// The entry points of the libnccl that nccl_loader.cpp opens (see nccl_api.h). Compiled to nothing
// without NCCL support.
#include "nccl/nccl_api.h"
#include "nccl/nccl_loader.h"

#ifdef DECENTPY_HAVE_NCCL_COMM

#include <dlfcn.h>

#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace decentpy {
namespace nccl {
namespace {

std::mutex g_mu;
NcclApi* g_api = nullptr;  // never freed: the library stays loaded for the process lifetime

const char* result_name(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "ncclResult";
  }
}

template <typename F>
bool bind(void* h, const char* name, F& fn, bool required, std::string& missing) {
  void* p = dlsym(h, name);
  if (!p) {
    if (required) missing += std::string(missing.empty() ? "" : ", ") + name;
    return false;
  }
  fn = reinterpret_cast<F>(p);
  return true;
}

// Fills `a` from handle `h`; returns "" or why the library is unusable.
std::string resolve(void* h, NcclApi& a) {
  std::string missing;
  bind(h, "ncclGetVersion", a.GetVersion, true, missing);
  bind(h, "ncclGetUniqueId", a.GetUniqueId, true, missing);
  bind(h, "ncclCommInitRankConfig", a.CommInitRankConfig, true, missing);
  bind(h, "ncclCommSplit", a.CommSplit, false, missing);
  bind(h, "ncclCommFinalize", a.CommFinalize, false, missing);
  bind(h, "ncclCommDestroy", a.CommDestroy, true, missing);
  bind(h, "ncclCommAbort", a.CommAbort, true, missing);
  bind(h, "ncclCommGetAsyncError", a.CommGetAsyncError, true, missing);
  bind(h, "ncclCommCount", a.CommCount, true, missing);
  bind(h, "ncclCommUserRank", a.CommUserRank, true, missing);
  bind(h, "ncclGetErrorString", a.GetErrorString, true, missing);
  bind(h, "ncclGetLastError", a.GetLastError, false, missing);
  bind(h, "ncclGroupStart", a.GroupStart, true, missing);
  bind(h, "ncclGroupEnd", a.GroupEnd, true, missing);
  bind(h, "ncclSend", a.Send, true, missing);
  bind(h, "ncclRecv", a.Recv, true, missing);
  bind(h, "ncclAllReduce", a.AllReduce, true, missing);
  if (!missing.empty()) return "missing symbol(s) " + missing + " (NCCL >= 2.14 is required)";
  return check_version(h, &a.version);
}

void load_locked(const std::vector<std::string>& candidates) {
  if (g_api) return;
  auto a = std::make_unique<NcclApi>();
  // The check binds the entry points: after a success `a` holds those of the library returned.
  OpenedLibrary lib = open_library(candidates, [&a](void* h) {
    *a = NcclApi();
    return resolve(h, *a);
  });
  a->handle = lib.handle;
  a->path = lib.path;
  g_api = a.release();
}

}  // namespace

void load_library(const std::vector<std::string>& candidates) {
  std::lock_guard<std::mutex> lk(g_mu);
  load_locked(candidates);
}

bool library_loaded() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_api != nullptr;
}

std::string library_path() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_api ? g_api->path : std::string();
}

int library_version() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_api ? g_api->version : 0;
}

int header_version() { return NCCL_VERSION_CODE; }

const NcclApi& api() {
  std::lock_guard<std::mutex> lk(g_mu);
  load_locked({});
  return *g_api;
}

std::string describe_result(ncclResult_t r, ncclComm_t comm) {
  const NcclApi& a = api();
  std::string s = result_name(r);
  s += " (";
  s += a.GetErrorString ? a.GetErrorString(r) : "?";
  s += ")";
  if (r != ncclSuccess && r != ncclInProgress && a.GetLastError) {
    const char* last = a.GetLastError(comm);
    if (last && *last) {
      s += ": ";
      s += last;
    }
  }
  return s;
}

std::string get_unique_id() {
  const NcclApi& a = api();
  ncclUniqueId id;
  const ncclResult_t r = a.GetUniqueId(&id);
  if (r != ncclSuccess) {
    throw std::runtime_error("decentpy: ncclGetUniqueId failed: " + describe_result(r, nullptr));
  }
  return std::string(id.internal, sizeof(id.internal));
}

}  // namespace nccl
}  // namespace decentpy

#endif  // DECENTPY_HAVE_NCCL_COMM
