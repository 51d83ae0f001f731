// decentpy's own NCCL communicator (torch-, CUDA- and NCCL-header free interface).
//
// Built only when both DECENTPY_WITH_CUDA (nvcc found: the static CUDA runtime is linked) and
// DECENTPY_WITH_NCCL (nccl.h found at build time) are defined; then DECENTPY_HAVE_NCCL_COMM is
// defined below. libnccl is never linked: it is dlopen'ed at run time (the copy torch already
// loaded when there is one, else the nvidia-nccl wheel's, else the system's), so the extension
// imports on machines without NCCL or without a GPU.
//
// Streams are passed as opaque handles (cudaStream_t as void*): the binding layer gets them from
// torch's device guard, the implementation (nccl_communicator.cpp) owns all CUDA/NCCL calls.
//
// Semantics, per operation (exchange, all_reduce):
//   * it runs on the communicator's own (high-priority, non-blocking) stream, ordered after the
//     work already queued on the caller's compute stream (an event recorded there);
//   * it returns an NcclWork; NcclWork::wait(stream) makes `stream` wait for the operation
//     (cudaStreamWaitEvent: no host synchronisation), NcclWork::synchronize blocks the host up to
//     a timeout;
//   * every operation has a deadline (launch + the communicator's timeout, shortened by a wait's
//     own timeout). A watchdog thread polls completion events and ncclCommGetAsyncError; past a
//     deadline, or on an asynchronous NCCL error, it calls ncclCommAbort (the stuck kernels exit,
//     so the compute stream never blocks forever) and records an error that names the peer(s)
//     and the operation's label. Every later call on the communicator or its works throws it.
//   * communicators are non-blocking NCCL communicators by default, so initialisation, the first
//     (connection-establishing) send/recv and ncclCommSplit are bounded by the timeout as well.
#pragma once

#if defined(DECENTPY_WITH_CUDA) && defined(DECENTPY_WITH_NCCL)
#define DECENTPY_HAVE_NCCL_COMM 1
#endif

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

// The classes are internal to decentpy._C (bound by pybind11, whose types are hidden).
#if defined(__GNUC__)
#define DECENTPY_NCCL_HIDDEN __attribute__((visibility("hidden")))
#else
#define DECENTPY_NCCL_HIDDEN
#endif

namespace decentpy {
namespace nccl {

// Element types (mapped to ncclDataType_t by the implementation).
enum class DataType : int { Float32 = 0, Float16 = 1, BFloat16 = 2, Float64 = 3, Int32 = 4,
                            Int64 = 5, Int8 = 6, UInt8 = 7 };

// A communicator failed: an operation timed out (a peer may have died), NCCL reported an
// asynchronous error, or the communicator was aborted. The message names the rank, the peer(s)
// and the operation's label. (Bound to Python as decentpy._C.NcclCommError.)
class DECENTPY_NCCL_HIDDEN NcclCommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

#ifdef DECENTPY_HAVE_NCCL_COMM

// Library loading. `candidates` are tried (in order) after the libnccl.so.2 already loaded in the
// process (RTLD_NOLOAD) and before a plain dlopen("libnccl.so.2"). Idempotent: the first success
// wins. Throws std::runtime_error listing every attempt when none works.
void load_library(const std::vector<std::string>& candidates);
bool library_loaded();
std::string library_path();      // "" before load_library
int library_version();           // e.g. 23203 (runtime version, ncclGetVersion)
int header_version();            // NCCL_VERSION_CODE of the nccl.h compiled against

// ncclGetUniqueId (loads the library with no extra candidates if needed): 128 bytes.
std::string get_unique_id();

struct CommState;
struct WorkState;

class DECENTPY_NCCL_HIDDEN NcclWork {
 public:
  explicit NcclWork(std::shared_ptr<WorkState> st);
  ~NcclWork();
  // Orders `stream` (a cudaStream_t; nullptr = legacy default stream) after the operation; host
  // non-blocking. Shortens the operation's deadline to now + timeout_ms (timeout_ms <= 0: keep).
  // Throws the communicator's error if it has failed (timeout, async error, abort).
  void wait(void* stream, int64_t timeout_ms);
  // Host wait up to timeout_ms (<= 0: the communicator's timeout). On timeout: aborts the
  // communicator and throws an error naming the peer(s) and the label.
  void synchronize(int64_t timeout_ms);
  // Non-blocking completion test; throws the communicator's error if it has failed.
  bool is_completed();
  const std::string& label() const;
  std::vector<int64_t> peers() const;  // global ranks (see NcclCommunicator::set_global_ranks)
  int device() const;                  // the communicator's CUDA device

 private:
  std::shared_ptr<WorkState> st_;
};

class DECENTPY_NCCL_HIDDEN NcclCommunicator {
 public:
  // Collective over the nranks processes sharing `unique_id` (128 bytes from get_unique_id).
  // timeout_ms bounds initialisation and is every operation's default deadline. blocking: use a
  // blocking NCCL communicator (initialisation and the first send/recv to a peer can then block
  // the host without bound; operations still get the watchdog).
  NcclCommunicator(const std::string& unique_id, int rank, int nranks, int device,
                   int64_t timeout_ms, bool blocking = false, const std::string& name = "world");
  ~NcclCommunicator();  // ncclCommFinalize + ncclCommDestroy (bounded), or abort if unhealthy
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // Grouped ncclSend(send -> peer) + ncclRecv(recv <- peer); peer is a rank of this communicator
  // (may be this rank). count elements of `dtype` each way.
  std::unique_ptr<NcclWork> exchange(const void* send, void* recv, int64_t count, DataType dtype,
                                     int peer, void* compute_stream, const std::string& label);
  // In-place sum over the communicator.
  std::unique_ptr<NcclWork> all_reduce(void* buf, int64_t count, DataType dtype,
                                       void* compute_stream, const std::string& label);
  // ncclCommSplit: collective over this communicator (every rank calls it, non-members with
  // color < 0 = NCCL_SPLIT_NOCOLOR). Returns nullptr for non-members.
  std::unique_ptr<NcclCommunicator> split(int color, int key, const std::string& name);

  // Aborts (ncclCommAbort) and marks the communicator failed with `reason` (no-op if closed).
  void abort(const std::string& reason);
  // Orderly close (finalize + destroy, bounded by the timeout; abort on failure). Idempotent.
  void close();
  // Throws the communicator's error if it failed (also polls ncclCommGetAsyncError).
  void check();

  // Rank names used in error messages (comm rank i is global rank global_ranks[i]).
  void set_global_ranks(const std::vector<int64_t>& global_ranks);

  int rank() const;
  int size() const;
  int device() const;
  int64_t timeout_ms() const;
  bool blocking() const;
  bool aborted() const;
  bool closed() const;
  std::string error() const;         // "" while healthy
  std::string name() const;
  void* stream() const;              // the communicator's cudaStream_t
  int64_t outstanding() const;       // operations launched and not yet seen complete

 private:
  explicit NcclCommunicator(std::shared_ptr<CommState> st);
  void start_watchdog();
  std::shared_ptr<CommState> st_;
};

#endif  // DECENTPY_HAVE_NCCL_COMM

}  // namespace nccl
}  // namespace decentpy
