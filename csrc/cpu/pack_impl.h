// The pack kernel, written once over a lane type L and compiled once per ISA by
// pack_{scalar,avx2,avx512}.cpp. See Note [Internal linkage in ISA translation units] (kernels_impl.h):
// everything here is in an anonymous namespace.
#pragma once
#include <cstdint>

#include "../common/dtype.h"
#include "../common/finite_math.h"
#include "../common/pack_math.h"
#include "vec_scalar.h"

namespace ncclavg {
namespace cpu {
namespace {

// Storage tags of the pack family (its own, so this family does not depend on kernels_impl.h).
struct PkF32 { using T = float; };
struct PkF16 { using T = uint16_t; };
struct PkBF16 { using T = uint16_t; };

template <class L> typename L::V pk_load(PkF32, const void* p, int64_t i) { return L::load_f32(static_cast<const float*>(p) + i); }
template <class L> typename L::V pk_load(PkF16, const void* p, int64_t i) { return L::load_f16(static_cast<const uint16_t*>(p) + i); }
template <class L> typename L::V pk_load(PkBF16, const void* p, int64_t i) { return L::load_bf16(static_cast<const uint16_t*>(p) + i); }
template <class L> void pk_store(PkF32, void* p, int64_t i, typename L::V v) { L::store_f32(static_cast<float*>(p) + i, v); }
template <class L> void pk_store(PkF16, void* p, int64_t i, typename L::V v) { L::store_f16(static_cast<uint16_t*>(p) + i, v); }
template <class L> void pk_store(PkBF16, void* p, int64_t i, typename L::V v) { L::store_bf16(static_cast<uint16_t*>(p) + i, v); }

template <class Fn>
void pk_with_storage(DType dtype, Fn&& f) {
  switch (dtype) {
    case DType::kFloat32: f(PkF32{}); break;
    case DType::kFloat16: f(PkF16{}); break;
    case DType::kBFloat16: f(PkBF16{}); break;
  }
}

inline float pk_limit(PkF32) { return ew::overflow_limit_f32(); }
inline float pk_limit(PkF16) { return ew::overflow_limit_f16(); }
inline float pk_limit(PkBF16) { return ew::overflow_limit_bf16(); }

// kCheck: returns whether a written value is an inf/NaN (Note [Finiteness from the pass that writes]),
// tested on each value as it is stored; without it the loop is the plain conversion and returns false.
//
// Note [The scalar level's check]
// At the scalar level GCC vectorises these loops by itself (SSE2). With the test fused into the two-way
// unrolled loop below it computed every scaled value twice (two divisions per element: an unpack /N
// 1.7-1.9x slower than unchecked, measured); as one plain element loop it computes each once and the
// checked loop costs what the unchecked one does. The average and sum loops run over a run-time number
// of buffers, which GCC does not vectorise: there the test is scalar work, +5-20% at the scalar level
// alone (measured; the SIMD levels test in registers at no measurable cost).
template <class L, class S, class D, int kMode, bool kCheck>
bool convert_loop(const void* src, void* dst, int64_t n, float mul, float div) {
  const float limit = pk_limit(D{});
  if constexpr (kCheck && L::W == 1) {   // See Note [The scalar level's check]
    ScalarLane::M bad = ScalarLane::no_flags();
    for (int64_t i = 0; i < n; ++i) {
      const float a = ew::pack_scale<kMode>(pk_load<ScalarLane>(S{}, src, i), mul, div);
      pk_store<ScalarLane>(D{}, dst, i, a);
      bad = ScalarLane::either(bad, ScalarLane::nonfinite(a, limit));
    }
    return ScalarLane::any(bad);
  }
  typename L::M bad = L::no_flags();
  int64_t i = 0;
  // Two vectors per iteration: independent load/convert chains hide the latency of the f16/bf16 casts.
  for (; i + 2 * L::W <= n; i += 2 * L::W) {
    const typename L::V a = ew::pack_scale<kMode>(pk_load<L>(S{}, src, i), mul, div);
    const typename L::V b = ew::pack_scale<kMode>(pk_load<L>(S{}, src, i + L::W), mul, div);
    pk_store<L>(D{}, dst, i, a);
    pk_store<L>(D{}, dst, i + L::W, b);
    if (kCheck) bad = L::either(bad, L::either(L::nonfinite(a, limit), L::nonfinite(b, limit)));
  }
  for (; i + L::W <= n; i += L::W) {
    const typename L::V a = ew::pack_scale<kMode>(pk_load<L>(S{}, src, i), mul, div);
    pk_store<L>(D{}, dst, i, a);
    if (kCheck) bad = L::either(bad, L::nonfinite(a, limit));
  }
  ScalarLane::M tail = ScalarLane::no_flags();
  for (; i < n; ++i) {
    const float a = ew::pack_scale<kMode>(pk_load<ScalarLane>(S{}, src, i), mul, div);
    pk_store<ScalarLane>(D{}, dst, i, a);
    if (kCheck) tail = ScalarLane::either(tail, ScalarLane::nonfinite(a, limit));
  }
  return L::any(bad) || ScalarLane::any(tail);
}

// A copy of n elements of U (unsigned, the storage's width) that also tells whether one of them is an
// inf/NaN bit pattern (all exponent bits set): the same bits as memcpy (a signalling NaN stays one), the
// test on the integer lanes as they pass through registers: the sign-cleared pattern plus (top bit - inf)
// carries into the top bit exactly for an exponent of all ones. Generic vectors as wide as the level's
// register (16 bytes, SSE2, for the scalar level), two per iteration.
template <class L, class U>
bool copy_checked(const void* src, void* dst, int64_t n, U inf) {
  constexpr int kBytes = L::W == 1 ? 16 : static_cast<int>(L::W * sizeof(float));
  typedef U Vec __attribute__((vector_size(kBytes)));
  constexpr int64_t kPer = kBytes / static_cast<int64_t>(sizeof(U));
  constexpr U kMag = static_cast<U>(static_cast<U>(~U{0}) >> 1);
  constexpr U kTop = static_cast<U>(kMag + 1);
  const U bump = static_cast<U>(kTop - inf);
  const auto* s = static_cast<const U*>(src);
  auto* d = static_cast<U*>(dst);
  Vec acc = {};
  int64_t i = 0;
  for (; i + 2 * kPer <= n; i += 2 * kPer) {
    Vec a, b;
    __builtin_memcpy(&a, s + i, sizeof a);
    __builtin_memcpy(&b, s + i + kPer, sizeof b);
    __builtin_memcpy(d + i, &a, sizeof a);
    __builtin_memcpy(d + i + kPer, &b, sizeof b);
    acc |= ((a & kMag) + bump) | ((b & kMag) + bump);
  }
  U any = 0;
  for (int q = 0; q < kPer; ++q) any |= acc[q];
  for (; i < n; ++i) {
    d[i] = s[i];
    any |= static_cast<U>((s[i] & kMag) + bump);
  }
  return (any & kTop) != 0;
}

// nonfinite != nullptr: *nonfinite = whether a written value is an inf/NaN. A plain copy (same dtype, no
// scale) is the C library's memcpy (the fastest there is) without the check, copy_checked with it.
template <class L>
void pack_convert(const void* src, DType sdt, void* dst, DType ddt, int64_t n, float mul, float div,
                  bool* nonfinite) {
  if (nonfinite != nullptr) *nonfinite = false;
  if (n <= 0) return;
  const int mode = ew::pack_mode(mul, div);
  if (sdt == ddt && mode == ew::kPackCopy) {
    if (nonfinite == nullptr) {
      __builtin_memcpy(dst, src, static_cast<size_t>(n) * dtype_size(sdt));
    } else if (sdt == DType::kFloat32) {
      *nonfinite = copy_checked<L, uint32_t>(src, dst, n, 0x7f800000u);
    } else {
      *nonfinite = copy_checked<L, uint16_t>(src, dst, n, sdt == DType::kBFloat16 ? 0x7f80u : 0x7c00u);
    }
    return;
  }
  pk_with_storage(sdt, [&](auto s) {
    pk_with_storage(ddt, [&](auto d) {
      using S = decltype(s);
      using D = decltype(d);
      bool bad = false;
      if (nonfinite == nullptr) {
        switch (mode) {
          case ew::kPackCopy: convert_loop<L, S, D, ew::kPackCopy, false>(src, dst, n, mul, div); break;
          case ew::kPackMul: convert_loop<L, S, D, ew::kPackMul, false>(src, dst, n, mul, div); break;
          case ew::kPackDiv: convert_loop<L, S, D, ew::kPackDiv, false>(src, dst, n, mul, div); break;
          default: convert_loop<L, S, D, ew::kPackMulDiv, false>(src, dst, n, mul, div); break;
        }
        return;
      }
      switch (mode) {
        case ew::kPackCopy: bad = convert_loop<L, S, D, ew::kPackCopy, true>(src, dst, n, mul, div); break;
        case ew::kPackMul: bad = convert_loop<L, S, D, ew::kPackMul, true>(src, dst, n, mul, div); break;
        case ew::kPackDiv: bad = convert_loop<L, S, D, ew::kPackDiv, true>(src, dst, n, mul, div); break;
        default: bad = convert_loop<L, S, D, ew::kPackMulDiv, true>(src, dst, n, mul, div); break;
      }
      *nonfinite = bad;
    });
  });
}

}  // namespace
}  // namespace cpu
}  // namespace ncclavg

// Constant initializer (see the note on NCCLAVG_KERNEL_TABLE in kernels_impl.h).
#define NCCLAVG_PACK_TABLE(Lane, level) \
  { level, &pack_convert<Lane> }
