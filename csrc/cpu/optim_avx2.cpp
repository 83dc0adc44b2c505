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
}  // namespace
}  // namespace cpu
}  // namespace ncclavg
#pragma GCC pop_options

namespace ncclavg {
namespace cpu {
constexpr OptimKernelTable kAvx2OptimKernels = NCCLAVG_OPTIM_KERNEL_TABLE(Avx2Lane, SimdLevel::kAvx2);
}  // namespace cpu
}  // namespace ncclavg
