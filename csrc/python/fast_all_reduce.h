// The small-message fast path of an all-reduce (Note [Small-message fast path] in ncclavg/comm/fast_average.py:
// the public API's all_reduce_avg, the torch backend's all_reduce), in terms of Python objects: the part of
// the library that has to look at a torch tensor without linking libtorch (its Python attributes only).
#pragma once
#include <pybind11/pybind11.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "../transport/host_lanes.h"
#include "../transport/shm_channel.h"

namespace ncclavg {
namespace py_glue {

namespace py = pybind11;

// Holds the GIL through a channel call and gives it up only if the call starts to wait (see
// cpu::ShmBlockingHook): an 8-byte all-reduce whose peers are ready costs no GIL hand-over.
struct ReleaseGilWhenBlocking : cpu::ShmBlockingHook {
  PyThreadState* saved = nullptr;
  ReleaseGilWhenBlocking() { cpu::set_blocking_hook(this); }
  ~ReleaseGilWhenBlocking() {
    cpu::set_blocking_hook(nullptr);
    if (saved != nullptr) PyEval_RestoreThread(saved);
  }
  void before_blocking() override { saved = PyEval_SaveThread(); }
};

// The order of one runner's collectives (ncclavg/transport/runner.py): a lock held while one runs, and the
// count of those submitted and not yet done. Native, so that the fast path checks both in nanoseconds;
// Python uses it like a threading.Lock (acquire, release, `with`), blocking without the GIL.
class ShmExec {
 public:
  bool try_lock() {
    bool expected = false;
    return locked_.compare_exchange_strong(expected, true, std::memory_order_acquire);
  }
  bool acquire(bool blocking);
  void release();
  int outstanding() const { return outstanding_.load(std::memory_order_acquire); }
  void add_outstanding(int delta) { outstanding_.fetch_add(delta, std::memory_order_acq_rel); }

 private:
  std::atomic<bool> locked_{false};
  std::atomic<int> outstanding_{0};
  std::atomic<int> waiters_{0};
  std::mutex m_;
  std::condition_variable cv_;
};

// An all-reduce of [t] with a divisor through one host's `channel`, or through `lanes` between hosts (the
// core's lanes on UCX; their channels inside the hosts), for tensors it has seen before. `prepare(t)` (Python:
// the general path's checks) returns (data_ptr, numel, type code, divisor, call tag) or None for a
// tensor the fast path must not take (the tag: the user call the channel checks, Note [Call
// signatures] in csrc/transport/shm_calls.cpp; its count is numel). Nothing may be outstanding on `exec` and its lock must be free, and the
// communicator must not have disabled it (a failure or close()), else the call returns False and the
// general path runs it in order (or says why it refuses).
class FastAllReduce {
 public:
  FastAllReduce(cpu::ShmChannel* channel, ShmExec* exec, py::object prepare);
  FastAllReduce(cpu::HostLanes* lanes, ShmExec* exec, py::object prepare);
  // True: done (and *count, when given, is the element count). False: the general path must run it.
  // Raises what the channel (or the lanes) raise. ready_wait_s >= 0: an asynchronous call, run here only on
  // a channel, when it is at most kAsyncInlineBytes and every peer has announced or posted its round within
  // ready_wait_s (Note [An asynchronous call whose peers wait] in csrc/transport/shm_channel.cpp); < 0: a
  // synchronous call. nonfinite != nullptr (a channel's call only): *nonfinite says whether any value the
  // round wrote is an inf or a NaN (the channel's note while writing: Note [Finiteness from the pass that
  // writes] in csrc/common/finite_math.h), as the general path's job notes it for Work.finite.
  bool run(py::handle tensors, double timeout_s, int64_t* count = nullptr, double ready_wait_s = -1.0,
           bool* nonfinite = nullptr);
  // The largest asynchronous call run on the caller's thread. A 256 KiB all-reduce of two processes takes
  // ~30 us on a 2-core VM, less than handing a call to a worker costs there (a burst of queued 1 MiB
  // calls took 300-450 us each against 120 us for one synchronous call), and it covers the single DDP
  // bucket of a small model (the digits MLP's 69 KB); a larger call would hold up the caller's own work
  // (DDP's backward) for longer than the overlap it gives up is worth on a machine with cores to spare.
  // Python's copy of this gate, for the calls written there: Runner.ready_for (ncclavg/transport/runner.py).
  static constexpr int64_t kAsyncInlineBytes = 256 << 10;
  // For good: also lets go of `prepare` and the cache, which would otherwise keep the communicator
  // alive through a reference cycle that Python's collector cannot see into (prepare -> communicator
  // -> this object -> prepare).
  void disable();
  size_t cached() const { return entries_.size(); }
  // Every call this object runs is then written into `recorder`'s ring (ncclavg/transport/flight.py's
  // Recorder, the communicator's) as Recorder.done writes it: (seq, what, dtype, count, t, t, t, done_word,
  // None), seq from the recorder's own counter, so that jobs and fast calls share one numbering. In C++:
  // the same record through Python cost the public API's 8-byte call ~0.4 us (0.9 -> 1.3-1.4 us,
  // bench/mpi_peer.py); Note [Calls run now] in ncclavg/transport/runner.py.
  void record_to(py::object recorder, py::object what, py::object done_word);

 private:
  struct Entry {
    py::object weak;   // a weak reference to the tensor: alive and the same object, or stale
    int64_t version;   // the tensor's version counter when it was prepared (in-place changes move it)
    uintptr_t data;
    int64_t count;
    int type;
    double div;
    uint64_t tag;
    py::object dtype;   // the tensor's dtype, for the flight record
  };
  const Entry* lookup(PyObject* t);
  void note(const py::object& dtype, int64_t count);   // the record of a call that ran (record_to)

  void all_reduce(uintptr_t data, int64_t count, int type, double div, uint64_t word, double timeout_s,
                  bool* nonfinite);

  cpu::ShmChannel* channel_ = nullptr;   // exactly one of the two
  cpu::HostLanes* lanes_ = nullptr;
  ShmExec* exec_;
  py::object prepare_;
  py::object name_version_, name_data_ptr_;
  bool enabled_ = true;
  std::vector<Entry> entries_;   // the most recent tensors, newest last
  py::object recorder_, ring_, counter_, what_, done_word_, name_last_seq_;   // record_to's
  int64_t capacity_ = 0;
};

}  // namespace py_glue
}  // namespace ncclavg
