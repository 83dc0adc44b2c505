// Shared pieces of the native SIMD harness (see harness_main.cpp): storage encoding, random inputs,
// the failure counter.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace harness {

using ncclavg::DType;

constexpr double kU32 = 1.0 / (1 << 24);  // float32's unit roundoff (half an ulp at 1)
constexpr DType kDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

// Unit roundoff of the storage type: 2^-p, p its significand bits.
inline double unit_roundoff(DType t) {
  return t == DType::kFloat32 ? kU32 : t == DType::kFloat16 ? 1.0 / (1 << 11) : 1.0 / (1 << 8);
}
// Spacing of the storage type's subnormals: the absolute error floor of a rounding.
inline double subnormal_step(DType t) {
  return t == DType::kFloat32 ? std::ldexp(1.0, -149) : t == DType::kFloat16 ? std::ldexp(1.0, -24)
                                                                              : std::ldexp(1.0, -133);
}
// The largest finite value of the storage type.
inline double max_finite(DType t) {
  return t == DType::kFloat32 ? 3.4028234663852886e38 : t == DType::kFloat16 ? 65504.0 : 3.3895313892515355e38;
}

// Decoding of one stored element, written from the formats' definitions (not with the kernels' code).
inline double decode(DType t, const void* p, int64_t i) {
  if (t == DType::kFloat32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  if (t == DType::kBFloat16) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const int sign = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v;
  if (e == 0x1f) v = m ? NAN : INFINITY;
  else if (e == 0) v = std::ldexp(m, -24);
  else v = std::ldexp(1024 + m, e - 25);
  return sign ? -v : v;
}

// Whether the stored element is an inf or a NaN (all exponent bits set).
inline bool stored_nonfinite(DType t, const void* p, int64_t i) {
  if (t == DType::kFloat32) {
    uint32_t u;
    std::memcpy(&u, static_cast<const float*>(p) + i, 4);
    return (u & 0x7f800000u) == 0x7f800000u;
  }
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return t == DType::kBFloat16 ? (h & 0x7f80u) == 0x7f80u : (h & 0x7c00u) == 0x7c00u;
}

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }
};

// A buffer of n elements of one storage type, as raw bytes.
struct Buf {
  DType t;
  std::vector<unsigned char> bytes;
  Buf(DType dt, int64_t n) : t(dt), bytes(static_cast<size_t>(n) * ncclavg::dtype_size(dt) + 64, 0) {}
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  double at(int64_t i) const { return decode(t, data(), i); }
};

// Random finite elements: random significand bits, sign, and a binary exponent in [lo, hi] (|x| in
// [2^lo, 2^(hi+1))), every 16th a zero; raw patterns so that every input is exactly representable.
inline void fill(Buf& b, int64_t n, Rng& r, int lo, int hi) {
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t x = r.next();
    const int e = lo + static_cast<int>((x >> 40) % static_cast<uint64_t>(hi - lo + 1));
    const bool zero = (x & 0xf) == 0;
    const uint32_t sign = (x >> 4) & 1;
    if (b.t == DType::kFloat32) {
      uint32_t u = zero ? 0 : (static_cast<uint32_t>(e + 127) << 23) | static_cast<uint32_t>((x >> 8) & 0x7fffff);
      u |= sign << 31;
      std::memcpy(static_cast<float*>(b.data()) + i, &u, 4);
    } else if (b.t == DType::kBFloat16) {
      uint16_t h = zero ? 0 : static_cast<uint16_t>(((e + 127) << 7) | ((x >> 8) & 0x7f));
      static_cast<uint16_t*>(b.data())[i] = static_cast<uint16_t>(h | (sign << 15));
    } else {
      uint16_t h = zero ? 0 : static_cast<uint16_t>(((e + 15) << 10) | ((x >> 8) & 0x3ff));
      static_cast<uint16_t*>(b.data())[i] = static_cast<uint16_t>(h | (sign << 15));
    }
  }
}

// Stores +inf, -inf or a quiet NaN pattern at element i. Quiet: a signalling NaN's bits are not the same
// at every level (on x86 as on aarch64: the scalar level's compiler drops a float16 round trip and
// copies the pattern, the SIMD conversions quiet it), and no kernel promises more than "a NaN".
inline void plant(Buf& b, int64_t i, int kind) {
  if (b.t == DType::kFloat32) {
    const uint32_t u = kind == 0 ? 0x7f800000u : kind == 1 ? 0xff800000u : 0x7fc00001u;
    std::memcpy(static_cast<float*>(b.data()) + i, &u, 4);
  } else {
    const bool bf = b.t == DType::kBFloat16;
    const uint16_t inf = bf ? 0x7f80u : 0x7c00u;
    static_cast<uint16_t*>(b.data())[i] =
        static_cast<uint16_t>(kind == 0 ? inf : kind == 1 ? (inf | 0x8000u) : (inf | (bf ? 0x41u : 0x201u)));
  }
}

// The failure counter: every check counts, the first few failures are printed.
struct Tally {
  int64_t checks = 0, failures = 0, cases = 0;
};
Tally& tally();

template <class... A>
void check(bool ok, const char* fmt, A... args) {
  ++tally().checks;
  if (ok) return;
  if (++tally().failures <= 20) {
    std::printf("FAIL: ");
    std::printf(fmt, args...);
    std::printf("\n");
  }
}

// Sizes that hit every tail: 0, 1, around every vector width (4 NEON, 4-16 SVE128-512, 8 AVX2,
// 16 AVX-512 and the 16-element optimizer blocks), and odd large ones.
inline std::vector<int64_t> sizes(bool quick) {
  std::vector<int64_t> s{0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 127, 1021};
  if (!quick) s.insert(s.end(), {129, 255, 257, 1025, 4099});
  return s;
}

void check_average_and_sum(bool quick);
void check_pack(bool quick);
void check_optim(bool quick);

}  // namespace harness
