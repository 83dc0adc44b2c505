// The NEON pieces of the optimizer kernels (see optim_mean.h): WideOps<NeonLane>, and RawOps<NeonLane>,
// the float32 tower mean of Note [Float32 tower mean when it is exact] with optim_x86.h's check done on
// two 128-bit registers of 8 16-bit lanes. Included after optim_impl.h by optim_neon.cpp and
// optim_sve.cpp.
#pragma once
#include <arm_neon.h>

#include <cstdint>
#include <type_traits>

#include "optim_mean.h"
#include "vec_neon.h"

namespace ncclavg {
namespace cpu {
namespace {

// Float lane <-> two float64x2_t: fcvtl widens exactly, fcvtn narrows rounding to nearest even.
template <>
struct WideOps<NeonLane> {
  using T = WidePair<float64x2_t>;
  static NCCLAVG_OPT_INLINE void widen(float32x4_t v, T& out) {
    out.lo = vcvt_f64_f32(vget_low_f32(v));
    out.hi = vcvt_high_f64_f32(v);
  }
  static NCCLAVG_OPT_INLINE float32x4_t narrow(const T& w) { return vcvt_high_f32_f64(vcvt_f32_f64(w.lo), w.hi); }
};

// 16 raw 16-bit lanes (two registers) of one tower at element i.
NCCLAVG_OPT_INLINE void load_raw16_neon(const void* tower, int64_t i, uint16x8_t (&raw)[2]) {
  const uint16_t* p = static_cast<const uint16_t*>(tower) + i;
  raw[0] = vld1q_u16(p);
  raw[1] = vld1q_u16(p + 8);
}

// 16 raw lanes -> four float vectors (elements 0-3, 4-7, 8-11, 12-15).
NCCLAVG_OPT_INLINE void raw_to_f32(BF16, const uint16x8_t (&raw)[2], float32x4_t (&x)[4]) {
  for (int h = 0; h < 2; ++h) {
    x[2 * h] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(raw[h]), 16));
    x[2 * h + 1] = vreinterpretq_f32_u32(vshll_high_n_u16(raw[h], 16));
  }
}
NCCLAVG_OPT_INLINE void raw_to_f32(F16, const uint16x8_t (&raw)[2], float32x4_t (&x)[4]) {
  for (int h = 0; h < 2; ++h) {
    x[2 * h] = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(raw[h])));
    x[2 * h + 1] = vcvt_high_f32_f16(vreinterpretq_f16_u16(raw[h]));
  }
}

// optim_x86.h's Range16 on two registers: the largest magnitude, and the smallest magnitude minus one
// (zeros wrap to 0xffff and drop out), per lane over the towers.
struct Range16Neon {
  uint16x8_t mx[2], mn[2];

  NCCLAVG_OPT_INLINE void init() {
    for (int h = 0; h < 2; ++h) {
      mx[h] = vdupq_n_u16(0);
      mn[h] = vdupq_n_u16(0xffff);
    }
  }

  NCCLAVG_OPT_INLINE void add(const uint16x8_t (&raw)[2]) {
    for (int h = 0; h < 2; ++h) {
      const uint16x8_t a = vandq_u16(raw[h], vdupq_n_u16(0x7fff));
      mx[h] = vmaxq_u16(mx[h], a);
      mn[h] = vminq_u16(mn[h], vsubq_u16(a, vdupq_n_u16(1)));
    }
  }

  // Every lane within the plan's limits; saturating differences are nonzero exactly where one is exceeded.
  template <class T>
  NCCLAVG_OPT_INLINE bool ok(const MeanPlan& mp) const {
    constexpr int kShift = std::is_same_v<T, BF16> ? 7 : 10;
    uint16x8_t bad = vdupq_n_u16(0);
    for (int h = 0; h < 2; ++h) {
      const uint16x8_t hi = vshrq_n_u16(mx[h], kShift);
      const uint16x8_t lo = vshrq_n_u16(mn[h], kShift);
      bad = vorrq_u16(bad, vqsubq_u16(vqsubq_u16(hi, lo), vdupq_n_u16(mp.max_spread)));
      bad = vorrq_u16(bad, vqsubq_u16(hi, vdupq_n_u16(mp.max_exp)));
      if constexpr (std::is_same_v<T, BF16>) bad = vorrq_u16(bad, vqsubq_u16(vdupq_n_u16(mp.min_exp), lo));
    }
    return vmaxvq_u16(bad) == 0;
  }
};

template <>
struct RawOps<NeonLane> {
  static constexpr bool kFast = true;
  // optim_x86.h's mean16_x86: false (and `out` unspecified) when the block must take the float64 path.
  template <class T>
  static NCCLAVG_OPT_INLINE bool mean16(T, const void* const* towers, int n, int64_t i, const MeanPlan& mp,
                                        float32x4_t (&out)[4]) {
    Range16Neon range;
    range.init();
    uint16x8_t raw[2];
    load_raw16_neon(towers[0], i, raw);
    range.add(raw);
    raw_to_f32(T{}, raw, out);
    for (int k = 1; k < n; ++k) {
      load_raw16_neon(towers[k], i, raw);
      range.add(raw);
      float32x4_t x[4];
      raw_to_f32(T{}, raw, x);
      for (int q = 0; q < 4; ++q) out[q] = out[q] + x[q];  // exact when the check passes: any order
    }
    if (!range.template ok<T>(mp)) return false;
    for (int q = 0; q < 4; ++q) out[q] = mp.pow2 ? out[q] * mp.inv_f : out[q] / mp.n_f;
    return true;
  }
};

}  // namespace
}  // namespace cpu
}  // namespace ncclavg
