// The lanes between hosts on UCX: setup, messages, waiting and failure. The collectives' loops are in
// host_lanes_collectives.cpp.
#include "host_lanes.h"

#include <poll.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "../common/check.h"
#include "host_lanes_internal.h"

namespace ncclavg {
namespace cpu {

// Note [Lanes between hosts]
// Between hosts, every local rank is on the wire at once, each carrying its lanes (Horovod's hierarchical
// all-reduce, oneCCL's "2d"): K lanes, K the most processes on one host; host h gives lane k to its local
// rank k % P_h, so a host with fewer processes gives each several. A lane's members are its carriers, one
// per host; every message between hosts goes between two members of one lane.
// - The wire is UCX's tag send and receive (UCP), one worker per process, one endpoint per peer, over
//   the network transports only (UCX_TLS as ucx.py sets it: shared memory and CMA would skip the link).
// - Every message starts with a LaneHeader: the call it serves. Each call also sends a hello (a header
//   alone) to every peer on every lane, right after its host's first channel round of the call (at once
//   on a host of one process): a hello says "my whole host makes this call". A rank ends a call only with
//   every peer's hello in, so no rank completes a call that another host's ranks disagree on (they fail
//   their round and send an abort instead), and a peer whose call differs is found in the call's first
//   exchange and named with ours, with no round trip of its own before the data: the data goes at once,
//   every receive posted at the length this rank expects. A longer message is a truncation, not an
//   overflow (UCX bounds every receive); the sender's hello (or its abort) names the sender's call.
// - A tag says which call (its number, the same on every rank), which kind of message, which lane and
//   which host sent it, so that a receive matches only its message; messages of one tag from one sender
//   are matched in the order they were sent (UCP's ordering, which MPI over UCX relies on too).
// - Waiting polls the worker for spin_ (kSpinUs unless NCCLAVG_HOSTS_SPIN_US says otherwise), yielding
//   the core between polls, then blocks on the worker's event fd (a late peer costs no CPU), with the
//   call's deadline; abort() from another thread wakes it through ucp_worker_signal. The yield: a rank that only spins holds a core that its host's other
//   ranks need for their channel steps and their own wire work whenever a machine runs more processes
//   than cores (measured with 2 emulated hosts x 2 processes on 2 cores, a 4 KiB all-reduce through the
//   torch face, calls back to back, median per call: 2500 Mbit/s + 0.1 ms 857 us spinning 50 us, 683
//   yielding for 50 us, 633 yielding for 300 us; unshaped veth 438, 249, 241; 2 x 1 unchanged within
//   noise, 300-340 us and 45-60 us; bench/hosts.py's calls, each after a sync, slowest rank: 2 x 2 at
//   4 KiB 0.80-0.88 ms before, 0.75-0.81 after). A yield costs nothing when no one else wants the core,
//   and the longer window keeps a rank off the event fd, whose wakeup costs tens of microseconds, for
//   about one round trip of a fast link.
//   The window's price is CPU where the link is slow: a pipelined call's waits are each a chunk's time on
//   the wire, and polling through them holds a core for nothing. A fixed shorter window is no answer
//   (bench/hosts.py, NCCLAVG_HOSTS_SPIN_US 300 against 50, 2 launches x 10 calls, alternated twice: on
//   2500 Mbit/s + 0.1 ms 2 x 1's CPU per call at 32 MiB 154 / 151 ms -> 81 / 81 at the same time, but 2 x 1
//   at 4 KiB 0.26 / 0.24 ms -> 0.30 / 0.40 and the unshaped veth link's 2 x 1 at 4 MiB 1.53 / 1.26 ms ->
//   2.03 / 1.69). So the chunks pace the waits: a pipelined call measures the time between two chunks'
//   completions (a moving average kept across calls, chunk_us), and while it is above kSlowChunkUs (1 ms,
//   twenty wake-ups from the event fd or more) the call's waits poll for kSlowSpinUs (50 us) at most; a
//   whole call, whose wait is a round trip, and the chunks of a fast link keep the full window. Measured
//   the same way, before (the fixed window) and after, alternated twice, ms and CPU ms per call of all
//   ranks: 2500 Mbit/s 2 x 1 at 4 MiB 15.32 / 14.03 -> 14.44 / 14.47 (CPU 22.2 / 21.9 -> 11.1 / 11.6), at
//   32 MiB 109.2 / 108.3 -> 108.8 / 108.7 (CPU 162 / 140 -> 84 / 83); 2 x 2 at 32 MiB 110.6 / 110.7 ->
//   109.6 / 112.2 (CPU 162 / 167 -> 149 / 152); 4 KiB and 256 KiB (whole or one chunk) unchanged within the
//   spread; 3 x 2 at 32 MiB 190.5 / 190.9 / 200.1 / 206.0 -> 196.2 / 201.3 / 200.4 / 207.5 (CPU unchanged:
//   its cores are full). NCCLAVG_HOSTS_SPIN_US sets the full window (the slow one is the lesser of it and
//   kSlowSpinUs).
// - The first failure of a process (a broken endpoint, a mismatch, a failed channel step, an abort; not a
//   timeout: Note [A timeout between the hosts]) is sent to every peer in an abort message and put into
//   this host's channel, so that every rank of every host fails at once, naming it; the engine then
//   refuses every call.
//
// Note [A timeout between the hosts]
// A rank that waits for a lane past the call's deadline cannot tell whether the rank it waits for is lost
// or itself waits on another, and the host's other ranks, waiting for it in a channel step, see it stop
// though it is alive. So a timeout here names no rank: it is a TimeoutError (ncclavg.CommTimeoutError),
// not the channel's ShmTimeoutError, a channel step's timeout inside a call is said in the same words
// (the channel's would name the host's rank that waits on the wire), and neither the peers nor this
// host's channel are told it (they would take its words for a rank's loss, and stop asking). The caller
// names the lost rank: the runner's failure asks the heartbeats and then aborts this host's channel with
// those words (ncclavg/transport/runner.py); the other hosts' ranks reach their own deadlines. On the
// general path the runner's watchdog does this at the deadline, before the lanes' limit (the deadline
// plus a backstop); on the fast path (ncclavg/comm/fast_average.py) the lanes' limit is the deadline, and
// every rank, on the wire or in a channel step, times out at its own deadline and asks the heartbeats.

namespace {
using Clock = std::chrono::steady_clock;
constexpr uint32_t kMagic = 0x6e63616c;   // "ncal"

// Note [TCP's receive segment]
// UCX's tcp transport receives a message of the eager protocol in segments of UCX_TCP_RX_SEG_SIZE (64 KiB
// by default), each read from the socket into a buffer of its own and then copied out to the posted
// receive: a lane's shard of a 512 KiB chunk costs 8 such reads. With 256 KiB segments, measured with
// bench/hosts.py on the unshaped veth link (the wire not the limit), 2 hosts x 1 process, median of two
// runs x 2 launches: 4 MiB 3.25 / 3.38 ms -> 1.84 / 2.57, 32 MiB 24.1 / 25.6 -> 20.9 / 21.8; 2 x 2 at
// 32 MiB 44.8 / 44.4 -> 40.9 / 42.2; on the 2500 Mbit/s link no change (the wire is the limit). 1 MiB
// segments bought no more. The receive buffer is per endpoint: 256 KiB per peer.
constexpr const char* kTcpRxSegment = "256K";

void on_send(void*, ucs_status_t status, void* user) {
  auto* r = static_cast<LaneRequest*>(user);
  r->status = status;
  r->done = true;
}
int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

void on_recv(void*, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user) {
  auto* r = static_cast<LaneRequest*>(user);
  r->done_ns = steady_ns();
  r->status = status;
  r->length = info != nullptr ? info->length : 0;
  r->done = true;
}
void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* p = static_cast<LanePeer*>(arg);
  p->error = status;
}

std::string join(const std::vector<int>& v) {
  std::ostringstream os;
  for (size_t i = 0; i < v.size(); ++i) os << (i ? "," : "") << v[i];
  return os.str();
}

void check_ucx(ucs_status_t s, const char* what) {
  if (s != UCS_OK) throw std::runtime_error(std::string("UCX ") + what + " failed: " + ucx::status_text(s));
}
}  // namespace

// ---------------------------------------------------------------------- layout
LaneLayout::LaneLayout(std::vector<std::vector<int>> hosts_in, int rank_in) : hosts(std::move(hosts_in)), rank(rank_in) {
  NCCLAVG_CHECK_ARG(hosts.size() >= 2, "hosts", "the lanes join two hosts or more, got ", hosts.size());
  host = -1;
  for (size_t h = 0; h < hosts.size(); ++h) {
    NCCLAVG_CHECK_ARG(!hosts[h].empty(), "hosts", "host ", h, " has no rank");
    lanes = std::max(lanes, static_cast<int>(hosts[h].size()));
    auto it = std::find(hosts[h].begin(), hosts[h].end(), rank);
    if (it != hosts[h].end()) {
      NCCLAVG_CHECK_ARG(host < 0, "hosts", "rank ", rank, " is on two hosts");
      host = static_cast<int>(h);
      local = static_cast<int>(it - hosts[h].begin());
    }
  }
  NCCLAVG_CHECK_ARG(host >= 0, "rank", rank, " is on no host of ", hosts.size());
}

std::vector<int> LaneLayout::lanes_of(int l) const {
  std::vector<int> out;
  for (int k = l; k < lanes; k += local_size()) out.push_back(k);
  return out;
}

int LaneLayout::host_of(int r) const {
  for (int h = 0; h < nhosts(); ++h)
    if (std::find(hosts[h].begin(), hosts[h].end(), r) != hosts[h].end()) return h;
  return -1;
}

std::vector<int> LaneLayout::peers() const {
  std::vector<int> out;
  for (int k : lanes_of(local))
    for (int h = 0; h < nhosts(); ++h)
      if (h != host) out.push_back(carrier(h, k));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// ---------------------------------------------------------------------- setup
HostLanes::HostLanes(std::vector<std::vector<int>> hosts, int rank, ShmChannel* channel, const std::string& tls,
                     const std::string& devices, int64_t chunk_bytes, int depth, int64_t spin_us,
                     int64_t slow_chunk_us)
    : layout_(std::move(hosts), rank), channel_(channel), arrivals_(layout_.hosts, layout_.host),
      chunk_bytes_(chunk_bytes), depth_(depth), spin_(std::chrono::microseconds(spin_us)),
      slow_chunk_ns_(static_cast<double>(slow_chunk_us) * 1e3), pid_(getpid()) {
  NCCLAVG_CHECK_ARG(spin_us >= 0 && spin_us <= kMaxSpinUs, "spin_us", "must be in [0, ", kMaxSpinUs, "], got ",
                    spin_us);
  NCCLAVG_CHECK_ARG(slow_chunk_us >= 0, "slow_chunk_us", "must be >= 0, got ", slow_chunk_us);
  NCCLAVG_CHECK_ARG(chunk_bytes >= 4096 && chunk_bytes % 64 == 0, "chunk_bytes",
                    "must be a multiple of 64 of at least 4096, got ", chunk_bytes);
  NCCLAVG_CHECK_ARG(depth >= 1 && depth <= 64, "depth", "must be in [1, 64], got ", depth);
  NCCLAVG_CHECK_ARG((channel == nullptr) == (layout_.local_size() == 1), "channel",
                    "a host of ", layout_.local_size(), " processes ", layout_.local_size() == 1 ? "has no" : "needs a",
                    " channel");
  // its ranks in this host's order: the hellos tell the other hosts their arrival (Note [Arrival times
  // between hosts])
  NCCLAVG_CHECK_ARG(channel == nullptr || channel->labels() == layout_.hosts[layout_.host], "channel",
                    "its ranks must be this host's group ranks, ascending: ", join(layout_.hosts[layout_.host]));
  const ucx::Api& u = ucx::api();
  ucp_config_t* config = nullptr;
  check_ucx(u.config_read(nullptr, nullptr, &config), "ucp_config_read");
  try {
    if (!tls.empty()) {
      check_ucx(u.config_modify(config, "TLS", tls.c_str()), "setting UCX_TLS");
      ucx_settings_["TLS"] = tls;
    }
    if (!devices.empty()) {
      check_ucx(u.config_modify(config, "NET_DEVICES", devices.c_str()), "setting UCX_NET_DEVICES");
      ucx_settings_["NET_DEVICES"] = devices;
    }
    // Note [TCP's receive segment]: larger than UCX's default unless the user chose one (best effort: a
    // UCX without its tcp transport has no such field)
    if (std::getenv("UCX_TCP_RX_SEG_SIZE") == nullptr &&
        u.config_modify(config, "TCP_RX_SEG_SIZE", kTcpRxSegment) == UCS_OK)
      ucx_settings_["TCP_RX_SEG_SIZE"] = kTcpRxSegment;
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    check_ucx(u.init_version(ucx::kApiMajor, ucx::kApiMinor, &params, config, &context_), "ucp_init");
  } catch (...) {
    u.config_release(config);
    throw;
  }
  u.config_release(config);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;   // abort() signals the worker from another thread
  ucs_status_t s = u.worker_create(context_, &wp, &worker_);
  if (s != UCS_OK) {
    u.cleanup(context_);
    context_ = nullptr;
    check_ucx(s, "ucp_worker_create");
  }
  ucp_address_t* addr = nullptr;
  size_t len = 0;
  s = u.worker_get_address(worker_, &addr, &len);
  if (s == UCS_OK) {
    address_.assign(reinterpret_cast<const char*>(addr), len);
    u.worker_release_address(worker_, addr);
    s = u.worker_get_efd(worker_, &efd_);
  }
  if (s != UCS_OK) {
    u.worker_destroy(worker_);
    u.cleanup(context_);
    worker_ = nullptr;
    context_ = nullptr;
    check_ucx(s, "the worker's address or event fd");
  }
  peers_.resize(static_cast<size_t>(std::max_element(layout_.hosts.begin(), layout_.hosts.end(),
                                                     [](auto& a, auto& b) { return a.back() < b.back(); })->back()) + 1);
  for (const auto& h : layout_.hosts)
    for (int r : h) peers_.resize(std::max(peers_.size(), static_cast<size_t>(r) + 1));
}

HostLanes::~HostLanes() {
  const ucx::Api& u = ucx::api();
  std::lock_guard<std::mutex> lock(failure_mu_);
  if (abort_req_ && abort_req_->ucp != nullptr) {   // no callback after request_free
    if (!abort_req_->done) u.request_cancel(worker_, abort_req_->ucp);
    u.request_free(abort_req_->ucp);
  }
  close_endpoints();
  if (worker_ != nullptr) u.worker_destroy(worker_);
  if (context_ != nullptr) u.cleanup(context_);
  worker_ = nullptr;
  context_ = nullptr;
}

// Every endpoint closed at once (FORCE: a peer that is gone cannot hold this up; sends still in flight
// are dropped, so no memory of a call that failed is read after it returned).
void HostLanes::close_endpoints() {
  const ucx::Api& u = ucx::api();
  for (auto& p : peers_) {
    if (!p || p->ep == nullptr) continue;
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t req = u.ep_close_nbx(p->ep, &prm);
    if (req != nullptr && !ucx::ptr_is_err(req)) {
      const auto until = Clock::now() + std::chrono::milliseconds(200);
      while (u.request_check_status(req) == UCS_INPROGRESS && Clock::now() < until) u.worker_progress(worker_);
      u.request_free(req);
    }
    p->ep = nullptr;
  }
}

void HostLanes::connect(const std::vector<std::string>& addresses, double timeout_s) {
  const ucx::Api& u = ucx::api();
  for (int r : layout_.peers()) {
    NCCLAVG_CHECK_ARG(static_cast<size_t>(r) < addresses.size() && !addresses[r].empty(), "addresses",
                      "has no address for rank ", r);
    auto p = std::make_unique<LanePeer>();
    p->rank = r;
    p->host = layout_.host_of(r);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(addresses[r].data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = on_ep_error;
    ep.err_handler.arg = p.get();
    check_ucx(u.ep_create(worker_, &ep, &p->ep), "ucp_ep_create");
    peers_[r] = std::move(p);
  }
  post_abort_recv();
  ShmCallTag none;
  LaneCall c(*this, LaneOp::kCheck, 0, 0, -1, timeout_s, none);
  run_checked(c, [] {});
}

// ---------------------------------------------------------------------- messages
uint64_t HostLanes::tag_of(uint64_t seq, int kind, int lane, int host) {
  return (seq & 0xffffffffull) << 32 | static_cast<uint64_t>(kind & 0xf) << 28 |
         static_cast<uint64_t>(lane & 0xfff) << 16 | static_cast<uint64_t>(host & 0xffff);
}

LaneHeader HostLanes::header_of(const LaneCall& c, int64_t chunk, int64_t bytes) const {
  LaneHeader h{};
  h.magic = kMagic;
  h.op = static_cast<uint16_t>(c.op);
  h.type = static_cast<uint16_t>(c.type);
  h.seq = c.seq;
  h.word = c.tag.word;
  h.count = c.count;
  h.user_count = c.tag.count;
  h.chunk = chunk;
  h.bytes = bytes;
  h.sender = layout_.rank;
  h.root = c.root;
  return h;
}

LaneRequest* HostLanes::post_send(LaneCall& c, int peer, int lane, int kind, int64_t chunk, const void* data,
                                  int64_t bytes) {
  return send_request(c, c.make_request(peer, lane, kind, chunk, false), data, bytes);
}

LaneRequest* HostLanes::send_request(LaneCall& c, LaneRequest* r, const void* data, int64_t bytes) {
  const ucx::Api& u = ucx::api();
  r->head = header_of(c, r->chunk, bytes);
  r->iov[0] = {&r->head, sizeof(LaneHeader)};
  r->iov[1] = {const_cast<void*>(data), static_cast<size_t>(bytes)};
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  prm.cb.send = on_send;
  prm.user_data = r;
  prm.datatype = UCP_DATATYPE_IOV;
  ucs_status_ptr_t req = u.tag_send_nbx(peers_[r->peer]->ep, r->iov, bytes > 0 ? 2 : 1,
                                        tag_of(c.seq, r->kind, r->lane, layout_.host), &prm);
  ++sent_;
  settle(r, req);
  return r;
}

LaneRequest* HostLanes::post_recv(LaneCall& c, int peer, int lane, int kind, int64_t chunk, void* into,
                                  int64_t bytes) {
  return recv_request(c, c.make_request(peer, lane, kind, chunk, true), into, bytes);
}

// A hello's receive: its payload lands in the request (Note [Arrival times between hosts]).
LaneRequest* HostLanes::post_hello_recv(LaneCall& c, int peer, int lane) {
  LaneRequest* r = c.make_request(peer, lane, kKindHello, -1, true);
  return recv_request(c, r, &r->hello, sizeof(LaneHello));
}

LaneRequest* HostLanes::recv_request(LaneCall& c, LaneRequest* r, void* into, int64_t bytes) {
  const ucx::Api& u = ucx::api();
  r->expect = bytes;
  r->iov[0] = {&r->head, sizeof(LaneHeader)};
  r->iov[1] = {into, static_cast<size_t>(bytes)};
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  prm.cb.recv = on_recv;
  prm.user_data = r;
  prm.datatype = UCP_DATATYPE_IOV;
  ucs_status_ptr_t req = u.tag_recv_nbx(worker_, r->iov, bytes > 0 ? 2 : 1,
                                        tag_of(c.seq, r->kind, r->lane, peers_[r->peer]->host), ~uint64_t{0}, &prm);
  settle(r, req);
  return r;
}

void HostLanes::settle(LaneRequest* r, ucs_status_ptr_t req) {
  if (req == nullptr) {   // done at once (a send whose data went out, or was copied; a message already in)
    r->done = true;
    r->status = UCS_OK;
    r->done_ns = steady_ns();
  } else if (ucx::ptr_is_err(req)) {
    r->done = true;
    r->status = ucx::ptr_status(req);
  } else {
    r->ucp = req;   // the callback sets done; the request is freed when the call ends
  }
}

void HostLanes::post_abort_recv() {
  const ucx::Api& u = ucx::api();
  abort_buf_.assign(sizeof(LaneHeader) + 2048, 0);
  abort_req_ = std::make_unique<LaneRequest>();
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.cb.recv = on_recv;
  prm.user_data = abort_req_.get();
  ucs_status_ptr_t req = u.tag_recv_nbx(worker_, abort_buf_.data(), abort_buf_.size(), tag_of(0, kKindAbort, 0, 0),
                                        uint64_t{0xf} << 28, &prm);
  settle(abort_req_.get(), req);
}

// Best effort, bounded: every peer is told `why` (kind first), then the worker is progressed for a moment
// so that the messages leave before the caller raises (and perhaps exits).
void HostLanes::tell_peers(int kind, const std::string& why) {
  const ucx::Api& u = ucx::api();
  std::string msg(1, static_cast<char>(kind));
  msg += why.substr(0, 2000);
  std::vector<ucs_status_ptr_t> reqs;
  ucp_request_param_t prm{};
  for (auto& p : peers_) {
    if (!p || p->ep == nullptr || p->error != UCS_OK) continue;
    auto* keep = new std::string(msg);   // must outlive the send: freed below or leaked with a stuck request
    ucs_status_ptr_t req = u.tag_send_nbx(p->ep, keep->data(), keep->size(), tag_of(0, kKindAbort, 0, layout_.host), &prm);
    if (req == nullptr || ucx::ptr_is_err(req)) {
      delete keep;
    } else {
      reqs.push_back(req);
      told_.emplace_back(keep);
    }
  }
  const auto until = Clock::now() + std::chrono::milliseconds(100);
  for (ucs_status_ptr_t req : reqs) {
    while (u.request_check_status(req) == UCS_INPROGRESS && Clock::now() < until) u.worker_progress(worker_);
    if (u.request_check_status(req) != UCS_INPROGRESS) u.request_free(req);
  }
}

// ---------------------------------------------------------------------- waiting
void HostLanes::wait(LaneCall& c, LaneRequest* r) {
  if (!r->done) {
    waiting_on_.store(r->peer, std::memory_order_relaxed);
    while (!r->done) step(c, r->peer);
    waiting_on_.store(-1, std::memory_order_relaxed);
  }
  check_done(c, r);
}

// One step of a wait: progress, or block on the event fd until something happens or the deadline.
void HostLanes::step(LaneCall& c, int waited) {
  const ucx::Api& u = ucx::api();
  if (u.worker_progress(worker_) != 0) {
    c.idle_since = Clock::time_point{};
    check_events(c);
    return;
  }
  check_events(c);
  const auto now = Clock::now();
  if (now >= c.deadline) {
    std::ostringstream os;
    os << "between the hosts: " << c.what() << " waited " << c.timeout_s << " s for rank " << waited
       << " (host " << (waited >= 0 && peers_[waited] ? peers_[waited]->host : -1) << ") without an answer";
    fail(c, os.str(), kFailTimeout);
  }
  if (c.idle_since == Clock::time_point{}) c.idle_since = now;
  if (now - c.idle_since < c.spin) {
    sched_yield();   // (the Note at the top: cores shared with the host's other ranks)
    return;
  }
  if (u.worker_arm(worker_) == UCS_ERR_BUSY) return;   // events came in meanwhile: progress them
  pollfd pfd{efd_, POLLIN, 0};
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(c.deadline - now).count() + 1;
  poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left, 100)));
}

// What can end a call while it waits: an abort (this process's, or a peer's message), a broken endpoint,
// a peer's hello that names another call (its data may never come: a broadcast whose roots differ).
void HostLanes::check_events(LaneCall& c) {
  for (LaneRequest* h : c.hellos)
    if (h->done && !h->checked) check_done(c, h);
  if (abort_requested_.load()) {
    std::string why;
    {
      std::lock_guard<std::mutex> lock(failure_mu_);
      why = abort_why_;
    }
    fail(c, why, kFailAborted);
  }
  if (abort_req_ && abort_req_->done) {
    const int kind = abort_req_->length > 0 ? abort_buf_[0] : kFailPeer;
    const size_t n = std::min(abort_req_->length, abort_buf_.size());
    std::string text(abort_buf_.begin() + (n > 0 ? 1 : 0), abort_buf_.begin() + static_cast<long>(n));
    fail(c, text, kind == kFailMismatch ? kFailMismatch : kFailPeer);   // (a peer's words, passed on)
  }
  for (auto& p : peers_) {
    // A peer's broken connection ends this call only when the call still waits on that peer: a peer that has
    // delivered all it had for the call may finish it and exit (its socket closes) before this rank ends it
    // (a rank of its host whose wire is elsewhere, or a last barrier before the process ends). The next call
    // that needs the peer fails here at its first wait.
    if (p && p->error != UCS_OK && c.waits_on(p->rank)) {
      std::ostringstream os;
      os << "between the hosts: " << c.what() << ": the connection to rank " << p->rank << " (host " << p->host
         << ") failed: " << ucx::status_text(p->error) << " (rank " << p->rank << " stopped responding)";
      fail(c, os.str(), kFailPeer);
    }
  }
}

void HostLanes::check_done(LaneCall& c, LaneRequest* r) {
  if (r->status == UCS_ERR_MESSAGE_TRUNCATED) {
    // a longer message than this call expects: the sender's call differs; its hello names it
    LaneRequest* hello = c.hello_from(r->peer, r->lane);
    if (hello != nullptr && hello != r) {
      while (!hello->done) step(c, r->peer);
      if (hello->status == UCS_OK) check_header(c, hello);
    }
    std::ostringstream os;
    os << "collectives out of step: rank " << layout_.rank << " called " << c.what() << ", rank " << r->peer
       << " sent " << r->length << " bytes where " << (sizeof(LaneHeader) + r->expect)
       << " were expected (its call differs): every rank must call the same collectives, with the same sizes, "
          "dtypes, ops and roots, in the same order (between the hosts, call "
       << c.seq << ")";
    fail(c, os.str(), kFailMismatch);
  }
  if (r->status != UCS_OK) {
    std::ostringstream os;
    os << "between the hosts: " << c.what() << ": a " << (r->is_recv ? "receive from" : "send to") << " rank "
       << r->peer << " failed: " << ucx::status_text(r->status) << " (rank " << r->peer << " stopped responding)";
    fail(c, os.str(), kFailPeer);
  }
  if (r->is_recv) check_header(c, r);
}

void HostLanes::check_header(LaneCall& c, LaneRequest* r) {
  if (r->checked) return;
  r->checked = true;
  const LaneHeader& h = r->head;
  const LaneHeader mine = header_of(c, r->chunk, r->expect);
  const bool same_call = h.magic == kMagic && h.op == mine.op && h.type == mine.type && h.seq == mine.seq &&
                         h.word == mine.word && h.count == mine.count && h.user_count == mine.user_count &&
                         h.root == mine.root;
  if (same_call && h.chunk == mine.chunk && h.bytes == mine.bytes && h.sender == r->peer) {
    if (r->kind == kKindHello)
      arrivals_.heard(r->peer, peers_[r->peer]->host, r->hello, r->done_ns + arrivals_.skew());
    return;
  }
  std::ostringstream os;
  if (h.magic != kMagic || h.sender != r->peer) {
    os << "between the hosts: " << c.what() << ": rank " << r->peer << " sent a message that is not ncclavg's "
       << "(or of another version)";
    fail(c, os.str(), kFailPeer);
  }
  std::string theirs = describe(h), ours = describe(mine);
  if (same_call || theirs == ours) {   // the same user call, different wire calls or chunks
    theirs += " (chunk " + std::to_string(h.chunk) + " of " + std::to_string(h.bytes) + " bytes)";
    ours += " (chunk " + std::to_string(mine.chunk) + " of " + std::to_string(mine.bytes) + " bytes)";
  }
  os << "collectives out of step: rank " << layout_.rank << " called " << ours << ", rank " << r->peer
     << " called " << theirs
     << ": every rank must call the same collectives, with the same sizes, dtypes, ops and roots, in the same "
        "order (between the hosts, call "
     << c.seq << ")";
  fail(c, os.str(), kFailMismatch);
}

std::string HostLanes::describe(const LaneHeader& h) const {
  if (h.word != 0) {
    ShmCallTag t;
    t.word = h.word;
    t.count = h.user_count;
    return describe_call(t);
  }
  static const char* ops[] = {"all_reduce_sum", "broadcast", "all_gather", "reduce_scatter_sum", "barrier"};
  std::ostringstream os;
  os << (h.op < 5 ? ops[h.op] : "unknown");
  if (h.op != static_cast<uint16_t>(LaneOp::kCheck))
    os << " of " << h.count << " " << type_name(static_cast<ShmType>(h.type < 4 ? h.type : 0));
  if (h.root >= 0) os << " from root " << h.root;
  return os.str();
}

// ---------------------------------------------------------------------- failure
void HostLanes::fail(LaneCall& c, const std::string& why, int kind) {
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (!failed_.load()) {
      failure_ = why;
      failure_kind_ = kind;
      failed_.store(true);
    }
  }
  c.failed = true;
  // a timeout leaves the peers and this host's channel to the caller (Note [A timeout between the hosts])
  if (kind == kFailTimeout) throw_failure();
  if (!told_peers_) {   // once: the first failure is what every rank hears
    told_peers_ = true;
    tell_peers(kind, why);
    close_endpoints();
  }
  if (channel_ != nullptr) channel_->abort(why, kind == kFailMismatch);
  throw_failure();
}

void HostLanes::fail_from_channel(LaneCall& c, const std::string& why, int kind) {
  try {
    fail(c, why, kind);
  } catch (...) {
  }
}

void HostLanes::throw_failure() const {
  std::string why;
  int kind;
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    why = failure_;
    kind = failure_kind_;
  }
  if (kind == kFailMismatch) throw ShmMismatchError(why);
  // not ShmTimeoutError: the rank a lane waited for may itself wait on another, so this names no lost
  // rank (the heartbeats do: Note [Failures are told by type] in ncclavg/transport/failure.py)
  if (kind == kFailTimeout) throw TimeoutError(why);
  throw ShmPeerError(why);
}

std::string HostLanes::failure() const {
  std::lock_guard<std::mutex> lock(failure_mu_);
  return failure_;
}

void HostLanes::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(failure_mu_);
  if (abort_requested_.load()) return;
  abort_why_ = why;
  abort_requested_.store(true);
  if (worker_ != nullptr) ucx::api().worker_signal(worker_);
}

// ---------------------------------------------------------------------- one call
LaneCall::LaneCall(HostLanes& e, LaneOp op_in, int type_in, int64_t count_in, int root_in, double timeout,
                   ShmCallTag tag_in)
    : engine(e), one_call(e.channel_), scope(e.arrivals_), op(op_in), type(type_in), count(count_in), root(root_in),
      timeout_s(timeout), tag(tag_in) {
  NCCLAVG_CHECK_ARG(timeout > 0 && timeout < 1e9, "timeout_s", "must be > 0, got ", timeout);
  NCCLAVG_CHECK_ARG(count >= 0, "count", "must be >= 0, got ", count);
  if (op != LaneOp::kCheck) check_call_tag(tag, "tag");
  deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout));
  spin = e.spin_;
  e.wait_window_us_ = e.spin_us();
}

LaneRequest* LaneCall::make_request(int peer, int lane, int kind, int64_t chunk, bool recv) {
  requests.push_back(std::make_unique<LaneRequest>());
  LaneRequest* r = requests.back().get();
  r->peer = peer;
  r->lane = lane;
  r->kind = kind;
  r->chunk = chunk;
  r->is_recv = recv;
  return r;
}

bool LaneCall::waits_on(int peer) const {
  for (const auto& r : requests)
    if (r->peer == peer && !r->done) return true;
  return false;
}

LaneRequest* LaneCall::hello_from(int peer, int lane) {
  for (LaneRequest* h : hellos)
    if (h->peer == peer && h->lane == lane) return h;
  return nullptr;
}

std::string LaneCall::what() const { return engine.describe(engine.header_of(*this, 0, 0)); }

void HostLanes::release(LaneCall& c) {
  const ucx::Api& u = ucx::api();
  bool stuck = false;
  for (auto& r : c.requests) {
    if (r->ucp == nullptr) continue;
    if (!r->done) {   // a failed call's: no callback reaches it once freed (its endpoint is closed)
      if (r->is_recv) u.request_cancel(worker_, r->ucp);
      stuck = true;
    }
    u.request_free(r->ucp);
    r->ucp = nullptr;
  }
  if (stuck) {   // kept while UCX may still read a header of theirs
    for (auto& r : c.requests) graveyard_.push_back(std::move(r));
  }
  c.requests.clear();
}

// This process's hellos of call `c`, once: after its host's first channel round of the call, so that a
// hello says the whole host agrees with the call (Note [Lanes between hosts]).
// Each hello says when this host arrived at the call (Note [Arrival times between hosts]): its ranks'
// stamps in the channel's first round of the call, or, alone on its host, when the call began.
void HostLanes::say_hello(LaneCall& c) {
  if (c.hello_said) return;
  c.hello_said = true;
  if (const int64_t* stamps = own_stamps()) arrivals_.set_own(stamps);
  for (LaneRequest* h : c.hellos) {
    LaneRequest* r = c.make_request(h->peer, h->lane, kKindHello, -1, false);
    r->hello = arrivals_.hello_to(h->peer);
    c.sends.push_back(send_request(c, r, &r->hello, sizeof(LaneHello)));
  }
}

// This host's ranks' arrival at the call now running (the channel's stamps of its first round; alone on
// the host, when the call began), or nullptr before the channel's first round.
const int64_t* HostLanes::own_stamps() const {
  return channel_ != nullptr ? channel_->scope_arrivals() : arrivals_.alone_stamps();
}

// Runs one call: refuses it after a failure, sends and receives the hellos around `body`, and makes any
// failure inside it (this process's, the channel's) the engine's.
void HostLanes::run_checked(LaneCall& c, const std::function<void()>& body) {
  if (failed_.load()) throw_failure();
  if (getpid() != pid_)   // UCX's worker and sockets are the parent's (as Note [One owner per rank] for the channel)
    throw std::runtime_error("between the hosts: pid " + std::to_string(getpid()) + " is not the process that made "
                             "these lanes (pid " + std::to_string(pid_) + "): a forked child cannot use its parent's");
  c.seq = ++seq_;
  arrivals_.begin_call();
  try {
    // the hellos: one each way per lane and peer (Note [Lanes between hosts])
    for (int k : layout_.lanes_of(layout_.local))
      for (int h = 0; h < layout_.nhosts(); ++h)
        if (h != layout_.host) c.hellos.push_back(post_hello_recv(c, layout_.carrier(h, k), k));
    if (channel_ == nullptr) say_hello(c);   // alone on its host: nobody here to agree with first
    body();
    say_hello(c);
    for (LaneRequest* r : c.hellos) wait(c, r);
    for (LaneRequest* r : c.sends) wait(c, r);
    if (const int64_t* stamps = own_stamps()) arrivals_.end_call(stamps);
  } catch (const ShmMismatchError& e) {
    if (!c.failed) fail_from_channel(c, e.what(), kFailMismatch);
    release(c);
    throw;
  } catch (const ShmTimeoutError&) {   // Note [A timeout between the hosts]: the channel's words name a rank
    if (!c.failed) {
      std::ostringstream os;
      os << "between the hosts: " << c.what() << " timed out after " << c.timeout_s << " s in a step within host "
         << layout_.host;
      fail_from_channel(c, os.str(), kFailTimeout);
    }
    release(c);
    throw_failure();
  } catch (const std::exception& e) {
    if (!c.failed) fail_from_channel(c, e.what(), kFailPeer);
    release(c);
    throw;
  }
  release(c);
}

}  // namespace cpu
}  // namespace ncclavg
