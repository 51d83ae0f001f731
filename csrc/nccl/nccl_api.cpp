// dlopen/dlsym binding of libnccl (see nccl_api.h). Compiled to nothing without NCCL support.
#include "nccl/nccl_api.h"

#ifdef DECENTPY_HAVE_NCCL_COMM

#include <dlfcn.h>

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
  int v = 0;
  if (a.GetVersion(&v) != ncclSuccess) return "ncclGetVersion failed";
  if (v < NCCL_VERSION(2, 14, 0)) {
    return "NCCL version " + std::to_string(v) + " is too old (>= 2.14 is required)";
  }
  a.version = v;
  return "";
}

std::string loaded_path(void* h, const std::string& fallback) {
  // dladdr of a resolved symbol names the file actually loaded.
  void* sym = dlsym(h, "ncclGetVersion");
  Dl_info info;
  if (sym && dladdr(sym, &info) && info.dli_fname) return info.dli_fname;
  return fallback;
}

// Tries one dlopen; on success (usable library) installs it as g_api. Appends to `log`.
bool try_open(const std::string& name, int flags, const char* how, std::string& log) {
  dlerror();
  void* h = dlopen(name.c_str(), flags);
  if (!h) {
    if (!(flags & RTLD_NOLOAD)) {
      const char* e = dlerror();
      log += "\n  " + std::string(how) + " " + name + ": " + (e ? e : "dlopen failed");
    }
    return false;
  }
  auto* a = new NcclApi();
  const std::string why = resolve(h, *a);
  if (!why.empty()) {
    log += "\n  " + std::string(how) + " " + name + ": " + why;
    delete a;
    dlclose(h);
    return false;
  }
  a->handle = h;
  a->path = loaded_path(h, name);
  g_api = a;
  return true;
}

void load_locked(const std::vector<std::string>& candidates) {
  if (g_api) return;
  std::string log;
  // 1. The libnccl.so.2 already in the process (torch's CUDA build loads one): share it.
  for (const char* n : {"libnccl.so.2", "libnccl.so"}) {
    if (try_open(n, RTLD_NOW | RTLD_NOLOAD, "already loaded", log)) return;
  }
  // 2. The candidates found by the Python side (nvidia-nccl wheel, NCCL_HOME, ...).
  for (const auto& c : candidates) {
    if (!c.empty() && try_open(c, RTLD_NOW | RTLD_LOCAL, "dlopen", log)) return;
  }
  // 3. The dynamic loader's search path.
  for (const char* n : {"libnccl.so.2", "libnccl.so"}) {
    if (try_open(n, RTLD_NOW | RTLD_LOCAL, "dlopen", log)) return;
  }
  throw std::runtime_error(
      "decentpy: cannot load the NCCL library (libnccl.so.2). Install the nvidia-nccl-cu12 / "
      "nvidia-nccl-cu13 wheel (a dependency of CUDA builds of torch), or put libnccl.so.2 on "
      "LD_LIBRARY_PATH. Tried:" + (log.empty() ? std::string(" nothing") : log));
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
