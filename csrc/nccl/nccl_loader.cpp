// dlopen of libnccl (see nccl_loader.h): no NCCL or CUDA headers.
#include "nccl/nccl_loader.h"

#include <dlfcn.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace decentpy {
namespace nccl {
namespace {

std::string loaded_path(void* h, const std::string& fallback) {
  // dladdr of a resolved symbol names the file actually loaded.
  void* sym = dlsym(h, "ncclGetVersion");
  Dl_info info;
  if (sym && dladdr(sym, &info) && info.dli_fname) return info.dli_fname;
  return fallback;
}

// One dlopen; the usable library, or a null handle with the attempt appended to `log`.
OpenedLibrary try_open(const std::string& name, int flags, const char* how, const LibraryCheck& check,
                       std::string& log) {
  dlerror();
  void* h = dlopen(name.c_str(), flags);
  if (!h) {
    if (!(flags & RTLD_NOLOAD)) {
      const char* e = dlerror();
      log += "\n  " + std::string(how) + " " + name + ": " + (e ? e : "dlopen failed");
    }
    return {};
  }
  const std::string why = check(h);
  if (!why.empty()) {
    log += "\n  " + std::string(how) + " " + name + ": " + why;
    dlclose(h);
    return {};
  }
  return {h, loaded_path(h, name)};
}

}  // namespace

std::string check_version(void* handle, int* version) {
  using GetVersion = int (*)(int*);  // ncclResult_t ncclGetVersion(int*): ncclSuccess is 0
  auto get = reinterpret_cast<GetVersion>(dlsym(handle, "ncclGetVersion"));
  if (!get) return "no ncclGetVersion in it: not an NCCL library";
  int v = 0;
  if (get(&v) != 0) return "ncclGetVersion failed";
  if (v < kMinNcclVersion) {
    return "NCCL version " + std::to_string(v) + " is too old (>= 2.14 is required)";
  }
  *version = v;
  return "";
}

OpenedLibrary open_library(const std::vector<std::string>& candidates, const LibraryCheck& check) {
  std::string log;
  // 1. The libnccl.so.2 already in the process (torch's CUDA build loads one): share it.
  for (const char* n : {"libnccl.so.2", "libnccl.so"}) {
    OpenedLibrary lib = try_open(n, RTLD_NOW | RTLD_NOLOAD, "already loaded", check, log);
    if (lib.handle) return lib;
  }
  log += "\n  already loaded in this process: none";
  // 2. The candidates found by the Python side (DECENTPY_NCCL_LIBRARY, NCCL_HOME, the wheel, ...).
  for (const auto& c : candidates) {
    if (c.empty()) continue;
    OpenedLibrary lib = try_open(c, RTLD_NOW | RTLD_LOCAL, "dlopen", check, log);
    if (lib.handle) return lib;
  }
  // 3. The dynamic loader's search path.
  for (const char* n : {"libnccl.so.2", "libnccl.so"}) {
    OpenedLibrary lib = try_open(n, RTLD_NOW | RTLD_LOCAL, "dlopen", check, log);
    if (lib.handle) return lib;
  }
  throw std::runtime_error(
      "decentpy: cannot load the NCCL library (libnccl.so.2, NCCL >= 2.14) that decentpy's NCCL "
      "communicator (comm='nccl') runs on. Install the nvidia-nccl-cu13 / nvidia-nccl-cu12 wheel (a "
      "dependency of CUDA builds of torch), or set DECENTPY_NCCL_LIBRARY to the path of a libnccl.so.2, "
      "or NCCL_HOME to the NCCL installation whose lib/ holds it, or put its directory on "
      "LD_LIBRARY_PATH; or use comm='torch' (torch.distributed). Tried:" + log);
}

}  // namespace nccl
}  // namespace decentpy
