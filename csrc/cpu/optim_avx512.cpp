// AVX-512 (F, BW, VL, DQ) instance of the optimizer kernels. See Note [Run-time ISA dispatch] and
// Note [Internal linkage in ISA translation units]: standard headers come before the target pragma.
#include <immintrin.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "simd.h"

#pragma GCC push_options
// GCC 12 flags the deliberately undefined pass-through operand inside its own AVX-512 intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include "vec_avx512.h"
#include "optim_kernels.h"
#include "optim_impl.h"
#include "optim_x86.h"

namespace ncclavg {
namespace cpu {
namespace {
// See WideOps in optim_impl.h: float lane <-> two __m512d (round to nearest even on narrowing). The
// pair holds a plain vector type: __m512d carries may_alias, which a template argument would drop.
typedef double f64x8 __attribute__((vector_size(64)));
template <>
struct WideOps<Avx512Lane> {
  using T = WidePair<f64x8>;
  static void widen(__m512 v, T& out) {
    out.lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    out.hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  static __m512 narrow(const T& w) {
    const __m256 lo = _mm512_cvtpd_ps(w.lo), hi = _mm512_cvtpd_ps(w.hi);
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
  }
};

// 16 raw 16-bit lanes -> one float vector.
template <>
struct RawCvt<Avx512Lane> {
  static NCCLAVG_OPT_INLINE void to_f32(BF16, __m256i raw, __m512 (&x)[1]) {
    x[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static NCCLAVG_OPT_INLINE void to_f32(F16, __m256i raw, __m512 (&x)[1]) { x[0] = _mm512_cvtph_ps(raw); }
};

template <>
struct RawOps<Avx512Lane> {
  static constexpr bool kFast = true;
  template <class T>
  static NCCLAVG_OPT_INLINE bool mean16(T, const void* const* towers, int n, int64_t i, const MeanPlan& mp,
                                        __m512 (&out)[1]) {
    return mean16_x86<Avx512Lane, T>(towers, n, i, mp, out);
  }
};
}  // namespace
}  // namespace cpu
}  // namespace ncclavg
#pragma GCC pop_options

namespace ncclavg {
namespace cpu {
constexpr OptimKernelTable kAvx512OptimKernels = NCCLAVG_OPTIM_KERNEL_TABLE(Avx512Lane, SimdLevel::kAvx512);
}  // namespace cpu
}  // namespace ncclavg
