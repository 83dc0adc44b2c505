// Finiteness of what a pass writes, as a side effect of the pass: the limits and the test of the CPU
// kernels (scalar and SIMD lanes), NCCLAVG_HD like the rest of the element math so that a CUDA kernel can
// note the same (none does yet). See Note [Finiteness from the pass that writes].
#pragma once
#include "elementwise.h"

namespace ncclavg {
namespace ew {

// Note [Finiteness from the pass that writes]
// A step skipped for an inf/NaN gradient must be decided before its first write, so without help the
// optimizer reads every gradient twice. The passes that produce the gradients (the towers' average, the
// channel's sum, a bucket's unpack) write every element of their output anyway, and can note in a register
// whether any value they WRITE is not finite, at the cost of a compare and an OR per vector. Checking the
// output is exact for the gradients' sums and means:
// - an inf or NaN input makes the output non-finite: inf + x = inf for finite x, inf + (-inf) = NaN,
//   NaN + x = NaN, and the scaling that follows (finite, non-zero factors) keeps inf and NaN;
// - finite inputs whose fp32 sum overflows give inf, which the output holds too;
// - narrowing to bfloat16 / float16 (round to nearest even) turns a finite fp32 value at or above the
//   storage type's overflow limit into inf: the test is made on the value that is written.
// So "any written value non-finite" is exactly "the gradient the optimizer reads holds an inf/NaN", and
// every rank that receives the same result bits computes the same answer, with no exchange.
// The test on the fp32 value about to be stored is !(|x| < limit), with `limit` the smallest magnitude
// that the storage type's rounding sends to inf: +inf for float32 (only inf and NaN fail), 65520 for
// float16 (halfway between 65504 and 2^16, a tie that rounds to the even 2^16 = inf), and 0x7f7f8000 as
// a float for bfloat16 (halfway between its largest finite 0x7f7f and 0x7f80 = inf; the tie goes to the
// even 0x7f80). An unordered compare: NaN fails it. A pass that copies bits unchanged (a plain copy)
// tests the bits instead: all exponent bits set.
NCCLAVG_HD float overflow_limit_f32() { return __builtin_inff(); }
NCCLAVG_HD float overflow_limit_f16() { return 65520.0f; }
NCCLAVG_HD float overflow_limit_bf16() {
  union { uint32_t u; float f; } v;
  v.u = 0x7f7f8000u;
  return v.f;
}

// Whether `x`, rounded to nearest even into a type with overflow limit `limit`, is an inf or a NaN.
NCCLAVG_HD bool written_nonfinite(float x, float limit) {
  return !(__builtin_fabsf(x) < limit);
}

}  // namespace ew
}  // namespace ncclavg
