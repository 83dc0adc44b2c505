// When each rank arrived at each collective of one host's channel, for the straggler report
// (ncclavg/transport/stragglers.py).
//
// Note [Arrival times]
// Every rank stamps the moment its collective starts (the steady clock, which on Linux is CLOCK_MONOTONIC:
// one clock for every process of a host) into its line of the segment with the call's first round, before
// it posts that round; once every rank has posted it, each reads every rank's stamp (the post's release
// makes it visible) and keeps the call in an ArrivalLog of its own: the earliest stamp and each rank's
// lateness after it. The stamp is the clock read the call's deadline needs anyway; the cost is one store
// and, after the round, one load per rank and a short copy under an uncontended lock. A stamp is read
// before anyone can post the round two later (which waits for this rank's `consumed`), so it is never
// overwritten before it is read. A user call may run several channel collectives (between hosts its
// steps within each host, chunk by chunk; on one host a reduction the channel cannot do, piece by piece):
// only the first is logged, the ranks' arrival at the call, not at its inner steps, which follow the
// call's own pace. ShmChannel::OneCall (the runner around every job: Runner._execute; the lanes around
// every call, which the native fast path makes without a job) marks the collectives of one call. Each
// host's channel compares the ranks of that host with each other.
#pragma once
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

namespace ncclavg {
namespace cpu {

class ArrivalLog {
 public:
  // The calls kept, the sliding window's longest reach: 4096, fewer for very many ranks (at most 8 MiB).
  explicit ArrivalLog(int nranks)
      : nranks_(nranks), capacity_(nranks * 4096 <= (1 << 20) ? 4096 : std::max(64, (1 << 20) / nranks)),
        start_(capacity_), late_(static_cast<size_t>(capacity_) * nranks) {}

  int capacity() const { return capacity_; }

  // One call: every rank's start stamp (ns of the steady clock), nranks of them.
  void add(const int64_t* stamps) {
    int64_t first = stamps[0];
    for (int r = 1; r < nranks_; ++r) first = stamps[r] < first ? stamps[r] : first;
    std::lock_guard<std::mutex> lock(mu_);
    const size_t at = static_cast<size_t>(calls_ % capacity_);
    start_[at] = first;
    for (int r = 0; r < nranks_; ++r) late_[at * nranks_ + r] = stamps[r] - first;
    ++calls_;
  }

  // The last `max_calls` calls logged (fewer when fewer are kept), oldest first: their earliest stamps
  // and, row by row, each rank's lateness in ns; returns how many calls were ever logged.
  uint64_t copy(int64_t max_calls, std::vector<int64_t>& starts, std::vector<int64_t>& late) const {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t kept = calls_ < static_cast<uint64_t>(capacity_) ? calls_ : static_cast<uint64_t>(capacity_);
    const uint64_t n = max_calls >= 0 && static_cast<uint64_t>(max_calls) < kept ? static_cast<uint64_t>(max_calls) : kept;
    starts.resize(n);
    late.resize(n * nranks_);
    for (uint64_t i = 0; i < n; ++i) {
      const size_t at = static_cast<size_t>((calls_ - n + i) % capacity_);
      starts[i] = start_[at];
      for (int r = 0; r < nranks_; ++r) late[i * nranks_ + r] = late_[at * nranks_ + r];
    }
    return calls_;
  }

 private:
  const int nranks_;
  const int capacity_;
  mutable std::mutex mu_;
  uint64_t calls_ = 0;
  std::vector<int64_t> start_;
  std::vector<int64_t> late_;
};

}  // namespace cpu
}  // namespace ncclavg
