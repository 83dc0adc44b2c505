// What host_lanes.cpp (messages, waiting, failure) and host_lanes_collectives.cpp (the collectives' loops)
// share: one message in flight, one peer, one call.
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "host_lanes.h"

namespace ncclavg {
namespace cpu {

// The kinds of message (a tag's 4 kind bits): a call's hello, the data of its first and second exchange,
// and the abort message that tells a peer this process failed.
constexpr int kKindHello = 1, kKindFirst = 2, kKindSecond = 3, kKindAbort = 15;
// How a failure is told (the first byte of an abort message; the exception raised).
constexpr int kFailPeer = 1, kFailMismatch = 2, kFailTimeout = 3, kFailAborted = 4;

struct LaneRequest {
  void* ucp = nullptr;          // UCP's request, freed when the call ends; nullptr when done at once
  bool done = false, is_recv = false, checked = false;
  ucs_status_t status = UCS_OK;
  size_t length = 0;            // a receive: the sender's message length
  int peer = -1, lane = 0, kind = 0;
  int64_t chunk = -1, expect = 0;
  int64_t done_ns = 0;          // a receive: when it completed (the steady clock), for a hello's delay
  LaneHello hello{};            // a hello's payload, sent or received (Note [Arrival times between hosts])
  LaneHeader head{};            // a send's header, a receive's landing place for the sender's
  ucp_dt_iov_t iov[2]{};
};

struct LanePeer {
  int rank = -1, host = -1;
  ucp_ep_h ep = nullptr;
  volatile ucs_status_t error = UCS_OK;   // set by UCX's error callback (on the progressing thread)
};

// One collective: its arguments, deadline and every message it posted.
struct LaneCall {
  LaneCall(HostLanes& e, LaneOp op, int type, int64_t count, int root, double timeout_s, ShmCallTag tag);
  LaneRequest* make_request(int peer, int lane, int kind, int64_t chunk, bool recv);
  LaneRequest* hello_from(int peer, int lane);
  bool waits_on(int peer) const;   // a request of this call to or from `peer` not complete yet
  std::string what() const;
  double deadline_left() const;   // seconds to the deadline, at least 1 ms (a channel step's limit)

  // The lanes' scope of one user call (as ShmChannel::OneCall): Note [Arrival times between hosts].
  struct Scope {
    explicit Scope(HostArrivals& a) : a_(a) { a_.begin_one_call(); }
    ~Scope() { a_.end_one_call(); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    HostArrivals& a_;
  };

  HostLanes& engine;
  ShmChannel::OneCall one_call;   // the host's channel logs the call's first step only (Note [Arrival times])
  Scope scope;
  LaneOp op;
  int type;
  int64_t count;
  int root;
  double timeout_s;
  ShmCallTag tag;
  uint64_t seq = 0;
  bool failed = false;
  bool hello_said = false;
  std::chrono::steady_clock::time_point deadline, idle_since{};
  std::chrono::steady_clock::duration spin{};   // how long this call's waits poll before they block
  std::vector<std::unique_ptr<LaneRequest>> requests;
  std::vector<LaneRequest*> hellos, sends;
};

}  // namespace cpu
}  // namespace ncclavg
