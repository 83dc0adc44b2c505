// What shm_channel.cpp (setup, waiting, rounds) and shm_collectives.cpp (the collectives) share.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstring>

#include "../common/check.h"
#include "shm_calls.h"
#include "shm_channel.h"

namespace ncclavg {
namespace cpu {
namespace shm_detail {

using Clock = std::chrono::steady_clock;
enum Op : int { kAllReduce = 0, kReduceScatter = 1, kAllGather = 2, kBroadcast = 3, kBarrier = 4 };

inline const char* type_name(int t) {
  static const char* names[] = {"float32", "float16", "bfloat16", "float64"};
  return t >= 0 && t < 4 ? names[t] : "unknown";
}

inline const char* op_name(int op) {
  static const char* names[] = {"all_reduce_sum", "reduce_scatter_sum", "all_gather", "broadcast", "barrier"};
  return op >= 0 && op < 5 ? names[op] : "unknown";
}

inline ShmType checked_type(int code) {
  NCCLAVG_CHECK_TYPE(code >= 0 && code <= 3, "type", "unknown element type code ", code,
                     " (0 float32, 1 float16, 2 bfloat16, 3 float64)");
  return static_cast<ShmType>(code);
}

// memcpy of `n` bytes that is also defined for n == 0 with a null pointer (an empty tensor's data; a
// count-0 call still runs a round, to check the signatures: Note [Shared-memory channel] in shm_channel.cpp).
inline void copy_bytes(void* dst, const void* src, int64_t n) {
  if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n));
}

inline void check_span(uintptr_t ptr, int64_t count, const char* argname) {
  NCCLAVG_CHECK_ARG(count >= 0, "count", "must be >= 0, got ", count);
  NCCLAVG_CHECK_ARG(count == 0 || ptr != 0, argname, "is null but count is ", count);
}

inline uint64_t double_bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof(u));
  return u;
}

// splitmix64's finalizer: every input bit moves every output bit.
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The count word of a round's signature: the wire count, XOR what else must agree but has no room of its
// own (the user's count and the scale). See Note [Call signatures] in shm_calls.cpp.
inline uint64_t count_word(int64_t count, int64_t user_count, double mul, double div) {
  const uint64_t folded = mix64(mix64(mix64(static_cast<uint64_t>(user_count)) ^ double_bits(mul)) ^ double_bits(div));
  return static_cast<uint64_t>(count) ^ folded;
}

// The fields of a round's first signature word: wire op | wire type << 4 | (root + 1) << 8 | the user's
// collective << 28 | dtype << 36 | op << 44. The root is the wire root for a broadcast (channel rank),
// else the user's (group rank), see Note [Call signatures].
constexpr int kSigRootShift = 8, kSigCollectiveShift = 28;
inline int sig_op(uint64_t w) { return static_cast<int>(w & 0xf); }
inline int sig_type(uint64_t w) { return static_cast<int>((w >> 4) & 0xf); }
inline int sig_root(uint64_t w) { return static_cast<int>((w >> kSigRootShift) & ShmCallTag::kRootMask) - 1; }
inline uint64_t sig_user_fields(uint64_t w) { return w >> kSigCollectiveShift; }   // collective | dtype | op

// out (and out2 unless null) = (srcs[0] + ... + srcs[nsrc-1]) * mul / div over n elements, in that order,
// fp32 accumulation (fp64 for float64); out may be one of srcs. bad != nullptr: *bad |= whether a written
// value is an inf/NaN. The channel's sums and the lanes' between hosts (host_lanes_collectives.cpp).
void sum_into(ShmType t, unsigned char* out, unsigned char* out2, const unsigned char* const* srcs, int nsrc,
              int64_t n, double mul, double div, bool* bad);

}  // namespace shm_detail

// One collective call: its name, element type, size, scale, the user's call, time limit and signature.
struct ShmChannel::Call {
  const char* op;
  ShmType type;
  int64_t count;
  double mul, div;
  ShmCallTag tag;
  double timeout_s;
  shm_detail::Clock::time_point deadline;
  uint64_t sig[2];   // see sig_op and count_word in shm_detail
  shm_detail::Clock::time_point arrived{};   // when the call began here (Note [Arrival times])
  uint64_t first_seq = 0;                    // its first round, once posted
};

}  // namespace cpu
}  // namespace ncclavg
