// A collective channel between the processes of one host, through one shared-memory segment: the gloo
// backend's transport when processes of the group share a host (ncclavg/transport/shm.py).
// See Note [Shared-memory channel] in shm_channel.cpp and Note [Segment without a name] in shm_segment.cpp.
#pragma once
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common/check.h"
#include "shm_arrivals.h"
#include "shm_calls.h"

namespace ncclavg {
namespace cpu {

// Element types of a channel collective: the core's three (same codes as DType) plus float64.
enum class ShmType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

inline size_t type_size(ShmType t) {
  switch (t) {
    case ShmType::kFloat32: return 4;
    case ShmType::kFloat16:
    case ShmType::kBFloat16: return 2;
    case ShmType::kFloat64: return 8;
  }
  return 0;
}

inline const char* type_name(ShmType t) {
  switch (t) {
    case ShmType::kFloat32: return "float32";
    case ShmType::kFloat16: return "float16";
    case ShmType::kBFloat16: return "bfloat16";
    case ShmType::kFloat64: return "float64";
  }
  return "unknown";
}
constexpr int kShmTypeCount = 4;

// A peer process exited, or some process aborted the channel -> ncclavg.CommError in Python.
struct ShmPeerError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The ranks called different collectives (Note [Call signatures] in shm_calls.cpp): raised on every
// rank, by its own check or through the abort of the rank that found it first.
struct ShmMismatchError : ShmPeerError {
  using ShmPeerError::ShmPeerError;
};
// The call's deadline passed while the channel waited for a rank, which the message names -> ncclavg's
// _C.ShmTimeoutError, a CommTimeoutError (Note [Failures are told by type] in ncclavg/transport/failure.py).
struct ShmTimeoutError : TimeoutError {
  using TimeoutError::TimeoutError;
};

// What a waiting collective calls once, on its own thread, when its wait outlasts the first spin (Note
// [Waiting in the channel]): the Python binding of the small-message fast path releases the GIL there,
// so that a call whose peers are ready never gives it up. Set per thread; nullptr: none.
struct ShmBlockingHook {
  virtual void before_blocking() = 0;

 protected:
  ~ShmBlockingHook() = default;
};
void set_blocking_hook(ShmBlockingHook* hook);

struct ShmHeader;
struct ShmRankLine;

// A reference to the callable that fills this rank's slot in a round (post_round): std::function would
// allocate on the heap for a lambda that captures more than two references, once per round. With
// ShmSources below: ~25 ns of an 8-byte all-reduce's ~0.9 us (two processes, 2-core Xeon). Valid for the
// call it is passed to.
class ShmFill {
 public:
  template <class F>
  ShmFill(F&& f)  // NOLINT(google-explicit-constructor): passed a lambda in place
      : obj_(static_cast<void*>(&f)), call_(&invoke<std::remove_reference_t<F>>) {}
  void operator()(unsigned char* slot) const { call_(obj_, slot); }

 private:
  template <class F>
  static void invoke(void* f, unsigned char* slot) {
    (*static_cast<F*>(f))(slot);
  }
  void* obj_;
  void (*call_)(void*, unsigned char*);
};

// The source pointers of a sum, one per rank: on the stack up to 16 ranks (no allocation per round).
class ShmSources {
 public:
  explicit ShmSources(int n) : ptr_(n <= kInline ? inline_ : (heap_.resize(n), heap_.data())) {}
  ShmSources(const ShmSources&) = delete;
  ShmSources& operator=(const ShmSources&) = delete;
  const unsigned char*& operator[](int r) { return ptr_[r]; }
  const unsigned char* const* data() const { return ptr_; }

 private:
  static constexpr int kInline = 16;
  const unsigned char* inline_[kInline];
  std::vector<const unsigned char*> heap_;
  const unsigned char** ptr_;
};
class ShmDoor;

class ShmChannel {
 public:
  // Rank 0 creates the segment and opens a door named `name` (any 1-100 printable characters; choose it
  // at random) through which the other ranks receive it; the other ranks ask that door, giving `nonce`,
  // and fail at once when it is not open (yet). `labels` (default 0..nranks-1): how errors name each
  // channel rank, e.g. its rank in the process group when the channel spans only one host's processes.
  ShmChannel(const std::string& name, int rank, int nranks, int64_t slot_bytes, uint64_t nonce,
             std::vector<int> labels = {});
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // Rank 0: closes the door (once every rank has joined, or given up). Idempotent; a no-op elsewhere.
  void close_door();

  // Every collective is called by every rank in the same order, and returns or fails within timeout_s.
  // Pointers are host memory of count elements (of `type`), unless said otherwise. Sums are in rank
  // order, accumulated in fp32 (fp64 for float64), rounded to `type`, then scaled by mul / div. `tag`:
  // the user's call this channel call serves (Note [Call signatures] in shm_calls.cpp); ranks whose
  // calls differ fail with ShmMismatchError naming both.
  // The sums: nonfinite != nullptr sets *nonfinite to whether any value this rank wrote into its output
  // is an inf or a NaN, noted while writing it (the slices it sums and those it copies from their owners:
  // Note [Finiteness from the pass that writes] in csrc/common/finite_math.h). Every rank of an all-reduce
  // writes the same bits, so every rank gets the same answer.
  void all_reduce_sum(uintptr_t data, int64_t count, int type, double timeout_s, double mul = 1.0, double div = 1.0,
                      ShmCallTag tag = {}, bool* nonfinite = nullptr);
  // in: nranks * count elements; out (count): the sum of every rank's slice `rank`.
  void reduce_scatter_sum(uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s, double mul = 1.0,
                          double div = 1.0, ShmCallTag tag = {}, bool* nonfinite = nullptr);
  // in: count elements; out: nranks * count, rank r's input at r * count.
  void all_gather(uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s, ShmCallTag tag = {});
  void broadcast(uintptr_t data, int64_t count, int type, int root, double timeout_s, ShmCallTag tag = {});
  // Announces that this rank posts its next round (a collective) and tells whether every peer has
  // announced or posted that round too, looking for at most max_wait_s, spinning then yielding as a wait
  // does (Note [An asynchronous call whose peers wait] in shm_channel.cpp). False at once on a failed or
  // aborted channel, or for a caller that is not the rank's owner. After it, whatever the answer, the
  // next collective this rank posts must be the one it announced. Call it only where no collective of
  // this rank runs (holding the order a collective holds).
  bool peers_ready(double max_wait_s);
  // One round that moves nothing: a barrier, or the signature check of a call that moves its data
  // another way (through gloo).
  void barrier(double timeout_s, ShmCallTag tag = {});

  // Makes this process's waits end now and tells the peers (their next wait raises ShmPeerError, or
  // ShmMismatchError when `mismatch`: the ranks' calls differ, found outside the channel).
  void abort(const std::string& why, bool mismatch = false) { abort_as(why, mismatch ? kAbortMismatch : kAbortOther); }

  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  const std::vector<int>& labels() const { return labels_; }   // how errors name each channel rank
  // The rank (its label) a collective of this process waits for now, or -1: read by another thread (a
  // watchdog that ends the collective at its deadline names that rank).
  int waiting_on() const { return waiting_on_.load(std::memory_order_relaxed); }
  int64_t slot_bytes() const { return slot_bytes_; }
  uint64_t collectives() const { return seq_; }
  // Bytes of rank r's slots that are in memory now (mincore): each rank reserves its own.
  int64_t resident_slot_bytes(int r) const;
  // When each rank arrived at this channel's recent collectives (Note [Arrival times] in shm_arrivals.h).
  const ArrivalLog& arrivals() const { return arrivals_; }
  // The channel collectives of one user call that takes several (a call between hosts): while a OneCall
  // lives, only the first of them logs its ranks' arrivals (Note [Arrival times]). Scopes may nest.
  class OneCall {
   public:
    explicit OneCall(ShmChannel* ch) : ch_(ch) {
      if (ch_ != nullptr) ch_->begin_one_call();
    }
    ~OneCall() {
      if (ch_ != nullptr) ch_->end_one_call();
    }
    OneCall(const OneCall&) = delete;
    OneCall& operator=(const OneCall&) = delete;

   private:
    ShmChannel* ch_;
  };
  void begin_one_call() {
    if (call_depth_++ == 0) call_logged_ = false;
  }
  void end_one_call() {
    if (call_depth_ > 0) --call_depth_;
  }
  // Inside a OneCall scope whose first collective has run: its ranks' start stamps (by channel rank), as
  // logged; else nullptr. The lanes tell the other hosts from them (Note [Arrival times between hosts]).
  const int64_t* scope_arrivals() const { return call_depth_ > 0 && call_logged_ ? scope_stamps_.data() : nullptr; }

 private:
  struct Call;
  enum Counter { kPosted, kReduced, kConsumed };
  enum AbortKind { kAbortOther = 1, kAbortMismatch = 2 };
  void abort_as(const std::string& why, AbortKind kind);
  [[noreturn]] void throw_aborted(const Call& call);
  std::string describe(const uint64_t* sig, const uint64_t* detail) const;
  unsigned char* slot(uint64_t seq, int r) const;
  ShmRankLine& line(int r) const;
  void begin(Call& call);
  uint64_t post_round(Call& call, ShmFill fill);
  void check_same_collective(const Call& call, uint64_t seq);
  void note_arrivals(uint64_t seq);
  void wait_for(Counter c, uint64_t target, int only_rank, const Call& call, uint64_t seq);
  void publish(Counter c, uint64_t seq);
  void wake_all();
  [[noreturn]] void fail_all(const std::string& why, bool timeout);
  [[noreturn]] void fail_mismatch(const std::string& why);

  std::string name_;
  int rank_, nranks_;
  std::vector<int> labels_;
  int64_t slot_bytes_;
  size_t map_bytes_ = 0;
  unsigned char* base_ = nullptr;
  ShmHeader* header_ = nullptr;
  unsigned char* data_ = nullptr;
  std::unique_ptr<ShmDoor> door_;   // rank 0, until every rank has joined
  uint64_t seq_ = 0;                // rounds done: the same on every rank
  ArrivalLog arrivals_;
  int call_depth_ = 0;         // OneCall scopes open
  bool call_logged_ = false;   // the scope's first collective has logged its arrivals
  std::vector<int64_t> scope_stamps_;   // and their stamps
  std::atomic<bool> local_abort_{false};
  std::atomic<int> waiting_on_{-1};
  bool failed_ = false;
  std::chrono::steady_clock::duration spin_{};   // how long a wait spins before it yields
};

}  // namespace cpu
}  // namespace ncclavg
