// Guarded buffers, input values and the comparison of the emulated-kernel harness.
#include <sanitizer/asan_interface.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <random>

#include "harness.h"

namespace emu_harness {

// See Note [Guarded buffers] in harness.h.
Guarded::Guarded(size_t bytes, size_t misalign) : bytes_(bytes) {
  constexpr size_t kFront = 256, kBack = 64;
  total_ = (kFront + misalign + bytes + kBack + 255) / 256 * 256;
  raw_ = static_cast<uint8_t*>(std::aligned_alloc(256, total_));
  if (raw_ == nullptr) std::abort();
  p_ = raw_ + kFront + misalign;
  std::memset(raw_, 0xa5, total_);
  ASAN_POISON_MEMORY_REGION(raw_, kFront + misalign);
  ASAN_POISON_MEMORY_REGION(p_ + bytes_, total_ - kFront - misalign - bytes_);
}

Guarded::~Guarded() {
  ASAN_UNPOISON_MEMORY_REGION(raw_, total_);
  std::free(raw_);
}

Guarded& Arena::add(size_t bytes, size_t misalign) {
  bufs.push_back(std::make_unique<Guarded>(bytes, misalign));
  return *bufs.back();
}

namespace {

// Note [Edge values]
// The cases where a conversion or a division can go wrong, as raw bits of each storage type: signed
// zeros, infinities, quiet and signalling NaNs with payloads and both signs, the smallest and largest
// subnormals and normals, fp16's overflow edge (65504 stays, 65519.99 rounds to 65504, 65520 rounds to
// inf), fp16 and bf16 rounding ties (exactly halfway, to an even and to an odd neighbour) and the
// fp16 underflow tie (2^-25 rounds to +0). Random values with such tie bits are added on top.
constexpr uint32_t kF32Edges[] = {
    0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7fc12345, 0xffd00001,
    0x7f800001, 0xff812345, 0x7fbfffff, 0x00000001, 0x807fffff, 0x00800000, 0x80800000, 0x7f7fffff,
    0xff7fffff, 0x477fe000, 0x477fefff, 0x477ff000, 0xc77ff000, 0x47800000, 0x33000000, 0x33000001,
    0xb3000000, 0x33800000, 0x38800000, 0x387fc000, 0x387fe000, 0x3f808000, 0x3f818000, 0xbf808000,
    0x7f7f8000, 0x7f7f7fff, 0x00008000, 0x00018000, 0x3f801000, 0x3f803000, 0x3f800001, 0x3f7fffff};
constexpr uint16_t kF16Edges[] = {0x0000, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0xfe00, 0x7d01, 0x7e55, 0xfd55,
                                  0x0001, 0x8001, 0x03ff, 0x83ff, 0x0400, 0x7bff, 0xfbff, 0x3c00, 0x3c01};
constexpr uint16_t kBF16Edges[] = {0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0xffc0, 0x7f81, 0xffc1, 0x7fd5,
                                   0x0001, 0x807f, 0x0080, 0x7f7f, 0xff7f, 0x3f80, 0x3f81, 0x0000, 0x8001};

uint32_t f32_value(std::mt19937_64& rng, double special_rate) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  if (u(rng) < special_rate) {
    switch (rng() % 4) {
      case 0: return static_cast<uint32_t>(rng());                                   // any bits
      case 1: return (static_cast<uint32_t>(rng()) & 0xffff0000u) | 0x8000u;       // bf16 tie
      case 2: return (static_cast<uint32_t>(rng()) & 0xc7ffe000u) | 0x38001000u;   // fp16 tie, in range
      default: return kF32Edges[rng() % std::size(kF32Edges)];
    }
  }
  // Sign, 23 random mantissa bits, exponent 2^-30 .. 2^20: most values fit fp16, some overflow it.
  const uint32_t exp = 127 - 30 + static_cast<uint32_t>(rng() % 51);
  return (static_cast<uint32_t>(rng() & 1) << 31) | (exp << 23) | (static_cast<uint32_t>(rng()) & 0x7fffffu);
}

uint16_t half_value(std::mt19937_64& rng, double special_rate, bool bf16) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  if (u(rng) < special_rate) {
    if (rng() % 2) return static_cast<uint16_t>(rng());
    return bf16 ? kBF16Edges[rng() % std::size(kBF16Edges)] : kF16Edges[rng() % std::size(kF16Edges)];
  }
  const uint16_t sign = static_cast<uint16_t>((rng() & 1) << 15);
  if (bf16) return sign | static_cast<uint16_t>((127 - 30 + rng() % 51) << 7) | (rng() & 0x7f);
  return sign | static_cast<uint16_t>((1 + rng() % 30) << 10) | (rng() & 0x3ff);
}

bool is_nan(DType dt, const uint8_t* p, int64_t i) {
  if (dt == DType::kFloat32) {
    uint32_t u;
    std::memcpy(&u, p + 4 * i, 4);
    return (u & 0x7fffffffu) > 0x7f800000u;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return (h & 0x7fffu) > (dt == DType::kFloat16 ? 0x7c00u : 0x7f80u);
}

}  // namespace

void fill(DType dt, void* p, int64_t n, uint64_t seed, double special_rate) {
  std::mt19937_64 rng(seed * 0x2545f4914f6cdd1dull + 1);
  for (int64_t i = 0; i < n; ++i) {
    if (dt == DType::kFloat32) {
      const uint32_t v = f32_value(rng, special_rate);
      std::memcpy(static_cast<uint8_t*>(p) + 4 * i, &v, 4);
    } else {
      const uint16_t v = half_value(rng, special_rate, dt == DType::kBFloat16);
      std::memcpy(static_cast<uint8_t*>(p) + 2 * i, &v, 2);
    }
  }
}

void fill_exact(DType dt, void* p, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + 7);
  for (int64_t i = 0; i < n; ++i) {
    // An integer in [-64, 64] times 2^k: exact in bf16 (8 significant bits) and in sums of a few.
    const float v = std::ldexp(static_cast<float>(static_cast<int>(rng() % 129) - 64), static_cast<int>(rng() % 9) - 4);
    if (dt == DType::kFloat32) {
      std::memcpy(static_cast<uint8_t*>(p) + 4 * i, &v, 4);
    } else {
      uint32_t u;
      std::memcpy(&u, &v, 4);
      uint16_t h;
      if (dt == DType::kBFloat16) {
        h = static_cast<uint16_t>(u >> 16);  // exact: 7 mantissa bits suffice
      } else {
        const _Float16 f = static_cast<_Float16>(v);
        std::memcpy(&h, &f, 2);
      }
      std::memcpy(static_cast<uint8_t*>(p) + 2 * i, &h, 2);
    }
  }
}

void Tally::fail(const std::string& what) {
  ++failures;
  if (messages.size() < 12) messages.push_back(what);
}

std::string describe_elem(DType dt, const void* p, int64_t i) {
  char buf[64];
  if (dt == DType::kFloat32) {
    uint32_t u;
    float f;
    std::memcpy(&u, static_cast<const uint8_t*>(p) + 4 * i, 4);
    std::memcpy(&f, &u, 4);
    std::snprintf(buf, sizeof buf, "0x%08x (%.9g)", u, static_cast<double>(f));
  } else {
    uint16_t h;
    std::memcpy(&h, static_cast<const uint8_t*>(p) + 2 * i, 2);
    std::snprintf(buf, sizeof buf, "0x%04x", h);
  }
  return buf;
}

// Note [NaN payloads]
// A NaN that goes through the CUDA headers' fp16 conversions (either way) or into bf16 comes out as the
// canonical NaN (0x7fff, 0x7fffffff) on their host paths, and fp32 arithmetic on a NaN gives the
// canonical NaN on the GPU; the CPU kernels keep the sign and the top of the payload. Which NaN is
// unspecified by IEEE 754 and nothing in the project reads payloads, so two NaNs count as equal here,
// and the harness reports how many had different bits. Everything else, signed zeros included, must
// match bit for bit.
int64_t compare(DType dt, const void* got, const void* want, int64_t n, Tally& tally, int64_t* nan_diffs) {
  const size_t es = ncclavg::dtype_size(dt);
  const auto* g = static_cast<const uint8_t*>(got);
  const auto* w = static_cast<const uint8_t*>(want);
  tally.elements += n;
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(g + es * i, w + es * i, es) == 0) continue;
    if (is_nan(dt, g, i) && is_nan(dt, w, i)) {
      ++*nan_diffs;
      continue;
    }
    return i;
  }
  return -1;
}

bool same_bytes(const void* a, const void* b, size_t n) { return n == 0 || std::memcmp(a, b, n) == 0; }

}  // namespace emu_harness
