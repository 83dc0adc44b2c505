// Lane type of the AVX-512 path: 16 floats. Only included by kernels_avx512.cpp, under its target pragma.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace ncclavg {
namespace cpu {
namespace {

struct Avx512Lane {
  using V = __m512;
  static constexpr int W = 16;
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V sqrt(V x) { return _mm512_sqrt_ps(x); }
  static V load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static void store_f32(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V load_bf16(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static void store_bf16(uint16_t* p, V v) {
    // Same rule as ew::float_to_bf16_bits: round to nearest even, NaN -> quiet NaN.
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __mmask16 isnan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(isnan, r, qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_f16(uint16_t* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // See ScalarLane::M: a mask bit per lane where !(|v| < limit) (an unordered compare: NaN is marked).
  using M = __mmask16;
  static M no_flags() { return 0; }
  static M nonfinite(V v, float limit) {
    return _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(limit), _CMP_NLT_UQ);
  }
  static M either(M a, M b) { return static_cast<M>(a | b); }
  static bool any(M m) { return m != 0; }
};

}  // namespace
}  // namespace cpu
}  // namespace ncclavg
