// Lane type of the AVX2 path: 8 floats. Only included by kernels_avx2.cpp, under its target pragma.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace ncclavg {
namespace cpu {
namespace {

struct Avx2Lane {
  using V = __m256;
  static constexpr int W = 8;
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V sqrt(V x) { return _mm256_sqrt_ps(x); }
  static V load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static void store_f32(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V load_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static void store_bf16(uint16_t* p, V v) {
    // Round to nearest even on the bits, NaN -> quiet NaN: the same rule as ew::float_to_bf16_bits.
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256 isnan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(qnan), isnan));
    // Values are < 2^16, so the signed->unsigned saturating pack is exact; packus works per 128-bit
    // half, the permute puts the two halves' results next to each other.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static V load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_f16(uint16_t* p, V v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // See ScalarLane::M: all-ones lanes where !(|v| < limit) (an unordered compare: NaN is marked).
  using M = __m256;
  static M no_flags() { return _mm256_setzero_ps(); }
  static M nonfinite(V v, float limit) {
    return _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v), _mm256_set1_ps(limit), _CMP_NLT_UQ);
  }
  static M either(M a, M b) { return _mm256_or_ps(a, b); }
  static bool any(M m) { return _mm256_movemask_ps(m) != 0; }
};

}  // namespace
}  // namespace cpu
}  // namespace ncclavg
