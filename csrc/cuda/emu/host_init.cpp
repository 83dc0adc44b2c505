// Host-logic scenarios: communicator creation (init_all, init_rank, init_ranks), the collective mode
// each NCCL version gets, and init failures. See host_util.h.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdlib>

#include "../nccl_api.h"
#include "emu_host.h"
#include "host_util.h"

namespace emu_host {
namespace {

using ncclavg::ArgError;
using ncclavg::NcclError;
using ncclavg::TimeoutError;
namespace nccl = ncclavg::nccl;

// The mode the Note [Blocking collectives after a bounded init] gives this NCCL and environment.
std::string expected_mode() {
  const char* env = std::getenv("NCCLAVG_NCCL_COLLECTIVES");
  const bool want_blocking = !(env && std::string(env) == "nonblocking");
  if (!nccl::api().CommInitRankConfig) return "blocking";
  if (!want_blocking || !nccl::api().CommSplit || !nccl::at_least(nccl::since::kCommSplit)) return "nonblocking";
  return "blocking";
}

void all_reduce_and_check(NcclComm& c, const std::vector<int>& devices, DType t, const char* what) {
  RankData d = make_inputs(devices, c.ranks(), 37, t);
  const uint64_t seq = c.all_reduce(d.buffers(), {}, false, "avg", std::nullopt, what);
  c.wait(10.0, seq);
  check_all_reduce(d, c.size(), c.reduction(t, false, "avg", true), t, what);
}

}  // namespace

SCENARIO(init_all_properties, 20) {
  auto c = NcclComm::init_all({0, 1, 2}, 10.0);
  EXPECT(c->size() == 3 && c->local_size() == 3 && c->rank() == 0, c->size());
  EXPECT((c->ranks() == std::vector<int>{0, 1, 2}));
  EXPECT((c->devices() == std::vector<int>{0, 1, 2}));
  EXPECT(c->nccl_version() == nccl::load_info().version);
  EXPECT(c->collective_mode() == expected_mode(), c->collective_mode(), " (", c->collective_mode_reason(), ")");
  EXPECT(!c->collective_mode_reason().empty());
  // the connection note of Note [Connections inside the bounded init] only where NCCL connects lazily
  const bool lazy = c->collective_mode_reason().rfind("ncclCommSplit (", 0) == 0 && nccl::at_least(nccl::since::kRuntimeConnect);
  EXPECT((c->collective_mode_reason().find("NCCL_RUNTIME_CONNECT") != std::string::npos) == lazy, c->collective_mode_reason());
  info("mode=" + c->collective_mode() + " reason=" + c->collective_mode_reason());
  const auto streams = c->streams();
  EXPECT(streams.size() == 3 && streams[0] && streams[0] != streams[1] && streams[1] != streams[2]);
  for (uintptr_t s : streams) {  // the greatest priority the device offers (Note in comm_init.cpp)
    int least = 0, greatest = 0, p = 1;
    cudaDeviceGetStreamPriorityRange(&least, &greatest);
    EXPECT(cudaStreamGetPriority(reinterpret_cast<cudaStream_t>(s), &p) == cudaSuccess && p == greatest, p);
  }
  all_reduce_and_check(*c, {0, 1, 2}, DType::kFloat32, "init_all");
  c->destroy();
  const Stats s = stats();
  EXPECT(s.misuse == 0, s.last_misuse);
  EXPECT(s.aborts == 0 && s.destroys >= 3, s.aborts, " ", s.destroys);
}

SCENARIO(init_arguments, 20) {
  throws<ArgError>(HERE, {"'devices'", "empty"}, [&] { NcclComm::init_all({}, 10.0); });
  throws<ArgError>(HERE, {"'devices[1]'", "does not exist", "4 device(s)"}, [&] { NcclComm::init_all({0, 7}, 10.0); });
  throws<ArgError>(HERE, {"'timeout_s'"}, [&] { NcclComm::init_all({0}, 0.0); });
  throws<ArgError>(HERE, {"'timeout_s'"}, [&] { NcclComm::init_all({0}, std::nan("")); });
  const std::string refusal = nccl::multi_rank_gpu_refusal();
  if (!refusal.empty()) {
    throws<ArgError>(HERE, {"'devices[1]'", "listed twice"}, [&] { NcclComm::init_all({1, 1}, 10.0); });
  } else {  // NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1: two ranks on one GPU
    auto c = NcclComm::init_all({1, 1}, 10.0);
    EXPECT(c->size() == 2);
    all_reduce_and_check(*c, {1, 1}, DType::kFloat32, "two ranks on one GPU");
  }
  const long inits = stats().inits;  // from here on nothing may reach NCCL's init
  const std::string uid = unique_id();
  throws<ArgError>(HERE, {"'unique_id'", "128"}, [&] { NcclComm::init_rank("short", 2, 0, 0, 10.0); });
  throws<ArgError>(HERE, {"'nranks'"}, [&] { NcclComm::init_rank(uid, 0, 0, 0, 10.0); });
  throws<ArgError>(HERE, {"'rank'"}, [&] { NcclComm::init_rank(uid, 2, 2, 0, 10.0); });
  throws<ArgError>(HERE, {"'device'", "does not exist"}, [&] { NcclComm::init_rank(uid, 2, 0, 9, 10.0); });
  throws<ArgError>(HERE, {"'first_rank'"}, [&] { NcclComm::init_ranks(uid, 2, 1, {0, 1}, 10.0); });
  ncclavg_emu::set_device_count(0);
  throws<ncclavg::CudaError>(HERE, {"needs a CUDA device"}, [&] { NcclComm::init_all({0}, 10.0); });
  ncclavg_emu::set_device_count(4);
  EXPECT(stats().inits == inits, stats().inits - inits, " refused init(s) reached NCCL");
}

SCENARIO(bad_collective_mode_names_the_variable, 10) {
  setenv("NCCLAVG_NCCL_COLLECTIVES", "fast", 1);
  throws<ArgError>(HERE, {"NCCLAVG_NCCL_COLLECTIVES", "'fast'"}, [&] { NcclComm::init_all({0}, 10.0); });
}

// Several ranks of one communicator, each in its own thread (init_rank with one unique id).
SCENARIO(init_rank_threads, 20) {
  const std::string uid = unique_id();
  run_threads(3, [&](int r) {
    auto c = NcclComm::init_rank(uid, 3, r, r, 10.0);
    EXPECT(c->size() == 3 && c->rank() == r && c->ranks() == std::vector<int>{r});
    all_reduce_and_check(*c, {r}, DType::kFloat16, "init_rank in threads");
    c->destroy();
  });
  EXPECT(stats().misuse == 0, stats().last_misuse);
}

// init_ranks across processes: towers 2+2 and 1+2, ranks numbered process-major.
static void towers_of_processes(const std::vector<int>& towers) {
  int total = 0;
  for (int t : towers) total += t;
  // Limits far above the ~1 s these take: a loaded 2-core machine runs four threads of two processes here.
  run_processes(static_cast<int>(towers.size()), 90.0, unique_id(), [&](int p, const std::string& uid) {
    int first = 0;
    for (int q = 0; q < p; ++q) first += towers[q];
    std::vector<int> devices;
    for (int k = 0; k < towers[p]; ++k) devices.push_back((first + k) % 4);
    auto c = NcclComm::init_ranks(uid, total, first, devices, 60.0);
    EXPECT(c->size() == total && c->rank() == first);
    for (int k = 0; k < towers[p]; ++k) EXPECT(c->ranks()[k] == first + k);
    all_reduce_and_check(*c, devices, DType::kBFloat16, "init_ranks");
    c->destroy();
    EXPECT(stats().misuse == 0, stats().last_misuse);
  });
}
SCENARIO(init_ranks_processes_2_2, 120) { towers_of_processes({2, 2}); }
SCENARIO(init_ranks_processes_1_2, 120) { towers_of_processes({1, 2}); }

// A peer that never starts: the bounded init times out, aborts, and says which init.
SCENARIO(init_peer_never_starts, 20) {
  if (!nccl::api().CommInitRankConfig) {  // See Note [Non-blocking init and abort]: NCCL < 2.14
    info("skip: a blocking init cannot time out with NCCL " + nccl::version_string(nccl::load_info().version));
    return;
  }
  const double t0 = now();
  const std::string m = throws<TimeoutError>(HERE, {"NCCL init of rank 0 of 2", "did not complete within 0.5 s", "ncclCommAbort"}, [&] { NcclComm::init_rank(unique_id(), 2, 0, 0, 0.5); });
  const double took = now() - t0;
  // at the deadline, plus the polling pace (<= 1 ms) and the abort (the init thread polls its flag
  // every 0.2 ms); 2 s of slack for a loaded CI machine
  EXPECT(took >= 0.5 && took < 2.5, took);
  if (nccl::api().CommInitRankConfig) EXPECT(stats().aborts == 1, stats().aborts);
}

// NCCLEMU_INIT_HANG=1: rank 1 joins, then its init never finishes. Its own bounded init times out; rank 0
// finishes its init, and its split to blocking communicators (which needs rank 1) times out under the
// same deadline (Note [Blocking collectives after a bounded init]); without a split rank 0 is ready.
SCENARIO(init_that_never_finishes_times_out, 20) {
  if (!nccl::api().CommInitRankConfig) {
    info("skip: a blocking init cannot time out with NCCL " + nccl::version_string(nccl::load_info().version));
    return;
  }
  const std::string uid = unique_id();
  const bool splits = expected_mode() == "blocking";
  run_threads(2, [&](int r) {
    if (r == 1 || splits) {
      const std::string m = throws<TimeoutError>(HERE, {"did not complete within 0.5 s"},
                                                 [&] { NcclComm::init_rank(uid, 2, r, r, 0.5); });
      if (r == 1) EXPECT(m.find("NCCL init of rank 1 of 2") != std::string::npos, m);
      if (r == 0) EXPECT(m.find("ncclCommSplit") != std::string::npos, m);
    } else {
      auto c = NcclComm::init_rank(uid, 2, r, r, 0.5);
      EXPECT(c->size() == 2);
      c->abort();
    }
  });
}

// An init that takes a while (NCCLEMU_INIT_DELAY_S) is polled to its end: ncclInProgress is not an error.
SCENARIO(init_slow_is_polled, 20) {
  auto c = NcclComm::init_all({0, 1}, 10.0);
  all_reduce_and_check(*c, {0, 1}, DType::kFloat32, "after a slow init");
}

// A failed split (NCCLEMU_SPLIT=fail / null) is an NcclError naming the step, the comms aborted.
SCENARIO(split_failure_is_an_error, 20) {
  if (expected_mode() != "blocking" || !nccl::api().CommSplit) {
    info("skip: no split with this NCCL");
    return;
  }
  const std::string m = throws<NcclError>(HERE, {"ncclCommSplit to blocking communicators"}, [&] { NcclComm::init_all({0, 1}, 5.0); });
  info("error=" + m);
  EXPECT(stats().aborts >= 2, stats().aborts);
}

}  // namespace emu_host
