// The stand-in libnccl: internals shared by nccl_standin.cpp (the entry points, groups, faults) and
// nccl_standin_world.cpp (rendezvous and data exchange). A test double for the host logic of
// csrc/cuda/comm*.cpp, loaded through NCCLAVG_NCCL_LIBRARY; never installed. See
// docs/cuda_emulation.md, "The stand-in NCCL".
//
// Note [Stand-in rendezvous]
// A unique id names a directory (under NCCLEMU_DIR, else $TMPDIR or /tmp). Every rank of a
// communicator, whether a thread of this process or another process, maps the same small control file
// there: who joined (and with which key, for a split), and per rank the last collective whose data it
// posted and the last one it finished reading. A collective k of rank r writes its send buffer to the
// file c<k>-r<r>, publishes posted[r] = k, waits until every rank posted k, reads them all, computes its
// output, publishes read[r] = k, waits until every rank read k, and removes its file. Every wait polls
// the communicator's abort flag, as NCCL's kernels and bootstrap do, so ncclCommAbort ends it.
// Collectives of one communicator run in the order they were enqueued on its stream, which is the
// order NCCL requires every rank to call them in.
#pragma once
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../nccl_api.h"

namespace ncclemu {

constexpr int kMaxRanks = 64;

// The control file of one communicator, shared by every rank (threads and processes). Zero-filled
// when created; lock-free atomics are address-free, so they work across processes.
struct Control {
  std::atomic<int> nranks;
  std::atomic<int> joined[kMaxRanks];
  std::atomic<int> key[kMaxRanks];  // split key + 1 (0: not yet written)
  std::atomic<uint64_t> posted[kMaxRanks];
  std::atomic<uint64_t> read[kMaxRanks];
  std::atomic<int> closed[kMaxRanks];
};

// The faults a communicator was created with (NCCLEMU_* variables, read once at its init).
struct Faults {
  int init_hang_rank = -1;       // NCCLEMU_INIT_HANG=<rank>: that rank's init never finishes
  double init_delay_s = 0;       // NCCLEMU_INIT_DELAY_S: every init takes this long
  int hang_rank = -1;            // NCCLEMU_HANG=<rank>:<k>: that rank freezes in its collective k
  uint64_t hang_at = 0;
  double slow_s = 0;             // NCCLEMU_SLOW_COLLECTIVE_S: every collective takes this long
  double async_error_s = -1;     // NCCLEMU_ASYNC_ERROR_AFTER_S=<s>[:<rank>]: ncclRemoteError after s
  int async_error_rank = -1;
  bool abort_blocks = false;     // NCCLEMU_ABORT_BLOCKS=1: abort waits until every peer closed
  std::string split;             // NCCLEMU_SPLIT=fail|null
  double enqueue_delay_s = 0.02; // NCCLEMU_ENQUEUE_DELAY_S: a non-blocking group's launch lags this much
};
Faults faults_from_env();

struct PreMul {
  ncclRedOp_t op;
  ncclDataType_t dtype;
  float scalar;  // the scalar rounded to dtype, widened back
};

}  // namespace ncclemu

struct ncclComm {
  std::string dir;  // this communicator's rendezvous directory
  int nranks = 0;
  int rank = 0;
  int device = 0;
  bool blocking = true;
  ncclemu::Control* ctl = nullptr;
  ncclemu::Faults faults;
  std::atomic<int> state{ncclSuccess};  // what ncclCommGetAsyncError reports
  std::atomic<bool> abort{false};
  std::atomic<bool> dead{false};         // destroyed or aborted: any later call is misuse
  std::atomic<uint64_t> enqueued{0};     // collectives called (their sequence numbers)
  std::atomic<uint64_t> completed{0};    // collectives finished on the stream
  std::atomic<double> ready_at{0};       // when the init finished (for the async error fault)
  int splits = 0;                        // children made, names the next child's directory
  std::mutex m;                          // premul, children, job
  std::vector<ncclemu::PreMul> premul;
  int premul_made = 0;                   // numbers the next PreMulSum op
  std::vector<ncclComm*> children;       // a split in flight: its child's abort flag follows ours
  std::thread job;                       // the init or split running for a non-blocking communicator
  int key = 0;                           // for a split child: its key
  ncclComm* parent = nullptr;            // for a split child
};

namespace ncclemu {

double now_s();
void sleep_s(double s);
size_t dtype_size(ncclDataType_t t);
bool dtype_known(ncclDataType_t t);

// Rendezvous (Note [Stand-in rendezvous]). join() blocks until every rank joined, the communicator is
// aborted (returns ncclSuccess; the caller sees the flag), or the fault says never; a mismatch of nranks
// or a rank joining twice is ncclInvalidUsage.
std::string id_dir(const ncclUniqueId& id);
ncclResult_t open_control(ncclComm* c);
ncclResult_t join(ncclComm* c);
// After join(): the rank of a split child, from the keys every rank wrote.
int rank_by_key(ncclComm* c);
void close_rank(ncclComm* c);
// Blocks until every other rank closed (or `limit_s` passed).
void wait_peers_closed(ncclComm* c, double limit_s);

enum class Kind { kAllReduce, kReduceScatter, kAllGather, kBroadcast };
struct Collective {
  Kind kind;
  const void* send;
  void* recv;
  size_t count;
  ncclDataType_t dtype;
  ncclRedOp_t op;
  float scalar;      // the pre-multiplier (1 for sum; 1/n rounded for avg; PreMulSum's)
  int root;
  ncclComm* comm;
  uint64_t seq;      // 1-based, per communicator
};
// Runs on the communicator's stream (a host function): Note [Stand-in rendezvous].
void run_collective(Collective* c);

}  // namespace ncclemu
