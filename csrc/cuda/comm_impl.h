// Internals of NcclComm shared by comm.cpp (lifecycle, watchdog) and comm_collectives.cpp (the
// collectives). Not included by bindings.cpp: it carries CUDA types.
#pragma once
#include <cuda_runtime_api.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm.h"
#include "cuda_check.h"

namespace ncclavg {
namespace nccl {

struct NcclComm::Device {
  int device = 0;
  // The collectives run on `comm`. With blocking collectives it is a blocking ncclCommSplit of
  // `parent`, the non-blocking communicator of the bounded init, kept until teardown; otherwise
  // `parent` is null. `split` is the output slot of a split in flight: NCCL's thread writes it, so it
  // is read only after the split finished (or its parent was aborted, which joins that thread). It is
  // shared with an abort's helper thread, which may outlive this object (Note [Abort on a helper
  // thread] in comm.cpp). See Note [Blocking collectives after a bounded init] in comm_init.cpp.
  ncclComm_t comm = nullptr;
  ncclComm_t parent = nullptr;
  std::shared_ptr<ncclComm_t> split;
  cudaStream_t stream = nullptr;  // the comm stream: NCCL and our scale kernels run here
  cudaEvent_t ready = nullptr;    // recorded on the caller's stream; the comm stream waits for it
  // PreMulSum(1/size) reduction ops, created on first use per dtype, destroyed with the communicator.
  ncclRedOp_t premul[3] = {ncclSum, ncclSum, ncclSum};
  bool has_premul[3] = {false, false, false};
};

struct NcclComm::Op {
  uint64_t seq = 0;
  std::string what;                // "all_reduce_avg[bucket 3] of 4194304 bytes (...)" for errors
  std::vector<cudaEvent_t> done;   // one per local device, recorded on the comm stream after the op
  std::vector<int> devices;
  Op() = default;
  Op(const Op&) = delete;
  Op& operator=(const Op&) = delete;
  ~Op() {
    for (size_t i = 0; i < done.size(); ++i) {
      if (done[i]) cudaEventDestroy(done[i]);  // safe while pending: released once it completes
    }
  }
};

// Seconds on a monotonic clock.
inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline Deadline deadline_in(double seconds) { return Deadline{now_s() + seconds, seconds}; }

// Polling pace for host waits: yield for the first millisecond (a collective that is about to finish
// is seen at once, which latency benchmarks need), then sleep 50 us, then 1 ms once the wait is long.
class Backoff {
 public:
  Backoff() : start_(now_s()) {}
  void pause() const {
    const double waited = now_s() - start_;
    if (waited < 1e-3) {
      std::this_thread::yield();
    } else if (waited < 20e-3) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

 private:
  double start_;
};

// "[0, 1]"
std::string list_string(const std::vector<int>& v);
// NCCL's words for a result: ncclGetErrorString, plus ncclGetLastError when the loaded NCCL has it.
std::string nccl_words(ncclResult_t r, ncclComm_t comm);
// Checks a timeout argument: finite and > 0.
double checked_timeout(double t, const char* argname);

}  // namespace nccl
}  // namespace ncclavg
