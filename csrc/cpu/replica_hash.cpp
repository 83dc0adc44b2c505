#include "replica_hash.h"

#include <atomic>
#include <cstring>

#include "../common/check.h"
#include "parallel.h"

namespace ncclavg {
namespace cpu {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Words [b, e) of `words`: their terms' sum (Note [Replica digest]).
uint64_t sum_terms(const unsigned char* bytes, int64_t b, int64_t e) {
  uint64_t s = 0;
  for (int64_t i = b; i < e; ++i) {
    uint64_t w;
    std::memcpy(&w, bytes + 8 * i, 8);   // any alignment: a parameter's storage may start anywhere
    s += splitmix64(w + static_cast<uint64_t>(i + 1) * kGolden);
  }
  return s;
}

}  // namespace

uint64_t digest_bytes(const void* data, int64_t nbytes) {
  NCCLAVG_CHECK_ARG(nbytes >= 0, "nbytes", "must be >= 0, got ", nbytes);
  const auto* bytes = static_cast<const unsigned char*>(data);
  const int64_t whole = nbytes / 8;
  std::atomic<uint64_t> total{0};
  parallel_for_range(whole, [&](int64_t b, int64_t e) { total.fetch_add(sum_terms(bytes, b, e)); });
  uint64_t s = total.load();
  if (const int64_t rest = nbytes - whole * 8) {
    uint64_t w = 0;
    std::memcpy(&w, bytes + whole * 8, static_cast<size_t>(rest));
    s += splitmix64(w + static_cast<uint64_t>(whole + 1) * kGolden);
  }
  return splitmix64(s ^ splitmix64(static_cast<uint64_t>(nbytes)));
}

std::vector<uint64_t> digest_spans(const std::vector<std::pair<uintptr_t, int64_t>>& spans) {
  std::vector<uint64_t> out;
  out.reserve(spans.size() + 1);
  uint64_t all = splitmix64(static_cast<uint64_t>(spans.size()));
  for (size_t i = 0; i < spans.size(); ++i) {
    const auto [addr, nbytes] = spans[i];
    NCCLAVG_CHECK_ARG(nbytes >= 0 && (addr != 0 || nbytes == 0), "spans", "spans[", i, "] is (", addr, ", ",
                      nbytes, "): expected a host address and a byte count >= 0");
    const uint64_t d = digest_bytes(reinterpret_cast<const void*>(addr), nbytes);
    out.push_back(d);
    all = splitmix64(all ^ d) + kGolden;   // in order: a sequential mix, not a sum
  }
  out.push_back(all);
  return out;
}

}  // namespace cpu
}  // namespace ncclavg
