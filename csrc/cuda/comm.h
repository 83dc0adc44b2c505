// NcclComm: the NCCL communicator behind the `nccl` backend of ncclavg.Communicator.
//
// One object drives every local device of this process: one NCCL communicator, one comm stream and a
// few events per device. Each collective is ONE grouped NCCL call over the local devices, ordered after
// the caller's streams with events (never a device sync), and tracked by per-device "done" events that
// the watchdog (wait / done) polls together with ncclCommGetAsyncError. A wait that passes its deadline
// aborts every local communicator and raises TimeoutError; the object then refuses every later call.
// See Note [Non-blocking init and abort] and Note [Blocking collectives after a bounded init] in
// comm_init.cpp, Note [Watchdog] and Note [Teardown] in comm.cpp, and Note [Choosing the reduction] in
// comm_collectives.cpp.
//
// No CUDA types in this header: streams and events cross as opaque handles, so bindings.cpp needs no
// CUDA headers. Every method is thread-safe (one mutex); wait() sleeps without holding it, so another
// thread can abort() a communicator whose wait is stuck.
//
// Lifetime of the buffers: a collective only enqueues work. The caller must keep the buffers alive
// (and not reuse their memory from another stream) until wait() returned or its own streams were
// ordered after the collective with stream_wait().
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "../common/buffer.h"
#include "nccl_api.h"

namespace ncclavg {
namespace nccl {

struct CollectivePlan;  // what one collective sends where, with which reduction (comm_collectives.cpp)

// A point on now_s()'s clock (comm_impl.h), and the seconds it was set from: timeout messages name the
// limit of the call that ran out, not the communicator's default.
struct Deadline {
  double at;
  double seconds;
};

class NcclComm {
 public:
  // One process, several devices: one rank per entry. A device listed twice is refused unless NCCL
  // allows several ranks on one GPU (See Note [Several ranks on one GPU] in nccl_api.cpp). Non-blocking
  // ncclCommInitRankConfig per device in one group when the loaded NCCL has it (>= 2.14), else
  // ncclCommInitRank per device in one group (what ncclCommInitAll does inside; blocking, so no init
  // timeout there).
  static std::unique_ptr<NcclComm> init_all(const std::vector<int>& devices, double timeout_s);
  // One rank of a multi-process communicator; `unique_id` is the 128 bytes of rank 0's nccl_unique_id().
  static std::unique_ptr<NcclComm> init_rank(const std::string& unique_id, int nranks, int rank, int device,
                                             double timeout_s);
  // Several ranks of a multi-process communicator: this process's towers, one rank per entry of
  // `devices`, ranks first_rank .. first_rank + devices.size() - 1 (the caller numbers them process-major:
  // first_rank = the towers of the processes before this one). Every process calls it with the same
  // `unique_id` and `nranks` (the towers of all processes). The local ranks start in ONE group, like
  // init_all, and follow its rule for a device listed twice; init_rank is the one-device case.
  static std::unique_ptr<NcclComm> init_ranks(const std::string& unique_id, int nranks, int first_rank,
                                              const std::vector<int>& devices, double timeout_s);
  // A fresh ncclUniqueId (128 bytes) for init_rank.
  static std::string unique_id();

  ~NcclComm();  // never throws; see Note [Teardown]
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int size() const { return size_; }              // ranks in the communicator (all processes)
  int local_size() const { return static_cast<int>(devices_.size()); }
  // The communicator rank of this process's first device: 0 for init_all, the process's rank for
  // init_rank, first_rank for init_ranks.
  int rank() const { return process_rank_; }
  const std::vector<int>& ranks() const { return ranks_; }    // communicator rank of each local device
  const std::vector<int>& devices() const { return devices_; }
  int nccl_version() const { return version_; }
  double timeout() const { return timeout_s_; }
  // "blocking" or "nonblocking": the kind of communicator the collectives run on, and why. See
  // Note [Blocking collectives after a bounded init] in comm_init.cpp.
  const std::string& collective_mode() const { return mode_; }
  const std::string& collective_mode_reason() const { return mode_reason_; }
  bool aborted() const;
  bool destroyed() const;
  std::string abort_reason() const;
  std::vector<uintptr_t> streams() const;  // the comm stream of each local device
  size_t pending();                        // collectives enqueued and not yet complete

  // In place: every buffer (one per local device, same numel and dtype) becomes the mean over all
  // ranks. `after_streams` (one per device, or empty = the legacy default stream) are the streams the
  // collective is ordered after. `op` is "avg" or "sum". `timeout_s` bounds the enqueue on non-blocking
  // communicators (empty: the communicator's timeout; a blocking enqueue cannot be bounded, see Note
  // [Blocking collectives after a bounded init]); `tag` names the collective in errors (e.g.
  // "bucket 3"). Returns the collective's sequence number for wait()/done() (0: nothing to do).
  uint64_t all_reduce(const std::vector<Buffer>& buffers, const std::vector<uintptr_t>& after_streams,
                      bool predivide, const std::string& op, std::optional<double> timeout_s,
                      const std::string& tag);
  // inputs: full buffers (numel divisible by size()); outputs: numel/size() shards. Output i receives
  // the mean of shard ranks()[i].
  uint64_t reduce_scatter(const std::vector<Buffer>& inputs, const std::vector<Buffer>& outputs,
                          const std::vector<uintptr_t>& after_streams, bool predivide, const std::string& op,
                          std::optional<double> timeout_s, const std::string& tag);
  // inputs: shards; outputs: size() * shard numel, rank r's shard at offset r * shard numel.
  uint64_t all_gather(const std::vector<Buffer>& inputs, const std::vector<Buffer>& outputs,
                      const std::vector<uintptr_t>& after_streams, std::optional<double> timeout_s,
                      const std::string& tag);

  // The reduction a collective would use on this communicator ("ncclAvg", "PreMulSum(1/3)",
  // "ncclSum + divide by 3", ...). See Note [Choosing the reduction] in comm_collectives.cpp.
  std::string reduction(DType dtype, bool predivide, const std::string& op, bool all_reduce) const;

  // Host waits until collective `seq` (0: everything enqueued so far) completed on every local device.
  // Polls the done events and ncclCommGetAsyncError; an async error aborts and raises NcclError, the
  // deadline aborts and raises TimeoutError naming the oldest unfinished collective.
  void wait(std::optional<double> timeout_s, uint64_t seq = 0);
  // Non-blocking: has collective `seq` (0: all) completed? Raises like wait() on an async error.
  bool done(uint64_t seq = 0);
  // Makes `streams` (one per local device) wait for collective `seq` (0: the last enqueued), with events;
  // the host does not wait.
  void stream_wait(const std::vector<uintptr_t>& streams, uint64_t seq = 0);

  // ncclCommAbort on every local communicator, on a helper thread joined for at most abort_join_s();
  // idempotent. See Note [Abort on a helper thread] in comm.cpp.
  void abort();
  // Refuses new collectives, waits (bounded by the timeout) for the ones in flight, then
  // ncclCommDestroy; aborts instead on timeout. See Note [Teardown] in comm.cpp.
  void destroy();

  // How long an abort is waited for before the caller gets its error (the abort goes on in the
  // background), and how long the destructor waits for work in flight (See Note [Teardown]).
  static constexpr double kAbortJoinMaxS = 10.0;
  static constexpr double kTeardownWaitMaxS = 10.0;
  double abort_join_s() const { return timeout_s_ < kAbortJoinMaxS ? timeout_s_ : kAbortJoinMaxS; }

 private:
  struct Device;    // per local device: comm, stream, events (comm_impl.h)
  struct Op;        // one enqueued collective: its done events and description (comm_impl.h)
  struct AbortJob;  // the helper thread of an abort (comm.cpp)

  enum class Which { kComm, kParent };  // the collectives' communicators, or the init ones they split off

  NcclComm() = default;
  static std::unique_ptr<NcclComm> create(const std::vector<int>& devices, int process_rank,
                                          double timeout_s);
  // init_rank / init_ranks once their arguments are checked: ranks first_rank, first_rank + 1, ... on
  // `devices`, in one group.
  static std::unique_ptr<NcclComm> init_process_ranks(const ncclUniqueId& id, int nranks, int first_rank,
                                                      const std::vector<int>& devices, double timeout_s,
                                                      bool want_blocking, const std::string& what);
  void init_comms(const ncclUniqueId& id, int nranks, const std::vector<int>& comm_ranks, bool want_blocking,
                  const std::string& what);

  // Every *_locked member expects mu_ to be held.
  bool choose_mode_locked(bool nonblocking_init, bool want_blocking);
  void start_init_locked(const ncclUniqueId& id, int nranks, const std::vector<int>& comm_ranks, bool nonblocking,
                         const std::string& what);
  void split_blocking_locked(const std::vector<int>& comm_ranks, const Deadline& deadline, const std::string& what);
  void read_back_locked(int nranks, const std::vector<int>& comm_ranks);
  void check_usable_locked(const char* what) const;
  void check_async_errors_locked(const std::string& during);
  void poll_ready_locked(const Deadline& deadline, const std::string& what, Which which = Which::kComm);
  void abort_locked(const std::string& reason);
  void abort_comms_locked();
  // Called WITHOUT mu_: waits (at most abort_join_s()) for the abort's helper thread; "" when it
  // finished (or there was none), else a note for the error message.
  std::string await_abort();
  // In a catch block: rethrows the current exception, with await_abort()'s note appended if any.
  [[noreturn]] void rethrow_after_abort();
  void destroy_within(double wait_s);
  void check_not_capturing(const std::vector<uintptr_t>& streams) const;
  void destroy_comms_locked();
  void release_cuda_locked();
  bool prune_locked();  // drops completed ops from the front; true when none is left
  void stream_wait_locked(const std::vector<uintptr_t>& streams, uint64_t seq);
  ncclRedOp_t premulsum_locked(size_t device_index, DType dtype, const Deadline& deadline);
  uint64_t run_locked(const CollectivePlan& plan, const std::vector<uintptr_t>& after_streams,
                      std::optional<double> timeout_s);
  std::string where() const;  // "rank 0 of 2, devices [0]"

  mutable std::mutex mu_;
  std::vector<int> devices_;
  std::vector<int> ranks_;
  std::vector<std::unique_ptr<Device>> dev_;
  std::deque<std::unique_ptr<Op>> ops_;
  uint64_t next_seq_ = 1;
  int size_ = 0;
  int divisor_ = 0;              // what averages divide by: size_, or the test switch's
  std::string forced_reduction_; // "" or the test switch's kind: See Note [Forcing the reduction in tests]
  int process_rank_ = 0;
  int version_ = 0;
  double timeout_s_ = 600.0;
  std::string mode_ = "nonblocking";  // See Note [Blocking collectives after a bounded init]
  std::string mode_reason_;
  bool ready_ = false;  // every communicator finished its init
  bool aborted_ = false;
  bool destroyed_ = false;
  bool closing_ = false;  // destroy() started: new collectives are refused (See Note [Teardown])
  std::string abort_reason_;
  std::shared_ptr<AbortJob> abort_job_;
};

// NCCLAVG_TEST_REDUCTION's value -> kind ("avg", "premulsum", "sum_divide") and divisor (0: the size).
// See Note [Forcing the reduction in tests] in comm_collectives.cpp.
void parse_test_reduction(const std::string& value, std::string* kind, int* divisor);

}  // namespace nccl
}  // namespace ncclavg
