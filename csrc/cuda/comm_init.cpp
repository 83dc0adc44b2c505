// NcclComm creation: argument checks, the bounded non-blocking init, and the split to the blocking
// communicators the collectives run on. Waiting, abort and teardown are in comm.cpp.
#include <algorithm>
#include <cstdlib>
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
// ncclSuccess or the error. So init_all / init_rank / init_ranks start the init (all local devices in
// ONE ncclGroupStart/End, as ncclCommInitAll does internally) and poll the state with a deadline. On the
// deadline, ncclCommAbort sets the communicator's abort flag, which NCCL's bootstrap and kernels poll:
// the init thread (or a collective stuck on the device) gives up, and abort frees the communicator
// without waiting for the peers. The same flag is how wait() recovers from a collective that a dead
// or diverged peer will never complete.
// Non-blocking communicators have one more rule: any NCCL call, collectives and ncclGroupEnd included,
// may return ncclInProgress, and until the state is ncclSuccess no other NCCL call may be made on that
// communicator and no kernel may be queued on the streams NCCL uses. Every call that got
// ncclInProgress therefore polls the state back to ncclSuccess (bounded by the call's deadline) before
// it touches the comm streams.
// With NCCL < 2.14 there is no config API: ncclCommInitRank in a group is used and cannot time out
// (the collectives still can: ncclCommAbort exists since 2.4).

// Note [Blocking collectives after a bounded init]
// The non-blocking rule above has a price on every collective: ncclGroupEnd of a non-blocking
// communicator hands the launch to a new NCCL group thread and returns ncclInProgress, and the host
// then polls ncclCommGetAsyncError (under the mutex) until that thread has enqueued the kernels: by
// estimate (not yet measured here) tens of microseconds per bucket, more than a small bucket's whole
// all-reduce. A blocking communicator enqueues in the calling thread. Two ways keep the bounded init and still get blocking collectives:
//  (a) a blocking ncclCommInitRank on a helper thread, aborted at the deadline. Not possible safely:
//      the communicator handle only exists once the blocking init returned, and NCCL requires that
//      no other thread is inside an NCCL call on a communicator while ncclCommAbort runs on it.
//  (b) ncclCommSplit (NCCL >= 2.18) of the non-blocking init communicator into a child with
//      config.blocking = 1, color 0 and key = rank (the same ranks in the same order). The split runs
//      as a job of the PARENT's group, so it is non-blocking too: it is polled through the parent's
//      ncclCommGetAsyncError with the same deadline as the init, and ncclCommAbort(parent) stops it
//      (it sets the child's abort flag as well, then joins the job). This is what NCCL's fault
//      tolerance guide shows, and what ncclavg does.
// The parent is kept until teardown rather than destroyed right after the split, so that teardown and
// abort have one path per mode and never depend on an early destroy finishing. It runs no collective:
// with NCCL >= 2.22 (connections made lazily, at a collective's first use) it holds no transport
// buffers; older NCCL connects rings and trees during init, so there the parent keeps that memory.
// Abort order matters (comm.cpp, abort_comms_locked): the collectives' communicators first (a kernel
// stuck in a collective stops only when its own communicator's flag is set, and NCCL frees the
// intra-process resources of a family of communicators at the last abort of the family), then the
// parents (which joins a split still in flight), then a child that such a split produced.
// The price of (b): a blocking ncclGroupEnd may itself wait for peers (e.g. to set up the connections of
// a collective's first use), and that wait cannot be interrupted from outside; completion (wait(),
// done()) stays bounded and aborts as before. Where that matters more than latency,
// NCCLAVG_NCCL_COLLECTIVES=nonblocking keeps the collectives on the non-blocking communicators. The
// mode in use is NcclComm.collective_mode ("blocking" / "nonblocking") with collective_mode_reason, so
// benchmarks can report it. NCCL < 2.18 (no ncclCommSplit) runs non-blocking; NCCL < 2.14 is blocking
// throughout. (NCCL_COMM_BLOCKING, when set, overrides every config.blocking, so the reported mode
// assumes it is unset.)

// Note [Connections inside the bounded init]
// NCCL >= 2.22 connects an algorithm's peers lazily, at its first collective (NCCL_RUNTIME_CONNECT=1,
// the default), and in blocking mode that happens inside the collective's blocking ncclGroupEnd, which
// waits for the peers with no limit while holding mu_ (which abort() needs too): a peer that dies
// between init and the first collective would hang that call for good. So ncclavg sets
// NCCL_RUNTIME_CONNECT=0 when the variable is unset and blocking collectives are asked for: every
// connection is then made during the init and the split, which run under the init's deadline and can be
// aborted. The cost is memory: all algorithms' buffers are set up at init (the non-blocking parent's
// too), whether or not a collective uses them. NCCL reads the variable once per process, at its first
// communicator: when torch (or anything) made one before ncclavg's first init, or the user set
// NCCL_RUNTIME_CONNECT=1, connections stay lazy, and collective_mode_reason says so. The variable is set
// in Python, once per process, when ncclavg.comm is imported (Note [Setting NCCL_RUNTIME_CONNECT once] in
// ncclavg/_ext.py), never here: an init may run on any thread, and setenv while another thread reads
// the environment (NCCL's and torch's threads do) is undefined behaviour.

namespace {

constexpr const char* kModeEnv = "NCCLAVG_NCCL_COLLECTIVES";

// True unless NCCLAVG_NCCL_COLLECTIVES=nonblocking; any other value than blocking/nonblocking is an error.
// Reads the environment only: See Note [Connections inside the bounded init] for where the
// NCCL_RUNTIME_CONNECT default of blocking collectives is set.
bool blocking_requested() {
  const char* env = std::getenv(kModeEnv);
  const std::string v = env ? env : "";
  if (v.empty() || v == "blocking") return true;
  if (v == "nonblocking") return false;
  detail::fail<ArgError>(__FILE__, __LINE__, "environment variable ", kModeEnv,
                         ": must be 'blocking' or 'nonblocking' (See Note [Blocking collectives after a bounded "
                         "init]), got '", v, "'");
}

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

// A device listed twice is one more rank on that GPU: allowed only where NCCL allows it.
// See Note [Several ranks on one GPU] in nccl_api.cpp.
void check_repeated_devices(const std::vector<int>& devices) {
  for (size_t i = 0; i < devices.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (devices[j] != devices[i]) continue;
      const std::string refusal = multi_rank_gpu_refusal();
      NCCLAVG_CHECK_ARG(refusal.empty(), "devices[" + std::to_string(i) + "]", "device ", devices[i],
                        " is listed twice (also devices[", j, "]), i.e. two NCCL ranks on one GPU: ", refusal);
    }
  }
}

// Every entry a visible device; a repeated one only where NCCL allows several ranks on one GPU.
void check_local_devices(const std::vector<int>& devices) {
  const int count = visible_device_count();
  for (size_t i = 0; i < devices.size(); ++i) check_device(devices[i], count, "devices[" + std::to_string(i) + "]");
  check_repeated_devices(devices);
}

ncclUniqueId checked_unique_id(const std::string& unique_id) {
  NCCLAVG_CHECK_ARG(unique_id.size() == sizeof(ncclUniqueId), "unique_id", "must be the ", sizeof(ncclUniqueId),
                    " bytes of nccl_unique_id(), got ", unique_id.size(), " bytes");
  ncclUniqueId id;
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  return id;
}

}  // namespace

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
    // The highest priority the device offers (DDP's comm streams do the same): a bucket's collective,
    // issued while backward still queues kernels, is scheduled ahead of them, so the overlap holds.
    int least = 0, greatest = 0;
    NCCLAVG_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    NCCLAVG_CUDA_CHECK(cudaStreamCreateWithPriority(&dev->stream, cudaStreamNonBlocking, greatest));
    NCCLAVG_CUDA_CHECK(cudaEventCreateWithFlags(&dev->ready, cudaEventDisableTiming));
    c->dev_.push_back(std::move(dev));
  }
  return c;
}

std::unique_ptr<NcclComm> NcclComm::init_all(const std::vector<int>& devices, double timeout_s) {
  checked_timeout(timeout_s, "timeout_s");
  NCCLAVG_CHECK_ARG(!devices.empty(), "devices", "needs at least one CUDA device ordinal, got an empty list");
  const bool want_blocking = blocking_requested();
  const Api& a = api();  // NcclError with the install hint when NCCL is missing
  check_local_devices(devices);
  auto c = create(devices, 0, timeout_s);
  ncclUniqueId id;
  NCCLAVG_NCCL_CHECK(a.GetUniqueId(&id), nullptr);
  std::vector<int> ranks(devices.size());
  for (size_t i = 0; i < ranks.size(); ++i) ranks[i] = static_cast<int>(i);
  c->init_comms(id, static_cast<int>(devices.size()), ranks, want_blocking,
                "NCCL init of " + std::to_string(devices.size()) + " rank(s) on devices " + list_string(devices));
  return c;
}

std::unique_ptr<NcclComm> NcclComm::init_rank(const std::string& unique_id, int nranks, int rank, int device,
                                              double timeout_s) {
  checked_timeout(timeout_s, "timeout_s");
  const ncclUniqueId id = checked_unique_id(unique_id);
  NCCLAVG_CHECK_ARG(nranks >= 1, "nranks", "must be >= 1, got ", nranks);
  NCCLAVG_CHECK_ARG(rank >= 0 && rank < nranks, "rank", "must be in [0, nranks) = [0, ", nranks, "), got ", rank);
  const bool want_blocking = blocking_requested();
  api();
  check_device(device, visible_device_count(), "device");
  return init_process_ranks(id, nranks, rank, {device}, timeout_s, want_blocking,
                            "NCCL init of rank " + std::to_string(rank) + " of " + std::to_string(nranks) +
                                " on cuda:" + std::to_string(device) +
                                " (does every rank call init_rank with the same unique id?)");
}

std::unique_ptr<NcclComm> NcclComm::init_ranks(const std::string& unique_id, int nranks, int first_rank,
                                               const std::vector<int>& devices, double timeout_s) {
  checked_timeout(timeout_s, "timeout_s");
  const ncclUniqueId id = checked_unique_id(unique_id);
  NCCLAVG_CHECK_ARG(!devices.empty(), "devices", "needs at least one CUDA device ordinal, got an empty list");
  NCCLAVG_CHECK_ARG(nranks >= 1, "nranks", "must be >= 1, got ", nranks);
  const long long last = static_cast<long long>(first_rank) + static_cast<long long>(devices.size()) - 1;
  NCCLAVG_CHECK_ARG(first_rank >= 0 && last < nranks, "first_rank", "ranks ", first_rank, "..", last, " (one per "
                    "device) must lie in [0, nranks) = [0, ", nranks, "), got first_rank ", first_rank, " with ",
                    devices.size(), " device(s)");
  const bool want_blocking = blocking_requested();
  api();
  check_local_devices(devices);
  return init_process_ranks(id, nranks, first_rank, devices, timeout_s, want_blocking,
                            "NCCL init of ranks " + std::to_string(first_rank) + ".." + std::to_string(last) +
                                " of " + std::to_string(nranks) + " on devices " + list_string(devices) +
                                " (does every process call init_ranks with the same unique id and nranks, "
                                "and ranks numbered process-major?)");
}

std::unique_ptr<NcclComm> NcclComm::init_process_ranks(const ncclUniqueId& id, int nranks, int first_rank,
                                                       const std::vector<int>& devices, double timeout_s,
                                                       bool want_blocking, const std::string& what) {
  // This process's (first) rank lives on devices[0]: make it the calling thread's device when the thread
  // has not chosen one (NCCL's examples do cudaSetDevice before ncclCommInitRank). A thread that already
  // chose a device keeps it. See Note [Device guard without a current context] in device_guard.cpp.
  if (cuda::current_device_or_none() < 0) NCCLAVG_CUDA_CHECK(cudaSetDevice(devices[0]));
  auto c = create(devices, first_rank, timeout_s);
  std::vector<int> ranks(devices.size());
  for (size_t i = 0; i < ranks.size(); ++i) ranks[i] = first_rank + static_cast<int>(i);
  c->init_comms(id, nranks, ranks, want_blocking, what);
  return c;
}

void NcclComm::init_comms(const ncclUniqueId& id, int nranks, const std::vector<int>& comm_ranks, bool want_blocking,
                          const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  const Deadline deadline = deadline_in(timeout_s_);  // init and split share one limit
  int forced_divisor = 0;   // See Note [Forcing the reduction in tests] in comm_collectives.cpp
  if (const char* v = std::getenv("NCCLAVG_TEST_REDUCTION"); v && v[0]) {
    parse_test_reduction(v, &forced_reduction_, &forced_divisor);
    NCCLAVG_CHECK_ARG(forced_reduction_ != "avg" || forced_divisor == 0 || forced_divisor == nranks,
                      "NCCLAVG_TEST_REDUCTION", "avg divides by the number of ranks (", nranks,
                      "); no other divisor can be given, got ", forced_divisor);
  }
  const bool nonblocking_init = api().CommInitRankConfig != nullptr;
  const bool split = choose_mode_locked(nonblocking_init, want_blocking);
  if (dev_.size() > 1) {  // See Note [Abort on a helper thread] in comm.cpp
    std::ostringstream os;
    os << "; " << dev_.size() << " ranks in this process: NCCL's directMode, where ncclCommAbort may wait for a "
       << "frozen peer (aborts run on a helper thread, waited for at most " << abort_join_s() << " s)";
    mode_reason_ += os.str();
  }
  start_init_locked(id, nranks, comm_ranks, nonblocking_init, what);
  if (nonblocking_init) poll_ready_locked(deadline, what);
  if (split) split_blocking_locked(comm_ranks, deadline, what);
  read_back_locked(nranks, comm_ranks);
  divisor_ = forced_divisor ? forced_divisor : size_;
  ready_ = true;
}

// Sets mode_ / mode_reason_; true when the init communicators are to be split into blocking ones.
// See Note [Blocking collectives after a bounded init].
bool NcclComm::choose_mode_locked(bool nonblocking_init, bool want_blocking) {
  const std::string loaded = "NCCL " + version_string(version_);
  if (!nonblocking_init) {
    mode_ = "blocking";
    mode_reason_ = loaded + " has no non-blocking init (needs " + version_string(since::kNonBlocking) +
                   "): blocking communicators throughout, their init cannot time out";
    return false;
  }
  mode_ = "nonblocking";
  if (!want_blocking) {
    mode_reason_ = std::string(kModeEnv) + "=nonblocking";
    return false;
  }
  if (api().CommSplit == nullptr || !at_least(since::kCommSplit)) {
    mode_reason_ = loaded + " has no ncclCommSplit (needs " + version_string(since::kCommSplit) +
                   "): collectives run on the non-blocking init communicators";
    return false;
  }
  mode_ = "blocking";
  mode_reason_ = "ncclCommSplit (config.blocking = 1) of the non-blocking init communicators";
  const char* rc = std::getenv("NCCL_RUNTIME_CONNECT");
  if (at_least(since::kRuntimeConnect)) {   // See Note [Connections inside the bounded init]
    mode_reason_ += (rc && std::string(rc) == "0")
        ? "; connections made during init (NCCL_RUNTIME_CONNECT=0, unless an earlier communicator of this "
          "process read it first)"
        : std::string("; connections made at each algorithm's first collective (NCCL_RUNTIME_CONNECT=") +
              (rc ? rc : "") + "): a peer lost before it can hang that call";
  }
  return true;
}

// Starts the init of every local rank in ONE group (what ncclCommInitAll does inside). Non-blocking:
// returns with the communicators in ncclInProgress; the caller polls them.
void NcclComm::start_init_locked(const ncclUniqueId& id, int nranks, const std::vector<int>& comm_ranks,
                                 bool nonblocking, const std::string& what) {
  const Api& a = api();
  ncclConfig_t config = default_config();
  config.blocking = 0;  // See Note [Non-blocking init and abort]
  ncclResult_t first_err = ncclSuccess;
  std::string first_err_where;
  cudaError_t cuda_err = cudaSuccess;
  {
    cuda::DeviceGuard guard(devices_[0]);  // restores the caller's device afterwards, if it had one
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
  if (cuda_err == cudaSuccess && first_err == ncclSuccess) return;
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

// Splits every ready init communicator into a blocking child of the same ranks, in ONE group, bounded
// by `deadline`. See Note [Blocking collectives after a bounded init].
void NcclComm::split_blocking_locked(const std::vector<int>& comm_ranks, const Deadline& deadline,
                                     const std::string& what) {
  const Api& a = api();
  ncclConfig_t config = default_config();
  config.blocking = 1;
  for (auto& d : dev_) {
    d->parent = d->comm;  // from here on abort_comms_locked sees the parents and the split slots
    d->comm = nullptr;
    d->split = std::make_shared<ncclComm_t>(nullptr);
  }
  const std::string step = what + ", ncclCommSplit to blocking communicators";
  ncclResult_t first_err = ncclSuccess;
  size_t first_i = 0;
  bool in_progress = false;
  NCCLAVG_NCCL_CHECK(a.GroupStart(), nullptr);
  for (size_t i = 0; i < dev_.size(); ++i) {
    // color 0: one child with every rank; key = rank: the same order. NCCL sets the device itself.
    ncclResult_t r = a.CommSplit(dev_[i]->parent, 0, comm_ranks[i], dev_[i]->split.get(), &config);
    in_progress |= r == ncclInProgress;
    if (r != ncclSuccess && r != ncclInProgress && first_err == ncclSuccess) {
      first_err = r;
      first_i = i;
    }
  }
  const ncclResult_t end = a.GroupEnd();
  in_progress |= end == ncclInProgress;
  if (first_err == ncclSuccess && end != ncclSuccess && end != ncclInProgress) first_err = end;
  if (first_err != ncclSuccess) {
    const std::string msg = step + " failed on cuda:" + std::to_string(dev_[first_i]->device) + ": " +
                            nccl_words(first_err, dev_[first_i]->parent);
    abort_locked(msg);
    throw NcclError(msg + "; the communicators were aborted");
  }
  if (in_progress) poll_ready_locked(deadline, step, Which::kParent);
  for (auto& d : dev_) {
    if (*d->split == nullptr) {
      const std::string msg = step + " gave no communicator on cuda:" + std::to_string(d->device);
      abort_locked(msg);
      throw NcclError(msg + "; the communicators were aborted");
    }
  }
  for (auto& d : dev_) {
    d->comm = *d->split;
    d->split.reset();
  }
}

// The communicators are ready: reads back what NCCL made of them and checks it.
void NcclComm::read_back_locked(int nranks, const std::vector<int>& comm_ranks) {
  const Api& a = api();
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
}

}  // namespace nccl
}  // namespace ncclavg
