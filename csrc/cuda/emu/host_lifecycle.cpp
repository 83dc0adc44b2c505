// Host-logic scenarios: the watchdog (wait, done, pending), abort, destroy, timeouts with a peer that
// hangs or never joins, async errors. See host_util.h.
#include <cuda_runtime_api.h>

#include <atomic>
#include <thread>

#include "../nccl_api.h"
#include "emu_host.h"
#include "host_util.h"

namespace emu_host {
namespace {

using ncclavg::ArgError;
using ncclavg::NcclError;
using ncclavg::TimeoutError;

// Two ranks of one communicator in this process, each its own NcclComm (init_rank in two threads).
// A rank left frozen by a fault is never destroyed (its teardown would wait out its timeout): the
// scenario ends with _exit and the OS takes it.
std::vector<std::unique_ptr<NcclComm>> two_ranks(double timeout_s) {
  const std::string uid = unique_id();
  std::vector<std::unique_ptr<NcclComm>> comms(2);
  run_threads(2, [&](int r) { comms[r] = NcclComm::init_rank(uid, 2, r, r, timeout_s); });
  return comms;
}

}  // namespace

// NCCLEMU_SLOW_COLLECTIVE_S=0.3: a collective in flight is seen as such, then as done.
SCENARIO(wait_done_pending, 20) {
  auto c = NcclComm::init_all({0, 1}, 10.0);
  RankData a = make_inputs({0, 1}, c->ranks(), 8, DType::kFloat32);
  RankData b = make_inputs({0, 1}, c->ranks(), 8, DType::kFloat32);
  EXPECT(c->done(0) && c->pending() == 0);
  const uint64_t s1 = c->all_reduce(a.buffers(), {}, false, "avg", std::nullopt, "first");
  const uint64_t s2 = c->all_reduce(b.buffers(), {}, false, "avg", std::nullopt, "second");
  EXPECT(s2 == s1 + 1);
  EXPECT(!c->done(s1) && !c->done(0), "a 0.3 s collective is done at once");
  EXPECT(c->pending() == 2, c->pending());
  c->wait(10.0, s1);
  EXPECT(c->done(s1));
  check_all_reduce(a, 2, "ncclAvg", DType::kFloat32, "first");
  c->wait(10.0);
  EXPECT(c->done(0) && c->pending() == 0);
  check_all_reduce(b, 2, "ncclAvg", DType::kFloat32, "second");
  throws<ArgError>(HERE, {"'seq'", "no collective with sequence number 3"}, [&] { c->done(3); });
  // an all-reduce of nothing enqueues nothing
  RankData empty = make_inputs({0, 1}, c->ranks(), 0, DType::kFloat32);
  EXPECT(c->all_reduce(empty.buffers(), {}, false, "avg", std::nullopt, "") == 0);
}

SCENARIO(abort_then_every_call_says_so, 20) {
  auto c = NcclComm::init_all({0, 1}, 10.0);
  RankData d = make_inputs({0, 1}, c->ranks(), 8, DType::kFloat32);
  c->wait(10.0, c->all_reduce(d.buffers(), {}, false, "avg", std::nullopt, ""));
  c->abort();
  c->abort();  // idempotent
  EXPECT(c->aborted() && c->abort_reason() == "abort() was called");
  const std::vector<std::string> words{"aborted after abort() was called", "create a new communicator"};
  throws<NcclError>(HERE, words, [&] { c->all_reduce(d.buffers(), {}, false, "avg", std::nullopt, ""); });
  throws<NcclError>(HERE, words, [&] { c->wait(1.0); });
  throws<NcclError>(HERE, words, [&] { c->done(0); });
  throws<NcclError>(HERE, words, [&] { c->stream_wait({0, 0}, 0); });
  EXPECT(c->pending() == 0);
  c->destroy();  // a no-op now
  const Stats s = stats();
  // one NCCL communicator per device, two where the collectives run on a split (Note [Blocking
  // collectives after a bounded init])
  const long per_device = c->collective_mode_reason().rfind("ncclCommSplit (", 0) == 0 ? 2 : 1;
  EXPECT(s.aborts == 2 * per_device && s.destroys == 0, s.aborts, " ", s.destroys);
  EXPECT(s.misuse == 0, s.last_misuse);
}

SCENARIO(destroy_and_refuse, 20) {
  auto c = NcclComm::init_all({0, 1}, 10.0);
  RankData d = make_inputs({0, 1}, c->ranks(), 8, DType::kFloat32);
  c->all_reduce(d.buffers(), {}, false, "avg", std::nullopt, "in flight at destroy");
  c->destroy();  // waits for the collective first
  check_all_reduce(d, 2, "ncclAvg", DType::kFloat32, "finished by destroy");
  EXPECT(c->destroyed() && !c->aborted());
  throws<NcclError>(HERE, {"destroyed", "all_reduce_avg refused"}, [&] { c->all_reduce(d.buffers(), {}, false, "avg", std::nullopt, ""); });
  c->destroy();
  const Stats s = stats();
  EXPECT(s.destroy_in_flight == 0 && s.aborts == 0, s.last_misuse);
  EXPECT(s.misuse == 0, s.last_misuse);
}

// NCCLEMU_HANG=1:1: rank 1 freezes in its first collective. Rank 0's wait times out at its deadline,
// aborts (ncclCommAbort), names the collective, and every later call says why.
SCENARIO(timeout_when_a_peer_hangs, 20) {
  auto comms = two_ranks(10.0);
  struct Leak { std::unique_ptr<NcclComm>& c; ~Leak() { c.release(); } } frozen{comms[1]};
  std::vector<RankData> d;
  for (int r = 0; r < 2; ++r) d.push_back(make_inputs({r}, {r}, 8, DType::kFloat32));
  comms[1]->all_reduce(d[1].buffers(), {}, false, "avg", std::nullopt, "frozen");
  comms[0]->all_reduce(d[0].buffers(), {}, false, "avg", std::nullopt, "bucket 3");
  const double t0 = now();
  throws<TimeoutError>(HERE, {"all_reduce_avg[bucket 3]", "did not complete within 0.4 s", "ncclCommAbort"}, [&] { comms[0]->wait(0.4); });
  const double took = now() - t0;
  EXPECT(took >= 0.4 && took < 2.4, took);  // the deadline, plus the 1 ms polling pace; 2 s of CI slack
  EXPECT(comms[0]->aborted(), "the timeout path did not abort");
  const long per_rank = comms[0]->collective_mode_reason().rfind("ncclCommSplit (", 0) == 0 ? 2 : 1;
  EXPECT(stats().aborts == per_rank, stats().aborts, " NCCL communicator(s) aborted, expected ", per_rank);
  throws<NcclError>(HERE, {"aborted after all_reduce_avg[bucket 3]"}, [&] { comms[0]->wait(1.0); });
}

// The peer initialised, then never calls the collective: the same bounded timeout.
SCENARIO(timeout_when_a_peer_skips_the_collective, 20) {
  auto comms = two_ranks(10.0);
  RankData d = make_inputs({0}, {0}, 8, DType::kFloat32);
  comms[0]->all_reduce(d.buffers(), {}, false, "avg", std::nullopt, "skipped by the peer");
  throws<TimeoutError>(HERE, {"skipped by the peer", "did not complete within 0.3 s"}, [&] { comms[0]->wait(0.3); });
  comms[1]->abort();
}

// NCCLEMU_ASYNC_ERROR_AFTER_S=0.1 with a slow collective: the watchdog's ncclCommGetAsyncError poll
// turns it into an NcclError with NCCL's words, and aborts.
SCENARIO(async_error_aborts, 20) {
  auto c = NcclComm::init_all({0, 1}, 10.0);
  RankData d = make_inputs({0, 1}, c->ranks(), 8, DType::kFloat32);
  c->all_reduce(d.buffers(), {}, false, "avg", std::nullopt, "hit");
  throws<NcclError>(HERE, {"NCCL reported an error", "remote process exited", "emulated remote error"}, [&] { c->wait(10.0); });
  EXPECT(c->aborted());
}

// wait() sleeps without the mutex: abort() from another thread ends a wait that would block 30 s.
SCENARIO(abort_from_another_thread_ends_a_wait, 20) {
  auto comms = two_ranks(30.0);
  RankData d = make_inputs({0}, {0}, 8, DType::kFloat32);
  comms[0]->all_reduce(d.buffers(), {}, false, "avg", std::nullopt, "never joined");
  std::thread killer([&] {
    sleep_s(0.2);
    comms[0]->abort();
  });
  const double t0 = now();
  throws<NcclError>(HERE, {"aborted after abort() was called"}, [&] { comms[0]->wait(30.0); });
  killer.join();
  EXPECT(now() - t0 < 5.0, now() - t0);
  comms[1]->abort();
}

}  // namespace emu_host
