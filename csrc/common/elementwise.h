// Element math shared by the CPU kernels (scalar and SIMD lanes) and the CUDA kernels, so that the CPU
// tests exercise the same arithmetic the GPU runs. Every function is a template over the lane type:
// `float` on the GPU and in the scalar CPU path, a GCC vector type (__m256, __m512) in the SIMD paths.
// The functions only use + - * / and helpers passed in by the caller, which all lane types support.
//
// See Note [Internal linkage in ISA translation units]: everything here is `static` so that each CPU
// translation unit compiled for a different ISA keeps its own copy.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define NCCLAVG_HD __host__ __device__ __forceinline__
#else
#define NCCLAVG_HD static inline __attribute__((always_inline))
#endif

namespace ncclavg {
namespace ew {

// Mean of an fp32 accumulator over n contributions. Division, not multiplication by 1/n: it is
// correctly rounded for every n, so the fp32 mean carries one rounding less (matters for n = 3, 5, 6, 7).
template <typename F>
NCCLAVG_HD F mean_of_sum(F sum, float n) {
  return sum / n;
}

// bfloat16 <-> float32 on raw bits, round to nearest even; NaN stays a quiet NaN with its sign.
// Used by the scalar CPU path; SIMD paths do the same on vector lanes.
NCCLAVG_HD float bf16_bits_to_float(uint16_t h) {
  union { uint32_t u; float f; } v;
  v.u = static_cast<uint32_t>(h) << 16;
  return v.f;
}

NCCLAVG_HD uint16_t float_to_bf16_bits(float f) {
  union { uint32_t u; float f; } v;
  v.f = f;
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((v.u >> 16) | 0x0040u);
  const uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);
  return static_cast<uint16_t>((v.u + rounding) >> 16);
}

}  // namespace ew
}  // namespace ncclavg
