// The NEON pieces of the optimizer kernels: WideOps<NeonLane> (see optim_mean.h). RawOps stays the
// generic kFast = false (the float64 tower mean every level can take: the same bits as the float32
// shortcut of the x86 levels, slower). Included after optim_impl.h by optim_neon.cpp and optim_sve.cpp.
#pragma once
#include <arm_neon.h>

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

}  // namespace
}  // namespace cpu
}  // namespace ncclavg
