// What shm_channel.cpp (setup, waiting, rounds) and shm_collectives.cpp (the collectives) share.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstring>

#include "../common/check.h"
#include "shm_channel.h"

namespace ncclavg {
namespace cpu {
namespace shm_detail {

using Clock = std::chrono::steady_clock;
enum Op : int { kAllReduce = 0, kReduceScatter = 1, kAllGather = 2, kBroadcast = 3, kBarrier = 4 };

inline size_t type_size(ShmType t) {
  switch (t) {
    case ShmType::kFloat32: return 4;
    case ShmType::kFloat16:
    case ShmType::kBFloat16: return 2;
    case ShmType::kFloat64: return 8;
  }
  return 0;
}

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

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// 24 bits that tell two scales (mul, div) of a call apart (a signature has room for no more).
inline uint64_t scale_hash(double mul, double div) {
  const uint64_t h = (uint64_t{float_bits(static_cast<float>(mul))} * 0x9E3779B97F4A7C15ull) ^
                     float_bits(static_cast<float>(div));
  return (h * 0xC2B2AE3D27D4EB4Full) >> 40;
}

}  // namespace shm_detail

// One collective call: its name, element type, size, scale, time limit and signature.
struct ShmChannel::Call {
  const char* op;
  ShmType type;
  int64_t count;
  double mul, div;
  double timeout_s;
  shm_detail::Clock::time_point deadline;
  uint64_t sig[2];   // op | type << 8 | (root + 1) << 16 | scale_hash << 40, count
};

}  // namespace cpu
}  // namespace ncclavg
