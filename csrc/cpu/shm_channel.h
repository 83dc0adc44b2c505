// A collective channel between the processes of one host, through one POSIX shared-memory segment:
// the gloo backend's transport when every process of the group shares the host (ncclavg/comm/shm.py).
// See Note [Shared-memory channel] in shm_channel.cpp.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace ncclavg {
namespace cpu {

// Element types of a channel collective: the core's three (same codes as DType) plus float64.
enum class ShmType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// A peer process exited, or some process aborted the channel -> ncclavg.CommError in Python.
struct ShmPeerError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ShmHeader;
struct ShmRankLine;

class ShmChannel {
 public:
  // Rank 0 creates the segment `name` (it must not exist) and reserves its memory, so that a full
  // /dev/shm fails here and not with SIGBUS later; the other ranks open it and check `nonce`.
  // `labels` (default 0..nranks-1): how errors name each channel rank, e.g. its rank in the process
  // group when the channel spans only one host's processes.
  ShmChannel(const std::string& name, int rank, int nranks, int64_t slot_bytes, uint64_t nonce,
             std::vector<int> labels = {});
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // Removes the name (the mapping stays): once every rank has opened it, so nothing outlives a crash.
  void unlink_name();

  // Every collective is called by every rank in the same order, and waits at most timeout_s for its
  // peers. Pointers are host memory of count elements (of `type`), unless said otherwise.
  void all_reduce_sum(uintptr_t data, int64_t count, int type, double timeout_s);
  // in: nranks * count elements; out (count): the sum of every rank's slice `rank`.
  void reduce_scatter_sum(uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s);
  // in: count elements; out: nranks * count, rank r's input at r * count.
  void all_gather(uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s);
  void broadcast(uintptr_t data, int64_t count, int type, int root, double timeout_s);

  // Makes this process's waits end now and tells the peers (their next wait raises ShmPeerError).
  void abort(const std::string& why);

  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  uint64_t collectives() const { return seq_; }

 private:
  enum Counter { kPosted, kReduced, kConsumed };
  unsigned char* slot(uint64_t seq, int r) const;
  ShmRankLine& line(int r) const;
  uint64_t begin_round(const char* op, double timeout_s);
  uint64_t post_round(const char* op, const unsigned char* data, int64_t bytes, uint64_t sig, double timeout_s);
  void check_same_collective(uint64_t sig, int only_rank, uint64_t seq);
  void wait_for(Counter c, uint64_t target, int only_rank, const char* op, double timeout_s, uint64_t seq);
  void publish(Counter c, uint64_t seq);
  void check_usable(const char* op) const;
  [[noreturn]] void fail_all(const std::string& why, bool timeout);

  std::string name_;
  int rank_, nranks_;
  std::vector<int> labels_;
  int64_t slot_bytes_;
  size_t map_bytes_ = 0;
  unsigned char* base_ = nullptr;
  ShmHeader* header_ = nullptr;
  unsigned char* data_ = nullptr;
  uint64_t seq_ = 0;                 // rounds done: the same on every rank
  std::atomic<bool> local_abort_{false};
  bool failed_ = false;
};

}  // namespace cpu
}  // namespace ncclavg
