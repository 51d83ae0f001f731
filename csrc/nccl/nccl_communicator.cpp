// NcclCommunicator: see nccl_communicator.h. Compiled to nothing without CUDA + NCCL support.
//
// Locking: CommState::op_mu serialises every NCCL call on the communicator (enqueue, polling,
// split, abort, destroy) -- NCCL calls on one communicator must not run concurrently; with a
// non-blocking communicator no NCCL call blocks, so op_mu is only ever held for a bounded time.
// CommState::mu guards the error string and the outstanding-work list. Lock order: op_mu, mu.
#include "nccl/nccl_api.h"

#ifdef DECENTPY_HAVE_NCCL_COMM

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <list>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "cuda/cuda_check.h"

namespace decentpy {
namespace nccl {

using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kWatchdogPoll = std::chrono::milliseconds(20);

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

int64_t deadline_after_ms(int64_t ms) {
  // Saturate: a huge timeout must not overflow.
  const int64_t cap = INT64_MAX / 4;
  const int64_t ns = ms >= cap / 1000000 ? cap : ms * 1000000;
  return now_ns() + ns;
}

// The message helpers build strings with std::to_string / snprintf, not std::ostringstream: on the
// H200 machine (torch 2.11, gcc 13) an ostream insertion of an integer inside this extension
// crashed (SIGSEGV in the num_put path, the first non-blocking exchange's label).
std::string seconds(int64_t ms) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), ms < 10000 ? "%.1f s" : "%.0f s", static_cast<double>(ms) / 1000.0);
  return buf;
}

ncclDataType_t to_nccl(DataType t) {
  switch (t) {
    case DataType::Float32: return ncclFloat32;
    case DataType::Float16: return ncclFloat16;
    case DataType::BFloat16: return ncclBfloat16;
    case DataType::Float64: return ncclFloat64;
    case DataType::Int32: return ncclInt32;
    case DataType::Int64: return ncclInt64;
    case DataType::Int8: return ncclInt8;
    case DataType::UInt8: return ncclUint8;
  }
  throw std::invalid_argument("decentpy NCCL: unknown data type");
}

// Sets the calling thread's current device for the scope; restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaError_t e = cudaGetDevice(&prev_);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(std::string("decentpy NCCL communicator: the CUDA runtime is not "
                                           "usable (no GPU or no driver?): cudaGetDevice: ") +
                               cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
    }
    if (prev_ != device) {
      e = cudaSetDevice(device);
      if (e != cudaSuccess) {
        cudaGetLastError();
        throw std::runtime_error("decentpy NCCL communicator: cannot use cuda:" +
                                 std::to_string(device) + ": cudaSetDevice: " +
                                 cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
      }
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
  bool changed_ = false;
};

}  // namespace

#define DECENTPY_NCCL_CHECK(expr, comm, what)                                                 \
  do {                                                                                        \
    const ncclResult_t decentpy_nr__ = (expr);                                                \
    if (decentpy_nr__ != ncclSuccess) {                                                       \
      throw std::runtime_error(std::string("decentpy NCCL error in ") + (what) + ": " +      \
                               describe_result(decentpy_nr__, comm) + " at " + __FILE__ + ":" + \
                               std::to_string(__LINE__) + " in `" #expr "`");                 \
    }                                                                                         \
  } while (0)

// ---------------------------------------------------------------------------------------------
// Shared state

struct CommState {
  const NcclApi* api = nullptr;
  ncclComm_t comm = nullptr;
  int rank = 0, nranks = 0, device = 0;
  int64_t timeout_ms = 0;
  bool blocking = false;
  std::string name;
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;  // recorded on the compute stream before each op (under op_mu)

  std::mutex op_mu;
  mutable std::mutex mu;
  std::condition_variable cv;
  std::string error;                                 // first failure (under mu)
  std::vector<int64_t> global_ranks;                 // under mu
  std::list<std::shared_ptr<WorkState>> outstanding; // under mu
  std::atomic<bool> failed{false}, aborted{false}, closed{false}, abort_requested{false};
  bool stop = false;                                 // under mu
  std::thread watchdog;

  ~CommState() {
    // close() ran (or the constructor failed); only device resources remain. Errors are ignored:
    // this may run during interpreter shutdown.
    //
    // The stream is deliberately never destroyed (as torch never destroys its pool streams):
    // buffers sent on it were marked with Tensor.record_stream, and torch's caching allocator
    // records an event on every such stream when it frees them -- possibly long after this
    // communicator is gone (the parameters outlive the wrapper). A destroyed stream there would
    // be an invalid handle inside a deleter. One stream per communicator is a bounded cost.
    if (ready) {
      int prev = -1;
      const bool switched = cudaGetDevice(&prev) == cudaSuccess && prev != device &&
                            cudaSetDevice(device) == cudaSuccess;
      cudaEventDestroy(ready);
      if (switched) cudaSetDevice(prev);
    }
    cudaGetLastError();
  }

  int64_t global(int r) const {
    std::lock_guard<std::mutex> lk(mu);
    return (r >= 0 && r < static_cast<int>(global_ranks.size())) ? global_ranks[r] : r;
  }

  std::string who() const {
    return "rank " + std::to_string(global(rank)) + " (NCCL communicator '" + name + "', rank " +
           std::to_string(rank) + " of " + std::to_string(nranks) + ", cuda:" + std::to_string(device) + ")";
  }

  std::string peers_str(const std::vector<int>& peers) const {
    std::string out = "[";
    for (size_t i = 0; i < peers.size(); ++i) out += (i ? ", " : "") + std::to_string(global(peers[i]));
    return out + "]";
  }

  std::string error_copy() const {
    std::lock_guard<std::mutex> lk(mu);
    return error;
  }

  void record_error(const std::string& msg) {
    std::lock_guard<std::mutex> lk(mu);
    if (error.empty()) error = msg;
    failed = true;
  }

  [[noreturn]] void throw_error() const {
    std::string e = error_copy();
    if (e.empty()) e = who() + ": the communicator failed";
    throw NcclCommError(e);
  }

  void throw_if_unusable() const {
    if (failed) throw_error();
    if (closed) throw NcclCommError(who() + ": the communicator was closed");
  }

  // Aborts with op_mu held by the caller. Records `reason` as the error (unless one is recorded).
  void abort_locked(const std::string& reason) {
    record_error(reason);
    if (comm && !aborted) {
      DeviceGuard g(device);
      const ncclResult_t r = api->CommAbort(comm);  // frees it; its in-flight kernels exit
      if (r != ncclSuccess && r != ncclInProgress) {
        std::fprintf(stderr, "[decentpy NCCL] ncclCommAbort of '%s' returned %s\n", name.c_str(),
                     describe_result(r, nullptr).c_str());
      }
      comm = nullptr;
      aborted = true;
    }
    cv.notify_all();
  }

  void abort(const std::string& reason) {
    record_error(reason);    // first: a polling enqueue that sees abort_requested reports it
    abort_requested = true;  // makes a polling enqueue give up op_mu
    std::lock_guard<std::mutex> op(op_mu);
    abort_locked(reason);
  }

  // Polls the communicator's state until it leaves ncclInProgress (non-blocking communicators:
  // initialisation, split, the first send/recv to a peer, finalize). On failure or past the
  // deadline: aborts `c` (and this communicator when c is it) and throws. op_mu must be held.
  void wait_ready(ncclComm_t c, int64_t deadline, const std::string& what, bool is_self) {
    int spins = 0;
    for (;;) {
      ncclResult_t st = ncclSuccess;
      const ncclResult_t r = api->CommGetAsyncError(c, &st);
      if (r != ncclSuccess) st = r;
      if (st == ncclSuccess) return;
      if (st != ncclInProgress) {
        const std::string msg = who() + ": " + what + " failed: " + describe_result(st, c);
        if (is_self) {
          abort_locked(msg);
        } else {
          api->CommAbort(c);
        }
        throw NcclCommError(msg);
      }
      if (now_ns() > deadline || (is_self && abort_requested)) {
        std::string msg = is_self && failed ? error_copy() : std::string();
        if (msg.empty()) {
          msg = who() + ": " + what + " did not complete within " + seconds(timeout_ms) +
                "; a peer may have died or not made the matching call. The NCCL communicator "
                "was aborted (ncclCommAbort)";
        }
        if (is_self) {
          abort_locked(msg);
        } else {
          api->CommAbort(c);
        }
        throw NcclCommError(msg);
      }
      if (++spins < 200) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(spins < 2000 ? 50 : 1000));
      }
    }
  }
};

struct WorkState {
  std::shared_ptr<CommState> comm;
  cudaEvent_t done = nullptr;
  std::string label;
  std::vector<int> peers;  // comm ranks
  int64_t launched_ns = 0;
  std::atomic<int64_t> deadline_ns{0};
  std::atomic<int64_t> budget_ms{0};  // the timeout that produced deadline_ns (messages)
  std::atomic<bool> completed{false};

  ~WorkState() {
    if (done) cudaEventDestroy(done);
    cudaGetLastError();
  }

  void tighten(int64_t timeout_ms) {
    if (timeout_ms <= 0) return;
    const int64_t d = deadline_after_ms(timeout_ms);
    int64_t cur = deadline_ns.load();
    while (d < cur && !deadline_ns.compare_exchange_weak(cur, d)) {
    }
    if (d <= cur) budget_ms = timeout_ms;
  }

  std::string timeout_message(const CommState& c) const {
    return c.who() + ": " + label + " with peer rank(s) " + c.peers_str(peers) +
           " did not complete within " + seconds(budget_ms.load()) +
           "; a peer may have died, hung, or not launched the matching operation. The NCCL "
           "communicator was aborted (ncclCommAbort); every later operation on it fails";
  }

  // cudaEventQuery: true when complete. Throws on a CUDA error (after failing the communicator).
  bool query() {
    if (completed) return true;
    const cudaError_t e = cudaEventQuery(done);
    if (e == cudaSuccess) {
      completed = true;
      return true;
    }
    if (e == cudaErrorNotReady) return false;
    cudaGetLastError();
    const std::string msg = comm->who() + ": " + label + " with peer rank(s) " +
                            comm->peers_str(peers) + " failed: cudaEventQuery: " +
                            cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
    comm->abort(msg);
    throw NcclCommError(msg);
  }
};

// ---------------------------------------------------------------------------------------------
// Watchdog: one thread per communicator, polling only while operations are outstanding.

static void watchdog_round(CommState* s, std::vector<std::shared_ptr<WorkState>>& snap);

static void watchdog_loop(CommState* s) {
  bool device_ok = true;
  std::string device_error;
  try {
    DECENTPY_CUDA_CHECK(cudaSetDevice(s->device));
  } catch (const std::exception& e) {
    device_ok = false;
    device_error = e.what();
  }
  std::vector<std::shared_ptr<WorkState>> snap;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(s->mu);
      if (s->outstanding.empty()) {
        s->cv.wait(lk, [&] { return s->stop || !s->outstanding.empty(); });
      } else {
        s->cv.wait_for(lk, kWatchdogPoll, [&] { return s->stop; });
      }
      if (s->stop) return;
      snap.assign(s->outstanding.begin(), s->outstanding.end());
    }
    if (!device_ok) {
      // Without the device this thread can neither poll events nor enforce deadlines: fail the
      // communicator (once) instead of silently leaving its waits unbounded.
      if (!s->failed) {
        const std::string msg = s->who() + ": the watchdog thread could not select cuda:" +
                                std::to_string(s->device) + " (" + device_error +
                                "), so waits cannot be bounded. The NCCL communicator was aborted";
        std::fprintf(stderr, "[decentpy NCCL watchdog] %s\n", msg.c_str());
        s->abort(msg);
      }
      snap.clear();
      continue;
    }
    try {
      watchdog_round(s, snap);
    } catch (const std::exception& e) {  // never let an exception end the process
      std::fprintf(stderr, "[decentpy NCCL watchdog] %s\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "[decentpy NCCL watchdog] unknown error\n");
    }
    snap.clear();
  }
}

static void watchdog_round(CommState* s, std::vector<std::shared_ptr<WorkState>>& snap) {
  {
    // 1. Asynchronous NCCL errors (network failure, remote abort, ...).
    if (!s->failed) {
      ncclResult_t st = ncclSuccess;
      {
        std::unique_lock<std::mutex> op(s->op_mu, std::try_to_lock);  // skip a round if busy
        if (op.owns_lock() && s->comm) {
          const ncclResult_t r = s->api->CommGetAsyncError(s->comm, &st);
          if (r != ncclSuccess) st = r;
          if (st != ncclSuccess && st != ncclInProgress) {
            std::string pending;
            for (const auto& w : snap) {
              if (w->completed) continue;
              pending += (pending.empty() ? "" : "; ") + w->label + " with peer rank(s) " +
                         s->peers_str(w->peers);
            }
            const std::string msg = s->who() + ": asynchronous NCCL error " +
                                    describe_result(st, s->comm) +
                                    (pending.empty() ? std::string() : " during " + pending) +
                                    ". The NCCL communicator was aborted (ncclCommAbort)";
            s->abort_locked(msg);
            std::fprintf(stderr, "[decentpy NCCL watchdog] %s\n", msg.c_str());
          }
        }
      }
    }

    // 2. Completion and deadlines.
    const int64_t now = now_ns();
    std::vector<WorkState*> done;
    for (const auto& w : snap) {
      if (w->completed) {
        done.push_back(w.get());
        continue;
      }
      const cudaError_t e = cudaEventQuery(w->done);
      if (e == cudaSuccess) {
        w->completed = true;
        done.push_back(w.get());
      } else if (e != cudaErrorNotReady) {
        cudaGetLastError();
        const std::string msg = s->who() + ": " + w->label + " with peer rank(s) " +
                                s->peers_str(w->peers) + " failed: cudaEventQuery: " +
                                cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
        if (!s->failed) std::fprintf(stderr, "[decentpy NCCL watchdog] %s\n", msg.c_str());
        s->abort(msg);
        done.push_back(w.get());  // nothing more to learn from it
      } else if (!s->failed && now > w->deadline_ns.load()) {
        const std::string msg = w->timeout_message(*s);
        std::fprintf(stderr, "[decentpy NCCL watchdog] %s\n", msg.c_str());
        s->abort(msg);
        // Aborted kernels exit, so the event completes; keep polling it.
      }
    }
    if (!done.empty()) {
      std::lock_guard<std::mutex> lk(s->mu);
      s->outstanding.remove_if([&](const std::shared_ptr<WorkState>& w) {
        return std::find(done.begin(), done.end(), w.get()) != done.end();
      });
    }
  }
}

// ---------------------------------------------------------------------------------------------
// NcclWork

NcclWork::NcclWork(std::shared_ptr<WorkState> st) : st_(std::move(st)) {}
NcclWork::~NcclWork() = default;

const std::string& NcclWork::label() const { return st_->label; }
int NcclWork::device() const { return st_->comm->device; }

std::vector<int64_t> NcclWork::peers() const {
  std::vector<int64_t> out;
  for (int p : st_->peers) out.push_back(st_->comm->global(p));
  return out;
}

void NcclWork::wait(void* stream, int64_t timeout_ms) {
  CommState& c = *st_->comm;
  if (c.failed) c.throw_error();
  st_->tighten(timeout_ms);
  if (st_->completed) return;
  DeviceGuard g(c.device);
  DECENTPY_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), st_->done, 0));
}

void NcclWork::synchronize(int64_t timeout_ms) {
  CommState& c = *st_->comm;
  if (c.failed) c.throw_error();
  st_->tighten(timeout_ms > 0 ? timeout_ms : c.timeout_ms);
  DeviceGuard g(c.device);
  int spins = 0;
  while (!st_->query()) {
    if (c.failed) c.throw_error();
    if (now_ns() > st_->deadline_ns.load()) {
      const std::string msg = st_->timeout_message(c);
      c.abort(msg);
      c.throw_error();
    }
    if (++spins < 100) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(spins < 1000 ? 50 : 500));
    }
  }
  if (c.failed) c.throw_error();
}

bool NcclWork::is_completed() {
  CommState& c = *st_->comm;
  if (c.failed) c.throw_error();
  DeviceGuard g(c.device);
  return st_->query();
}

// ---------------------------------------------------------------------------------------------
// NcclCommunicator

namespace {

ncclConfig_t make_config(bool blocking) {
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = blocking ? 1 : 0;
  return cfg;
}

void create_stream(CommState& s) {
  int lo = 0, hi = 0;
  DECENTPY_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  DECENTPY_CUDA_CHECK(cudaStreamCreateWithPriority(&s.stream, cudaStreamNonBlocking, hi));
  DECENTPY_CUDA_CHECK(cudaEventCreateWithFlags(&s.ready, cudaEventDisableTiming));
}

}  // namespace

NcclCommunicator::NcclCommunicator(const std::string& unique_id, int rank, int nranks, int device,
                                   int64_t timeout_ms, bool blocking, const std::string& name) {
  if (unique_id.size() != sizeof(ncclUniqueId)) {
    throw std::invalid_argument("decentpy NCCL communicator: unique_id must be " +
                                std::to_string(sizeof(ncclUniqueId)) + " bytes (from "
                                "nccl_get_unique_id), got " + std::to_string(unique_id.size()));
  }
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    throw std::invalid_argument("decentpy NCCL communicator: rank " + std::to_string(rank) +
                                " is not in [0, " + std::to_string(nranks) + ")");
  }
  if (device < 0) {
    throw std::invalid_argument("decentpy NCCL communicator: device must be >= 0, got " +
                                std::to_string(device));
  }
  if (timeout_ms <= 0) {
    throw std::invalid_argument("decentpy NCCL communicator: timeout_ms must be > 0, got " +
                                std::to_string(timeout_ms));
  }
  auto s = std::make_shared<CommState>();
  s->rank = rank;
  s->nranks = nranks;
  s->device = device;
  s->timeout_ms = timeout_ms;
  s->blocking = blocking;
  s->name = name;
  DeviceGuard g(device);  // fails clearly without a GPU/driver, before NCCL is touched
  s->api = &api();
  create_stream(*s);

  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclConfig_t cfg = make_config(blocking);
  std::lock_guard<std::mutex> op(s->op_mu);
  const int64_t deadline = deadline_after_ms(timeout_ms);
  ncclComm_t comm = nullptr;
  const ncclResult_t r = s->api->CommInitRankConfig(&comm, nranks, id, rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    std::string msg = s->who() + ": ncclCommInitRankConfig failed: " + describe_result(r, comm);
    if (comm) s->api->CommAbort(comm);
    throw std::runtime_error(msg);
  }
  s->comm = comm;
  if (!blocking) {
    s->wait_ready(comm, deadline,
                  "initialisation (waiting for all " + std::to_string(nranks) + " ranks to join)",
                  true);
  }
  st_ = s;
  start_watchdog();
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<CommState> st) : st_(std::move(st)) {
  start_watchdog();
}

void NcclCommunicator::start_watchdog() {
  CommState* raw = st_.get();
  st_->watchdog = std::thread([raw] { watchdog_loop(raw); });
}

NcclCommunicator::~NcclCommunicator() {
  try {
    close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[decentpy NCCL] closing communicator '%s': %s\n", st_->name.c_str(),
                 e.what());
  }
}

void NcclCommunicator::close() {
  CommState& s = *st_;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.stop = true;
  }
  s.cv.notify_all();
  if (s.watchdog.joinable() && s.watchdog.get_id() != std::this_thread::get_id()) s.watchdog.join();
  std::lock_guard<std::mutex> op(s.op_mu);
  if (s.closed) return;
  s.closed = true;
  if (s.comm && !s.aborted) {
    DeviceGuard g(s.device);
    bool ok = !s.failed;
    // The watchdog is stopped: finalisation may take as long as the latest outstanding
    // operation's deadline, at least 10 s, at most the timeout; past it, abort.
    int64_t deadline = deadline_after_ms(std::min<int64_t>(10000, s.timeout_ms));
    {
      std::lock_guard<std::mutex> lk(s.mu);
      for (const auto& w : s.outstanding) {
        if (!w->completed) deadline = std::max(deadline, w->deadline_ns.load());
      }
    }
    deadline = std::min(deadline, deadline_after_ms(s.timeout_ms));
    if (ok && s.api->CommFinalize) {
      // Flushes the outstanding operations (bounded: non-blocking communicators poll).
      const ncclResult_t r = s.api->CommFinalize(s.comm);
      ok = (r == ncclSuccess || r == ncclInProgress);
      if (ok && !s.blocking) {
        try {
          s.wait_ready(s.comm, deadline, "finalisation (flushing outstanding operations)", true);
        } catch (const std::exception&) {
          ok = false;  // wait_ready aborted the communicator
        }
      }
    }
    if (s.comm && !s.aborted) {
      const ncclResult_t r = ok ? s.api->CommDestroy(s.comm) : s.api->CommAbort(s.comm);
      if (r != ncclSuccess && r != ncclInProgress) {
        std::fprintf(stderr, "[decentpy NCCL] %s of '%s' returned %s\n",
                     ok ? "ncclCommDestroy" : "ncclCommAbort", s.name.c_str(),
                     describe_result(r, nullptr).c_str());
      }
      if (!ok) s.aborted = true;
      s.comm = nullptr;
    }
  }
  std::lock_guard<std::mutex> lk(s.mu);
  s.outstanding.clear();
}

void NcclCommunicator::abort(const std::string& reason) {
  if (st_->closed) return;
  st_->abort(st_->who() + ": " + (reason.empty() ? std::string("aborted") : reason));
}

void NcclCommunicator::check() {
  CommState& s = *st_;
  s.throw_if_unusable();
  ncclResult_t st = ncclSuccess;
  {
    std::lock_guard<std::mutex> op(s.op_mu);
    if (!s.comm) s.throw_if_unusable();
    const ncclResult_t r = s.api->CommGetAsyncError(s.comm, &st);
    if (r != ncclSuccess) st = r;
    if (st != ncclSuccess && st != ncclInProgress) {
      s.abort_locked(s.who() + ": asynchronous NCCL error " + describe_result(st, s.comm) +
                     ". The NCCL communicator was aborted (ncclCommAbort)");
    }
  }
  s.throw_if_unusable();
}

void NcclCommunicator::set_global_ranks(const std::vector<int64_t>& global_ranks) {
  if (static_cast<int>(global_ranks.size()) != st_->nranks) {
    throw std::invalid_argument("decentpy NCCL communicator: set_global_ranks needs " +
                                std::to_string(st_->nranks) + " ranks, got " +
                                std::to_string(global_ranks.size()));
  }
  std::lock_guard<std::mutex> lk(st_->mu);
  st_->global_ranks = global_ranks;
}

int NcclCommunicator::rank() const { return st_->rank; }
int NcclCommunicator::size() const { return st_->nranks; }
int NcclCommunicator::device() const { return st_->device; }
int64_t NcclCommunicator::timeout_ms() const { return st_->timeout_ms; }
bool NcclCommunicator::blocking() const { return st_->blocking; }
bool NcclCommunicator::aborted() const { return st_->aborted; }
bool NcclCommunicator::closed() const { return st_->closed; }
std::string NcclCommunicator::error() const { return st_->error_copy(); }
std::string NcclCommunicator::name() const { return st_->name; }
void* NcclCommunicator::stream() const { return st_->stream; }
int64_t NcclCommunicator::outstanding() const {
  std::lock_guard<std::mutex> lk(st_->mu);
  int64_t n = 0;
  for (const auto& w : st_->outstanding) n += w->completed ? 0 : 1;
  return n;
}

namespace {

// Enqueues `issue` (NCCL calls on s.comm / s.stream) after the compute stream's current work and
// returns the work (completion event recorded on s.stream).
template <typename Issue>
std::unique_ptr<NcclWork> enqueue(const std::shared_ptr<CommState>& sp, void* compute_stream,
                                  std::vector<int> peers, const std::string& label,
                                  Issue&& issue) {
  CommState& s = *sp;
  DeviceGuard g(s.device);
  std::lock_guard<std::mutex> op(s.op_mu);
  s.throw_if_unusable();
  auto w = std::make_shared<WorkState>();
  w->comm = sp;
  w->label = label;
  w->peers = std::move(peers);
  w->launched_ns = now_ns();
  w->deadline_ns = deadline_after_ms(s.timeout_ms);
  w->budget_ms = s.timeout_ms;
  DECENTPY_CUDA_CHECK(cudaEventCreateWithFlags(&w->done, cudaEventDisableTiming));
  DECENTPY_CUDA_CHECK(cudaEventRecord(s.ready, static_cast<cudaStream_t>(compute_stream)));
  DECENTPY_CUDA_CHECK(cudaStreamWaitEvent(s.stream, s.ready, 0));

  const ncclResult_t r = issue(s);
  if (r != ncclSuccess && r != ncclInProgress) {
    const std::string msg = s.who() + ": " + label + " with peer rank(s) " +
                            s.peers_str(w->peers) + ": NCCL launch failed: " +
                            describe_result(r, s.comm) +
                            ". The NCCL communicator was aborted (ncclCommAbort)";
    s.abort_locked(msg);
    throw NcclCommError(msg);
  }
  if (!s.blocking) {
    // ncclInProgress (first operation with a peer: connection set-up) -- or a deferred error.
    s.wait_ready(s.comm, w->deadline_ns.load(),
                 label + " with peer rank(s) " + s.peers_str(w->peers) + " (launch)", true);
  }
  try {
    DECENTPY_CUDA_CHECK(cudaEventRecord(w->done, s.stream));
  } catch (const std::exception& e) {
    // The operation is in flight but cannot be tracked: nothing could bound a wait on it.
    s.abort_locked(s.who() + ": " + label + " with peer rank(s) " + s.peers_str(w->peers) +
                   " was launched but its completion event could not be recorded (" + e.what() +
                   "). The NCCL communicator was aborted (ncclCommAbort)");
    throw;
  }
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.outstanding.push_back(w);
  }
  s.cv.notify_all();
  return std::unique_ptr<NcclWork>(new NcclWork(w));
}

void check_count(int64_t count, const char* what) {
  if (count < 0) {
    throw std::invalid_argument(std::string("decentpy NCCL ") + what + ": count must be >= 0, got " +
                                std::to_string(count));
  }
}

}  // namespace

std::unique_ptr<NcclWork> NcclCommunicator::exchange(const void* send, void* recv, int64_t count,
                                                     DataType dtype, int peer,
                                                     void* compute_stream,
                                                     const std::string& label) {
  check_count(count, "exchange");
  if (peer < 0 || peer >= st_->nranks) {
    throw std::invalid_argument("decentpy NCCL exchange: peer " + std::to_string(peer) +
                                " is not a rank of communicator '" + st_->name + "' (size " +
                                std::to_string(st_->nranks) + ")");
  }
  if (count > 0 && (send == nullptr || recv == nullptr)) {
    throw std::invalid_argument("decentpy NCCL exchange: null buffer");
  }
  const ncclDataType_t dt = to_nccl(dtype);
  const size_t n = static_cast<size_t>(count);
  return enqueue(st_, compute_stream, {peer}, label, [&](CommState& s) {
    ncclResult_t r = s.api->GroupStart();
    if (r != ncclSuccess) return r;
    const ncclResult_t r1 = s.api->Send(send, n, dt, peer, s.comm, s.stream);
    const ncclResult_t r2 = s.api->Recv(recv, n, dt, peer, s.comm, s.stream);
    r = s.api->GroupEnd();  // always closes the group
    if (r1 != ncclSuccess && r1 != ncclInProgress) return r1;
    if (r2 != ncclSuccess && r2 != ncclInProgress) return r2;
    return r;
  });
}

std::unique_ptr<NcclWork> NcclCommunicator::all_reduce(void* buf, int64_t count, DataType dtype,
                                                       void* compute_stream,
                                                       const std::string& label) {
  check_count(count, "all_reduce");
  if (count > 0 && buf == nullptr) throw std::invalid_argument("decentpy NCCL all_reduce: null buffer");
  const ncclDataType_t dt = to_nccl(dtype);
  std::vector<int> peers;
  for (int r = 0; r < st_->nranks; ++r) {
    if (r != st_->rank) peers.push_back(r);
  }
  return enqueue(st_, compute_stream, std::move(peers), label, [&](CommState& s) {
    return s.api->AllReduce(buf, buf, static_cast<size_t>(count), dt, ncclSum, s.comm, s.stream);
  });
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::split(int color, int key,
                                                          const std::string& name) {
  CommState& s = *st_;
  if (!s.api->CommSplit) {
    throw std::runtime_error("decentpy NCCL split: the loaded NCCL (" + library_path() + ", " +
                             std::to_string(s.api->version) + ") has no ncclCommSplit; NCCL "
                             ">= 2.18 is required for sub-communicators");
  }
  DeviceGuard g(s.device);
  auto child = std::make_shared<CommState>();
  child->api = s.api;
  child->device = s.device;
  child->timeout_ms = s.timeout_ms;
  child->blocking = s.blocking;
  child->name = name;
  {
    std::lock_guard<std::mutex> op(s.op_mu);
    s.throw_if_unusable();
    ncclConfig_t cfg = make_config(s.blocking);
    const int64_t deadline = deadline_after_ms(s.timeout_ms);
    ncclComm_t c = nullptr;
    const ncclResult_t r =
        s.api->CommSplit(s.comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &c, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
      const std::string msg = s.who() + ": ncclCommSplit (color " + std::to_string(color) +
                              ", key " + std::to_string(key) + ") failed: " +
                              describe_result(r, s.comm) +
                              ". The NCCL communicator was aborted (ncclCommAbort)";
      if (c) s.api->CommAbort(c);
      s.abort_locked(msg);
      throw NcclCommError(msg);
    }
    if (!s.blocking) {
      // Non-blocking split: the parent and the child stay ncclInProgress until done.
      try {
        s.wait_ready(s.comm, deadline, "ncclCommSplit into '" + name + "'", true);
      } catch (...) {
        if (c) s.api->CommAbort(c);
        throw;
      }
    }
    if (!c) return nullptr;
    if (!s.blocking) {  // aborts `c` itself if it fails or times out
      s.wait_ready(c, deadline, "ncclCommSplit into '" + name + "' (new communicator)", false);
    }
    int n = 0, rk = 0;
    try {  // a failure from here on must not leak the new communicator
      DECENTPY_NCCL_CHECK(s.api->CommCount(c, &n), c, "ncclCommCount");
      DECENTPY_NCCL_CHECK(s.api->CommUserRank(c, &rk), c, "ncclCommUserRank");
    } catch (...) {
      s.api->CommAbort(c);
      throw;
    }
    child->comm = c;
    child->nranks = n;
    child->rank = rk;
  }
  try {
    create_stream(*child);
  } catch (...) {
    child->api->CommAbort(child->comm);
    child->comm = nullptr;
    child->aborted = true;
    throw;
  }
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(child));
}

}  // namespace nccl
}  // namespace decentpy

#endif  // DECENTPY_HAVE_NCCL_COMM
