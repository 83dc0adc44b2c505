// NcclComm state and watchdog: wait/done, stream ordering, abort, destroy. Creation is in
// comm_init.cpp, the collectives in comm_collectives.cpp.
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <sstream>

#include "../common/check.h"
#include "comm_impl.h"

namespace ncclavg {
namespace nccl {

// Note [Watchdog]
// There is no watchdog thread: whoever waits (wait(), done(), destroy()) polls, without holding the
// mutex while sleeping, (1) the per-device done events of the collectives still in flight and
// (2) ncclCommGetAsyncError of every local communicator. An async error aborts every local
// communicator and raises NcclError with NCCL's words; the deadline aborts and raises TimeoutError
// naming the oldest unfinished collective, its bytes, ranks and devices; a CUDA error other than
// "not ready" from a done event (a sticky error: a faulting kernel, a lost device) aborts and raises
// CudaError, since NCCL must not flush communicators on a broken context later. Each way the object is
// marked aborted and every later call raises NcclError("communicator was aborted after ...").
// Completed collectives are dropped from the front of the in-flight queue: each comm stream runs in
// order, so completion is always a prefix of the queue.

// Note [Teardown]
// destroy() first marks the communicator as closing, so a collective another thread tries to enqueue
// from then on is refused (it would otherwise be destroyed in flight), then waits (bounded by the
// communicator's timeout) for the collectives in flight, then calls ncclCommDestroy on the
// collectives' communicators and then on the init communicators they were split off (if any); it is
// blocking even for non-blocking communicators and does not communicate. A collective that does not
// finish in time turns destroy into an abort, so teardown can never hang.
// The destructor does the same and swallows every error, but waits at most kTeardownWaitMaxS: it runs
// when Python collects the object or the interpreter exits, where nobody chose a timeout and a peer that
// died with collectives in flight would otherwise hold the exit for the full timeout (600 s by default).
// The Python binding releases the GIL before running it (see the holder in bindings.cpp), so the wait
// blocks no other Python thread.

// Note [Abort on a helper thread]
// ncclCommAbort is not always bounded: NCCL's commFree joins the proxy thread, which force-closes its
// peer connections only with cuMem and cuMem-host on and directMode off (proxy.cc); directMode is on
// whenever two local ranks share a process (init_all, init_ranks with several devices). A frozen peer
// can then hold the abort. Called under mu_, that would keep TimeoutError from ever being raised and
// block every other call of every thread on mu_. So abort_locked only marks the object aborted and hands
// the NCCL handles (and the split output slots, which NCCL may still write) to a helper thread that
// aborts them in the order of Note [Blocking collectives after a bounded init]. The caller waits for
// that thread without mu_ (await_abort), at most abort_join_s() = min(timeout, kAbortJoinMaxS); if it
// has not returned by then, the error says so and the thread goes on in the background (the object
// touches none of those handles again, and the thread keeps what it needs alive itself); until it
// returns, NCCL may still touch the buffers of the collectives that were in flight.

// Note [Event queries during a capture]
// cudaEventQuery is one of the calls CUDA forbids while a stream capture is in progress in global mode
// (the default of torch.cuda.graph), in ANY thread: the query fails and the capture is invalidated, so a
// collective waited for in one thread breaks the graph another thread is capturing. The queries here
// observe events recorded outside any capture and cannot join one, so prune_locked makes them in
// relaxed mode (cudaThreadExchangeStreamCaptureMode), which CUDA allows. A collective ordered after a
// stream that is itself capturing is refused with a clear error instead: its done events would be
// graph nodes that no host wait can observe.

std::string list_string(const std::vector<int>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

double checked_timeout(double t, const char* argname) {
  NCCLAVG_CHECK_ARG(std::isfinite(t) && t > 0, argname, "must be a finite number of seconds > 0, got ", t);
  return t;
}

std::string nccl_words(ncclResult_t r, ncclComm_t comm) {
  const Api& a = api();
  std::string s = a.GetErrorString(r);
  if (a.GetLastError) {
    const char* last = a.GetLastError(comm);
    if (last && last[0]) s += std::string(": ") + last;
  }
  return s;
}

struct NcclComm::AbortJob {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
};

NcclComm::~NcclComm() {
  try {
    destroy_within(std::min(timeout_s_, kTeardownWaitMaxS));  // See Note [Teardown]
    await_abort();
  } catch (...) {
    // See Note [Teardown]: a destructor never throws.
  }
}

// ---- state -----------------------------------------------------------------------------------------

bool NcclComm::aborted() const {
  std::lock_guard<std::mutex> lock(mu_);
  return aborted_;
}

bool NcclComm::destroyed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return destroyed_;
}

std::string NcclComm::abort_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return abort_reason_;
}

std::vector<uintptr_t> NcclComm::streams() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uintptr_t> out;
  for (const auto& d : dev_) out.push_back(reinterpret_cast<uintptr_t>(d->stream));
  return out;
}

size_t NcclComm::pending() {
  try {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_ || destroyed_) return 0;
    cuda::DeviceGuard guard(devices_[0]);  // See Note [Device guard without a current context]
    prune_locked();
    return ops_.size();
  } catch (...) {
    rethrow_after_abort();
  }
}

std::string NcclComm::where() const {
  std::ostringstream os;
  if (dev_.size() == 1 && !ranks_.empty()) {
    os << "rank " << ranks_[0] << " of " << size_ << ", device cuda:" << devices_[0];
  } else {
    os << "ranks " << list_string(ranks_) << " of " << size_ << ", devices " << list_string(devices_);
  }
  return os.str();
}

void NcclComm::check_usable_locked(const char* what) const {
  if (aborted_) {
    throw NcclError("communicator was aborted after " + abort_reason_ + "; " + what +
                    " refused: create a new communicator");
  }
  if (destroyed_) throw NcclError(std::string("communicator was destroyed; ") + what + " refused");
  NCCLAVG_CHECK_INTERNAL(ready_, what, " on a communicator whose init did not finish");
}

void NcclComm::check_async_errors_locked(const std::string& during) {
  const Api& a = api();
  for (const auto& d : dev_) {
    for (ncclComm_t c : {d->comm, d->parent}) {
      if (!c) continue;
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = a.CommGetAsyncError(c, &state);
      if (r != ncclSuccess) state = r;
      if (state == ncclSuccess || state == ncclInProgress) continue;
      std::ostringstream os;
      os << "NCCL reported an error on cuda:" << d->device << " (" << where() << ") while " << during << ": "
         << nccl_words(state, c);
      const std::string reason = os.str();
      abort_locked(reason);
      throw NcclError(reason + "; the communicator was aborted");
    }
  }
}

void NcclComm::poll_ready_locked(const Deadline& deadline, const std::string& what, Which which) {
  // Holding mu_ while sleeping is fine here: this is the enqueue (or init) of a non-blocking
  // communicator, which NCCL finishes in milliseconds unless a peer is missing.
  const Api& a = api();
  Backoff backoff;
  while (true) {
    bool in_progress = false;
    for (const auto& d : dev_) {
      ncclComm_t c = which == Which::kComm ? d->comm : d->parent;
      if (!c) continue;
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = a.CommGetAsyncError(c, &state);
      if (r != ncclSuccess) state = r;
      if (state == ncclInProgress) {
        in_progress = true;
      } else if (state != ncclSuccess) {
        const std::string reason = what + " failed on cuda:" + std::to_string(d->device) + ": " + nccl_words(state, c);
        abort_locked(reason);
        throw NcclError(reason + "; the communicator was aborted");
      }
    }
    if (!in_progress) return;
    if (now_s() >= deadline.at) {
      std::ostringstream os;
      os << what << " did not complete within " << deadline.seconds << " s";  // the limit of THIS call
      const std::string reason = os.str();
      abort_locked(reason);
      throw TimeoutError(reason + "; the communicator was aborted (ncclCommAbort)");
    }
    backoff.pause();
  }
}

namespace {
// The calling thread in relaxed capture mode for the scope: See Note [Event queries during a capture].
class RelaxedCapture {
 public:
  RelaxedCapture() {
    if (cudaThreadExchangeStreamCaptureMode(&mode_) != cudaSuccess) {
      cudaGetLastError();
      ok_ = false;
    }
  }
  ~RelaxedCapture() {
    if (ok_) cudaThreadExchangeStreamCaptureMode(&mode_);  // back to the caller's mode
  }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool ok_ = true;
};
}  // namespace

bool NcclComm::prune_locked() {
  RelaxedCapture relaxed;
  while (!ops_.empty()) {
    Op& op = *ops_.front();
    for (size_t i = 0; i < op.done.size(); ++i) {
      cudaError_t e = cudaEventQuery(op.done[i]);
      if (e == cudaErrorNotReady) return false;
      if (e != cudaSuccess) {
        // A sticky error (a faulting kernel, a lost device) breaks the context: NCCL must not be asked
        // to destroy (flush) communicators on it later, so this is an abort, like a timeout.
        cudaGetLastError();
        std::ostringstream os;
        os << "CUDA error while " << op.what << " ran on cuda:" << op.devices[i] << ": " << cudaGetErrorString(e)
           << " (" << cudaGetErrorName(e) << ")";
        const std::string reason = os.str();
        abort_locked(reason);
        detail::fail<CudaError>(__FILE__, __LINE__, reason, "; the communicator was aborted (ncclCommAbort)");
      }
    }
    ops_.pop_front();
  }
  return true;
}

// ---- waiting ---------------------------------------------------------------------------------------

void NcclComm::wait(std::optional<double> timeout_s, uint64_t seq) {
  const double timeout = timeout_s ? checked_timeout(*timeout_s, "timeout_s") : timeout_s_;
  const double deadline = now_s() + timeout;
  uint64_t target = seq;
  try {
    {
      std::lock_guard<std::mutex> lock(mu_);
      check_usable_locked("wait");
      NCCLAVG_CHECK_ARG(seq < next_seq_, "seq", "no collective with sequence number ", seq,
                        " was enqueued (last: ", next_seq_ - 1, ")");
      if (target == 0) target = next_seq_ - 1;
    }
    // The events are queried from this thread: See Note [Device guard without a current context].
    cuda::DeviceGuard guard(devices_[0]);
    Backoff backoff;  // See Note [Watchdog]
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        check_usable_locked("wait");
        if (prune_locked() || ops_.front()->seq > target) return;
        check_async_errors_locked("waiting for " + ops_.front()->what);
        if (now_s() >= deadline) {
          std::ostringstream os;
          os << ops_.front()->what << " did not complete within " << timeout << " s (" << ops_.size()
             << " collective(s) in flight; a peer rank probably died, hangs, or skipped this collective)";
          const std::string reason = os.str();
          abort_locked(reason);
          throw TimeoutError(reason + "; the communicator was aborted (ncclCommAbort)");
        }
      }
      backoff.pause();
    }
  } catch (...) {
    rethrow_after_abort();  // outside mu_: See Note [Abort on a helper thread]
  }
}

bool NcclComm::done(uint64_t seq) {
  try {
    std::lock_guard<std::mutex> lock(mu_);
    check_usable_locked("done");
    NCCLAVG_CHECK_ARG(seq < next_seq_, "seq", "no collective with sequence number ", seq,
                      " was enqueued (last: ", next_seq_ - 1, ")");
    cuda::DeviceGuard guard(devices_[0]);  // See Note [Device guard without a current context]
    if (prune_locked()) return true;
    if (seq != 0 && ops_.front()->seq > seq) return true;
    check_async_errors_locked("checking " + ops_.front()->what);
    return false;
  } catch (...) {
    rethrow_after_abort();
  }
}

void NcclComm::stream_wait(const std::vector<uintptr_t>& streams, uint64_t seq) {
  try {
    std::lock_guard<std::mutex> lock(mu_);
    check_usable_locked("stream_wait");
    NCCLAVG_CHECK_ARG(streams.size() == dev_.size(), "streams", "needs one stream per local device (",
                      dev_.size(), "), got ", streams.size());
    NCCLAVG_CHECK_ARG(seq < next_seq_, "seq", "no collective with sequence number ", seq,
                      " was enqueued (last: ", next_seq_ - 1, ")");
    cuda::DeviceGuard guard(devices_[0]);  // before the first query: See Note [Device guard without a current context]
    stream_wait_locked(streams, seq);
  } catch (...) {
    rethrow_after_abort();
  }
}

void NcclComm::stream_wait_locked(const std::vector<uintptr_t>& streams, uint64_t seq) {
  if (prune_locked()) return;  // nothing in flight: nothing to order after
  // collective `seq` only (0: the last enqueued): a caller ordering bucket 2 must not wait for bucket 7
  const Op* op = ops_.back().get();
  if (seq != 0) {
    if (seq < ops_.front()->seq) return;  // already complete and pruned
    auto it = std::find_if(ops_.begin(), ops_.end(), [&](const std::unique_ptr<Op>& o) { return o->seq == seq; });
    if (it == ops_.end()) return;
    op = it->get();
  }
  for (size_t i = 0; i < dev_.size(); ++i) {
    cuda::DeviceGuard guard(dev_[i]->device);
    NCCLAVG_CUDA_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(streams[i]), op->done[i], 0));
  }
}

// ---- abort and destroy -----------------------------------------------------------------------------

void NcclComm::abort() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    abort_locked("abort() was called");
  }
  await_abort();  // See Note [Abort on a helper thread]
}

void NcclComm::abort_locked(const std::string& reason) {
  if (aborted_ || destroyed_) return;
  aborted_ = true;
  abort_reason_ = reason;
  cuda::TeardownDeviceGuard guard(devices_.empty() ? 0 : devices_[0]);
  if (load_info().loaded) abort_comms_locked();
  release_cuda_locked();
}

// See Note [Abort on a helper thread], Note [Non-blocking init and abort] and, for the order, Note
// [Blocking collectives after a bounded init] in comm_init.cpp.
void NcclComm::abort_comms_locked() {
  struct Target {
    ncclComm_t comm;
    int device;
  };
  std::vector<Target> comms, parents;
  std::vector<std::pair<std::shared_ptr<ncclComm_t>, int>> splits;
  for (auto& d : dev_) {
    if (d->comm) comms.push_back({d->comm, d->device});
    if (d->parent) parents.push_back({d->parent, d->device});
    if (d->split) splits.emplace_back(d->split, d->device);
    d->comm = d->parent = nullptr;
    d->split.reset();
    for (int t = 0; t < 3; ++t) d->has_premul[t] = false;  // freed with their communicator
  }
  auto job = std::make_shared<AbortJob>();
  abort_job_ = job;
  const Api* a = &api();
  std::thread([job, comms, parents, splits, a] {
    // NCCL frees a communicator from its device: set it, so this thread makes no context elsewhere.
    auto abort_on = [a](ncclComm_t c, int device) {
      if (cudaSetDevice(device) != cudaSuccess) cudaGetLastError();
      a->CommAbort(c);
    };
    for (const auto& t : comms) abort_on(t.comm, t.device);  // a stuck kernel stops only on its own flag
    for (const auto& t : parents) abort_on(t.comm, t.device);  // joins a split still in flight
    for (const auto& [slot, device] : splits) {  // written by that split: safe to read once joined
      if (*slot) abort_on(*slot, device);
    }
    std::lock_guard<std::mutex> lock(job->m);
    job->done = true;
    job->cv.notify_all();
  }).detach();
}

std::string NcclComm::await_abort() {
  std::shared_ptr<AbortJob> job;
  double bound = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job = abort_job_;
    bound = abort_join_s();
  }
  if (!job) return "";
  {
    std::unique_lock<std::mutex> lock(job->m);
    if (job->cv.wait_for(lock, std::chrono::duration<double>(bound), [&] { return job->done; })) return "";
  }
  std::ostringstream os;
  os << "; ncclCommAbort had not returned after " << bound << " s (NCCL may be waiting for a peer that keeps its "
     << "connections open, See Note [Abort on a helper thread]) and goes on in the background: keep the buffers "
     << "of the collectives that were in flight alive";
  return os.str();
}

void NcclComm::rethrow_after_abort() {
  const std::string note = await_abort();
  if (note.empty()) throw;
  try {
    throw;
  } catch (const TimeoutError& e) {
    throw TimeoutError(e.what() + note);
  } catch (const CudaError& e) {
    throw CudaError(e.what() + note);
  } catch (const NcclError& e) {
    throw NcclError(e.what() + note);
  }
}

void NcclComm::destroy_comms_locked() {
  const Api& a = api();
  for (auto& d : dev_) {
    if (!d->comm) continue;
    for (int t = 0; t < 3; ++t) {
      if (d->has_premul[t] && a.RedOpDestroy) a.RedOpDestroy(d->premul[t], d->comm);
      d->has_premul[t] = false;
    }
    a.CommDestroy(d->comm);
    d->comm = nullptr;
  }
  for (auto& d : dev_) {  // the init communicators of a split (idle since the split)
    if (d->parent) a.CommDestroy(d->parent);
    d->parent = nullptr;
  }
}

void NcclComm::release_cuda_locked() {
  ops_.clear();  // Op's destructor releases its events
  for (auto& d : dev_) {
    if (d->ready) cudaEventDestroy(d->ready);
    if (d->stream) cudaStreamDestroy(d->stream);  // returns at once; freed when its work is done
    d->ready = nullptr;
    d->stream = nullptr;
  }
}

void NcclComm::destroy() {
  destroy_within(timeout_s_);
  await_abort();
}

void NcclComm::destroy_within(double wait_s) {
  // See Note [Teardown]. Wait outside the lock first (an abort on timeout is done by wait()).
  cuda::TeardownDeviceGuard guard(devices_.empty() ? 0 : devices_[0]);  // the event queries too
  bool healthy = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_ || destroyed_) return;
    closing_ = true;  // from here on no collective is enqueued: the wait below sees all there will be
    healthy = ready_;
  }
  if (healthy) {
    try {
      wait(wait_s);
    } catch (...) {
      // wait() already aborted the communicator and recorded why; teardown below is a no-op then.
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_ || destroyed_) return;
  if (!ready_) {
    abort_locked("its init did not finish");
    return;
  }
  bool idle = false;
  try {
    idle = prune_locked();
  } catch (...) {
    return;  // a CUDA error: prune_locked aborted
  }
  if (!idle) {  // cannot happen after closing_ and a successful wait; never destroy work in flight
    abort_locked("destroy() found collectives still in flight");
    return;
  }
  destroy_comms_locked();
  release_cuda_locked();
  destroyed_ = true;
}

}  // namespace nccl
}  // namespace ncclavg
