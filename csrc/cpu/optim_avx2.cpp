// AVX2 + FMA + F16C instance of the optimizer kernels. See Note [Run-time ISA dispatch] and
// Note [Internal linkage in ISA translation units]: standard headers come before the target pragma.
#include <immintrin.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "simd.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "vec_avx2.h"
#include "optim_kernels.h"
#include "optim_impl.h"
#include "optim_x86.h"

namespace ncclavg {
namespace cpu {
namespace {
// See WideOps in optim_impl.h: float lane <-> two __m256d (round to nearest even on narrowing). The
// pair holds a plain vector type: __m256d carries may_alias, which a template argument would drop.
typedef double f64x4 __attribute__((vector_size(32)));
template <>
struct WideOps<Avx2Lane> {
  using T = WidePair<f64x4>;
  static void widen(__m256 v, T& out) {
    out.lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    out.hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  }
  static __m256 narrow(const T& w) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(w.lo)), _mm256_cvtpd_ps(w.hi), 1);
  }
};

// 16 raw 16-bit lanes -> two float vectors (elements 0-7, 8-15).
template <>
struct RawCvt<Avx2Lane> {
  static NCCLAVG_OPT_INLINE void to_f32(BF16, __m256i raw, __m256 (&x)[2]) {
    // unpack works within 128-bit halves: order the 64-bit quarters 0, 2 | 1, 3 first, then zeros
    // interleaved below each pattern give the floats (bits << 16) of elements 0-7 and 8-15.
    const __m256i q = _mm256_permute4x64_epi64(raw, 0xD8);
    x[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), q));
    x[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), q));
  }
  static NCCLAVG_OPT_INLINE void to_f32(F16, __m256i raw, __m256 (&x)[2]) {
    x[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(raw));
    x[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(raw, 1));
  }
};

template <>
struct RawOps<Avx2Lane> {
  static constexpr bool kFast = true;
  template <class T>
  static NCCLAVG_OPT_INLINE bool mean16(T, const void* const* towers, int n, int64_t i, const MeanPlan& mp,
                                        __m256 (&out)[2]) {
    return mean16_x86<Avx2Lane, T>(towers, n, i, mp, out);
  }
};

// Two vectors of bfloat16 copy-out in one store: one pack and one permute per 16 elements instead of
// per 8, and one NaN test per 16 elements: NaN params are rare, and only they need the quiet-NaN
// blend. The rounding is Avx2Lane::store_bf16's (ew::float_to_bf16_bits).
NCCLAVG_OPT_INLINE __m256i bf16_round_avx2(__m256 v) {  // round to nearest even, NaN aside
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
}

NCCLAVG_OPT_INLINE __m256i bf16_bits_avx2(__m256 v) {
  const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(v), 16), _mm256_set1_epi32(0x40));
  const __m256 isnan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(bf16_round_avx2(v)), _mm256_castsi256_ps(qnan), isnan));
}

template <>
struct BlockStore<Avx2Lane> {
  template <class O>
  static NCCLAVG_OPT_INLINE void out(const OutSlice& o, int64_t i, const __m256 (&p)[2]) {
    if constexpr (std::is_same_v<O, BF16>) {
      const __m256 any_nan = _mm256_cmp_ps(p[0], p[1], _CMP_UNORD_Q);
      __m256i r0, r1;
      if (__builtin_expect(_mm256_testz_ps(any_nan, any_nan), 1)) {
        r0 = bf16_round_avx2(p[0]);
        r1 = bf16_round_avx2(p[1]);
      } else {
        r0 = bf16_bits_avx2(p[0]);
        r1 = bf16_bits_avx2(p[1]);
      }
      // Values < 2^16: the saturating pack is exact; it interleaves 128-bit halves, the permute undoes it.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(o.out) + i), packed);
    } else {
      store_out<Avx2Lane, O>(o, i, p[0]);
      store_out<Avx2Lane, O>(o, i + 8, p[1]);
    }
  }
};
}  // namespace
}  // namespace cpu
}  // namespace ncclavg
#pragma GCC pop_options

namespace ncclavg {
namespace cpu {
constexpr OptimKernelTable kAvx2OptimKernels = NCCLAVG_OPTIM_KERNEL_TABLE(Avx2Lane, SimdLevel::kAvx2);
}  // namespace cpu
}  // namespace ncclavg
