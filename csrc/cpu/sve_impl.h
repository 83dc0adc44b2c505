// The average, sum and pack kernels for SVE, written as predicated loops. Included by kernels_sve.cpp
// and pack_sve.cpp after their target pragma (and after kernels_impl.h, whose storage tags and limits
// they share); everything has internal linkage (Note [Internal linkage in ISA translation units]).
//
// Note [SVE kernels without a compile-time width]
// SVE's vector length is a property of the CPU (128 to 2048 bits), read at run time (svcntw()). Its
// types (svfloat32_t, svbool_t) are sizeless: no struct members, no arrays, no sizeof. The lane-type
// templates need a constant L::W and arrays of L::V (kernels_impl.h's staging buffer in sum_step, the
// optimizer's blocks of 16 elements), so these families are written here once more, as loops of
// svwhilelt predicates over [begin, end): the last, partial vector is the same code with fewer active
// lanes, so there is no scalar tail. Each element sees exactly the scalar level's operations in the same
// order (loads and roundings as ScalarLane's, fp32 sums over the buffers in order, one division; no
// FMA: -ffp-contract=off and no svmla), so every vector length gives the scalar level's bits. The
// optimizer family keeps its 16-element blocks, by which its norm accumulators are laid out
// (Note [Norm reduction independent of the SIMD level]): at this level it runs the NEON lanes
// (optim_sve.cpp). Making the impl headers take a run-time width would let it use SVE too.
#pragma once
#include <arm_sve.h>

#include <cstdint>

#include "../common/dtype.h"
#include "../common/finite_math.h"
#include "../common/pack_math.h"
#include "kernels_impl.h"

namespace ncclavg {
namespace cpu {
namespace {

// One predicated vector of 32-bit lanes from storage T; inactive lanes are not read.
inline svfloat32_t sv_ld(F32, svbool_t pg, const void* p, int64_t i) {
  return svld1_f32(pg, static_cast<const float*>(p) + i);
}
inline svfloat32_t sv_ld(BF16, svbool_t pg, const void* p, int64_t i) {
  return svreinterpret_f32_u32(svlsl_n_u32_x(pg, svld1uh_u32(pg, static_cast<const uint16_t*>(p) + i), 16));
}
// The halves sit in the low 16 bits of each 32-bit container: where fcvt reads them.
inline svfloat32_t sv_ld(F16, svbool_t pg, const void* p, int64_t i) {
  return svcvt_f32_f16_x(pg, svreinterpret_f16_u32(svld1uh_u32(pg, static_cast<const uint16_t*>(p) + i)));
}

// bfloat16 patterns in the low 16 bits of each lane: round to nearest even, NaN -> quiet NaN (the rule of
// ew::float_to_bf16_bits).
inline svuint32_t sv_bf16_bits(svbool_t pg, svfloat32_t v) {
  const svuint32_t u = svreinterpret_u32_f32(v);
  const svuint32_t hi = svlsr_n_u32_x(pg, u, 16);
  const svuint32_t bias = svadd_n_u32_x(pg, svand_n_u32_x(pg, hi, 1), 0x7fff);
  const svuint32_t r = svlsr_n_u32_x(pg, svadd_u32_x(pg, u, bias), 16);
  return svsel_u32(svcmpuo_f32(pg, v, v), svorr_n_u32_x(pg, hi, 0x40), r);
}

// Half patterns in the low 16 bits of each lane (fcvt: correctly rounded, FPCR's nearest even).
inline svuint32_t sv_f16_bits(svbool_t pg, svfloat32_t v) { return svreinterpret_u32_f16(svcvt_f16_f32_x(pg, v)); }

inline void sv_st(F32, svbool_t pg, void* p, int64_t i, svfloat32_t v) { svst1_f32(pg, static_cast<float*>(p) + i, v); }
inline void sv_st(BF16, svbool_t pg, void* p, int64_t i, svfloat32_t v) {
  svst1h_u32(pg, static_cast<uint16_t*>(p) + i, sv_bf16_bits(pg, v));
}
inline void sv_st(F16, svbool_t pg, void* p, int64_t i, svfloat32_t v) {
  svst1h_u32(pg, static_cast<uint16_t*>(p) + i, sv_f16_bits(pg, v));
}

// v rounded to storage T and back, in registers (the channel's sum rounds before it scales).
inline svfloat32_t sv_round(F32, svbool_t, svfloat32_t v) { return v; }
inline svfloat32_t sv_round(BF16, svbool_t pg, svfloat32_t v) {
  return svreinterpret_f32_u32(svlsl_n_u32_x(pg, sv_bf16_bits(pg, v), 16));
}
inline svfloat32_t sv_round(F16, svbool_t pg, svfloat32_t v) {
  return svcvt_f32_f16_x(pg, svcvt_f16_f32_x(pg, v));
}

// y = x * mul / div as ew::pack_scale<kMode>.
template <int kMode>
inline svfloat32_t sv_scale(svbool_t pg, svfloat32_t x, float mul, float div) {
  if (kMode & ew::kPackMul) x = svmul_n_f32_x(pg, x, mul);
  if (kMode & ew::kPackDiv) x = svdiv_n_f32_x(pg, x, div);
  return x;
}

// The active lanes where !(|v| < limit) (facgt is false for NaN: NaN is marked). See ScalarLane::M.
inline svbool_t sv_nonfinite(svbool_t pg, svfloat32_t v, float limit) {
  return svnot_b_z(pg, svaclt_n_f32(pg, v, limit));
}

// ---- average (kernels_impl.h's average_range)

template <class T, bool kCheck>
bool sve_average_typed(void* const* bufs, int n, int64_t begin, int64_t end) {
  const float fn = static_cast<float>(n);
  const float limit = limit_of(T{});
  svbool_t bad = svpfalse_b();
  for (int64_t i = begin; i < end; i += static_cast<int64_t>(svcntw())) {
    const svbool_t pg = svwhilelt_b32_s64(i, end);
    svfloat32_t acc = sv_ld(T{}, pg, bufs[0], i);
    for (int k = 1; k < n; ++k) acc = svadd_f32_x(pg, acc, sv_ld(T{}, pg, bufs[k], i));
    const svfloat32_t mean = svdiv_n_f32_x(pg, acc, fn);  // ew::mean_of_sum
    for (int k = 0; k < n; ++k) sv_st(T{}, pg, bufs[k], i, mean);
    if (kCheck) bad = svorr_b_z(svptrue_b32(), bad, sv_nonfinite(pg, mean, limit));
  }
  return svptest_any(svptrue_b32(), bad);
}

// [[maybe_unused]]: pack_sve.cpp includes this header for the conversion alone.
[[maybe_unused]] void sve_average_range(void* const* bufs, int n, DType dtype, int64_t begin, int64_t end,
                                        bool* nonfinite) {
  with_storage(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (nonfinite != nullptr) {
      *nonfinite = sve_average_typed<T, true>(bufs, n, begin, end);
    } else {
      sve_average_typed<T, false>(bufs, n, begin, end);
    }
  });
}

// ---- the channel's sum (kernels_impl.h's sum_range: round to storage, then scale)

template <class T, int kMode, bool kCheck>
bool sve_sum_mode(void* out, void* out2, const void* const* srcs, int n, float mul, float div, int64_t begin,
                  int64_t end) {
  const float limit = limit_of(T{});
  svbool_t bad = svpfalse_b();
  for (int64_t i = begin; i < end; i += static_cast<int64_t>(svcntw())) {
    const svbool_t pg = svwhilelt_b32_s64(i, end);
    svfloat32_t acc = sv_ld(T{}, pg, srcs[0], i);
    for (int k = 1; k < n; ++k) acc = svadd_f32_x(pg, acc, sv_ld(T{}, pg, srcs[k], i));
    if (kMode != ew::kPackCopy) acc = sv_scale<kMode>(pg, sv_round(T{}, pg, acc), mul, div);
    sv_st(T{}, pg, out, i, acc);
    if (out2 != nullptr) sv_st(T{}, pg, out2, i, acc);
    if (kCheck) bad = svorr_b_z(svptrue_b32(), bad, sv_nonfinite(pg, acc, limit));
  }
  return svptest_any(svptrue_b32(), bad);
}

template <class T, bool kCheck>
bool sve_sum_typed(void* out, void* out2, const void* const* srcs, int n, float mul, float div, int64_t begin,
                   int64_t end) {
  switch (ew::pack_mode(mul, div)) {
    case ew::kPackCopy: return sve_sum_mode<T, ew::kPackCopy, kCheck>(out, out2, srcs, n, mul, div, begin, end);
    case ew::kPackMul: return sve_sum_mode<T, ew::kPackMul, kCheck>(out, out2, srcs, n, mul, div, begin, end);
    case ew::kPackDiv: return sve_sum_mode<T, ew::kPackDiv, kCheck>(out, out2, srcs, n, mul, div, begin, end);
    default: return sve_sum_mode<T, ew::kPackMulDiv, kCheck>(out, out2, srcs, n, mul, div, begin, end);
  }
}

[[maybe_unused]] void sve_sum_range(void* out, void* out2, const void* const* srcs, int n, DType dtype, float mul,
                                    float div, int64_t begin, int64_t end, bool* nonfinite) {
  with_storage(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (nonfinite != nullptr) {
      *nonfinite = sve_sum_typed<T, true>(out, out2, srcs, n, mul, div, begin, end);
    } else {
      sve_sum_typed<T, false>(out, out2, srcs, n, mul, div, begin, end);
    }
  });
}

// ---- the pack conversion (pack_impl.h's convert_loop): load S, scale, store D

template <class S, class D, int kMode, bool kCheck>
bool sve_convert_loop(const void* src, void* dst, int64_t n, float mul, float div) {
  const float limit = limit_of(D{});
  svbool_t bad = svpfalse_b();
  for (int64_t i = 0; i < n; i += static_cast<int64_t>(svcntw())) {
    const svbool_t pg = svwhilelt_b32_s64(i, n);
    const svfloat32_t a = sv_scale<kMode>(pg, sv_ld(S{}, pg, src, i), mul, div);
    sv_st(D{}, pg, dst, i, a);
    if (kCheck) bad = svorr_b_z(svptrue_b32(), bad, sv_nonfinite(pg, a, limit));
  }
  return svptest_any(svptrue_b32(), bad);
}

template <class S, class D, bool kCheck>
bool sve_convert_typed(const void* src, void* dst, int64_t n, float mul, float div) {
  switch (ew::pack_mode(mul, div)) {
    case ew::kPackCopy: return sve_convert_loop<S, D, ew::kPackCopy, kCheck>(src, dst, n, mul, div);
    case ew::kPackMul: return sve_convert_loop<S, D, ew::kPackMul, kCheck>(src, dst, n, mul, div);
    case ew::kPackDiv: return sve_convert_loop<S, D, ew::kPackDiv, kCheck>(src, dst, n, mul, div);
    default: return sve_convert_loop<S, D, ew::kPackMulDiv, kCheck>(src, dst, n, mul, div);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace ncclavg
