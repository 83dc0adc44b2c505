// The collectives between hosts: each one native loop over chunks (Note [The lanes' pipeline]).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../common/check.h"
#include "host_lanes_internal.h"
#include "shm_internal.h"

namespace ncclavg {
namespace cpu {
using namespace shm_detail;

// Note [The lanes' pipeline]
// A collective between hosts is cut in chunks, each through three steps, `depth` chunks in flight:
//   (1) within the host, the channel's step before the wire (an all-reduce's reduce-scatter: local rank l
//       then holds the host's sum of its lanes' shards of the chunk);
//   (2) the wire: each lane's members exchange their shards (one message to each other host; between 3
//       hosts or more, a large shard goes as a reduce-scatter then an all-gather among the lane's members,
//       2(H-1)/H of it each way instead of H-1 times it), and each member adds what it received in host
//       order, so every host holds the same bits;
//   (3) within the host, the channel's step after it (the all-gather of the chunk).
// The channel's steps run in the same order on every local rank whatever the wire does (chunk i's (3),
// then chunk i + depth's (1)): they are collective within the host. While one waits, every chunk in flight
// moves (the receives are posted ahead, a second exchange starts when its first one is done). One thread,
// no Python, no lock but UCX's. The receives land where the data goes (UCX bounds each at its length).

namespace {

int64_t elems_per_chunk(int64_t chunk_bytes, int64_t es, int64_t unit) {
  return std::max<int64_t>(unit, chunk_bytes / es / unit * unit);
}

}  // namespace

// The driver: (1) and the posts of the first `depth` chunks, then for each chunk: wait for its messages
// (moving the others), (3), and (1) + the posts of the chunk `depth` further on.
class LanePipeline {
 public:
  LanePipeline(HostLanes& e, LaneCall& c) : e_(e), c_(c), L_(e.layout_) {}
  virtual ~LanePipeline() = default;

  void run(int64_t nchunks) {
    if (nchunks == 0) {
      if (e_.channel_ != nullptr) e_.channel_->barrier(c_.deadline_left(), c_.tag);   // the host's calls compared
      return;
    }
    const int64_t depth = std::min<int64_t>(e_.depth_, nchunks);
    if (nchunks > 1) pace_waits();
    for (int64_t i = 0; i < depth; ++i) {
      start(i);
      if (i > 0) continue;
      // the hellos once the host's first round passed (it agrees on the call), before any wait on the wire:
      // a host whose steps (1) have no round gets one here, or two hosts whose calls differ could each wait
      // for the other's data and neither say hello (Note [Lanes between hosts])
      if (e_.channel_ != nullptr && !round_in_start()) e_.channel_->barrier(c_.deadline_left(), c_.tag);
      e_.say_hello(c_);
    }
    for (int64_t i = 0; i < nchunks; ++i) {
      int waited = -1;
      while (!advance(i, waited)) {
        for (int64_t j = i + 1; j < std::min(nchunks, i + depth); ++j) {
          int ignored;
          advance(j, ignored);
        }
        if (!advance(i, waited)) e_.step(c_, waited);
      }
      after(i);
      const auto now = std::chrono::steady_clock::now();
      if (i > 0) chunk_done(now - last_done_);
      last_done_ = now;
      if (i + depth < nchunks) start(i + depth);
    }
  }

 protected:
  virtual void start(int64_t i) = 0;                // steps (1) and the posts of (2)
  virtual bool advance(int64_t i, int& waited) = 0;  // (2) done? (a second exchange posted when its time comes)
  virtual void after(int64_t i) = 0;                // step (3)
  // Does start(0) run a channel round (then the hellos follow it)? Else run() adds one.
  virtual bool round_in_start() const = 0;

  // The time between two chunks' completions, into the engine's moving average, and this call's waits
  // paced by it (Note [Lanes between hosts] in host_lanes.cpp): a chunk slower than kSlowChunkUs is a slow
  // link's, whose waits are worth polling for kSlowSpinUs at most.
  void chunk_done(std::chrono::steady_clock::duration took) {
    const double ns = static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(took).count());
    e_.chunk_ns_ = e_.chunk_ns_ == 0 ? ns : 0.75 * e_.chunk_ns_ + 0.25 * ns;
    pace_waits();
  }
  void pace_waits() {
    using std::chrono::microseconds;
    const bool slow = e_.chunk_ns_ > e_.slow_chunk_ns_;   // (never before a measure: the threshold is >= 0)
    c_.spin = slow ? std::min<std::chrono::steady_clock::duration>(e_.spin_, microseconds(HostLanes::kSlowSpinUs))
                   : e_.spin_;
    e_.wait_window_us_ = std::chrono::duration_cast<std::chrono::microseconds>(c_.spin).count();
  }

  // this rank's pipeline buffers: chunk i's `which` (in its slot, i % depth), or one the chunks share
  static constexpr int kPerSlot = 256;
  unsigned char* buf(int64_t i, int which, int64_t bytes) {
    return e_.scratch(static_cast<size_t>((i % e_.depth_) * kPerSlot + which), std::max<int64_t>(bytes, 1));
  }
  unsigned char* shared(int which, int64_t bytes) {
    return e_.scratch(static_cast<size_t>(e_.depth_ * kPerSlot + which), std::max<int64_t>(bytes, 1));
  }
  bool all_done(const std::vector<LaneRequest*>& reqs, int& waited) {
    for (LaneRequest* r : reqs) {
      if (!r->done) {
        waited = r->peer;
        return false;
      }
      e_.check_done(c_, r);
    }
    return true;
  }
  LaneRequest* send(int peer, int lane, int kind, int64_t chunk, const void* p, int64_t bytes) {
    return e_.post_send(c_, peer, lane, kind, chunk, p, bytes);
  }
  LaneRequest* recv(int peer, int lane, int kind, int64_t chunk, void* p, int64_t bytes) {
    return e_.post_recv(c_, peer, lane, kind, chunk, p, bytes);
  }

  ShmChannel* channel() const { return e_.channel_; }

  HostLanes& e_;
  LaneCall& c_;
  const LaneLayout& L_;
  std::chrono::steady_clock::time_point last_done_{};
};

double LaneCall::deadline_left() const {
  // the channel's own limit: the call's deadline (its waits end there too), at least a millisecond
  const double left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
  return std::max(left, 1e-3);
}

unsigned char* HostLanes::scratch(size_t slot, int64_t bytes) {
  if (scratch_.size() <= slot) scratch_.resize(slot + 1);
  auto& b = scratch_[slot];
  if (static_cast<int64_t>(b.size()) < bytes) b.resize(static_cast<size_t>(bytes));
  return b.data();
}

namespace {

// ---------------------------------------------------------------------- all-reduce and broadcast
// A chunk of the tensor in K shards, lane k's shard [k*s, k*s + v_k). Local rank l's region in the
// channel holds its lanes' shards side by side (zeros after a short one), regions in local-rank order.
class ShardPipe : public LanePipeline {
 public:
  ShardPipe(HostLanes& e, LaneCall& c, unsigned char* data, int root_host, int root_local)
      : LanePipeline(e, c), data_(data), es_(static_cast<int64_t>(type_size(static_cast<ShmType>(c.type)))),
        root_host_(root_host), root_local_(root_local) {
    K_ = L_.lanes;
    P_ = L_.local_size();
    mine_ = L_.lanes_of(L_.local);
    maxm_ = static_cast<int64_t>(L_.lanes_of(0).size());
    per_ = elems_per_chunk(e.chunk_bytes(), es_, K_);
    state_.resize(static_cast<size_t>(e.depth()));
  }
  int64_t chunks() const { return (c_.count + per_ - 1) / per_; }

 protected:
  struct Lane {
    int phase = 0;     // 0: first exchange pending, 1: second, 2: done
    std::vector<LaneRequest*> p;   // the messages in flight
    int64_t v = 0;     // the shard's elements
    unsigned char* shard = nullptr;
    unsigned char* rows = nullptr;
  };
  struct Chunk {
    int64_t lo = 0, n = 0, s = 0;
    bool direct = false, in_place = false;   // direct: the chunk is the channel's layout as it lies
    unsigned char* mine = nullptr;           // this rank's region (in_place: the chunk itself)
    std::vector<Lane> lanes;
  };
  bool sum() const { return root_host_ < 0; }
  bool at_root() const { return L_.host == root_host_; }
  bool round_in_start() const override { return P_ > 1 && (sum() || at_root()); }
  unsigned char* at(int64_t elem) const { return data_ + elem * es_; }
  int64_t valid(const Chunk& ch, int k) const { return std::clamp<int64_t>(ch.n - k * ch.s, 0, ch.s); }
  int64_t region(const Chunk& ch) const { return maxm_ * ch.s; }

  // The chunk's shards laid out as the channel's regions (into `stage`), or back (from it).
  void lay_out(const Chunk& ch, unsigned char* stage, bool into_stage) {
    for (int l = 0; l < P_; ++l) {
      const std::vector<int> lanes = L_.lanes_of(l);
      for (size_t j = 0; j < lanes.size(); ++j) {
        unsigned char* slot = stage + (l * region(ch) + static_cast<int64_t>(j) * ch.s) * es_;
        const int64_t v = valid(ch, lanes[j]);
        unsigned char* part = at(ch.lo + lanes[j] * ch.s);
        if (into_stage) {
          copy_bytes(slot, part, v * es_);
          if (v < ch.s) std::memset(slot + v * es_, 0, static_cast<size_t>((ch.s - v) * es_));
        } else {
          copy_bytes(part, slot, v * es_);
        }
      }
      if (into_stage && static_cast<int64_t>(lanes.size()) < maxm_) {
        unsigned char* rest = stage + (l * region(ch) + static_cast<int64_t>(lanes.size()) * ch.s) * es_;
        std::memset(rest, 0, static_cast<size_t>((maxm_ - static_cast<int64_t>(lanes.size())) * ch.s * es_));
      }
    }
  }

  void start(int64_t i) override {
    Chunk& ch = state_[static_cast<size_t>(i % e_.depth())];
    ch = Chunk{};
    ch.lo = i * per_;
    ch.n = std::min(per_, c_.count - ch.lo);
    ch.s = (ch.n + K_ - 1) / K_;
    ch.direct = P_ == K_ && ch.n == K_ * ch.s;
    ch.in_place = P_ == 1 && ch.n == K_ * ch.s;   // alone on the host: the chunk is this rank's region
    if (ch.in_place || (!sum() && (at_root() || P_ == 1))) {
      ch.mine = nullptr;   // the shards are the chunk's own: sent from it, summed or received in place
    } else {
      ch.mine = buf(i, 0, region(ch) * es_);
    }
    if (sum()) {                                                                                  // (1)
      if (P_ > 1) {
        unsigned char* src = at(ch.lo);
        if (!ch.direct) {
          src = shared(0, P_ * region(ch) * es_);
          lay_out(ch, src, true);
        }
        channel()->reduce_scatter_sum(reinterpret_cast<uintptr_t>(src), reinterpret_cast<uintptr_t>(ch.mine),
                                        region(ch), c_.type, c_.deadline_left(), 1.0, 1.0, c_.tag);
      } else if (!ch.in_place) {
        lay_out(ch, ch.mine, true);   // one region: the chunk, zero-padded
      }
    } else if (at_root() && P_ > 1) {
      channel()->broadcast(reinterpret_cast<uintptr_t>(at(ch.lo)), ch.n, c_.type, root_local_, c_.deadline_left(),
                             c_.tag);
    }
    ch.lanes.resize(mine_.size());
    for (size_t j = 0; j < mine_.size(); ++j) {
      Lane& ln = ch.lanes[j];
      const int k = mine_[j];
      ln.v = valid(ch, k);
      ln.shard = ch.mine != nullptr ? ch.mine + static_cast<int64_t>(j) * ch.s * es_ : at(ch.lo + k * ch.s);
      if (ln.v == 0) {
        ln.phase = 2;
        continue;
      }
      post_first(i, ln, k, static_cast<int>(j));
    }
  }

  bool split(const Lane& ln) const { return sum() && L_.nhosts() >= 3 && ln.v * es_ >= kSplitBytes; }
  // the piece of a split shard that host q sums: [q * sub, q * sub + its length)
  int64_t sub(const Lane& ln) const { return (ln.v + L_.nhosts() - 1) / L_.nhosts(); }
  int64_t piece(const Lane& ln, int q) const { return std::clamp<int64_t>(ln.v - q * sub(ln), 0, sub(ln)); }

  void post_first(int64_t i, Lane& ln, int k, int j) {
    const int H = L_.nhosts(), me = L_.host;
    const int64_t bytes = ln.v * es_;
    if (!sum()) {   // a broadcast: the root's host sends each lane's shard to the lane's other members
      if (at_root()) {
        for (int h = 0; h < H; ++h)
          if (h != me) ln.p.push_back(send(L_.carrier(h, k), k, kKindFirst, i, ln.shard, bytes));
      } else {
        ln.p.push_back(recv(L_.carrier(root_host_, k), k, kKindFirst, i, ln.shard, bytes));
      }
      return;
    }
    if (!split(ln)) {   // every member sends its shard to every other, and adds them all
      ln.rows = buf(i, 1 + j, H * bytes);
      for (int h = 0; h < H; ++h) {
        if (h == me) continue;
        ln.p.push_back(recv(L_.carrier(h, k), k, kKindFirst, i, ln.rows + h * bytes, bytes));
        ln.p.push_back(send(L_.carrier(h, k), k, kKindFirst, i, ln.shard, bytes));
      }
      return;
    }
    // a reduce-scatter among the lane's members: host q sums piece q of the shard
    const int64_t mine = piece(ln, me) * es_;
    ln.rows = buf(i, 1 + j, H * mine);
    for (int q = 0; q < H; ++q) {
      if (q == me) continue;
      if (mine > 0) ln.p.push_back(recv(L_.carrier(q, k), k, kKindFirst, i, ln.rows + q * mine, mine));
      if (piece(ln, q) > 0)
        ln.p.push_back(send(L_.carrier(q, k), k, kKindFirst, i, ln.shard + q * sub(ln) * es_, piece(ln, q) * es_));
    }
  }

  bool advance(int64_t i, int& waited) override {
    Chunk& ch = state_[static_cast<size_t>(i % e_.depth())];
    bool all = true;
    for (size_t j = 0; j < ch.lanes.size(); ++j) {
      Lane& ln = ch.lanes[j];
      if (ln.phase == 2) continue;
      if (!all_done(ln.p, waited)) {
        all = false;
        continue;
      }
      ln.p.clear();
      if (!sum()) {
        ln.phase = 2;
        continue;
      }
      const int H = L_.nhosts(), me = L_.host, k = mine_[j];
      if (ln.phase == 0 && !split(ln)) {   // every host's shard here: their sum, in host order
        sum_rows(ln.shard, ln.rows, ln.shard, ln.v, ln.v * es_);
        ln.phase = 2;
      } else if (ln.phase == 0) {   // this host's piece summed, then sent to every other member
        const int64_t n = piece(ln, me);
        unsigned char* own = ln.shard + me * sub(ln) * es_;
        sum_rows(own, ln.rows, own, n, n * es_);
        for (int q = 0; q < H; ++q) {
          if (q == me) continue;
          if (n > 0) ln.p.push_back(send(L_.carrier(q, k), k, kKindSecond, i, own, n * es_));
          if (piece(ln, q) > 0)
            ln.p.push_back(recv(L_.carrier(q, k), k, kKindSecond, i, ln.shard + q * sub(ln) * es_, piece(ln, q) * es_));
        }
        ln.phase = 1;
        all = false;
      } else {
        ln.phase = 2;
      }
    }
    return all;
  }

  // out = the rows of every host in host order (this host's own: `own`), n elements each `stride` apart
  void sum_rows(unsigned char* out, const unsigned char* rows, const unsigned char* own, int64_t n, int64_t stride) {
    ShmSources srcs(L_.nhosts());
    for (int h = 0; h < L_.nhosts(); ++h) srcs[h] = h == L_.host ? own : rows + h * stride;
    sum_into(static_cast<ShmType>(c_.type), out, nullptr, srcs.data(), L_.nhosts(), n, 1.0, 1.0, nullptr);
  }

  void after(int64_t i) override {                                                              // (3)
    Chunk& ch = state_[static_cast<size_t>(i % e_.depth())];
    if (!sum() && at_root()) return;   // the root's host held the chunk already
    if (P_ > 1) {
      if (ch.direct) {
        channel()->all_gather(reinterpret_cast<uintptr_t>(ch.mine), reinterpret_cast<uintptr_t>(at(ch.lo)), ch.s,
                                c_.type, c_.deadline_left(), c_.tag);
      } else {
        unsigned char* stage = shared(1, P_ * region(ch) * es_);
        channel()->all_gather(reinterpret_cast<uintptr_t>(ch.mine), reinterpret_cast<uintptr_t>(stage),
                                region(ch), c_.type, c_.deadline_left(), c_.tag);
        lay_out(ch, stage, false);
      }
    } else if (ch.mine != nullptr) {
      lay_out(ch, ch.mine, false);
    }
  }

  static constexpr int64_t kSplitBytes = 64 << 10;
  unsigned char* data_;
  int64_t es_;
  int root_host_, root_local_;
  int K_ = 1, P_ = 1;
  int64_t maxm_ = 1, per_ = 1;
  std::vector<int> mine_;
  std::vector<Chunk> state_;
};


// ---------------------------------------------------------------------- a small all-reduce or broadcast
// Whole, in one exchange and one channel round (Note [The lanes' pipeline]): the host's sum (or the root's
// data) on every local rank through the channel, then every rank receives every other host's whole from
// the carrier of its first lane there and adds them in host order. A host's rank j sends to the ranks of
// each other host whose first lane it carries. No all-gather round after the wire, so no local rank waits
// for another's messages; a host's data crosses once per local rank of the receiving host, which costs
// nothing at these sizes and saves the latency of a round on a busy host.
class WholePipe : public LanePipeline {
 public:
  WholePipe(HostLanes& e, LaneCall& c, unsigned char* data, int root_host, int root_local)
      : LanePipeline(e, c), data_(data), bytes_(c.count * static_cast<int64_t>(type_size(static_cast<ShmType>(c.type)))),
        root_host_(root_host), root_local_(root_local) {}

 protected:
  bool sum() const { return root_host_ < 0; }
  bool round_in_start() const override { return true; }   // (a host of one process said hello at once)
  void start(int64_t i) override {
    const int H = L_.nhosts(), me = L_.host, P = L_.local_size();
    if (P > 1) {                                                                                    // (1)
      if (sum())
        channel()->all_reduce_sum(reinterpret_cast<uintptr_t>(data_), c_.count, c_.type, c_.deadline_left(), 1.0, 1.0,
                                  c_.tag);
      else if (me == root_host_)
        channel()->broadcast(reinterpret_cast<uintptr_t>(data_), c_.count, c_.type, root_local_, c_.deadline_left(),
                             c_.tag);
      else
        channel()->barrier(c_.deadline_left(), c_.tag);   // (the host's calls compared all the same)
    }
    if (sum() || me == root_host_) {                                                               // (2)
      for (int k : L_.lanes_of(L_.local))
        for (int h = 0; h < H; ++h)
          if (h != me && k < static_cast<int>(L_.hosts[h].size()))
            p_.push_back(send(L_.hosts[h][k], k, kKindFirst, i, data_, bytes_));
    }
    if (sum()) {
      rows_ = buf(i, 1, H * bytes_);
      for (int h = 0; h < H; ++h)
        if (h != me) p_.push_back(recv(L_.carrier(h, L_.local), L_.local, kKindFirst, i, rows_ + h * bytes_, bytes_));
    } else if (me != root_host_) {
      p_.push_back(recv(L_.carrier(root_host_, L_.local), L_.local, kKindFirst, i, data_, bytes_));
    }
  }
  bool advance(int64_t, int& waited) override { return all_done(p_, waited); }
  void after(int64_t) override {
    if (!sum()) return;
    ShmSources srcs(L_.nhosts());
    for (int h = 0; h < L_.nhosts(); ++h) srcs[h] = h == L_.host ? data_ : rows_ + h * bytes_;
    sum_into(static_cast<ShmType>(c_.type), data_, nullptr, srcs.data(), L_.nhosts(), c_.count, 1.0, 1.0, nullptr);
  }

  unsigned char* data_;
  int64_t bytes_;
  int root_host_, root_local_;
  unsigned char* rows_ = nullptr;
  std::vector<LaneRequest*> p_;
};

// ---------------------------------------------------------------------- all-gather and reduce-scatter
// Every rank's slice of `n` elements, chunk [lo, lo + c) of every slice at once. Lane k carries the
// slices of local rank k of every host that has one, so a rank's own slice leaves its host from it and a
// reduce-scatter's sum lands on the rank that wants it. Local rank l's region in the channel holds, for
// each of its lanes and each host with a slice on it (host order), that slice's chunk: its slots.
class SlicePipe : public LanePipeline {
 public:
  SlicePipe(HostLanes& e, LaneCall& c, const unsigned char* in, unsigned char* out, bool gather)
      : LanePipeline(e, c), in_(in), out_(out), gather_(gather),
        es_(static_cast<int64_t>(type_size(static_cast<ShmType>(c.type)))) {
    P_ = L_.local_size();
    int world = 0;
    for (const auto& h : L_.hosts) world += static_cast<int>(h.size());
    per_ = std::max<int64_t>(1, e.chunk_bytes() / (es_ * world));
    for (int l = 0; l < P_; ++l) {
      std::vector<Slot> slots;
      for (int k : L_.lanes_of(l))
        for (int h = 0; h < L_.nhosts(); ++h)
          if (L_.slice_owner(h, k) >= 0) slots.push_back({k, h, L_.slice_owner(h, k)});
      units_ = std::max<int64_t>(units_, static_cast<int64_t>(slots.size()));
      slots_.push_back(std::move(slots));
    }
    pending_.resize(static_cast<size_t>(e.depth()));
  }
  int64_t chunks() const { return (c_.count + per_ - 1) / per_; }

 protected:
  bool round_in_start() const override { return P_ > 1 && !gather_; }
  struct Slot {
    int lane, host, owner;
  };
  struct Chunk {
    int64_t lo = 0, c = 0;
    unsigned char* mine = nullptr;   // this rank's region in the channel (nullptr: alone on its host)
    unsigned char* rows = nullptr;   // a reduce-scatter's sums from the other hosts, in host order
    std::vector<LaneRequest*> p;   // the messages in flight
  };
  const unsigned char* slice_in(int owner, int64_t lo) const { return in_ + (owner * c_.count + lo) * es_; }
  unsigned char* slot_at(const Chunk& ch, int l, int64_t u, unsigned char* region) const {
    return region + (l * units_ + u) * ch.c * es_;
  }

  void start(int64_t i) override {
    Chunk& ch = pending_[static_cast<size_t>(i % e_.depth())];
    ch = Chunk{};
    ch.lo = i * per_;
    ch.c = std::min(per_, c_.count - ch.lo);
    const int64_t bytes = ch.c * es_;
    const std::vector<Slot>& mine = slots_[static_cast<size_t>(L_.local)];
    if (P_ > 1) ch.mine = buf(i, 0, units_ * bytes);
    if (!gather_) {                                                                                // (1)
      if (P_ > 1) {
        unsigned char* stage = shared(0, P_ * units_ * bytes);
        for (int l = 0; l < P_; ++l) {
          const auto& slots = slots_[static_cast<size_t>(l)];
          for (size_t u = 0; u < slots.size(); ++u)
            copy_bytes(slot_at(ch, l, static_cast<int64_t>(u), stage), slice_in(slots[u].owner, ch.lo), bytes);
          const int64_t used = static_cast<int64_t>(slots.size());
          if (used < units_) std::memset(slot_at(ch, l, used, stage), 0, static_cast<size_t>((units_ - used) * bytes));
        }
        channel()->reduce_scatter_sum(reinterpret_cast<uintptr_t>(stage), reinterpret_cast<uintptr_t>(ch.mine),
                                        units_ * ch.c, c_.type, c_.deadline_left(), 1.0, 1.0, c_.tag);
      }
      ch.rows = buf(i, 1, L_.nhosts() * bytes);
      for (int h = 0; h < L_.nhosts(); ++h)   // every other host's sum of this rank's slice, on its own lane
        if (h != L_.host)
          ch.p.push_back(recv(L_.carrier(h, L_.local), L_.local, kKindFirst, i, ch.rows + h * bytes, bytes));
      for (size_t u = 0; u < mine.size(); ++u)   // this host's sums of the other hosts' ranks' slices, to them
        if (mine[u].host != L_.host)
          ch.p.push_back(send(mine[u].owner, mine[u].lane, kKindFirst, i, own_sum(ch, u), bytes));
      return;
    }
    for (int h = 0; h < L_.nhosts(); ++h)   // this rank's own slice, on its own lane, to every other host
      if (h != L_.host)
        ch.p.push_back(send(L_.carrier(h, L_.local), L_.local, kKindFirst, i, slice_in(0, ch.lo) , bytes));
    for (size_t u = 0; u < mine.size(); ++u) {   // the other hosts' slices this rank's lanes carry
      const Slot& sl = mine[u];
      if (sl.host == L_.host) continue;
      unsigned char* into = P_ > 1 ? slot_at(ch, 0, static_cast<int64_t>(u), ch.mine)
                                   : out_ + (sl.owner * c_.count + ch.lo) * es_;
      ch.p.push_back(recv(sl.owner, sl.lane, kKindFirst, i, into, bytes));
    }
  }

  // A reduce-scatter's slot u of this rank: the host's sum (alone on the host: the input itself)
  const unsigned char* own_sum(const Chunk& ch, size_t u) const {
    const Slot& sl = slots_[static_cast<size_t>(L_.local)][u];
    return P_ > 1 ? slot_at(ch, 0, static_cast<int64_t>(u), ch.mine) : slice_in(sl.owner, ch.lo);
  }

  bool advance(int64_t i, int& waited) override {
    return all_done(pending_[static_cast<size_t>(i % e_.depth())].p, waited);
  }

  void after(int64_t i) override {
    Chunk& ch = pending_[static_cast<size_t>(i % e_.depth())];
    const int64_t bytes = ch.c * es_;
    const std::vector<Slot>& mine = slots_[static_cast<size_t>(L_.local)];
    if (!gather_) {   // the hosts' sums of this rank's slice, in host order
      size_t own = 0;
      while (mine[own].host != L_.host) ++own;   // (lane local, this host: this rank's own slice)
      ShmSources srcs(L_.nhosts());
      for (int h = 0; h < L_.nhosts(); ++h) srcs[h] = h == L_.host ? own_sum(ch, own) : ch.rows + h * bytes;
      sum_into(static_cast<ShmType>(c_.type), out_ + ch.lo * es_, nullptr, srcs.data(), L_.nhosts(), ch.c, 1.0, 1.0,
               nullptr);
      return;
    }
    const int me = L_.rank;
    if (P_ == 1) {
      copy_bytes(out_ + (me * c_.count + ch.lo) * es_, slice_in(0, ch.lo), bytes);
      return;
    }
    for (size_t u = 0; u < mine.size(); ++u)
      if (mine[u].host == L_.host) copy_bytes(slot_at(ch, 0, static_cast<int64_t>(u), ch.mine), slice_in(0, ch.lo), bytes);
    unsigned char* stage = shared(1, P_ * units_ * bytes);                                          // (3)
    channel()->all_gather(reinterpret_cast<uintptr_t>(ch.mine), reinterpret_cast<uintptr_t>(stage), units_ * ch.c,
                            c_.type, c_.deadline_left(), c_.tag);
    for (int l = 0; l < P_; ++l) {
      const auto& slots = slots_[static_cast<size_t>(l)];
      for (size_t u = 0; u < slots.size(); ++u)
        copy_bytes(out_ + (slots[u].owner * c_.count + ch.lo) * es_, slot_at(ch, l, static_cast<int64_t>(u), stage),
                   bytes);
    }
  }

  const unsigned char* in_;
  unsigned char* out_;
  bool gather_;
  int64_t es_;
  int P_ = 1;
  int64_t per_ = 1, units_ = 0;
  std::vector<std::vector<Slot>> slots_;
  std::vector<Chunk> pending_;
};

}  // namespace

// ---------------------------------------------------------------------- entry points
// An all-reduce or a broadcast: whole when small and not empty, else in shards, pipelined.
void HostLanes::run_shards(LaneCall& c, uintptr_t data, int root_host, int root_local) {
  auto* p = reinterpret_cast<unsigned char*>(data);
  if (c.count > 0 && c.count * static_cast<int64_t>(type_size(static_cast<ShmType>(c.type))) <= kWholeBytes) {
    WholePipe pipe(*this, c, p, root_host, root_local);
    run_checked(c, [&] { pipe.run(1); });
    return;
  }
  ShardPipe pipe(*this, c, p, root_host, root_local);
  run_checked(c, [&] { pipe.run(pipe.chunks()); });
}
void HostLanes::all_reduce_sum(uintptr_t data, int64_t count, int type, double timeout_s, ShmCallTag tag,
                               double div) {
  checked_type(type);
  check_span(data, count, "data");
  NCCLAVG_CHECK_ARG(std::isfinite(div) && div != 0, "div", "must be finite and not 0, got ", div);
  LaneCall c(*this, LaneOp::kAllReduce, type, count, -1, timeout_s, tag);
  run_shards(c, data, -1, -1);
  if (div == 1.0 || count == 0) return;
  // Each rank divides its own copy after the wire: the messages are those of an undivided sum, and the
  // pass is the channel's element step with one source (Note [Pack scale modes]), the same bits as the
  // core's unpack scale or torch's div_ after the sum.
  auto* p = reinterpret_cast<unsigned char*>(data);
  const unsigned char* const srcs[1] = {p};
  sum_into(static_cast<ShmType>(type), p, nullptr, srcs, 1, count, 1.0, div, nullptr);
}

void HostLanes::broadcast(uintptr_t data, int64_t count, int type, int root, double timeout_s, ShmCallTag tag) {
  checked_type(type);
  check_span(data, count, "data");
  int root_host = -1, root_local = -1;
  for (int h = 0; h < layout_.nhosts(); ++h)
    for (size_t l = 0; l < layout_.hosts[h].size(); ++l)
      if (layout_.hosts[h][l] == root) {
        root_host = h;
        root_local = static_cast<int>(l);
      }
  NCCLAVG_CHECK_ARG(root_host >= 0, "root", "is no rank of the group: ", root);
  LaneCall c(*this, LaneOp::kBroadcast, type, count, root, timeout_s, tag);
  run_shards(c, data, root_host, root_local);
}

void HostLanes::all_gather(uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s, ShmCallTag tag) {
  checked_type(type);
  check_span(in, count, "in");
  check_span(out, count, "out");
  LaneCall c(*this, LaneOp::kAllGather, type, count, -1, timeout_s, tag);
  SlicePipe pipe(*this, c, reinterpret_cast<const unsigned char*>(in), reinterpret_cast<unsigned char*>(out), true);
  run_checked(c, [&] { pipe.run(pipe.chunks()); });
}

void HostLanes::reduce_scatter_sum(uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s,
                                   ShmCallTag tag) {
  checked_type(type);
  check_span(in, count, "in");
  check_span(out, count, "out");
  LaneCall c(*this, LaneOp::kReduceScatter, type, count, -1, timeout_s, tag);
  SlicePipe pipe(*this, c, reinterpret_cast<const unsigned char*>(in), reinterpret_cast<unsigned char*>(out), false);
  run_checked(c, [&] { pipe.run(pipe.chunks()); });
}

void HostLanes::check(double timeout_s, ShmCallTag tag) {
  LaneCall c(*this, LaneOp::kCheck, 0, 0, -1, timeout_s, tag);
  run_checked(c, [&] {   // (the hellos go after the host's barrier: Note [Lanes between hosts])
    if (channel_ != nullptr) channel_->barrier(c.deadline_left(), tag);
  });
}

}  // namespace cpu
}  // namespace ncclavg
