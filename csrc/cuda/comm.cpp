// NcclComm lifecycle and watchdog: init, wait/done, stream ordering, abort, destroy. The collectives
// themselves are in comm_collectives.cpp.
#include <cmath>
#include <sstream>

#include "../common/check.h"
#include "comm_impl.h"

namespace ncclavg {
namespace nccl {

// Note [Non-blocking init and abort]
// A blocking ncclCommInitRank waits inside NCCL until every rank has joined: a rank that never starts
// hangs the others forever, and nothing can interrupt the call. Since NCCL 2.14 a communicator made
// with ncclCommInitRankConfig and config.blocking = 0 returns at once (ncclInProgress) and finishes
// its init on NCCL's own thread; ncclCommGetAsyncError reports ncclInProgress until it is done, then
// ncclSuccess or the error. So init_all / init_rank start the init (all local devices in ONE
// ncclGroupStart/End, as ncclCommInitAll does internally) and poll the state with a deadline. On the
// deadline, ncclCommAbort sets the communicator's abort flag, which NCCL's bootstrap and kernels poll:
// the init thread (or a collective stuck on the device) gives up, and abort frees the communicator
// without waiting for the peers. The same flag is how wait() recovers from a collective that a dead
// or diverged peer will never complete.
// Non-blocking communicators have one more rule: any NCCL call, collectives and ncclGroupEnd included,
// may return ncclInProgress, and until the state is ncclSuccess no other NCCL call may be made on that
// communicator and no kernel may be queued on the streams NCCL uses. Every call here therefore polls
// the state back to ncclSuccess (bounded by the same deadline) before it touches the comm streams.
// With NCCL < 2.14 there is no config API: ncclCommInitRank in a group is used and cannot time out
// (the collectives still can: ncclCommAbort exists since 2.4).

// Note [Watchdog]
// There is no watchdog thread: whoever waits (wait(), done(), destroy()) polls, without holding the
// mutex while sleeping, (1) the per-device done events of the collectives still in flight and
// (2) ncclCommGetAsyncError of every local communicator. An async error aborts every local
// communicator and raises NcclError with NCCL's words; the deadline aborts and raises TimeoutError
// naming the oldest unfinished collective, its bytes, ranks and devices. Either way the object is
// marked aborted and every later call raises NcclError("communicator was aborted after ...").
// Completed collectives are dropped from the front of the in-flight queue: each comm stream runs in
// order, so completion is always a prefix of the queue.

// Note [Teardown]
// destroy() waits (bounded by the communicator's timeout) for the collectives in flight, then calls
// ncclCommDestroy, which is blocking even for non-blocking communicators and does not communicate.
// A collective that does not finish in time turns destroy into an abort, so teardown can never hang.
// The destructor does the same and swallows every error; the Python binding releases the GIL before
// running it (see the holder in bindings.cpp), so a bounded wait there blocks no other Python thread.

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

namespace {

int visible_device_count() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    detail::fail<CudaError>(__FILE__, __LINE__, "the NCCL backend needs a CUDA device, but cudaGetDeviceCount "
                            "failed: ", cudaGetErrorString(e), " (", cudaGetErrorName(e), ")");
  }
  if (n == 0) {
    detail::fail<CudaError>(__FILE__, __LINE__, "the NCCL backend needs a CUDA device, but none is visible "
                            "(CUDA_VISIBLE_DEVICES?)");
  }
  return n;
}

void check_device(int device, int count, const std::string& argname) {
  NCCLAVG_CHECK_ARG(device >= 0 && device < count, argname, "CUDA device ", device,
                    " does not exist: this process sees ", count, " device(s), 0..", count - 1);
}

}  // namespace

std::string nccl_words(ncclResult_t r, ncclComm_t comm) {
  const Api& a = api();
  std::string s = a.GetErrorString(r);
  if (a.GetLastError) {
    const char* last = a.GetLastError(comm);
    if (last && last[0]) s += std::string(": ") + last;
  }
  return s;
}

// ---- creation --------------------------------------------------------------------------------------

std::string NcclComm::unique_id() {
  const Api& a = api();
  ncclUniqueId id;
  NCCLAVG_NCCL_CHECK(a.GetUniqueId(&id), nullptr);
  return std::string(id.internal, sizeof(id.internal));
}

std::unique_ptr<NcclComm> NcclComm::create(const std::vector<int>& devices, int process_rank,
                                           double timeout_s) {
  std::unique_ptr<NcclComm> c(new NcclComm());
  c->devices_ = devices;
  c->process_rank_ = process_rank;
  c->timeout_s_ = timeout_s;
  c->version_ = load_info().version;
  for (int d : devices) {
    auto dev = std::make_unique<Device>();
    dev->device = d;
    cuda::DeviceGuard guard(d);
    NCCLAVG_CUDA_CHECK(cudaStreamCreateWithFlags(&dev->stream, cudaStreamNonBlocking));
    NCCLAVG_CUDA_CHECK(cudaEventCreateWithFlags(&dev->ready, cudaEventDisableTiming));
    c->dev_.push_back(std::move(dev));
  }
  return c;
}

std::unique_ptr<NcclComm> NcclComm::init_all(const std::vector<int>& devices, double timeout_s) {
  checked_timeout(timeout_s, "timeout_s");
  NCCLAVG_CHECK_ARG(!devices.empty(), "devices", "needs at least one CUDA device ordinal, got an empty list");
  const Api& a = api();  // NcclError with the install hint when NCCL is missing
  const int count = visible_device_count();
  for (size_t i = 0; i < devices.size(); ++i) {
    const std::string what = "devices[" + std::to_string(i) + "]";
    check_device(devices[i], count, what);
    for (size_t j = 0; j < i; ++j) {
      NCCLAVG_CHECK_ARG(devices[j] != devices[i], what, "device ", devices[i], " is listed twice (also devices[",
                        j, "]); one process drives each device once (several ranks on one GPU need "
                        "one process per rank, NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1)");
    }
  }
  auto c = create(devices, 0, timeout_s);
  ncclUniqueId id;
  NCCLAVG_NCCL_CHECK(a.GetUniqueId(&id), nullptr);
  std::vector<int> ranks(devices.size());
  for (size_t i = 0; i < ranks.size(); ++i) ranks[i] = static_cast<int>(i);
  c->init_comms(id, static_cast<int>(devices.size()), ranks,
                "NCCL init of " + std::to_string(devices.size()) + " rank(s) on devices " + list_string(devices));
  return c;
}

std::unique_ptr<NcclComm> NcclComm::init_rank(const std::string& unique_id, int nranks, int rank, int device,
                                              double timeout_s) {
  checked_timeout(timeout_s, "timeout_s");
  NCCLAVG_CHECK_ARG(unique_id.size() == sizeof(ncclUniqueId), "unique_id", "must be the ", sizeof(ncclUniqueId),
                    " bytes of nccl_unique_id(), got ", unique_id.size(), " bytes");
  NCCLAVG_CHECK_ARG(nranks >= 1, "nranks", "must be >= 1, got ", nranks);
  NCCLAVG_CHECK_ARG(rank >= 0 && rank < nranks, "rank", "must be in [0, nranks) = [0, ", nranks, "), got ", rank);
  api();
  check_device(device, visible_device_count(), "device");
  auto c = create({device}, rank, timeout_s);
  ncclUniqueId id;
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  c->init_comms(id, nranks, {rank},
                "NCCL init of rank " + std::to_string(rank) + " of " + std::to_string(nranks) + " on cuda:" +
                    std::to_string(device) + " (does every rank call init_rank with the same unique id?)");
  return c;
}

void NcclComm::init_comms(const ncclUniqueId& id, int nranks, const std::vector<int>& comm_ranks,
                          const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  const Api& a = api();
  const double deadline = now_s() + timeout_s_;
  const bool nonblocking = a.CommInitRankConfig != nullptr;
  ncclConfig_t config = default_config();
  config.blocking = 0;  // See Note [Non-blocking init and abort]

  ncclResult_t first_err = ncclSuccess;
  std::string first_err_where;
  cudaError_t cuda_err = cudaSuccess;
  {
    cuda::DeviceGuard guard(devices_[0]);  // restores the caller's device afterwards
    NCCLAVG_NCCL_CHECK(a.GroupStart(), nullptr);
    for (size_t i = 0; i < dev_.size(); ++i) {
      // NCCL takes the device of a new communicator from the calling thread's current device.
      cudaError_t e = cudaSetDevice(dev_[i]->device);
      if (e != cudaSuccess) {
        if (cuda_err == cudaSuccess) cuda_err = e;
        continue;  // no early exit between GroupStart and GroupEnd
      }
      ncclResult_t r = nonblocking
                           ? a.CommInitRankConfig(&dev_[i]->comm, nranks, id, comm_ranks[i], &config)
                           : a.CommInitRank(&dev_[i]->comm, nranks, id, comm_ranks[i]);
      if (r != ncclSuccess && r != ncclInProgress && first_err == ncclSuccess) {
        first_err = r;
        first_err_where = "cuda:" + std::to_string(dev_[i]->device);
      }
    }
    ncclResult_t r = a.GroupEnd();
    if (r != ncclSuccess && r != ncclInProgress && first_err == ncclSuccess) {
      first_err = r;
      first_err_where = "ncclGroupEnd";
    }
  }
  if (cuda_err != cudaSuccess || first_err != ncclSuccess) {
    std::string msg = what + " failed: ";
    if (cuda_err != cudaSuccess) {
      msg += std::string("cudaSetDevice: ") + cudaGetErrorString(cuda_err);
    } else {
      msg += nccl_words(first_err, nullptr) + " (at " + first_err_where + ")";
    }
    abort_locked(msg);
    if (cuda_err != cudaSuccess) throw CudaError(msg);
    throw NcclError(msg);
  }
  if (nonblocking) poll_ready_locked(deadline, what);

  // The communicators are ready: read back what NCCL made of them.
  size_ = nranks;
  ranks_.assign(dev_.size(), -1);
  for (size_t i = 0; i < dev_.size(); ++i) {
    int count = 0, user_rank = -1, cu_dev = -1;
    NCCLAVG_NCCL_CHECK(a.CommCount(dev_[i]->comm, &count), dev_[i]->comm);
    NCCLAVG_NCCL_CHECK(a.CommUserRank(dev_[i]->comm, &user_rank), dev_[i]->comm);
    NCCLAVG_NCCL_CHECK(a.CommCuDevice(dev_[i]->comm, &cu_dev), dev_[i]->comm);
    NCCLAVG_CHECK_INTERNAL(count == nranks && user_rank == comm_ranks[i] && cu_dev == dev_[i]->device,
                           "NCCL communicator ", i, " reports ", count, " ranks, rank ", user_rank, ", device ",
                           cu_dev, "; expected ", nranks, ", ", comm_ranks[i], ", ", dev_[i]->device);
    ranks_[i] = user_rank;
  }
  ready_ = true;
}

NcclComm::~NcclComm() {
  try {
    destroy();
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
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_ || destroyed_) return 0;
  prune_locked();
  return ops_.size();
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
    if (!d->comm) continue;
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = a.CommGetAsyncError(d->comm, &state);
    if (r != ncclSuccess) state = r;
    if (state == ncclSuccess || state == ncclInProgress) continue;
    std::ostringstream os;
    os << "NCCL reported an error on cuda:" << d->device << " (" << where() << ") while " << during << ": "
       << nccl_words(state, d->comm);
    const std::string reason = os.str();
    abort_locked(reason);
    throw NcclError(reason + "; the communicator was aborted");
  }
}

void NcclComm::poll_ready_locked(double deadline, const std::string& what) {
  // Holding mu_ while sleeping is fine here: this is the enqueue (or init) of a non-blocking
  // communicator, which NCCL finishes in milliseconds unless a peer is missing.
  const Api& a = api();
  Backoff backoff;
  while (true) {
    bool in_progress = false;
    for (const auto& d : dev_) {
      if (!d->comm) continue;
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = a.CommGetAsyncError(d->comm, &state);
      if (r != ncclSuccess) state = r;
      if (state == ncclInProgress) {
        in_progress = true;
      } else if (state != ncclSuccess) {
        const std::string reason = what + " failed on cuda:" + std::to_string(d->device) + ": " +
                                   nccl_words(state, d->comm);
        abort_locked(reason);
        throw NcclError(reason + "; the communicator was aborted");
      }
    }
    if (!in_progress) return;
    if (now_s() >= deadline) {
      std::ostringstream os;
      os << what << " did not complete within " << timeout_s_ << " s";
      const std::string reason = os.str();
      abort_locked(reason);
      throw TimeoutError(reason + "; the communicator was aborted (ncclCommAbort)");
    }
    backoff.pause();
  }
}

bool NcclComm::prune_locked() {
  while (!ops_.empty()) {
    Op& op = *ops_.front();
    for (size_t i = 0; i < op.done.size(); ++i) {
      cudaError_t e = cudaEventQuery(op.done[i]);
      if (e == cudaErrorNotReady) return false;
      if (e != cudaSuccess) {
        cudaGetLastError();
        detail::fail<CudaError>(__FILE__, __LINE__, "CUDA error while ", op.what, " ran on cuda:", op.devices[i],
                                ": ", cudaGetErrorString(e), " (", cudaGetErrorName(e), ")");
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_usable_locked("wait");
    NCCLAVG_CHECK_ARG(seq < next_seq_, "seq", "no collective with sequence number ", seq,
                      " was enqueued (last: ", next_seq_ - 1, ")");
    if (target == 0) target = next_seq_ - 1;
  }
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
}

bool NcclComm::done(uint64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable_locked("done");
  NCCLAVG_CHECK_ARG(seq < next_seq_, "seq", "no collective with sequence number ", seq,
                    " was enqueued (last: ", next_seq_ - 1, ")");
  if (prune_locked()) return true;
  if (seq != 0 && ops_.front()->seq > seq) return true;
  check_async_errors_locked("checking " + ops_.front()->what);
  return false;
}

void NcclComm::stream_wait(const std::vector<uintptr_t>& streams) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable_locked("stream_wait");
  NCCLAVG_CHECK_ARG(streams.size() == dev_.size(), "streams", "needs one stream per local device (",
                    dev_.size(), "), got ", streams.size());
  if (prune_locked()) return;  // nothing in flight: nothing to order after
  const Op& last = *ops_.back();
  for (size_t i = 0; i < dev_.size(); ++i) {
    cuda::DeviceGuard guard(dev_[i]->device);
    NCCLAVG_CUDA_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(streams[i]), last.done[i], 0));
  }
}

// ---- abort and destroy -----------------------------------------------------------------------------

void NcclComm::abort() {
  std::lock_guard<std::mutex> lock(mu_);
  abort_locked("abort() was called");
}

void NcclComm::abort_locked(const std::string& reason) {
  if (aborted_ || destroyed_) return;
  aborted_ = true;
  abort_reason_ = reason;
  if (load_info().loaded) {
    const Api& a = api();
    for (auto& d : dev_) {
      if (d->comm) a.CommAbort(d->comm);  // See Note [Non-blocking init and abort]
      d->comm = nullptr;
    }
  }
  release_cuda_locked();
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
  // See Note [Teardown]. Wait outside the lock first (an abort on timeout is done by wait()).
  bool healthy = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_ || destroyed_) return;
    healthy = ready_;
  }
  if (healthy) {
    try {
      wait(std::nullopt);
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
  destroy_comms_locked();
  release_cuda_locked();
  destroyed_ = true;
}

}  // namespace nccl
}  // namespace ncclavg
