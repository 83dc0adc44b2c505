// When each rank of every host arrived at each call between the hosts, on one clock: the straggler
// report of a group that spans hosts (ncclavg/transport/stragglers.py). Kept by the lanes (host_lanes.h).
//
// Note [Arrival times between hosts]
// A host's channel knows when its own ranks arrived at a call (Note [Arrival times] in shm_arrivals.h), on
// its host's steady clock; another host's clock counts from another boot. The lanes already send every
// peer one hello per call, after the host's first channel round, so the hello carries what the receiver
// needs, in 48 bytes (LaneHello): the sender host's arrival at the call (its first and last rank and
// their stamps, and the sum of its ranks' lateness after its first), the moment the hello was posted,
// and the sender's estimate of the one-way delay from the receiver (below). A process alone on its host
// arrives when the call (or the runner's job around it) begins.
// - One clock: for each peer p, d_in = min over recent hellos from p of (receive stamp - p's send
//   stamp) = offset + delay(p -> me), and p reports its own d_in for hellos from this process, d_out =
//   -offset + delay(me -> p). offset = (d_in - d_out) / 2, NTP's estimate, exact when the least delays
//   of the two directions are equal; the error is half their difference (tens of microseconds on a LAN,
//   against the report's millisecond threshold). A minimum, because a hello can only be seen late (the
//   receiver was busy in a channel step, or in a step of its own); over a window of kWindow hellos, so
//   that the clocks' slow drift apart (their rates differ by parts per million) does not age it.
// - Per call, once every host's hello is in: every rank's stamp on this process's clock. This host's are
//   exact; another host's first and last ranks are exact (its stamps plus the offset), and its other
//   ranks get their mean (from the sum): all the report reads (who was last, by how much, the others'
//   mean wait) is then exact, with 1-2 processes per host every stamp is.
// - A call is logged once the offsets to its peers are known (from the call after the lanes' connect
//   on: the connect's hellos give each side its first sample) and every host said when it arrived; a
//   user call that makes several calls between hosts (a job of the runner) logs its first, as a host's
//   channel does (the runner opens a scope on the lanes too).
// Every process of a host logs the same calls with (nearly) the same stamps; each host's offsets are its
// own estimates, so two hosts' reports may differ by the estimates' error.
#pragma once
#include <chrono>
#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

#include "shm_arrivals.h"

namespace ncclavg {
namespace cpu {

// A hello's payload (Note [Arrival times between hosts]); stamps in the sender's clock, ns.
struct LaneHello {
  int64_t sent_ns;        // when the sender posted this hello
  int64_t min_delay_ns;   // the sender's d_in for hellos from the receiver, kUnknown before it has one
  int64_t first_ns;       // the sender host's first rank's arrival at the call, kUnknown when not known
  int64_t last_ns;        // its last rank's
  int64_t late_sum_ns;    // the sum over its ranks of (arrival - first_ns)
  int32_t first_rank, last_rank;   // group ranks
  static constexpr int64_t kUnknown = std::numeric_limits<int64_t>::min();
};
static_assert(sizeof(LaneHello) == 48, "LaneHello: no padding on the wire");

// One host's arrival at a call, on some process's clock.
struct HostArrival {
  int64_t first_ns = LaneHello::kUnknown, last_ns = 0, late_sum_ns = 0;
  int first_rank = -1, last_rank = -1;
  bool known() const { return first_ns != LaneHello::kUnknown; }
  // From a host's ranks (`ranks`, group ranks) and their stamps.
  static HostArrival of(const std::vector<int>& ranks, const int64_t* stamps);
};

class HostArrivals {
 public:
  static constexpr int kWindow = 128;   // the hellos per peer whose least delay is d_in

  // `hosts`: every host's group ranks, as the lanes' layout; `host`: this process's.
  HostArrivals(const std::vector<std::vector<int>>& hosts, int host);

  // This process's clock (the steady clock, plus NCCLAVG_TEST_CLOCK_SKEW_MS: tests stand for hosts whose
  // clocks differ).
  int64_t now() const;
  int64_t skew() const { return skew_ns_; }

  // The runner's scope around one user call (as ShmChannel::OneCall): only its first call is logged.
  void begin_one_call();
  void end_one_call();
  // A process alone on its host: its arrival, the scope's start (the steady clock), as a host's stamps.
  const int64_t* alone_stamps() const { return &scope_started_ns_; }

  // A call begins: no host's arrival known yet.
  void begin_call();
  // This host's arrival at the call (what its hellos say): its ranks' stamps of the steady clock.
  void set_own(const int64_t* stamps);
  // The hello to `peer` (its group rank).
  LaneHello hello_to(int peer) const;
  // A hello from `peer` (of host `host`), received at `received_ns` of this process's clock.
  void heard(int peer, int host, const LaneHello& h, int64_t received_ns);
  // A call ended well: logged when it is its scope's first and every host's arrival and offset is known.
  // `own_stamps`: this host's ranks' exact stamps, as set_own's.
  void end_call(const int64_t* own_stamps);

  // The offset of `peer`'s clock to this process's (add it to a stamp of theirs), or kUnknown.
  int64_t offset_of(int peer) const;
  const ArrivalLog& log() const { return log_; }
  const std::vector<int>& labels() const { return labels_; }

 private:
  struct Peer {
    std::vector<int64_t> delays;   // recent (receive - send) of its hellos, a ring of kWindow
    int64_t next = 0;
    int64_t d_in = LaneHello::kUnknown, d_out = LaneHello::kUnknown;
  };

  std::vector<std::vector<int>> hosts_;
  int host_;
  int64_t skew_ns_ = 0;
  std::vector<int> labels_;            // the group's ranks, ascending: the log's columns
  std::vector<int> column_;            // group rank -> its column
  std::vector<Peer> peers_;            // by group rank
  mutable std::mutex delays_mu_;       // peers_' d_in and d_out: offset_of is read from other threads too
  std::vector<HostArrival> heard_;     // per host, this call's, on the sender's clock
  std::vector<int> heard_from_;        // per host, the peer whose hello gave it (-1: none yet)
  ArrivalLog log_;
  int call_depth_ = 0;
  bool call_logged_ = false;
  int64_t scope_started_ns_ = 0;       // the steady clock, without the skew
  std::vector<int64_t> stamps_;        // end_call's row
};

}  // namespace cpu
}  // namespace ncclavg
