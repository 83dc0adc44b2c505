// The float32 tower mean of Note [Float32 tower mean when it is exact] (optim_mean.h) for the x86 SIMD
// levels. Included by optim_avx2.cpp and optim_avx512.cpp after their target pragma and optim_impl.h;
// both run the check on 16 lanes of 16-bit patterns in one 256-bit register (AVX2 integer instructions,
// also part of the AVX-512 target). Each TU supplies RawCvt<L>::to_f32 (16 raw lanes -> K float vectors)
// and the RawOps<L> specialisation that forwards to mean16_x86.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "optim_mean.h"

namespace ncclavg {
namespace cpu {
namespace {

template <class L>
struct RawCvt;

NCCLAVG_OPT_INLINE __m256i load_raw16(const void* tower, int64_t i) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(tower) + i));
}

// Exponent range of 16 lanes over the towers: the largest magnitude, and the smallest magnitude minus
// one (zeros wrap to 0xffff and drop out). See Note [Float32 tower mean when it is exact].
// (No default member initialisers: GCC compiles the implicit constructor without the TU's target.)
struct Range16 {
  __m256i mx, mn;

  NCCLAVG_OPT_INLINE void init() {
    mx = _mm256_setzero_si256();
    mn = _mm256_set1_epi16(-1);
  }

  NCCLAVG_OPT_INLINE void add(__m256i raw) {
    const __m256i a = _mm256_and_si256(raw, _mm256_set1_epi16(0x7fff));
    mx = _mm256_max_epu16(mx, a);
    mn = _mm256_min_epu16(mn, _mm256_add_epi16(a, _mm256_set1_epi16(-1)));
  }

  // Every lane within the plan's limits (lanes of zeros pass: their min field reads 0xffff >> shift).
  template <class T>
  NCCLAVG_OPT_INLINE bool ok(const MeanPlan& mp) const {
    constexpr int kShift = std::is_same_v<T, BF16> ? 7 : 10;
    const __m256i hi = _mm256_srli_epi16(mx, kShift);
    const __m256i lo = _mm256_srli_epi16(mn, kShift);
    // Saturating differences are nonzero exactly where a limit is exceeded.
    __m256i bad = _mm256_subs_epu16(_mm256_subs_epu16(hi, lo), _mm256_set1_epi16(static_cast<short>(mp.max_spread)));
    bad = _mm256_or_si256(bad, _mm256_subs_epu16(hi, _mm256_set1_epi16(static_cast<short>(mp.max_exp))));
    if constexpr (std::is_same_v<T, BF16>) {
      bad = _mm256_or_si256(bad, _mm256_subs_epu16(_mm256_set1_epi16(static_cast<short>(mp.min_exp)), lo));
    }
    return _mm256_testz_si256(bad, bad);
  }
};

// The mean of 16 elements at i over n >= 2 towers of 16-bit storage T in float32; false (and `out`
// unspecified) when the block fails the exactness check and must take the float64 path.
template <class L, class T>
NCCLAVG_OPT_INLINE bool mean16_x86(const void* const* towers, int n, int64_t i, const MeanPlan& mp,
                                   typename L::V (&out)[kBlock / L::W]) {
  constexpr int K = kBlock / L::W;
  Range16 range;
  range.init();
  __m256i raw = load_raw16(towers[0], i);
  range.add(raw);
  RawCvt<L>::to_f32(T{}, raw, out);
  for (int k = 1; k < n; ++k) {
    raw = load_raw16(towers[k], i);
    range.add(raw);
    typename L::V x[K];
    RawCvt<L>::to_f32(T{}, raw, x);
    for (int q = 0; q < K; ++q) out[q] = out[q] + x[q];  // exact when the check passes: any order
  }
  if (!range.template ok<T>(mp)) return false;
  for (int q = 0; q < K; ++q) out[q] = mp.pow2 ? out[q] * mp.inv_f : out[q] / mp.n_f;
  return true;
}

}  // namespace
}  // namespace cpu
}  // namespace ncclavg
