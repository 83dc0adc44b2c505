// Lane type of the scalar path: one float. Also provides the scalar load/store used for the tails of
// the SIMD paths. See Note [Internal linkage in ISA translation units].
#pragma once
#include <cstdint>

#include "../common/elementwise.h"
#include "../common/finite_math.h"

namespace ncclavg {
namespace cpu {
namespace {

// IEEE binary16 as a C++ type: GCC 12 accepts _Float16 in C++ on x86 only; on aarch64 its __fp16 is the
// same format (AHP, the alternative format, is off unless FPCR asks for it) as a storage-only type whose
// conversions to and from float are single instructions.
#if defined(__aarch64__)
using Half = __fp16;
#else
using Half = _Float16;
#endif

struct ScalarLane {
  using V = float;
  static constexpr int W = 1;
  static V set1(float x) { return x; }
  static V sqrt(V x) { return __builtin_sqrtf(x); }
  static V load_f32(const float* p) { return *p; }
  static void store_f32(float* p, V v) { *p = v; }
  static V load_bf16(const uint16_t* p) { return ew::bf16_bits_to_float(*p); }
  static void store_bf16(uint16_t* p, V v) { *p = ew::float_to_bf16_bits(v); }
  // Half conversions are correctly rounded (F16C when the TU's target has it, libgcc otherwise; on
  // aarch64 one fcvt, rounding as FPCR says: to nearest even unless someone changed it).
  static V load_f16(const uint16_t* p) { return static_cast<float>(*reinterpret_cast<const Half*>(p)); }
  static void store_f16(uint16_t* p, V v) { *reinterpret_cast<Half*>(p) = static_cast<Half>(v); }
  // "Some lane was not finite", accumulated in registers (Note [Finiteness from the pass that writes]):
  // nonfinite(v, limit) marks the lanes whose value rounds to an inf/NaN in a type with that overflow limit.
  // On the bits, as ew::written_nonfinite on the values (|x| < limit orders like the sign-cleared
  // patterns, NaN patterns above inf's): the top bit of (|x| bits) + (2^31 - limit bits) is set exactly
  // when |x| >= limit or x is NaN. Integer and/add/or, which GCC vectorises in the scalar level's loops
  // (SSE2). See Note [The scalar level's check] in pack_impl.h.
  using M = uint32_t;
  static M no_flags() { return 0; }
  static M nonfinite(V v, float limit) {
    return (__builtin_bit_cast(uint32_t, v) & 0x7fffffffu) + (0x80000000u - __builtin_bit_cast(uint32_t, limit));
  }
  static M either(M a, M b) { return a | b; }
  static bool any(M m) { return (m & 0x80000000u) != 0; }
};

}  // namespace
}  // namespace cpu
}  // namespace ncclavg
