// Note [Shared-memory channel]
// On one host, torch's gloo moves even an 8-byte all-reduce through the TCP stack and its worker
// threads: about 250 us per call on loopback, and about 1 GB/s for large buffers. Processes of one host
// can instead meet in one shared-memory segment (Note [Segment without a name] in shm_segment.cpp):
//
//   [header][one line per rank: posted / reduced / consumed counters, signatures, pid][per rank: 2 slots]
//
// A collective is a sequence of rounds (at least one, also for count 0), numbered the same on every rank
// (`seq`); round `seq` uses each rank's slot seq % 2, so a rank can post round seq + 1 while a slower
// peer still reads round seq. One round:
//   1. wait until every rank has consumed round seq - 2 (the slots of this parity are free again);
//   2. copy what the peers need into this rank's slot, write the call's signature (op, type, count, root,
//      scale), publish posted = seq; wait until every rank has posted seq; check that every rank made
//      the same call (so ranks that disagree on the op, the size or a broadcast's root all fail with
//      both calls named, instead of mixing data or pairing with a later round);
//   3. by op:
//      all_reduce_sum, chunk <= 32 KiB: sum every rank's chunk into the output (this rank's own chunk is
//        read from its input: it is not copied for itself);
//      all_reduce_sum, larger: slice r of the chunk belongs to rank r, which does not copy it, sums it
//        from every slot (its own from its input) into its output and into its slot, and publishes
//        reduced = seq; each rank then copies every other slice as soon as its owner has published.
//        The sum's work is split over the ranks, and nobody reads or writes its own slice twice;
//      reduce_scatter_sum: each slot holds one piece per destination rank, so every rank sums its piece
//        of every slot in every round (all ranks work in every round);
//      all_gather / broadcast: copy the slots out; barrier: nothing;
//   4. publish consumed = seq.
// Sums run in rank order 0, 1, ..., P-1 per element, accumulated in fp32 (fp64 for float64) with the
// core's SIMD lanes, rounded once to the element type, then scaled (an average divides by P in the same
// pass): every rank gets the same bits whichever rank computed an element, and a half-precision sum has
// one rounding instead of P - 1. For two ranks an fp32 sum is the same a + b as gloo's.
//
// Note [Waiting in the channel]
// A wait spins for 2 us (a ready peer on another core answers in under a microsecond), then yields the
// core until 1 ms, then
// sleeps on a futex in the segment, which a publishing rank wakes when someone sleeps: a rank waiting
// for a late peer costs no CPU. The spin is short because on a busy machine every microsecond of it is
// taken from a process that may be the peer: 2 ranks on 2 cores with a third process busy took 40 us
// per 8-byte all-reduce with a 50 us spin, 3-9 us with 0-2 us, and 0.8 us when quiet (1.25 us with
// 50 us: a yield costs little when nobody else wants the core). With more ranks than CPUs this process
// may use, a wait does not spin at all. Yielding, not sleeping, for the first millisecond: with 4 ranks
// on 2 cores an 8-byte all-reduce took 4-5 us yielding, 9-12 us when the waiters went to the futex
// after 10-50 us (each sleep and wake-up costs tens of microseconds), and up to 250 us per call where
// other work kept the cores busy. While waiting it checks (a) the call's deadline (timeout_s from the
// call's start), (b) an abort word in the header that any rank sets when it fails, with its reason, so
// every survivor fails within a moment of the first, and (c) every 100 ms, whether the peer it waits
// for still runs: its pid with its start time, so that a reused pid is not taken for the peer. The
// error names that peer. A failed channel stays failed.
//
// Note [One owner per rank]
// Each rank claims its line with a compare-and-swap of its pid, and every collective checks that the
// caller is that process: a second process joining as an existing rank (the door refuses it too), or a
// forked child calling its parent's channel, gets an error instead of mixing its data into the round.
#include "shm_channel.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstddef>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <mutex>
#include <sstream>

#include "../common/check.h"
#include "shm_internal.h"
#include "shm_segment.h"

namespace ncclavg {
namespace cpu {
using namespace shm_detail;

namespace {
constexpr uint64_t kMagic = 0x6e63636c61767334ull;    // "ncclavs4"
constexpr size_t kLinesOffset = 1024;
// See Note [Waiting in the channel] for these two.
constexpr std::chrono::microseconds kSpin{2};
constexpr std::chrono::microseconds kYieldUntil{1000};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared counters must be lock-free");
static_assert(std::atomic<int32_t>::is_always_lock_free, "shared counters must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "the futex word must be a plain int");

// This process's pid, kept current across fork() (a forked child must not pass for its parent).
std::atomic<int> g_pid{0};
int current_pid() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_pid.store(getpid());
    pthread_atfork(nullptr, nullptr, [] { g_pid.store(getpid()); });
  });
  return g_pid.load(std::memory_order_relaxed);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

Clock::time_point deadline_after(Clock::time_point from, double seconds) {
  if (seconds >= 1e9) return Clock::time_point::max();   // ~31 years: no deadline (and no overflow)
  return from + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

const char* counter_meaning(int c) {
  static const char* names[] = {"post its data", "finish its share of the sum", "finish reading"};
  return names[c];
}

thread_local ShmBlockingHook* t_blocking_hook = nullptr;

// Runs this thread's blocking hook, once: before the first yield or sleep of a call (the GIL goes).
inline void before_blocking() {
  if (t_blocking_hook != nullptr) {
    ShmBlockingHook* hook = t_blocking_hook;
    t_blocking_hook = nullptr;
    hook->before_blocking();
  }
}
}  // namespace

void set_blocking_hook(ShmBlockingHook* hook) { t_blocking_hook = hook; }

struct ShmHeader {
  std::atomic<uint64_t> magic;
  uint64_t nonce;
  int32_t nranks;
  int32_t unused;
  int64_t slot_bytes;
  std::atomic<int32_t> abort_claim;   // first failing rank + 1 claims the reason
  std::atomic<int32_t> aborted_by;    // rank + 1, published after the reason and the kind are written
  std::atomic<int32_t> abort_kind;    // ShmChannel::AbortKind
  alignas(64) std::atomic<uint32_t> wake_epoch;   // the futex word: bumped to wake sleepers
  std::atomic<int32_t> sleepers;                  // ranks asleep on it (or about to be)
  char abort_reason[512];
};
static_assert(sizeof(ShmHeader) <= kLinesOffset, "header overlaps the rank lines");

struct alignas(64) ShmRankLine {
  // Written by its rank every round and read by every peer: one cache line.
  std::atomic<uint64_t> counter[3];   // posted, reduced, consumed: the last round done
  // the call of round seq at [seq % 2] (op | type | root | scale, count): a rank may post round seq + 1
  // while a peer still checks round seq, never round seq + 2 (that waits for the peer's consumed = seq)
  std::atomic<uint64_t> signature[2][2];
  // The round this rank's caller announced it posts next, while it looks whether its peers are there
  // (Note [An asynchronous call whose peers wait]).
  std::atomic<uint64_t> arriving;
  // The owner, claimed with a compare-and-swap from 0 (Note [One owner per rank]), and its start time
  // (a reused pid has another): read only while waiting long, so on a line of their own.
  alignas(64) std::atomic<int32_t> pid;
  std::atomic<uint64_t> start_ticks;
  // The exact values behind round seq's signature at [seq % 2]: wire count, user count, mul and div bits.
  // Read by a peer only to describe a mismatch (Note [Call signatures] in shm_calls.cpp).
  alignas(64) std::atomic<uint64_t> detail[2][4];
  // When this rank's call whose first round is seq began, at [seq % 2] (Note [Arrival times]).
  alignas(64) std::atomic<int64_t> arrived_ns[2];
};
static_assert(offsetof(ShmRankLine, pid) == 64, "the round's state must fill exactly one cache line");

ShmChannel::ShmChannel(const std::string& name, int rank, int nranks, int64_t slot_bytes, uint64_t nonce,
                       std::vector<int> labels)
    : name_(name), rank_(rank), nranks_(nranks), labels_(std::move(labels)), slot_bytes_(slot_bytes),
      arrivals_(std::clamp(nranks, 1, 65536)) {
  NCCLAVG_CHECK_ARG(nranks >= 1 && nranks <= 65536, "nranks", "must be in [1, 65536], got ", nranks);
  NCCLAVG_CHECK_ARG(labels_.empty() || labels_.size() == static_cast<size_t>(nranks), "labels",
                    "must be empty or hold one entry per rank (", nranks, "), got ", labels_.size());
  if (labels_.empty()) {
    for (int r = 0; r < nranks; ++r) labels_.push_back(r);
  }
  NCCLAVG_CHECK_ARG(rank >= 0 && rank < nranks, "rank", "must be in [0, ", nranks, "), got ", rank);
  // >= 64 bytes per rank: a reduce-scatter round carries one piece for every rank
  NCCLAVG_CHECK_ARG(slot_bytes >= std::max<int64_t>(4096, 64 * int64_t{nranks}) && slot_bytes % 64 == 0 &&
                        slot_bytes <= kShmMaxSlotBytes,
                    "slot_bytes", "must be a multiple of 64 in [max(4096, 64 x nranks), ", kShmMaxSlotBytes,
                    "], got ", slot_bytes);
  check_channel_name(name);
  const size_t lines_end = kLinesOffset + static_cast<size_t>(nranks) * sizeof(ShmRankLine);
  const size_t data_offset = (lines_end + 4095) / 4096 * 4096;
  map_bytes_ = checked_segment_bytes(data_offset, nranks, slot_bytes);
  const size_t region = 2 * static_cast<size_t>(slot_bytes);   // one rank's two slots
  const ShmDoorRequest request{kMagic, nonce, rank, nranks, slot_bytes};

  const int fd = rank == 0 ? create_memory_file(map_bytes_) : receive_memory_file(name, request, 30.0);
  auto give_up = [&](const std::string& why) {
    if (base_ != nullptr) munmap(base_, map_bytes_);
    base_ = nullptr;
    ::close(fd);
    throw std::runtime_error(why);
  };
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != map_bytes_) {
    give_up("shared-memory channel '" + name + "': the segment rank 0 sent has an unexpected size");
  }
  void* p = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) give_up("shared-memory channel '" + name + "': mmap failed: " + std::strerror(errno));
  base_ = static_cast<unsigned char*>(p);
  header_ = reinterpret_cast<ShmHeader*>(base_);
  data_ = base_ + data_offset;
  // Each rank allocates its own slots, from its own process, and writes them first: they are placed on
  // its NUMA node (the node of the first touch), where it writes them every round. Rank 0 used to
  // reserve every slot, placing all of them on its own node.
  try {
    if (rank == 0) reserve_memory(fd, 0, data_offset, "the channel's header");
    reserve_memory(fd, data_offset + static_cast<size_t>(rank) * region, region,
                   "rank " + std::to_string(labels_[rank]) + "'s slots");
  } catch (const std::exception& e) {
    give_up(e.what());
  }
  std::memset(slot(0, rank), 0, region);
  if (rank == 0) {
    header_->nonce = nonce;
    header_->nranks = nranks;
    header_->slot_bytes = slot_bytes;
    header_->magic.store(kMagic, std::memory_order_release);
  } else if (header_->magic.load(std::memory_order_acquire) != kMagic || header_->nonce != nonce ||
             header_->nranks != nranks || header_->slot_bytes != slot_bytes) {
    give_up("shared-memory channel '" + name + "': the segment is not the one rank 0 created");
  }
  // See Note [One owner per rank].
  int32_t expected = 0;
  if (!line(rank).pid.compare_exchange_strong(expected, current_pid())) {
    give_up("shared-memory channel '" + name + "': rank " + std::to_string(labels_[rank]) +
            " is taken already, by pid " + std::to_string(expected));
  }
  line(rank).start_ticks.store(process_start_ticks(current_pid()), std::memory_order_release);
  // More ranks than CPUs to run them: a spinning waiter holds the CPU its peer needs, so yield at once.
  cpu_set_t cpus;
  const int usable = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 0;
  spin_ = usable > 0 && nranks > usable ? Clock::duration::zero() : kSpin;
  if (rank == 0) {
    try {
      door_ = std::make_unique<ShmDoor>(name, fd, request);   // owns fd from here
    } catch (const std::exception& e) {
      give_up(e.what());
    }
  } else {
    ::close(fd);
  }
}

ShmChannel::~ShmChannel() {
  door_.reset();
  if (base_ != nullptr) munmap(base_, map_bytes_);
}

void ShmChannel::close_door() { door_.reset(); }

int64_t ShmChannel::resident_slot_bytes(int r) const {
  NCCLAVG_CHECK_ARG(r >= 0 && r < nranks_, "r", "must be in [0, ", nranks_, "), got ", r);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(slot(0, r)), hi = lo + 2 * static_cast<size_t>(slot_bytes_);
  const uintptr_t first = lo / page * page;
  std::vector<unsigned char> in_core((hi - first + page - 1) / page);
  if (mincore(reinterpret_cast<void*>(first), hi - first, in_core.data()) != 0) return -1;
  int64_t bytes = 0;
  for (size_t i = 0; i < in_core.size(); ++i) {
    if (in_core[i] & 1) {
      const uintptr_t a = std::max(lo, first + i * page), b = std::min(hi, first + (i + 1) * page);
      bytes += static_cast<int64_t>(b - a);
    }
  }
  return bytes;
}

ShmRankLine& ShmChannel::line(int r) const {
  return reinterpret_cast<ShmRankLine*>(base_ + kLinesOffset)[r];
}

unsigned char* ShmChannel::slot(uint64_t seq, int r) const {
  return data_ + (2 * static_cast<size_t>(r) + (seq & 1)) * static_cast<size_t>(slot_bytes_);
}

void ShmChannel::abort_as(const std::string& why, AbortKind kind) {
  local_abort_.store(true, std::memory_order_release);
  int32_t expected = 0;
  if (header_->abort_claim.compare_exchange_strong(expected, rank_ + 1)) {
    std::strncpy(header_->abort_reason, why.c_str(), sizeof(header_->abort_reason) - 1);
    header_->abort_kind.store(kind, std::memory_order_relaxed);
    header_->aborted_by.store(rank_ + 1, std::memory_order_release);
  }
  wake_all();
}

// The error of a call that finds the channel aborted: a mismatch found by a peer is a mismatch here too.
void ShmChannel::throw_aborted(const Call& call) {
  failed_ = true;
  const int by = header_->aborted_by.load(std::memory_order_acquire);
  if (by == 0) throw ShmPeerError(std::string("shared-memory ") + call.op + ": aborted by this process");
  const int who = by - 1 < nranks_ ? labels_[by - 1] : by - 1;
  if (by - 1 == rank_ && header_->abort_kind.load(std::memory_order_relaxed) == kAbortMismatch) {
    throw ShmMismatchError(header_->abort_reason);   // this rank's own finding, as it said it
  }
  const std::string text = std::string("shared-memory ") + call.op + ": the channel was aborted by rank " +
                           std::to_string(who) + ": " + header_->abort_reason;
  if (header_->abort_kind.load(std::memory_order_relaxed) == kAbortMismatch) throw ShmMismatchError(text);
  throw ShmPeerError(text);
}

void ShmChannel::fail_mismatch(const std::string& why) {
  failed_ = true;
  abort_as(why, kAbortMismatch);
  throw ShmMismatchError(why);
}

void ShmChannel::fail_all(const std::string& why, bool timeout) {
  failed_ = true;
  abort(why);
  if (timeout) throw ShmTimeoutError(why);
  throw ShmPeerError(why);
}

void ShmChannel::wake_all() {
  header_->wake_epoch.fetch_add(1, std::memory_order_seq_cst);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&header_->wake_epoch), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// seq_cst store, then the sleepers' count: with the sleeper's increment-then-check (wait_for), one of
// the two sides always sees the other, so no wake-up is lost. See Note [Waiting in the channel].
void ShmChannel::publish(Counter c, uint64_t seq) {
  line(rank_).counter[c].store(seq, std::memory_order_seq_cst);
  if (header_->sleepers.load(std::memory_order_seq_cst) > 0) wake_all();
}

void ShmChannel::begin(Call& call) {
  if (header_->aborted_by.load(std::memory_order_acquire) != 0) throw_aborted(call);
  if (failed_) throw ShmPeerError(std::string("shared-memory ") + call.op + ": the channel failed earlier");
  const int owner = line(rank_).pid.load(std::memory_order_relaxed);
  if (owner != current_pid()) {   // See Note [One owner per rank]
    throw std::runtime_error("shared-memory " + std::string(call.op) + ": rank " + std::to_string(labels_[rank_]) +
                             " of this channel belongs to pid " + std::to_string(owner) + ", not to pid " +
                             std::to_string(current_pid()) + " (a forked child cannot use its parent's channel)");
  }
  call.arrived = Clock::now();
  call.deadline = deadline_after(call.arrived, call.timeout_s);
}

// Note [An asynchronous call whose peers wait]
// A collective issued asynchronously goes to a worker thread, so that its caller never waits for a peer
// that is not there yet (the peer may be waiting for something this caller does next). When every peer is
// already at this very collective, nothing can be waiting for this caller: running the collective on the
// caller's thread then costs the round itself and no hand-over to a worker (on a busy 2-core machine a
// worker's wake-up costs more than a small round). peers_ready() announces, in this rank's line, the
// round it posts next (`arriving`), then looks for at most max_wait_s (spinning for spin_, then yielding)
// whether every peer has announced or posted that round. A rank that gives up queues the collective,
// and its worker posts the announced round: a peer that saw the announcement and went ahead waits for a
// worker, never for a caller. A rank that announced and then does not run the call (its group failed or
// was shut down meanwhile) fails the waiting peer as any absent peer does: by its abort, its exit or the
// call's deadline. Ranks decide independently, so one may run the call inline and another queue it; they
// still meet in the same round.
bool ShmChannel::peers_ready(double max_wait_s) {
  if (failed_ || local_abort_.load(std::memory_order_acquire) ||
      line(rank_).pid.load(std::memory_order_relaxed) != current_pid()) {
    return false;
  }
  const uint64_t next = seq_ + 1;
  line(rank_).arriving.store(next, std::memory_order_release);
  const Clock::time_point start = Clock::now();
  const Clock::time_point until =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(max_wait_s));
  for (int r = 0; r < nranks_; ++r) {
    if (r == rank_) continue;
    const std::atomic<uint64_t>& posted = line(r).counter[kPosted];
    const std::atomic<uint64_t>& arriving = line(r).arriving;
    while (posted.load(std::memory_order_acquire) < next && arriving.load(std::memory_order_acquire) < next) {
      if (header_->aborted_by.load(std::memory_order_acquire) != 0) return false;
      const Clock::time_point now = Clock::now();
      if (now >= until) return false;
      if (now - start < spin_) {
        cpu_relax();
      } else {
        sched_yield();
      }
    }
  }
  return true;
}

// Waits until rank `only_rank` (every other rank when -1) has published counter c >= target.
void ShmChannel::wait_for(Counter c, uint64_t target, int only_rank, const Call& call, uint64_t seq) {
  for (int r = 0; r < nranks_; ++r) {
    if (r == rank_ || (only_rank >= 0 && r != only_rank)) continue;
    std::atomic<uint64_t>& counter = line(r).counter[c];
    if (counter.load(std::memory_order_acquire) >= target) continue;
    const Clock::time_point start = Clock::now();
    Clock::time_point next_check = start + std::chrono::milliseconds(100);
    enum { kSpinning, kYielding, kSleeping } phase = spin_ > Clock::duration::zero() ? kSpinning : kYielding;
    waiting_on_.store(labels_[r], std::memory_order_relaxed);   // for a watchdog's words (waiting_on)
    for (uint64_t i = 1; counter.load(std::memory_order_acquire) < target; ++i) {
      if (local_abort_.load(std::memory_order_acquire) || header_->aborted_by.load(std::memory_order_acquire)) {
        throw_aborted(call);
      }
      if (phase != kSpinning) before_blocking();
      if (phase == kSpinning) {
        cpu_relax();
      } else if (phase == kYielding) {
        sched_yield();
      }
      if (phase != kSleeping && i % 64 != 0) continue;
      const Clock::time_point now = Clock::now();
      const int pid = line(r).pid.load(std::memory_order_acquire);
      // the same words as the gloo path's diagnosis (ncclavg/transport/liveness.py): "rank N stopped responding"
      if (now >= call.deadline) {
        std::ostringstream os;
        os << "shared-memory " << call.op << " timed out after " << call.timeout_s << " s: rank " << labels_[r]
           << " stopped responding (pid " << pid << "): it did not " << counter_meaning(c) << " for round " << seq
           << " (this is rank " << labels_[rank_] << ", " << nranks_ << " processes on this channel)";
        fail_all(os.str(), true);
      }
      if (now >= next_check) {
        next_check = now + std::chrono::milliseconds(100);
        if (process_gone(pid, line(r).start_ticks.load(std::memory_order_acquire))) {
          std::ostringstream os;
          os << "shared-memory " << call.op << ": rank " << labels_[r] << " stopped responding (pid " << pid
             << "): its process exited while rank " << labels_[rank_] << " waited for it to " << counter_meaning(c);
          fail_all(os.str(), false);
        }
      }
      const auto waited = now - start;
      phase = waited < spin_ ? kSpinning : waited < kYieldUntil ? kYielding : kSleeping;
      if (phase != kSleeping) continue;
      before_blocking();
      // Sleep until a publish (or an abort) bumps the futex word, the next liveness check, or the deadline.
      header_->sleepers.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t epoch = header_->wake_epoch.load(std::memory_order_seq_cst);
      if (counter.load(std::memory_order_seq_cst) < target && !local_abort_.load(std::memory_order_acquire)) {
        const auto until = std::min(next_check, call.deadline);
        const int64_t ns = std::max<int64_t>(
            1000, std::chrono::duration_cast<std::chrono::nanoseconds>(until - Clock::now()).count());
        timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&header_->wake_epoch), FUTEX_WAIT, epoch, &ts, nullptr, 0);
      }
      header_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
    waiting_on_.store(-1, std::memory_order_relaxed);
  }
}

// A round's call in the user's terms when it has a user call, else in the channel's (Note [Call
// signatures] in shm_calls.cpp).
std::string ShmChannel::describe(const uint64_t* sig, const uint64_t* detail) const {
  const int op = sig_op(sig[0]), root = sig_root(sig[0]);
  const uint64_t user = sig_user_fields(sig[0]);
  std::ostringstream d;
  if (user != 0) {
    // the root field is the wire root for a broadcast (a channel rank: name it as the group does)
    const int user_root = op == kBroadcast && root >= 0 && root < nranks_ ? labels_[root] : root;
    ShmCallTag tag;
    tag.word = user | static_cast<uint64_t>(user_root + 1) << 24;
    tag.count = static_cast<int64_t>(detail[1]);
    return describe_call(tag);
  }
  d << op_name(op) << " of " << detail[0] << " " << type_name(sig_type(sig[0]));
  if (op == kBroadcast) d << " from root " << (root >= 0 && root < nranks_ ? labels_[root] : root);
  if (detail[2] != double_bits(1.0) || detail[3] != double_bits(1.0)) d << " (scaled)";
  return d.str();
}

void ShmChannel::check_same_collective(const Call& call, uint64_t seq) {
  for (int r = 0; r < nranks_; ++r) {
    if (r == rank_) continue;
    const uint64_t theirs[2] = {line(r).signature[seq & 1][0].load(std::memory_order_relaxed),
                                line(r).signature[seq & 1][1].load(std::memory_order_relaxed)};
    if (theirs[0] == call.sig[0] && theirs[1] == call.sig[1]) continue;
    uint64_t mine_detail[4], their_detail[4];
    for (int k = 0; k < 4; ++k) {
      mine_detail[k] = line(rank_).detail[seq & 1][k].load(std::memory_order_relaxed);
      their_detail[k] = line(r).detail[seq & 1][k].load(std::memory_order_relaxed);
    }
    std::string mine = describe(call.sig, mine_detail), other = describe(theirs, their_detail);
    if (mine == other) {   // the same user call, different channel calls (arguments that differ locally)
      const uint64_t no_user_mine[2] = {call.sig[0] & ((uint64_t{1} << kSigCollectiveShift) - 1), 0};
      const uint64_t no_user_theirs[2] = {theirs[0] & ((uint64_t{1} << kSigCollectiveShift) - 1), 0};
      mine += " (channel: " + describe(no_user_mine, mine_detail) + ")";
      other += " (channel: " + describe(no_user_theirs, their_detail) + ")";
    }
    std::ostringstream os;
    os << "collectives out of step: rank " << labels_[rank_] << " called " << mine << ", rank " << labels_[r]
       << " called " << other
       << ": every rank must call the same collectives, with the same sizes, dtypes, ops and roots, in the same "
          "order (shared-memory channel, round "
       << seq << ")";
    fail_mismatch(os.str());
  }
}

// Steps 1-2 of a round: returns the round, every rank's slot filled, every rank in the same collective.
void ShmChannel::note_arrivals(uint64_t seq) {
  static_assert(std::is_same_v<Clock::duration, std::chrono::nanoseconds>, "stamps are in ns");
  constexpr int kInline = 16;
  int64_t inline_stamps[kInline];
  std::vector<int64_t> heap;
  int64_t* stamps = nranks_ <= kInline ? inline_stamps : (heap.resize(nranks_), heap.data());
  for (int r = 0; r < nranks_; ++r) stamps[r] = line(r).arrived_ns[seq & 1].load(std::memory_order_relaxed);
  arrivals_.add(stamps);
  if (call_depth_ > 0) scope_stamps_.assign(stamps, stamps + nranks_);
}

uint64_t ShmChannel::post_round(Call& call, ShmFill fill) {
  const uint64_t seq = ++seq_;
  if (seq > 2) wait_for(kConsumed, seq - 2, -1, call, seq);
  fill(slot(seq, rank_));
  ShmRankLine& mine = line(rank_);
  for (int k = 0; k < 2; ++k) mine.signature[seq & 1][k].store(call.sig[k], std::memory_order_relaxed);
  const uint64_t detail[4] = {static_cast<uint64_t>(call.count), static_cast<uint64_t>(call.tag.count),
                              double_bits(call.mul), double_bits(call.div)};
  for (int k = 0; k < 4; ++k) mine.detail[seq & 1][k].store(detail[k], std::memory_order_relaxed);
  const bool first = call.first_seq == 0;
  if (first) {   // Note [Arrival times]
    call.first_seq = seq;
    mine.arrived_ns[seq & 1].store(call.arrived.time_since_epoch().count(), std::memory_order_relaxed);
  }
  publish(kPosted, seq);
  wait_for(kPosted, seq, -1, call, seq);
  check_same_collective(call, seq);
  if (first && (call_depth_ == 0 || !call_logged_)) {   // a user call's first collective only
    call_logged_ = true;
    note_arrivals(seq);
  }
  return seq;
}

}  // namespace cpu
}  // namespace ncclavg
