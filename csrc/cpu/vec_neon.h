// Lane type of the NEON (Advanced SIMD) path: 4 floats. Only included by the *_neon.cpp translation
// units (and the SVE ones, whose optimizer runs these lanes; see optim_sve.cpp). Advanced SIMD is part
// of every ARMv8-A CPU, so these TUs need no target pragma.
#pragma once
#include <arm_neon.h>

#include <cstdint>

namespace ncclavg {
namespace cpu {
namespace {

struct NeonLane {
  using V = float32x4_t;
  static constexpr int W = 4;
  static V set1(float x) { return vdupq_n_f32(x); }
  static V sqrt(V x) { return vsqrtq_f32(x); }  // fsqrt: correctly rounded
  static V load_f32(const float* p) { return vld1q_f32(p); }
  static void store_f32(float* p, V v) {
#ifdef NCCLAVG_PLANT_NEON_DEFECT
    // A deliberately wrong lane, for the test that proves the native harness catches one (never in a
    // real build): lane 2 of every float32 store comes out one ulp off.
    v = vreinterpretq_f32_u32(vaddq_u32(vreinterpretq_u32_f32(v), uint32x4_t{0, 0, 1, 0}));
#endif
    vst1q_f32(p, v);
  }
  static V load_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
  static void store_bf16(uint16_t* p, V v) {
    // Round to nearest even on the bits, NaN -> quiet NaN: the same rule as ew::float_to_bf16_bits.
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7fff))), 16);
    const uint32x4_t qnan = vorrq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x40));
    const uint32x4_t isnan = vmvnq_u32(vceqq_f32(v, v));
    vst1_u16(p, vmovn_u32(vbslq_u32(isnan, qnan, r)));
  }
  // fcvtl / fcvtn: IEEE half (FPCR.AHP is 0 on Linux), correctly rounded to nearest even (FPCR.RMode 0).
  static V load_f16(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
  static void store_f16(uint16_t* p, V v) { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(v))); }
  // See ScalarLane::M: all-ones lanes where !(|v| < limit) (facgt is false for NaN: NaN is marked).
  using M = uint32x4_t;
  static M no_flags() { return vdupq_n_u32(0); }
  static M nonfinite(V v, float limit) { return vmvnq_u32(vcaltq_f32(v, vdupq_n_f32(limit))); }
  static M either(M a, M b) { return vorrq_u32(a, b); }
  static bool any(M m) { return vmaxvq_u32(m) != 0; }
};

}  // namespace
}  // namespace cpu
}  // namespace ncclavg
