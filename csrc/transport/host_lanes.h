// The lanes between hosts on UCX: one native loop per collective moves every chunk, with this host's
// shared-memory channel inside the host (ncclavg/transport/ucx.py sets it up). See Note [Lanes between
// hosts] in host_lanes.cpp and Note [The lanes' pipeline] in host_lanes_collectives.cpp.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "host_arrivals.h"
#include "shm_calls.h"
#include "shm_channel.h"
#include "ucx_api.h"

namespace ncclavg {
namespace cpu {

// Where the lanes are: every host's group ranks (ascending, hosts in the order of their lowest rank) and
// which lanes each process carries (Note [Lanes between hosts]). Pure arithmetic, shared by the engine
// and its tests.
struct LaneLayout {
  std::vector<std::vector<int>> hosts;
  int rank = 0, host = 0, local = 0, lanes = 0;   // this process; `lanes`: K, the most processes on one host

  LaneLayout(std::vector<std::vector<int>> hosts, int rank);
  int nhosts() const { return static_cast<int>(hosts.size()); }
  int local_size() const { return static_cast<int>(hosts[host].size()); }
  // The group rank that carries lane k on host h: its local rank k % P_h.
  int carrier(int h, int k) const { return hosts[h][k % hosts[h].size()]; }
  // The lanes local rank l of this host carries (k % P == l), ascending.
  std::vector<int> lanes_of(int l) const;
  // The rank whose slice lane k carries from host h (its local rank k), or -1 where host h has none.
  int slice_owner(int h, int k) const { return k < static_cast<int>(hosts[h].size()) ? hosts[h][k] : -1; }
  // The host of group rank r, or -1.
  int host_of(int r) const;
  // Every rank this process exchanges with: its lanes' carriers on the other hosts, ascending.
  std::vector<int> peers() const;
};

// One message's head (Note [Lanes between hosts]): the call it serves, so that a receiver whose call
// differs names both; which chunk and how many payload bytes follow.
struct LaneHeader {
  uint32_t magic;
  uint16_t op, type;        // the wire collective (LaneOp) and element type (ShmType)
  uint64_t seq;             // the call's number on this engine (the same on every rank)
  uint64_t word;            // ShmCallTag::word of the user's call
  int64_t count;            // the wire call's element count
  int64_t user_count;       // ShmCallTag::count
  int64_t chunk;            // -1: the call's hello
  int64_t bytes;            // payload bytes after the header
  int32_t sender, root;     // the sender's group rank; the wire root (-1: none)
};
static_assert(sizeof(LaneHeader) == 64, "LaneHeader: no padding on the wire");

enum class LaneOp : uint16_t { kAllReduce = 0, kBroadcast = 1, kAllGather = 2, kReduceScatter = 3, kCheck = 4 };

struct LaneRequest;
struct LanePeer;
struct LaneCall;

class HostLanes {
 public:
  // An all-reduce or broadcast of at most this many bytes goes whole, in one exchange (WholePipe).
  static constexpr int64_t kWholeBytes = 16 << 10;
  // How long a wait polls the worker, yielding the core between polls, before it blocks on the event fd
  // (Note [Lanes between hosts] in host_lanes.cpp), in microseconds.
  static constexpr int64_t kSpinUs = 300, kMaxSpinUs = 1000000;
  // A pipelined call whose chunks have been taking longer than kSlowChunkUs each (a slow link) polls for
  // at most kSlowSpinUs: its waits are a chunk's time on the wire, not a round trip (Note [Lanes between
  // hosts] in host_lanes.cpp).
  static constexpr int64_t kSlowChunkUs = 1000;
  static constexpr int64_t kSlowSpinUs = 50;
  // `channel`: this host's channel (nullptr when this process is alone on its host), kept alive by the
  // caller; `tls`, `devices`: UCX_TLS and UCX_NET_DEVICES for this process's context ("" : UCX's own).
  HostLanes(std::vector<std::vector<int>> hosts, int rank, ShmChannel* channel, const std::string& tls,
            const std::string& devices, int64_t chunk_bytes, int depth, int64_t spin_us = kSpinUs,
            int64_t slow_chunk_us = kSlowChunkUs);
  ~HostLanes();
  HostLanes(const HostLanes&) = delete;
  HostLanes& operator=(const HostLanes&) = delete;

  // This worker's address, to be handed to every peer (through the group's store).
  std::string address() const { return address_; }
  const LaneLayout& layout() const { return layout_; }
  // Connects to every peer (`addresses` indexed by group rank: each peer's address()) and exchanges one
  // hello with each within timeout_s, so that a link that does not work fails here, not in a collective.
  void connect(const std::vector<std::string>& addresses, double timeout_s);

  // The collectives, every rank of every host calling them in the same order. Element types and tags as
  // ShmChannel's; sums in host order with fp32 accumulation (fp64 for float64): every rank gets the same bits.
  // div != 1: each rank then divides its result by div (not on the wire: any rank may pass 1 and divide
  // after, with the same bits).
  void all_reduce_sum(uintptr_t data, int64_t count, int type, double timeout_s, ShmCallTag tag, double div = 1.0);
  void broadcast(uintptr_t data, int64_t count, int type, int root, double timeout_s, ShmCallTag tag);
  // in: count elements; out: world x count, rank r's at r * count.
  void all_gather(uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s, ShmCallTag tag);
  // in: world x count; out (count): the sum over the ranks of their slice `rank`.
  void reduce_scatter_sum(uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s, ShmCallTag tag);
  // The ranks' calls compared; every rank has arrived when it returns (a barrier).
  void check(double timeout_s, ShmCallTag tag);

  // From any thread: ends this process's waits now with `why`, tells the peers and this host's channel.
  void abort(const std::string& why);
  bool failed() const { return failed_.load(); }
  std::string failure() const;
  // The group rank this process waits for between the hosts now, or -1 (read by a watchdog).
  int waiting_on() const { return waiting_on_.load(std::memory_order_relaxed); }
  uint64_t calls() const { return seq_; }
  uint64_t messages_sent() const { return sent_; }
  int64_t chunk_bytes() const { return chunk_bytes_; }
  int depth() const { return depth_; }
  int64_t spin_us() const { return std::chrono::duration_cast<std::chrono::microseconds>(spin_).count(); }
  // The time between two chunks' completions of recent pipelined calls (a moving average; 0 before any).
  double chunk_us() const { return chunk_ns_ / 1e3; }
  // How long the latest call's waits polled before blocking (spin_us, or less on a slow link).
  int64_t wait_window_us() const { return wait_window_us_; }
  // The UCX settings the engine gave its context (name without "UCX_" -> value), beside the environment's.
  const std::map<std::string, std::string>& ucx_settings() const { return ucx_settings_; }
  // When every rank of every host arrived at the recent calls, on this process's clock (Note [Arrival
  // times between hosts] in host_arrivals.h); the runner's scope around one user call's calls.
  const HostArrivals& arrivals() const { return arrivals_; }
  void begin_one_call() { arrivals_.begin_one_call(); }
  void end_one_call() { arrivals_.end_one_call(); }

 private:
  friend struct LaneCall;
  friend class LanePipeline;

  // messages, waiting, failure (host_lanes.cpp)
  static uint64_t tag_of(uint64_t seq, int kind, int lane, int host);
  LaneHeader header_of(const LaneCall& c, int64_t chunk, int64_t bytes) const;
  LaneRequest* post_send(LaneCall& c, int peer, int lane, int kind, int64_t chunk, const void* data, int64_t bytes);
  LaneRequest* post_recv(LaneCall& c, int peer, int lane, int kind, int64_t chunk, void* into, int64_t bytes);
  LaneRequest* send_request(LaneCall& c, LaneRequest* r, const void* data, int64_t bytes);
  LaneRequest* recv_request(LaneCall& c, LaneRequest* r, void* into, int64_t bytes);
  LaneRequest* post_hello_recv(LaneCall& c, int peer, int lane);
  void settle(LaneRequest* r, ucs_status_ptr_t req);
  void wait(LaneCall& c, LaneRequest* r);
  void step(LaneCall& c, int waited);
  void check_events(LaneCall& c);
  void check_done(LaneCall& c, LaneRequest* r);
  void check_header(LaneCall& c, LaneRequest* r);
  std::string describe(const LaneHeader& h) const;
  void post_abort_recv();
  void tell_peers(int kind, const std::string& why);
  [[noreturn]] void fail(LaneCall& c, const std::string& why, int kind);
  void fail_from_channel(LaneCall& c, const std::string& why, int kind);
  [[noreturn]] void throw_failure() const;
  void release(LaneCall& c);
  void close_endpoints();
  void run_checked(LaneCall& c, const std::function<void()>& body);
  void say_hello(LaneCall& c);
  const int64_t* own_stamps() const;
  unsigned char* scratch(size_t slot, int64_t bytes);
  void run_shards(LaneCall& c, uintptr_t data, int root_host, int root_local);

  LaneLayout layout_;
  ShmChannel* channel_;
  HostArrivals arrivals_;
  int64_t chunk_bytes_;
  int depth_;
  std::chrono::steady_clock::duration spin_;
  double chunk_ns_ = 0;   // chunk_us()
  double slow_chunk_ns_;
  int64_t wait_window_us_ = 0;
  std::map<std::string, std::string> ucx_settings_;
  int pid_;   // the process that made the lanes: the only one that may use them
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::string address_;
  std::vector<std::unique_ptr<LanePeer>> peers_;   // by group rank (null: not a peer)
  std::vector<std::vector<unsigned char>> scratch_;   // the pipeline's buffers, grown, never shrunk
  uint64_t seq_ = 0;
  uint64_t sent_ = 0;
  std::atomic<bool> failed_{false};
  std::atomic<bool> abort_requested_{false};
  std::atomic<int> waiting_on_{-1};
  mutable std::mutex failure_mu_;   // failure_, abort_why_; and the worker's life against abort()'s signal
  std::string failure_;
  int failure_kind_ = 0;
  std::string abort_why_;
  std::unique_ptr<LaneRequest> abort_req_;
  std::vector<char> abort_buf_;
  std::vector<std::unique_ptr<LaneRequest>> graveyard_;   // requests of failed calls, kept while UCX may touch them
  bool told_peers_ = false;
  std::vector<std::unique_ptr<std::string>> told_;        // abort messages' texts, kept while UCX may send them
};

}  // namespace cpu
}  // namespace ncclavg
