// Host-logic scenarios for the hard cases of teardown and threading: an abort that a frozen peer
// holds, graph capture in another thread, the destructor's bounded wait, threads with no CUDA context,
// sticky CUDA errors, and destroy racing an enqueue. See host_util.h.
#include <cuda_runtime_api.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "../nccl_api.h"
#include "emu_host.h"
#include "host_util.h"

namespace emu_host {
namespace {

using ncclavg::ArgError;
using ncclavg::CudaError;
using ncclavg::NcclError;
using ncclavg::TimeoutError;

std::vector<std::unique_ptr<NcclComm>> two_ranks(double timeout_s) {
  const std::string uid = unique_id();
  std::vector<std::unique_ptr<NcclComm>> comms(2);
  run_threads(2, [&](int r) { comms[r] = NcclComm::init_rank(uid, 2, r, r, timeout_s); });
  return comms;
}

// Calls f every 5 ms on its own thread until stopped; remembers the longest call.
class Prober {
 public:
  explicit Prober(std::function<void()> f) : f_(std::move(f)), t_([this] { loop(); }) {}
  ~Prober() { stop(); }
  double stop() {
    stop_.store(true);
    if (t_.joinable()) t_.join();
    return longest_;
  }

 private:
  void loop() {
    while (!stop_.load()) {
      const double t0 = now();
      f_();
      longest_ = std::max(longest_, now() - t0);
      sleep_s(0.005);
    }
  }
  std::function<void()> f_;
  std::atomic<bool> stop_{false};
  double longest_ = 0;
  std::thread t_;
};

}  // namespace

// NCCLEMU_ABORT_BLOCKS=1 NCCLEMU_HANG=1:1: rank 1 freezes in its collective and never closes, and an
// abort waits for every peer to close (as NCCL's proxy join can in directMode). Rank 0's timeout still
// raises, within its deadline plus the abort's bounded join, and no call of another thread waits for it.
// See Note [Abort on a helper thread] in comm.cpp.
SCENARIO(abort_held_by_a_frozen_peer_is_bounded, 30) {
  auto comms = two_ranks(0.5);
  struct Leak {
    std::unique_ptr<NcclComm>& c;
    ~Leak() { c.release(); }
  } frozen{comms[1]};
  RankData d1 = make_inputs({1}, {1}, 8, DType::kFloat32);
  // The abort goes on in the background, so the buffers of rank 0's collective are not ours to free
  // (the error says so): kept to the process's end.
  RankData& d0 = *new RankData(make_inputs({0}, {0}, 8, DType::kFloat32));
  comms[1]->all_reduce(d1.buffers(), {}, false, "avg", std::nullopt, "frozen");
  comms[0]->all_reduce(d0.buffers(), {}, false, "avg", std::nullopt, "held");
  Prober prober([&] { (void)comms[0]->aborted(); (void)comms[0]->abort_reason(); });
  const double t0 = now();
  const std::string m = throws<TimeoutError>(HERE, {"did not complete within 0.5 s", "ncclCommAbort had not returned after 0.5 s"},
                                             [&] { comms[0]->wait(std::nullopt); });
  const double took = now() - t0;
  const double longest = prober.stop();
  // the deadline (0.5 s) plus the abort's join (min(timeout, 10 s) = 0.5 s); 2 s of slack for CI
  EXPECT(took >= 1.0 && took < 3.0, took);
  // a state query takes mu_ for microseconds; 0.25 s would mean it waited for the abort
  EXPECT(longest < 0.25, "a call of another thread waited ", longest, " s for the abort");
  EXPECT(comms[0]->aborted());
  info("error=" + m);
  // the mode names the abort's behaviour where several local ranks share the process
  unsetenv("NCCLEMU_ABORT_BLOCKS");  // read at init: these two ranks' aborts return
  auto c = NcclComm::init_all({2, 3}, 5.0);
  EXPECT(c->collective_mode_reason().find("directMode") != std::string::npos, c->collective_mode_reason());
  EXPECT(comms[0]->collective_mode_reason().find("directMode") == std::string::npos);
}

// A stream capture (global mode, the default of torch.cuda.graph) in another thread is not broken by
// the watchdog's event queries, and a collective ordered after a capturing stream is refused clearly.
// See Note [Event queries during a capture] in comm.cpp.
SCENARIO(capture_in_another_thread_survives_the_watchdog, 20) {
  auto c = NcclComm::init_all({0, 1}, 10.0);
  RankData d = make_inputs({0, 1}, c->ranks(), 8, DType::kFloat32);
  const uint64_t seq = c->all_reduce(d.buffers(), {}, false, "avg", std::nullopt, "during a capture");
  std::atomic<int> phase{0};
  cudaError_t end = cudaErrorUnknown;
  std::thread capturer([&] {
    cudaSetDevice(0);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    EXPECT(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    phase.store(1);
    while (phase.load() != 2) sleep_s(0.001);
    cudaGraph_t g = nullptr;
    end = cudaStreamEndCapture(s, &g);
  });
  while (phase.load() != 1) sleep_s(0.001);
  try {
    (void)c->pending();
    (void)c->done(seq);
    c->wait(10.0, seq);
  } catch (const std::exception& e) {
    fail("the watchdog failed during another thread's capture: ", e.what());
  }
  phase.store(2);
  capturer.join();
  EXPECT(end == cudaSuccess, "the capture was broken: ", cudaGetErrorString(end));
  check_all_reduce(d, 2, "ncclAvg", DType::kFloat32, "during a capture");

  std::vector<cudaStream_t> s(2);
  for (int k = 0; k < 2; ++k) {
    cudaSetDevice(k);
    cudaStreamCreateWithFlags(&s[k], cudaStreamNonBlocking);
  }
  EXPECT(cudaStreamBeginCapture(s[0], cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  throws<ArgError>(HERE, {"'after_streams[0]'", "capturing a CUDA graph"}, [&] {
    c->all_reduce(d.buffers(), {reinterpret_cast<uintptr_t>(s[0]), reinterpret_cast<uintptr_t>(s[1])}, false, "avg",
                  std::nullopt, "captured");
  });
  cudaGraph_t g = nullptr;
  EXPECT(cudaStreamEndCapture(s[0], &g) == cudaSuccess, "the refusal broke the caller's capture");
  c->wait(10.0);
  EXPECT(!c->aborted());
}

// NCCLEMU_HANG=1:1 with the default 600 s timeout: the destructor (Python's GC, interpreter exit) waits
// at most kTeardownWaitMaxS for the collective a dead peer never completes. See Note [Teardown].
SCENARIO(destructor_wait_is_bounded, 40) {
  auto comms = two_ranks(600.0);
  struct Leak {
    std::unique_ptr<NcclComm>& c;
    ~Leak() { c.release(); }
  } frozen{comms[1]};
  RankData d1 = make_inputs({1}, {1}, 8, DType::kFloat32);
  RankData d0 = make_inputs({0}, {0}, 8, DType::kFloat32);
  comms[1]->all_reduce(d1.buffers(), {}, false, "avg", std::nullopt, "frozen");
  comms[0]->all_reduce(d0.buffers(), {}, false, "avg", std::nullopt, "in flight at exit");
  const double t0 = now();
  comms[0].reset();
  const double took = now() - t0;
  // the bounded wait, then an abort that returns at once (its peer holds nothing); 3 s of CI slack
  EXPECT(took >= NcclComm::kTeardownWaitMaxS && took < NcclComm::kTeardownWaitMaxS + 3.0, took);
  EXPECT(stats().destroys == 0 && stats().aborts >= 1, "teardown of a hung collective must abort");
}

// A thread that never chose a device (a finalizer, a helper) waits, polls and tears down a
// communicator on cuda:1 without creating a context on cuda:0. See Note [Device guard without a
// current context] in device_guard.cpp.
SCENARIO(no_context_on_a_device_the_comm_does_not_use, 20) {
  cudaSetDevice(1);  // this process's rank uses GPU 1 only
  auto c = NcclComm::init_all({1}, 10.0);
  RankData d = make_inputs({1}, c->ranks(), 8, DType::kFloat32);
  cudaStream_t reader;
  cudaStreamCreateWithFlags(&reader, cudaStreamNonBlocking);
  EXPECT(ncclavg_emu::contexts_created(0) == 0, "the init made a context on cuda:0");
  const uint64_t seq = c->all_reduce(d.buffers(), {}, false, "avg", std::nullopt, "");
  auto fresh = [](const std::function<void()>& f) {
    const int before = ncclavg_emu::context_binds(0);
    std::thread(f).join();
    return ncclavg_emu::context_binds(0) - before;
  };
  EXPECT(fresh([&] { (void)c->pending(); }) == 0, "pending made a context on cuda:0");
  EXPECT(fresh([&] { (void)c->done(seq); }) == 0, "done made a context on cuda:0");
  EXPECT(fresh([&] { c->stream_wait({reinterpret_cast<uintptr_t>(reader)}, seq); }) == 0, "stream_wait made a context on cuda:0");
  EXPECT(fresh([&] { c->wait(10.0, seq); }) == 0, "wait made a context on cuda:0");
  EXPECT(fresh([&] { (void)c->all_reduce(d.buffers(), {}, false, "avg", std::nullopt, "from a fresh thread"); }) == 0, "all_reduce made a context on cuda:0");
  EXPECT(fresh([&] { c->destroy(); }) == 0, "destroy made a context on cuda:0");
  EXPECT(c->destroyed());
  EXPECT(ncclavg_emu::contexts_created(0) == 0, "a thread with no context made one on cuda:0 (",
         ncclavg_emu::context_binds(0), " thread(s))");
}

// NCCLEMU_SLOW_COLLECTIVE_S=0.3: a sticky CUDA error found while waiting is a CudaError that aborts the
// communicator, so that no ncclCommDestroy (which flushes) runs on the broken context later.
SCENARIO(sticky_cuda_error_aborts, 20) {
  auto c = NcclComm::init_all({0, 1}, 10.0);
  RankData d = make_inputs({0, 1}, c->ranks(), 8, DType::kFloat32);
  c->all_reduce(d.buffers(), {}, false, "avg", std::nullopt, "bucket 0");
  ncclavg_emu::inject_sticky_error(0, cudaErrorIllegalAddress);
  throws<CudaError>(HERE, {"all_reduce_avg[bucket 0]", "an illegal memory access was encountered", "aborted"},
                    [&] { c->wait(10.0); });
  EXPECT(c->aborted(), "a sticky CUDA error left the communicator usable");
  c->destroy();
  EXPECT(stats().destroys == 0, stats().destroys, " ncclCommDestroy on a broken context");
  throws<NcclError>(HERE, {"aborted after CUDA error"}, [&] { c->wait(1.0); });
}

// NCCLEMU_SLOW_COLLECTIVE_S=0.005: another thread keeps enqueueing while destroy() runs; nothing is
// destroyed in flight, the late collectives are refused with a clear error. See Note [Teardown].
SCENARIO(destroy_refuses_collectives_enqueued_meanwhile, 30) {
  auto c = NcclComm::init_all({0, 1}, 10.0);
  RankData d = make_inputs({0, 1}, c->ranks(), 8, DType::kFloat32);
  std::atomic<bool> started{false};
  std::string refusal;
  std::thread enqueuer([&] {
    for (int i = 0; i < 100000; ++i) {
      try {
        c->all_reduce(d.buffers(), {}, false, "avg", std::nullopt, "late");
      } catch (const NcclError& e) {
        refusal = e.what();
        return;
      }
      started.store(true);
      sleep_s(0.001);
    }
  });
  while (!started.load()) sleep_s(0.001);
  sleep_s(0.05);
  c->destroy();
  enqueuer.join();
  EXPECT(c->destroyed() && !c->aborted(), c->abort_reason());
  EXPECT(refusal.find("destroy") != std::string::npos, "refusal: ", refusal);
  const Stats s = stats();
  EXPECT(s.destroy_in_flight == 0 && s.misuse == 0, s.last_misuse);
}

}  // namespace emu_host
