// The stand-in libnccl's entry points: the C ABI that csrc/cuda/nccl_api.h declares, over the emulated
// CUDA runtime of the process that loads it (cudaLaunchHostFunc puts each collective on its stream).
// A test double: See nccl_standin.h and docs/cuda_emulation.md.
//
// NCCLEMU_API (a version code, set by the build) decides which entry points exist, as in the NCCL
// release of that number: the optional ones of nccl_api.h are then missing from the library, so every
// version gate of the code under test is taken. NCCLEMU_VERSION (environment) may report another
// version of the same feature set.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "nccl_standin.h"

#ifndef NCCLEMU_API
#define NCCLEMU_API 22809
#endif
#define NCCLEMU_EXPORT extern "C" __attribute__((visibility("default")))

using namespace ncclemu;

namespace {

// Counters a test reads through ncclEmuStats (nccl_standin_stats.h mirrors the struct).
struct Stats {
  std::atomic<long> inits{0}, destroys{0}, aborts{0}, collectives{0}, misuse{0}, destroy_in_flight{0};
};
Stats g_stats;
std::mutex g_misuse_mu;
std::string g_last_misuse;
std::atomic<long> g_calls{0}, g_group_ends{0};

void misuse(const std::string& what) {
  g_stats.misuse.fetch_add(1);
  std::lock_guard<std::mutex> lock(g_misuse_mu);
  g_last_misuse = what;
  std::fprintf(stderr, "ncclemu: MISUSE: %s\n", what.c_str());
}

thread_local std::string tl_last_error;

ncclResult_t fail(ncclResult_t r, const std::string& why) {
  tl_last_error = why;
  return r;
}

double env_double(const char* name, double dflt) {
  const char* v = std::getenv(name);
  return v && v[0] ? std::atof(v) : dflt;
}

// "<a>:<b>" -> a, b (b optional)
void env_pair(const char* name, long* a, long* b) {
  const char* v = std::getenv(name);
  if (!v || !v[0]) return;
  *a = std::strtol(v, nullptr, 10);
  if (const char* colon = std::strchr(v, ':')) *b = std::strtol(colon + 1, nullptr, 10);
}

// A call on a communicator that is gone or not ready is a bug in the caller: counted and refused.
ncclResult_t check_comm(ncclComm* c, const char* call) {
  if (!c) return fail(ncclInvalidArgument, std::string(call) + ": comm is NULL");
  if (c->dead.load()) {
    misuse(std::string(call) + " on a destroyed or aborted communicator");
    return fail(ncclInvalidUsage, "communicator was destroyed or aborted");
  }
  if (c->state.load() == ncclInProgress) {
    misuse(std::string(call) + " while the communicator is ncclInProgress");
    return fail(ncclInvalidUsage, "communicator is still in progress");
  }
  return ncclSuccess;
}

// ---- groups ----------------------------------------------------------------------------------------

struct Job {
  enum Type { kInit, kSplit, kColl } type;
  ncclComm* comm = nullptr;      // init: the new comm; split: the child; coll: the comm
  ncclComm** out = nullptr;      // split: where the child goes once made
  Collective* coll = nullptr;
  cudaStream_t stream = nullptr;
};
thread_local int tl_depth = 0;
thread_local std::vector<Job> tl_jobs;
// The first error of a call inside the open group: NCCL's ncclGroupEnd then launches nothing of the
// group and returns it (a half-launched group would leave the peers waiting).
thread_local ncclResult_t tl_group_error = ncclSuccess;

ncclResult_t in_group(ncclResult_t r) {
  if (r != ncclSuccess && tl_depth > 0 && tl_group_error == ncclSuccess) tl_group_error = r;
  return r;
}

ncclResult_t do_init(ncclComm* c) {
  ncclResult_t r = open_control(c);
  if (r == ncclSuccess) r = join(c);
  if (r == ncclSuccess && c->parent) c->rank = rank_by_key(c);
  if (r == ncclSuccess && c->abort.load()) r = ncclInternalError;  // aborted while joining
  c->ready_at.store(now_s());
  if (r == ncclSuccess) g_stats.inits.fetch_add(1);
  return r;
}

void launch(const Job& j) {
  cudaSetDevice(j.comm->device);  // NCCL's own threads set the communicator's device first
  g_stats.collectives.fetch_add(1);
  const cudaError_t e = cudaLaunchHostFunc(
      j.stream, [](void* p) { run_collective(static_cast<Collective*>(p)); }, j.coll);
  if (e != cudaSuccess) {
    j.comm->state.store(ncclUnhandledCudaError);
    delete j.coll;
  }
}

ncclResult_t run_group(std::vector<Job> jobs) {
  ncclResult_t first = ncclSuccess;
  bool in_progress = false;
  std::vector<std::thread> blocking;
  std::vector<Job> async_colls;
  for (const Job& j : jobs) {
    if (j.type == Job::kColl) {
      if (j.comm->blocking) {
        launch(j);
      } else {
        async_colls.push_back(j);
      }
      continue;
    }
    // init and split: each on its own thread (all ranks of the group join together)
    ncclComm* c = j.comm;
    ncclComm* owner = j.type == Job::kSplit ? c->parent : c;  // a split is a job of its parent
    auto body = [c, j, owner] {
      if (j.type == Job::kSplit) cudaSetDevice(c->device);
      ncclResult_t r = ncclSuccess;
      if (j.type == Job::kSplit && c->faults.split == "fail") {
        r = fail(ncclInternalError, "emulated split failure (NCCLEMU_SPLIT=fail)");
      } else {
        r = do_init(c);
      }
      if (r == ncclSuccess && j.type == Job::kSplit && c->faults.split != "null") *j.out = c;
      c->state.store(r);
      if (owner != c) owner->state.store(r);
    };
    if (!owner->blocking) {
      owner->state.store(ncclInProgress);
      if (owner != c) c->state.store(ncclInProgress);
      std::lock_guard<std::mutex> lock(owner->m);
      if (owner->job.joinable()) owner->job.join();  // its previous job (the init) has finished
      owner->job = std::thread(body);
      in_progress = true;
    } else {
      blocking.emplace_back(body);
    }
  }
  for (auto& t : blocking) t.join();
  for (const Job& j : jobs) {
    if (j.type != Job::kColl && j.comm->blocking && first == ncclSuccess && j.comm->state.load() != ncclSuccess)
      first = static_cast<ncclResult_t>(j.comm->state.load());
  }
  if (!async_colls.empty()) {
    // A non-blocking group launches on NCCL's group thread, a little later: until then the communicator
    // is ncclInProgress and the caller must not touch its stream (Note [Non-blocking init and abort]).
    std::vector<ncclComm*> comms;
    for (const Job& j : async_colls) {
      j.comm->state.store(ncclInProgress);
      comms.push_back(j.comm);
    }
    const double delay = async_colls[0].comm->faults.enqueue_delay_s;
    std::thread([async_colls, comms, delay] {
      sleep_s(delay);
      for (const Job& j : async_colls) launch(j);
      for (ncclComm* c : comms) {
        int expect = ncclInProgress;
        c->state.compare_exchange_strong(expect, ncclSuccess);
      }
    }).detach();
    in_progress = true;
  }
  if (first != ncclSuccess) return first;
  return in_progress ? ncclInProgress : ncclSuccess;
}

ncclResult_t submit(Job j) {
  if (tl_depth > 0) {
    tl_jobs.push_back(j);
    return ncclSuccess;
  }
  std::vector<Job> one{j};
  return run_group(std::move(one));
}

ncclComm* new_comm(int nranks, int rank, int device, bool blocking) {
  auto* c = new ncclComm();  // never freed: a later call on it is reported as misuse, not a crash
  c->nranks = nranks;
  c->rank = rank;
  c->device = device;
  c->blocking = blocking;
  c->faults = faults_from_env();
  c->state.store(ncclSuccess);
  return c;
}

bool config_ok(const ncclConfig_t* config) {
  return config->magic == 0xcafebeef && config->size >= offsetof(ncclConfig_t, netName) + sizeof(void*);
}

int reported_version() { return static_cast<int>(env_double("NCCLEMU_VERSION", NCCLEMU_API)); }

ncclResult_t init_rank(ncclComm** out, int nranks, ncclUniqueId id, int rank, bool blocking) {
  if (!out) return fail(ncclInvalidArgument, "comm out pointer is NULL");
  if (nranks < 1 || nranks > kMaxRanks) return fail(ncclInvalidArgument, "nranks out of range");
  if (rank < 0 || rank >= nranks) return fail(ncclInvalidArgument, "rank out of range");
  if (std::memcmp(id.internal, "NCCLEMU", 7) != 0) return fail(ncclInvalidArgument, "not a stand-in unique id");
  int device = 0;
  cudaGetDevice(&device);  // the calling thread's device, as NCCL takes it
  ncclComm* c = new_comm(nranks, rank, device, blocking);
  c->dir = id_dir(id);
  *out = c;
  Job j;
  j.type = Job::kInit;
  j.comm = c;
  return submit(j);
}

}  // namespace

namespace ncclemu {
Faults faults_from_env() {
  Faults f;
  f.init_hang_rank = static_cast<int>(env_double("NCCLEMU_INIT_HANG", -1));
  f.init_delay_s = env_double("NCCLEMU_INIT_DELAY_S", 0);
  long hr = -1, hk = 0;
  env_pair("NCCLEMU_HANG", &hr, &hk);
  f.hang_rank = static_cast<int>(hr);
  f.hang_at = static_cast<uint64_t>(hk);
  f.slow_s = env_double("NCCLEMU_SLOW_COLLECTIVE_S", 0);
  long ar = -1;
  if (const char* v = std::getenv("NCCLEMU_ASYNC_ERROR_AFTER_S"); v && v[0]) {
    f.async_error_s = std::atof(v);
    if (const char* colon = std::strchr(v, ':')) ar = std::strtol(colon + 1, nullptr, 10);
  }
  f.async_error_rank = static_cast<int>(ar);
  f.abort_blocks = env_double("NCCLEMU_ABORT_BLOCKS", 0) != 0;
  if (const char* v = std::getenv("NCCLEMU_SPLIT")) f.split = v;
  f.enqueue_delay_s = env_double("NCCLEMU_ENQUEUE_DELAY_S", 0.02);
  return f;
}
}  // namespace ncclemu

// ---- the C ABI -------------------------------------------------------------------------------------

struct NcclEmuStats {
  long inits, destroys, aborts, collectives, misuse, destroy_in_flight;
  char last_misuse[256];
};

NCCLEMU_EXPORT void ncclEmuStats(NcclEmuStats* s) {
  s->inits = g_stats.inits.load();
  s->destroys = g_stats.destroys.load();
  s->aborts = g_stats.aborts.load();
  s->collectives = g_stats.collectives.load();
  s->misuse = g_stats.misuse.load();
  s->destroy_in_flight = g_stats.destroy_in_flight.load();
  std::lock_guard<std::mutex> lock(g_misuse_mu);
  std::snprintf(s->last_misuse, sizeof s->last_misuse, "%s", g_last_misuse.c_str());
}

NCCLEMU_EXPORT ncclResult_t ncclGetVersion(int* v) {
  if (!v) return ncclInvalidArgument;
  *v = reported_version();
  return ncclSuccess;
}

NCCLEMU_EXPORT const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

#if NCCLEMU_API >= 21300
NCCLEMU_EXPORT const char* ncclGetLastError(ncclComm_t) { return tl_last_error.c_str(); }
#endif

NCCLEMU_EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!id) return ncclInvalidArgument;
  std::memset(id->internal, 0, sizeof id->internal);
  std::memcpy(id->internal, "NCCLEMU", 7);
  std::random_device rd;
  for (int i = 8; i < 24; ++i) id->internal[i] = static_cast<char>(rd());
  return ncclSuccess;
}

NCCLEMU_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t* out, int nranks, ncclUniqueId id, int rank) {
  return init_rank(out, nranks, id, rank, /*blocking=*/true);
}

#if NCCLEMU_API >= 21400
NCCLEMU_EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank,
                                                   ncclConfig_t* config) {
  if (config && !config_ok(config)) return fail(ncclInvalidArgument, "ncclConfig_t: bad magic or size");
  const bool blocking = !config || config->blocking != 0;  // INT_MIN (undefined) is NCCL's default: blocking
  return init_rank(out, nranks, id, rank, blocking);
}
#endif

NCCLEMU_EXPORT ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  if (!comms || ndev < 1) return ncclInvalidArgument;
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  ++tl_depth;
  for (int i = 0; i < ndev; ++i) {
    cudaSetDevice(devlist ? devlist[i] : i);
    init_rank(&comms[i], ndev, id, i, true);
  }
  --tl_depth;
  std::vector<Job> jobs;
  jobs.swap(tl_jobs);
  return run_group(std::move(jobs));
}

#if NCCLEMU_API >= 21800
NCCLEMU_EXPORT ncclResult_t ncclCommSplit(ncclComm_t parent, int color, int key, ncclComm_t* out,
                                          ncclConfig_t* config) {
  if (const ncclResult_t r = check_comm(parent, "ncclCommSplit")) return r;
  if (!out) return fail(ncclInvalidArgument, "newcomm is NULL");
  if (config && !config_ok(config)) return fail(ncclInvalidArgument, "ncclConfig_t: bad magic or size");
  if (color != 0) return fail(ncclInvalidUsage, "the stand-in splits with color 0 only");
  *out = nullptr;  // written by the split's job when it finishes
  ncclComm* child = new_comm(parent->nranks, parent->rank, parent->device, !config || config->blocking != 0);
  child->parent = parent;
  child->key = key;
  {
    std::lock_guard<std::mutex> lock(parent->m);
    child->dir = parent->dir + "-s" + std::to_string(++parent->splits);
    parent->children.push_back(child);
  }
  Job j;
  j.type = Job::kSplit;
  j.comm = child;
  j.out = out;
  return submit(j);
}
#endif

NCCLEMU_EXPORT ncclResult_t ncclCommAbort(ncclComm_t c) {
  if (!c) return ncclSuccess;
  if (c->dead.exchange(true)) {
    misuse("ncclCommAbort on a destroyed or aborted communicator");
    return ncclInvalidUsage;
  }
  c->abort.store(true);  // the flag every wait of this communicator polls
  std::thread job;
  {
    std::lock_guard<std::mutex> lock(c->m);
    for (ncclComm* child : c->children) child->abort.store(true);
    job.swap(c->job);
  }
  if (job.joinable()) job.join();  // an init or split in flight gives up on the flag
  // Its collectives in flight see the flag and end; NCCL's abort returns once they have (so the caller
  // may free their buffers). A frozen one (NCCLEMU_HANG) never ends: bounded, as a lost GPU would be.
  const double until = now_s() + 300.0;
  while (c->completed.load() < c->enqueued.load() && now_s() < until) sleep_s(200e-6);
  close_rank(c);
  // Real NCCL's commFree joins its proxy thread, which may wait for peers that hold connections open
  // (Note [Abort on a helper thread] in csrc/cuda/comm.cpp): NCCLEMU_ABORT_BLOCKS shows that.
  if (c->faults.abort_blocks && c->ctl) wait_peers_closed(c, 300.0);
  g_stats.aborts.fetch_add(1);
  return ncclSuccess;
}

NCCLEMU_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t c) {
  if (const ncclResult_t r = check_comm(c, "ncclCommDestroy")) return r;
  if (c->completed.load() < c->enqueued.load()) {
    g_stats.destroy_in_flight.fetch_add(1);
    misuse("ncclCommDestroy with " + std::to_string(c->enqueued.load() - c->completed.load()) +
           " collective(s) in flight");
  }
  // NCCL's destroy flushes the work in flight first (it does not communicate otherwise)
  while (c->completed.load() < c->enqueued.load() && !c->abort.load()) sleep_s(1e-3);
  c->dead.store(true);
  std::thread job;
  {
    std::lock_guard<std::mutex> lock(c->m);
    job.swap(c->job);
  }
  if (job.joinable()) job.join();
  close_rank(c);
  g_stats.destroys.fetch_add(1);
  return ncclSuccess;
}

NCCLEMU_EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t* state) {
  if (!c || !state) return ncclInvalidArgument;
  if (c->dead.load()) {
    misuse("ncclCommGetAsyncError on a destroyed or aborted communicator");
    return ncclInvalidUsage;
  }
  const Faults& f = c->faults;
  if (f.async_error_s >= 0 && c->state.load() == ncclSuccess && c->ready_at.load() > 0 &&
      (f.async_error_rank < 0 || f.async_error_rank == c->rank) && now_s() - c->ready_at.load() >= f.async_error_s) {
    tl_last_error = "emulated remote error (NCCLEMU_ASYNC_ERROR_AFTER_S)";
    c->state.store(ncclRemoteError);
  }
  *state = static_cast<ncclResult_t>(c->state.load());
  return ncclSuccess;
}

NCCLEMU_EXPORT ncclResult_t ncclCommCount(const ncclComm_t c, int* n) {
  if (const ncclResult_t r = check_comm(c, "ncclCommCount")) return r;
  *n = c->nranks;
  return ncclSuccess;
}

NCCLEMU_EXPORT ncclResult_t ncclCommCuDevice(const ncclComm_t c, int* d) {
  if (const ncclResult_t r = check_comm(c, "ncclCommCuDevice")) return r;
  *d = c->device;
  return ncclSuccess;
}

NCCLEMU_EXPORT ncclResult_t ncclCommUserRank(const ncclComm_t c, int* rank) {
  if (const ncclResult_t r = check_comm(c, "ncclCommUserRank")) return r;
  *rank = c->rank;
  return ncclSuccess;
}

namespace {

// The pointer must be device memory of the communicator's device, as NCCL requires.
bool on_device(const void* p, int device) {
  cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) return false;
  return a.type == cudaMemoryTypeDevice && a.device == device;
}

ncclResult_t collective_checked(Kind kind, const void* send, void* recv, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                        int root, ncclComm* c, cudaStream_t stream, const char* name) {
  if (const ncclResult_t r = check_comm(c, name)) return r;
  const long call = g_calls.fetch_add(1) + 1;
  if (const char* v = std::getenv("NCCLEMU_FAIL_CALL"); v && std::atol(v) == call) {
    return fail(ncclInvalidUsage, std::string("emulated error at ") + name + " (NCCLEMU_FAIL_CALL)");
  }
  if (!dtype_known(dt) || (dt == ncclBfloat16 && NCCLEMU_API < 21000))
    return fail(ncclInvalidArgument, std::string(name) + ": invalid datatype");
  if (dt != ncclFloat32 && dt != ncclFloat16 && dt != ncclBfloat16)
    return fail(ncclInvalidArgument, std::string(name) + ": the stand-in reduces floating types only");
  float scalar = 1.0f;
  if (kind == Kind::kAllReduce || kind == Kind::kReduceScatter) {
    if (op == ncclAvg) {
      if (NCCLEMU_API < 21000) return fail(ncclInvalidArgument, std::string(name) + ": invalid reduction op");
      scalar = 1.0f / static_cast<float>(c->nranks);  // NCCL: PreMulSum by 1/n rounded to the type
    } else if (op != ncclSum) {
      std::lock_guard<std::mutex> lock(c->m);
      bool found = false;
      for (const PreMul& p : c->premul) {
        if (p.op == op) {
          if (p.dtype != dt) return fail(ncclInvalidArgument, std::string(name) + ": PreMulSum op of another datatype");
          scalar = p.scalar;
          found = true;
        }
      }
      if (!found) return fail(ncclInvalidArgument, std::string(name) + ": invalid reduction op for this communicator");
    }
  }
  const size_t in_elems = kind == Kind::kReduceScatter ? count * c->nranks : count;
  const size_t out_elems = kind == Kind::kAllGather ? count * c->nranks : count;
  if (count > 0 && (!on_device(send, c->device) || !on_device(recv, c->device) ||
                    !on_device(static_cast<const char*>(send) + in_elems * dtype_size(dt) - 1, c->device) ||
                    !on_device(static_cast<char*>(recv) + out_elems * dtype_size(dt) - 1, c->device))) {
    return fail(ncclInvalidArgument, std::string(name) + ": buffer is not device memory of cuda:" +
                                         std::to_string(c->device));
  }
  auto* x = new Collective{kind, send, recv, count, dt, op, scalar, root, c, c->enqueued.fetch_add(1) + 1};
  if (scalar != 1.0f) {  // the scalar rounded to the element type, as NCCL stores it
    uint16_t h;
    if (dt == ncclFloat16) x->scalar = static_cast<float>(static_cast<_Float16>(scalar));
    if (dt == ncclBfloat16) {
      uint32_t u;
      std::memcpy(&u, &scalar, 4);
      u += 0x7fffu + ((u >> 16) & 1);
      h = static_cast<uint16_t>(u >> 16);
      u = static_cast<uint32_t>(h) << 16;
      std::memcpy(&x->scalar, &u, 4);
    }
  }
  Job j;
  j.type = Job::kColl;
  j.comm = c;
  j.coll = x;
  j.stream = stream;
  return submit(j);
}

ncclResult_t collective(Kind kind, const void* send, void* recv, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                        int root, ncclComm* c, cudaStream_t stream, const char* name) {
  return in_group(collective_checked(kind, send, recv, count, dt, op, root, c, stream, name));
}

}  // namespace

NCCLEMU_EXPORT ncclResult_t ncclAllReduce(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op,
                                          ncclComm_t c, cudaStream_t st) {
  return collective(Kind::kAllReduce, s, r, n, t, op, 0, c, st, "ncclAllReduce");
}
NCCLEMU_EXPORT ncclResult_t ncclReduceScatter(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op,
                                              ncclComm_t c, cudaStream_t st) {
  return collective(Kind::kReduceScatter, s, r, n, t, op, 0, c, st, "ncclReduceScatter");
}
NCCLEMU_EXPORT ncclResult_t ncclAllGather(const void* s, void* r, size_t n, ncclDataType_t t, ncclComm_t c,
                                          cudaStream_t st) {
  return collective(Kind::kAllGather, s, r, n, t, ncclSum, 0, c, st, "ncclAllGather");
}
NCCLEMU_EXPORT ncclResult_t ncclBroadcast(const void* s, void* r, size_t n, ncclDataType_t t, int root, ncclComm_t c,
                                          cudaStream_t st) {
  if (c && (root < 0 || root >= c->nranks)) return fail(ncclInvalidArgument, "ncclBroadcast: root out of range");
  return collective(Kind::kBroadcast, s, r, n, t, ncclSum, root, c, st, "ncclBroadcast");
}

NCCLEMU_EXPORT ncclResult_t ncclGroupStart() {
  ++tl_depth;
  return ncclSuccess;
}

NCCLEMU_EXPORT ncclResult_t ncclGroupEnd() {
  if (tl_depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--tl_depth > 0) return ncclSuccess;
  std::vector<Job> jobs;
  jobs.swap(tl_jobs);
  bool has_coll = false;
  for (const Job& j : jobs) has_coll |= j.type == Job::kColl;
  ncclResult_t err = tl_group_error;
  tl_group_error = ncclSuccess;
  if (has_coll && err == ncclSuccess) {
    const long end = g_group_ends.fetch_add(1) + 1;
    if (const char* v = std::getenv("NCCLEMU_FAIL_GROUPEND"); v && std::atol(v) == end) {
      err = fail(ncclInternalError, "emulated error at ncclGroupEnd (NCCLEMU_FAIL_GROUPEND)");
    }
  }
  if (err != ncclSuccess) {
    for (const Job& j : jobs) {  // nothing of the group is launched
      if (j.type != Job::kColl) continue;
      j.comm->enqueued.fetch_sub(1);
      delete j.coll;
    }
    return err;
  }
  return run_group(std::move(jobs));
}

#if NCCLEMU_API >= 21100
NCCLEMU_EXPORT ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t dt,
                                                     ncclScalarResidence_t residence, ncclComm_t c) {
  if (const ncclResult_t r = check_comm(c, "ncclRedOpCreatePreMulSum")) return r;
  if (!op || !scalar) return fail(ncclInvalidArgument, "ncclRedOpCreatePreMulSum: NULL argument");
  if (residence != ncclScalarHostImmediate) return fail(ncclInvalidUsage, "the stand-in keeps host scalars only");
  float v = 0;
  switch (dt) {
    case ncclFloat32: std::memcpy(&v, scalar, 4); break;
    case ncclFloat16: v = static_cast<float>(*static_cast<_Float16*>(scalar)); break;
    case ncclBfloat16: {
      uint32_t u = static_cast<uint32_t>(*static_cast<uint16_t*>(scalar)) << 16;
      std::memcpy(&v, &u, 4);
      break;
    }
    default: return fail(ncclInvalidArgument, "ncclRedOpCreatePreMulSum: datatype");
  }
  std::lock_guard<std::mutex> lock(c->m);
  const ncclRedOp_t made = static_cast<ncclRedOp_t>(5 + c->premul_made++);  // after ncclNumOps, like NCCL
  c->premul.push_back(PreMul{made, dt, v});
  *op = made;
  return ncclSuccess;
}

NCCLEMU_EXPORT ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t c) {
  if (const ncclResult_t r = check_comm(c, "ncclRedOpDestroy")) return r;
  std::lock_guard<std::mutex> lock(c->m);
  for (auto it = c->premul.begin(); it != c->premul.end(); ++it) {
    if (it->op == op) {
      c->premul.erase(it);
      return ncclSuccess;
    }
  }
  return fail(ncclInvalidArgument, "ncclRedOpDestroy: unknown op");
}
#endif
