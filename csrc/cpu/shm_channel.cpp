// Note [Shared-memory channel]
// On one host, torch's gloo moves even an 8-byte all-reduce through the TCP stack and its worker
// threads: about 250 us per call on loopback, and about 1 GB/s for large buffers. Processes of one host
// can instead meet in one shared-memory segment (DeepSpeed's CPU shm all-reduce does the same):
//
//   [header][one line per rank: posted / reduced / consumed counters, pid][2 x nranks data slots]
//
// A collective is a sequence of rounds, numbered the same on every rank (`seq`); round `seq` uses the
// slot set seq % 2, so a rank can post round seq + 1 while a slower peer still reads round seq. One round:
//   1. wait until every rank has consumed round seq - 2 (the slot set is free again);
//   2. copy this rank's chunk (at most slot_bytes) into its slot; publish posted = seq (release);
//   3. wait until every rank has posted seq (acquire); then by op:
//      all_reduce_sum, small chunk: sum every slot into the output;
//      all_reduce_sum, large chunk: rank r sums slice r of every slot into slice r of its own slot
//        (nobody else reads that slice), publishes reduced = seq, waits for every rank's reduced, and
//        copies every slice out: the sum's work is split over the ranks;
//      reduce_scatter_sum: sum the part of the chunk that falls in this rank's output;
//      all_gather / broadcast: copy the slots out;
//   4. publish consumed = seq.
// Sums run in rank order 0, 1, ..., P-1 per element, accumulated in fp32 (fp64 for float64) and rounded
// once: every rank gets the same bits whichever rank computed an element, and a half-precision sum has
// one rounding instead of P - 1. For two ranks an fp32 sum is the same a + b as gloo's.
//
// Waiting never blocks forever: a wait spins briefly, then yields, then sleeps 50 us at a time, and
// checks (a) a deadline, (b) an abort word in the header that any rank sets when it fails, with its
// reason, so every survivor fails within a moment of the first, and (c) every 100 ms, whether the peer
// it waits for still exists (its pid: gone, or a zombie). The error names that peer. A failed channel
// stays failed. Each round also checks that every rank is in the same collective (op, type and count),
// so two ranks that call different collectives fail with both names instead of mixing data.
#include "shm_channel.h"

#include <fcntl.h>
#include <signal.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "../common/check.h"
#include "../common/elementwise.h"

namespace ncclavg {
namespace cpu {

namespace {
constexpr uint64_t kMagic = 0x6e63636c61767368ull;   // "ncclavsh"
constexpr size_t kLinesOffset = 1024;
constexpr int64_t kDirectBytes = 32 << 10;            // below: every rank sums the whole chunk
constexpr int64_t kBlock = 512;                       // elements per accumulator block
using Clock = std::chrono::steady_clock;

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared counters must be lock-free");
static_assert(std::atomic<int32_t>::is_always_lock_free, "shared counters must be lock-free");

size_t type_size(ShmType t) {
  switch (t) {
    case ShmType::kFloat32: return 4;
    case ShmType::kFloat16:
    case ShmType::kBFloat16: return 2;
    case ShmType::kFloat64: return 8;
  }
  return 0;
}

const char* type_name(ShmType t) {
  switch (t) {
    case ShmType::kFloat32: return "float32";
    case ShmType::kFloat16: return "float16";
    case ShmType::kBFloat16: return "bfloat16";
    case ShmType::kFloat64: return "float64";
  }
  return "unknown";
}

ShmType checked_type(int code) {
  NCCLAVG_CHECK_TYPE(code >= 0 && code <= 3, "type", "unknown element type code ", code,
                     " (0 float32, 1 float16, 2 bfloat16, 3 float64)");
  return static_cast<ShmType>(code);
}

// out[i] = src[0][i] + src[1][i] + ... in rank order, accumulated in Acc, rounded once. `out` may be
// one of the sources (a whole block is read before it is written).
template <typename Elem, typename Acc, typename Load, typename Store>
void sum_rows(unsigned char* out, const unsigned char* const* srcs, int nsrc, int64_t n, Load load,
              Store store) {
  Acc acc[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = std::min(kBlock, n - b);
    const Elem* s0 = reinterpret_cast<const Elem*>(srcs[0]) + b;
    for (int64_t i = 0; i < m; ++i) acc[i] = load(s0[i]);
    for (int r = 1; r < nsrc; ++r) {
      const Elem* s = reinterpret_cast<const Elem*>(srcs[r]) + b;
      for (int64_t i = 0; i < m; ++i) acc[i] += load(s[i]);
    }
    Elem* o = reinterpret_cast<Elem*>(out) + b;
    for (int64_t i = 0; i < m; ++i) o[i] = store(acc[i]);
  }
}

void sum_ranks(ShmType t, unsigned char* out, const unsigned char* const* srcs, int nsrc, int64_t n) {
  switch (t) {
    case ShmType::kFloat32:
      sum_rows<float, float>(out, srcs, nsrc, n, [](float x) { return x; }, [](float x) { return x; });
      break;
    case ShmType::kFloat64:
      sum_rows<double, double>(out, srcs, nsrc, n, [](double x) { return x; }, [](double x) { return x; });
      break;
    case ShmType::kFloat16:
      sum_rows<_Float16, float>(out, srcs, nsrc, n, [](_Float16 x) { return static_cast<float>(x); },
                                [](float x) { return static_cast<_Float16>(x); });
      break;
    case ShmType::kBFloat16:
      sum_rows<uint16_t, float>(out, srcs, nsrc, n, [](uint16_t x) { return ew::bf16_bits_to_float(x); },
                                [](float x) { return ew::float_to_bf16_bits(x); });
      break;
  }
}

// A process that no longer runs: gone, or a zombie nobody has reaped yet.
bool process_gone(int pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  if (paren == std::string::npos || paren + 2 >= text.size()) return false;
  const char state = text[paren + 2];
  return state == 'Z' || state == 'X';
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spin a little (a peer on another core is usually microseconds away), then give the core away: with
// more processes than cores, a spinning waiter would delay the very peer it waits for.
struct Backoff {
  Clock::time_point start = Clock::now();
  int64_t spins = 0;
  void pause() {
    ++spins;
    if (spins < 1024) {
      cpu_relax();
    } else if (Clock::now() - start < std::chrono::milliseconds(1)) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
};

const char* counter_meaning(int c) {
  static const char* names[] = {"post its data", "finish its share of the sum", "finish reading"};
  return names[c];
}

uint64_t signature(int op, ShmType t, int64_t count) {
  return (static_cast<uint64_t>(op) << 56) ^ (static_cast<uint64_t>(t) << 48) ^ static_cast<uint64_t>(count);
}

const char* op_name(int op) {
  static const char* names[] = {"all_reduce_sum", "reduce_scatter_sum", "all_gather", "broadcast"};
  return op >= 0 && op < 4 ? names[op] : "unknown";
}

void check_span(uintptr_t ptr, int64_t count, const char* argname) {
  NCCLAVG_CHECK_ARG(count >= 0, "count", "must be >= 0, got ", count);
  NCCLAVG_CHECK_ARG(count == 0 || ptr != 0, argname, "is null but count is ", count);
}
}  // namespace

struct ShmHeader {
  std::atomic<uint64_t> magic;
  uint64_t nonce;
  int32_t nranks;
  int32_t unused;
  int64_t slot_bytes;
  std::atomic<int32_t> abort_claim;   // first failing rank + 1 claims the reason
  std::atomic<int32_t> aborted_by;    // rank + 1, published after the reason is written
  char abort_reason[512];
};
static_assert(sizeof(ShmHeader) <= kLinesOffset, "header overlaps the rank lines");

struct alignas(64) ShmRankLine {
  std::atomic<uint64_t> counter[3];   // posted, reduced, consumed: the last round done
  // op, type and count of the collective of round seq, at [seq % 2]: a rank may post round seq + 1
  // while a peer still checks round seq, never round seq + 2 (that waits for the peer's consumed = seq)
  std::atomic<uint64_t> signature[2];
  std::atomic<int32_t> pid;
};

ShmChannel::ShmChannel(const std::string& name, int rank, int nranks, int64_t slot_bytes, uint64_t nonce,
                       std::vector<int> labels)
    : name_(name), rank_(rank), nranks_(nranks), labels_(std::move(labels)), slot_bytes_(slot_bytes) {
  NCCLAVG_CHECK_ARG(nranks >= 1 && nranks <= 65536, "nranks", "must be in [1, 65536], got ", nranks);
  NCCLAVG_CHECK_ARG(labels_.empty() || labels_.size() == static_cast<size_t>(nranks), "labels",
                    "must be empty or hold one entry per rank (", nranks, "), got ", labels_.size());
  if (labels_.empty()) {
    for (int r = 0; r < nranks; ++r) labels_.push_back(r);
  }
  NCCLAVG_CHECK_ARG(rank >= 0 && rank < nranks, "rank", "must be in [0, ", nranks, "), got ", rank);
  NCCLAVG_CHECK_ARG(slot_bytes >= 4096 && slot_bytes % 64 == 0, "slot_bytes",
                    "must be >= 4096 and a multiple of 64, got ", slot_bytes);
  NCCLAVG_CHECK_ARG(name.size() > 1 && name[0] == '/' && name.find('/', 1) == std::string::npos && name.size() < 200,
                    "name", "must look like /some-name (one leading slash, no other), got '", name, "'");
  const size_t lines_end = kLinesOffset + static_cast<size_t>(nranks) * sizeof(ShmRankLine);
  const size_t data_offset = (lines_end + 4095) / 4096 * 4096;
  map_bytes_ = data_offset + 2 * static_cast<size_t>(nranks) * static_cast<size_t>(slot_bytes);

  int fd;
  if (rank == 0) {
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) throw std::runtime_error("shm_open(" + name + ", create) failed: " + std::strerror(errno));
    // Reserve the pages now: a /dev/shm too small for the segment must fail here, not with SIGBUS later.
    int err = ftruncate(fd, static_cast<off_t>(map_bytes_)) != 0 ? errno : 0;
    if (err == 0) err = posix_fallocate(fd, 0, static_cast<off_t>(map_bytes_));
    if (err != 0) {
      close(fd);
      shm_unlink(name.c_str());
      throw std::runtime_error("cannot reserve " + std::to_string(map_bytes_) + " bytes of shared memory (" +
                               name + "): " + std::strerror(err) + " (is /dev/shm too small?)");
    }
  } else {
    fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) throw std::runtime_error("shm_open(" + name + ") failed: " + std::strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != map_bytes_) {
      close(fd);
      throw std::runtime_error("shared-memory segment " + name + " has an unexpected size");
    }
  }
  void* p = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    if (rank == 0) shm_unlink(name.c_str());
    throw std::runtime_error("mmap of " + name + " failed: " + std::strerror(map_err));
  }
  base_ = static_cast<unsigned char*>(p);
  header_ = reinterpret_cast<ShmHeader*>(base_);
  data_ = base_ + data_offset;
  if (rank == 0) {
    header_->nonce = nonce;
    header_->nranks = nranks;
    header_->slot_bytes = slot_bytes;
    header_->magic.store(kMagic, std::memory_order_release);
  } else if (header_->magic.load(std::memory_order_acquire) != kMagic || header_->nonce != nonce ||
             header_->nranks != nranks || header_->slot_bytes != slot_bytes) {
    munmap(base_, map_bytes_);
    base_ = nullptr;
    throw std::runtime_error("shared-memory segment " + name + " is not the one rank 0 created");
  }
  line(rank_).pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
}

ShmChannel::~ShmChannel() {
  if (base_ != nullptr) munmap(base_, map_bytes_);
  if (rank_ == 0 && !name_.empty()) shm_unlink(name_.c_str());
}

void ShmChannel::unlink_name() {
  if (rank_ == 0 && !name_.empty()) shm_unlink(name_.c_str());
  name_.clear();
}

ShmRankLine& ShmChannel::line(int r) const {
  return reinterpret_cast<ShmRankLine*>(base_ + kLinesOffset)[r];
}

unsigned char* ShmChannel::slot(uint64_t seq, int r) const {
  return data_ + (static_cast<size_t>(seq & 1) * nranks_ + r) * static_cast<size_t>(slot_bytes_);
}

void ShmChannel::check_usable(const char* op) const {
  const int by = header_->aborted_by.load(std::memory_order_acquire);
  if (by != 0) {
    const int who = by - 1 < nranks_ ? labels_[by - 1] : by - 1;
    throw ShmPeerError(std::string("shared-memory ") + op + ": the channel was aborted by rank " +
                       std::to_string(who) + ": " + header_->abort_reason);
  }
  if (failed_) throw ShmPeerError(std::string("shared-memory ") + op + ": the channel failed earlier");
}

void ShmChannel::abort(const std::string& why) {
  local_abort_.store(true, std::memory_order_release);
  int32_t expected = 0;
  if (header_->abort_claim.compare_exchange_strong(expected, rank_ + 1)) {
    std::strncpy(header_->abort_reason, why.c_str(), sizeof(header_->abort_reason) - 1);
    header_->aborted_by.store(rank_ + 1, std::memory_order_release);
  }
}

void ShmChannel::fail_all(const std::string& why, bool timeout) {
  failed_ = true;
  abort(why);
  if (timeout) throw TimeoutError(why);
  throw ShmPeerError(why);
}

void ShmChannel::publish(Counter c, uint64_t seq) {
  line(rank_).counter[c].store(seq, std::memory_order_release);
}

// Waits until rank `only_rank` (every other rank when -1) has published counter c >= target.
void ShmChannel::wait_for(Counter c, uint64_t target, int only_rank, const char* op, double timeout_s,
                          uint64_t seq) {
  Clock::time_point deadline = Clock::time_point::max();
  bool have_deadline = false;
  for (int r = 0; r < nranks_; ++r) {
    if (r == rank_ || (only_rank >= 0 && r != only_rank)) continue;
    std::atomic<uint64_t>& counter = line(r).counter[c];
    if (counter.load(std::memory_order_acquire) >= target) continue;
    if (!have_deadline) {   // the clock is read only when some peer is not there yet
      deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
      have_deadline = true;
    }
    Backoff backoff;
    Clock::time_point next_pid_check = backoff.start + std::chrono::milliseconds(100);
    while (counter.load(std::memory_order_acquire) < target) {
      if (local_abort_.load(std::memory_order_acquire) || header_->aborted_by.load(std::memory_order_acquire)) {
        failed_ = true;
        check_usable(op);
        throw ShmPeerError(std::string("shared-memory ") + op + ": aborted by this process");
      }
      backoff.pause();
      if (backoff.spins % 64 != 0) continue;
      const Clock::time_point now = Clock::now();
      const int pid = line(r).pid.load(std::memory_order_acquire);
      // the same words as the gloo path's diagnosis (ncclavg/comm/liveness.py): "rank N stopped responding"
      if (now >= deadline) {
        std::ostringstream os;
        os << "shared-memory " << op << " timed out after " << timeout_s << " s: rank " << labels_[r]
           << " stopped responding (pid " << pid << "): it did not " << counter_meaning(c) << " for round " << seq
           << " (this is rank " << labels_[rank_] << ", " << nranks_ << " processes on this channel)";
        fail_all(os.str(), true);
      }
      if (now >= next_pid_check) {
        next_pid_check = now + std::chrono::milliseconds(100);
        if (process_gone(pid)) {
          std::ostringstream os;
          os << "shared-memory " << op << ": rank " << labels_[r] << " stopped responding (pid " << pid
             << "): its process exited while rank " << labels_[rank_] << " waited for it to " << counter_meaning(c);
          fail_all(os.str(), false);
        }
      }
    }
  }
}

uint64_t ShmChannel::begin_round(const char* op, double timeout_s) {
  const uint64_t seq = ++seq_;
  if (seq > 2) wait_for(kConsumed, seq - 2, -1, op, timeout_s, seq);
  return seq;
}

namespace {
// The same collective on every rank, or a clear error that names both.
void check_signatures(ShmRankLine* lines, int nranks, int rank, uint64_t mine, int only_rank, uint64_t seq,
                      const std::vector<int>& labels) {
  for (int r = 0; r < nranks; ++r) {
    if (r == rank || (only_rank >= 0 && r != only_rank)) continue;
    const uint64_t theirs = lines[r].signature[seq & 1].load(std::memory_order_relaxed);
    if (theirs != mine) {
      std::ostringstream os;
      auto describe = [](uint64_t sig) {
        std::ostringstream d;
        d << op_name(int(sig >> 56)) << " of " << (sig & 0xffffffffffffull) << " "
          << type_name(static_cast<ShmType>((sig >> 48) & 0xff));
        return d.str();
      };
      os << "shared-memory collectives out of step: rank " << labels[rank] << " called " << describe(mine)
         << ", rank " << labels[r] << " called " << describe(theirs) << ": every rank must call the same collectives in the same order";
      throw ShmPeerError(os.str());
    }
  }
}
}  // namespace

// Steps 1-3 of a round in which every rank posts `bytes` from `data`: returns the round, every rank's
// chunk readable in its slot, every rank in the same collective.
uint64_t ShmChannel::post_round(const char* op, const unsigned char* data, int64_t bytes, uint64_t sig,
                                double timeout_s) {
  const uint64_t seq = begin_round(op, timeout_s);
  std::memcpy(slot(seq, rank_), data, static_cast<size_t>(bytes));
  line(rank_).signature[seq & 1].store(sig, std::memory_order_relaxed);
  publish(kPosted, seq);
  wait_for(kPosted, seq, -1, op, timeout_s, seq);
  check_same_collective(sig, -1, seq);
  return seq;
}

void ShmChannel::check_same_collective(uint64_t sig, int only_rank, uint64_t seq) {
  try {
    check_signatures(&line(0), nranks_, rank_, sig, only_rank, seq, labels_);
  } catch (const ShmPeerError& e) {
    fail_all(e.what(), false);
  }
}

void ShmChannel::all_reduce_sum(uintptr_t data, int64_t count, int type, double timeout_s) {
  const ShmType t = checked_type(type);
  check_span(data, count, "data");
  check_usable("all_reduce_sum");
  const int64_t es = static_cast<int64_t>(type_size(t));
  const int64_t chunk = slot_bytes_ / es;
  const uint64_t sig = signature(0, t, count);
  auto* base = reinterpret_cast<unsigned char*>(data);
  std::vector<const unsigned char*> srcs(nranks_);
  for (int64_t off = 0; off < count; off += chunk) {
    const int64_t n = std::min(chunk, count - off);
    unsigned char* out = base + off * es;
    const uint64_t seq = post_round("all_reduce_sum", out, n * es, sig, timeout_s);
    if (n * es <= kDirectBytes || nranks_ == 1) {
      for (int r = 0; r < nranks_; ++r) srcs[r] = slot(seq, r);
      sum_ranks(t, out, srcs.data(), nranks_, n);
    } else {
      // slice r of the chunk, 64-byte aligned, is summed by rank r into its own slot
      const int64_t per = ((n + nranks_ - 1) / nranks_ + 31) / 32 * 32;
      const int64_t lo = std::min(n, rank_ * per), hi = std::min(n, lo + per);
      for (int r = 0; r < nranks_; ++r) srcs[r] = slot(seq, r) + lo * es;
      if (hi > lo) sum_ranks(t, slot(seq, rank_) + lo * es, srcs.data(), nranks_, hi - lo);
      publish(kReduced, seq);
      wait_for(kReduced, seq, -1, "all_reduce_sum", timeout_s, seq);
      for (int r = 0; r < nranks_; ++r) {
        const int64_t rlo = std::min(n, r * per), rhi = std::min(n, rlo + per);
        if (rhi > rlo) std::memcpy(out + rlo * es, slot(seq, r) + rlo * es, static_cast<size_t>((rhi - rlo) * es));
      }
    }
    publish(kConsumed, seq);
  }
}

void ShmChannel::reduce_scatter_sum(uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s) {
  const ShmType t = checked_type(type);
  check_span(in, count, "in");
  check_span(out, count, "out");
  check_usable("reduce_scatter_sum");
  const int64_t es = static_cast<int64_t>(type_size(t));
  const int64_t chunk = slot_bytes_ / es;
  const int64_t total = count * nranks_;
  const int64_t mine_lo = rank_ * count, mine_hi = mine_lo + count;
  const uint64_t sig = signature(1, t, count);
  const auto* src = reinterpret_cast<const unsigned char*>(in);
  auto* dst = reinterpret_cast<unsigned char*>(out);
  std::vector<const unsigned char*> srcs(nranks_);
  for (int64_t off = 0; off < total; off += chunk) {
    const int64_t n = std::min(chunk, total - off);
    const uint64_t seq = post_round("reduce_scatter_sum", src + off * es, n * es, sig, timeout_s);
    const int64_t lo = std::max(off, mine_lo), hi = std::min(off + n, mine_hi);
    if (hi > lo) {
      for (int r = 0; r < nranks_; ++r) srcs[r] = slot(seq, r) + (lo - off) * es;
      sum_ranks(t, dst + (lo - mine_lo) * es, srcs.data(), nranks_, hi - lo);
    }
    publish(kConsumed, seq);
  }
}

void ShmChannel::all_gather(uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s) {
  const ShmType t = checked_type(type);
  check_span(in, count, "in");
  check_span(out, count, "out");
  check_usable("all_gather");
  const int64_t es = static_cast<int64_t>(type_size(t));
  const int64_t chunk = slot_bytes_ / es;
  const uint64_t sig = signature(2, t, count);
  const auto* src = reinterpret_cast<const unsigned char*>(in);
  auto* dst = reinterpret_cast<unsigned char*>(out);
  for (int64_t off = 0; off < count; off += chunk) {
    const int64_t n = std::min(chunk, count - off);
    const uint64_t seq = post_round("all_gather", src + off * es, n * es, sig, timeout_s);
    for (int r = 0; r < nranks_; ++r) {
      std::memcpy(dst + (r * count + off) * es, slot(seq, r), static_cast<size_t>(n * es));
    }
    publish(kConsumed, seq);
  }
}

void ShmChannel::broadcast(uintptr_t data, int64_t count, int type, int root, double timeout_s) {
  const ShmType t = checked_type(type);
  check_span(data, count, "data");
  NCCLAVG_CHECK_ARG(root >= 0 && root < nranks_, "root", "must be in [0, ", nranks_, "), got ", root);
  check_usable("broadcast");
  const int64_t es = static_cast<int64_t>(type_size(t));
  const int64_t chunk = slot_bytes_ / es;
  const uint64_t sig = signature(3, t, count);
  auto* base = reinterpret_cast<unsigned char*>(data);
  for (int64_t off = 0; off < count; off += chunk) {
    const int64_t n = std::min(chunk, count - off);
    const uint64_t seq = begin_round("broadcast", timeout_s);
    if (rank_ == root) {
      std::memcpy(slot(seq, rank_), base + off * es, static_cast<size_t>(n * es));
      line(rank_).signature[seq & 1].store(sig, std::memory_order_relaxed);
      publish(kPosted, seq);
    } else {
      wait_for(kPosted, seq, root, "broadcast", timeout_s, seq);
      check_same_collective(sig, root, seq);
      std::memcpy(base + off * es, slot(seq, root), static_cast<size_t>(n * es));
    }
    publish(kConsumed, seq);
  }
}

}  // namespace cpu
}  // namespace ncclavg
