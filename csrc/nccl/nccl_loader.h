// Finding and opening libnccl at run time (dlopen), with no nccl.h: compiled in every build, so
// the message a user gets when no library is usable -- every file tried, why each was refused,
// what to install or set -- is the same code, and testable, with or without NCCL at build time.
// csrc/nccl/nccl_api.cpp binds the entry points of the library opened here.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace decentpy {
namespace nccl {

// The oldest NCCL decentpy uses, as ncclGetVersion encodes it (NCCL_VERSION(2, 14, 0)).
constexpr int kMinNcclVersion = 21400;

// "" when `handle` (from dlopen) is a libnccl decentpy can use, else why not.
using LibraryCheck = std::function<std::string(void* handle)>;

struct OpenedLibrary {
  void* handle = nullptr;
  std::string path;  // the file actually loaded
};

// The libnccl.so.2 already loaded in the process (torch's CUDA build loads one), else the first
// of `candidates` (paths) that loads and passes `check`, else libnccl.so.2 from the dynamic
// loader's search path. The library stays loaded. Throws std::runtime_error naming every attempt
// and what to install or set when none is usable.
OpenedLibrary open_library(const std::vector<std::string>& candidates, const LibraryCheck& check);

// The check of a build without decentpy's communicator: ncclGetVersion exists and reports NCCL
// >= 2.14 (then *version is set). "" or why not.
std::string check_version(void* handle, int* version);

}  // namespace nccl
}  // namespace decentpy
