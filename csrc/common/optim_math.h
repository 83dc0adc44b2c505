// Element math of the optimizers (Adam/AdamW, SGD with momentum/Nesterov), shared by the CPU kernels
// (scalar and SIMD lanes, csrc/cpu/optim_impl.h) and usable by CUDA kernels: every function is a
// template over the lane type F (`float` on the GPU and in the scalar CPU path, a GCC vector type in the
// SIMD paths) and uses only + - * /, comparisons and a square root supplied by the caller.
//
// Note [Optimizer arithmetic follows torch]
// The per-element formulas are torch.optim's single-tensor ones, operation by operation, with the
// per-step scalars computed in double on the host exactly as torch computes them in Python and rounded
// to float once (what a float kernel does with a Python float argument):
//   AdamW:  p = p * (1 - lr*wd)                      (skipped when wd == 0: p*1 is exact anyway)
//   Adam:   g = g + wd*p                             (L2; only when wd != 0)
//           m = lerp(m, g, 1-beta1)                  (torch's lerp: two forms around weight 0.5)
//           v = v*beta2 + ((1-beta2)*g)*g            (mul_ then addcmul_)
//           vmax = max(vmax, v)                      (amsgrad)
//           denom = sqrt(v or vmax) / sqrt(1-beta2^t) + eps
//           p = p + ((-lr/(1-beta1^t)) * m) / denom  (addcdiv_ with value=-step_size)
//   SGD:    g = g + wd*p; b = g (first step) | b*mu + (1-dampening)*g; g = g + mu*b (Nesterov) | b;
//           p = p + (-lr)*g
// torch's vectorized CPU kernels contract some of these into FMAs; we never do (-ffp-contract=off,
// --fmad=false), so every SIMD level and the GPU give bit-identical results, and torch agrees to a few
// ulp per step.
//
// Note [Exact tower mean]
// N tower gradients are averaged in double: each lane is widened, summed, divided by N and rounded to
// float once. The sum of a few float/bf16/f16 values in double is exact unless their exponents span more
// than about 27 binades (53 - 24 bits, less log2 N), so the result is the float64 mean rounded to float32:
// the gradient a reference gets from `torch.stack(grads).double().mean(0).float()`. With one tower this
// is the identity, and the kernels skip the widening. For 16-bit gradients the CPU SIMD levels get the
// same bits from a float32 sum where that sum is provably exact (Note [Float32 tower mean when it is
// exact] in csrc/cpu/optim_mean.h).
#pragma once
#include <cstdint>

#include "elementwise.h"

namespace ncclavg {
namespace om {

// Scalars of one Adam/AdamW update of one tensor (its own step count), rounded to float on the host.
struct AdamCoef {
  float decay;          // AdamW: 1 - lr*wd; used only when `decoupled`
  float l2;             // Adam: wd; used only when `l2_on`
  float w1;             // lerp weight 1 - beta1
  float w1_comp;        // 1 - w1, in float (torch's large-weight lerp branch)
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;       // sqrt(1 - beta2^t)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^t)
  bool decoupled;       // AdamW decay applies (wd != 0)
  bool l2_on;           // Adam L2 term applies (wd != 0)
  bool w1_small;        // |w1| < 0.5: m + w1*(g - m), else g - (g - m)*(1 - w1)
  bool amsgrad;
};

// Scalars of one SGD update.
struct SgdCoef {
  float neg_lr;         // -lr
  float wd;             // used only when `wd_on`
  float momentum;       // mu; used only when `momentum_on`
  float damp_comp;      // 1 - dampening
  bool wd_on;
  bool momentum_on;
  bool nesterov;
  bool first;           // the momentum buffer does not exist yet: b = g
};

// How the raw gradient becomes the one the update uses: g = ((mean of towers) * inv_scale) * clip.
// inv_scale is 1/loss_scale (negated for `maximize`); both factors are 1 by default (exact identity).
struct GradCoef {
  float inv_scale;
  float clip;
};

template <typename F>
NCCLAVG_HD F scale_grad(F mean, const GradCoef& gc) {
  F g = mean * gc.inv_scale;
  return g * gc.clip;
}

// torch's lerp(self, end, w) with w in float; `small` is |w| < 0.5, decided once per call.
template <typename F>
NCCLAVG_HD F lerp_torch(F self, F end, float w, float w_comp, bool small) {
  return small ? self + w * (end - self) : end - (end - self) * w_comp;
}

// max(a, b) as torch.maximum for the values Adam produces (v >= 0, never NaN for finite grads).
template <typename F>
NCCLAVG_HD F max_lane(F a, F b) {
  return (a < b) ? b : a;
}

// One Adam/AdamW element update. `Sqrt` is a functor (lane sqrt, correctly rounded on every target).
// vmax is read and written only when c.amsgrad.
template <typename F, typename Sqrt>
NCCLAVG_HD void adam_update(F& p, F& m, F& v, F& vmax, F g, const AdamCoef& c, Sqrt sqrt_fn) {
  if (c.decoupled) p = p * c.decay;
  if (c.l2_on) g = g + c.l2 * p;
  m = lerp_torch(m, g, c.w1, c.w1_comp, c.w1_small);
  v = v * c.beta2;
  v = v + (c.one_minus_beta2 * g) * g;
  F denom_src = v;
  if (c.amsgrad) {
    vmax = max_lane(vmax, v);
    denom_src = vmax;
  }
  const F denom = sqrt_fn(denom_src) / c.bc2_sqrt + c.eps;
  p = p + (c.neg_step_size * m) / denom;
}

// Note [Adam's common configuration]
// AdamW (or Adam without weight decay) with beta1 >= 0.5 and no amsgrad is nearly every step. Its
// flags decided at compile time (no per-vector tests of c.l2_on, c.w1_small, c.amsgrad) made the AVX2
// loop ~8% faster with 4 bfloat16 towers. adam_is_plain(c) says whether it applies; then
// adam_update_plain<Decoupled> runs exactly adam_update's operations for that configuration.
NCCLAVG_HD bool adam_is_plain(const AdamCoef& c) { return !c.l2_on && c.w1_small && !c.amsgrad; }

template <bool Decoupled, typename F, typename Sqrt>
NCCLAVG_HD void adam_update_plain(F& p, F& m, F& v, F g, const AdamCoef& c, Sqrt sqrt_fn) {
  if (Decoupled) p = p * c.decay;
  m = m + c.w1 * (g - m);  // lerp_torch's |w| < 0.5 form
  v = v * c.beta2;
  v = v + (c.one_minus_beta2 * g) * g;
  const F denom = sqrt_fn(v) / c.bc2_sqrt + c.eps;
  p = p + (c.neg_step_size * m) / denom;
}

// One SGD element update; `b` (momentum buffer) is read/written only when c.momentum_on.
template <typename F>
NCCLAVG_HD void sgd_update(F& p, F& b, F g, const SgdCoef& c) {
  if (c.wd_on) g = g + c.wd * p;
  if (c.momentum_on) {
    if (c.first) {
      b = g;
    } else {
      b = b * c.momentum;
      b = b + c.damp_comp * g;
    }
    g = c.nesterov ? g + c.momentum * b : b;
  }
  p = p + c.neg_lr * g;
}

}  // namespace om
}  // namespace ncclavg
