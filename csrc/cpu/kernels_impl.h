// The CPU kernels, written once over a lane type L (ScalarLane, Avx2Lane, Avx512Lane) and compiled once
// per ISA by kernels_{scalar,avx2,avx512}.cpp.
//
// Note [Internal linkage in ISA translation units]
// The same source is compiled under different `#pragma GCC target`s. Any function with external linkage
// (an inline function, a template instance) emitted by two of these TUs would be merged by the linker,
// which may keep the AVX-512 copy and run it on a CPU without AVX-512. So everything here lives in an
// anonymous namespace, the shared element math is `static`, and the ISA TUs include standard headers
// (which instantiate inline functions) only before their target pragma.
//
// Note [OpenMP outside the ISA kernels]
// GCC outlines `#pragma omp parallel` bodies into new functions that inherit the target of the function
// that holds the pragma, not of its caller. The parallel loops therefore live in the default-ISA
// dispatchers (reduce.cpp, ...), and each thread calls the ISA kernel on its slice [begin, end).
#pragma once
#include <cstdint>

#include "../common/dtype.h"
#include "../common/elementwise.h"
#include "../common/finite_math.h"
#include "../common/pack_math.h"
#include "vec_scalar.h"

namespace ncclavg {
namespace cpu {
namespace {

// Storage tags: turn a run-time DType into a compile-time choice of load/store, outside inner loops.
struct F32 {};
struct F16 {};
struct BF16 {};
template <class T> struct IsF32 { static constexpr bool value = false; };
template <> struct IsF32<F32> { static constexpr bool value = true; };

template <class L> typename L::V ld(F32, const void* p, int64_t i) { return L::load_f32(static_cast<const float*>(p) + i); }
template <class L> typename L::V ld(F16, const void* p, int64_t i) { return L::load_f16(static_cast<const uint16_t*>(p) + i); }
template <class L> typename L::V ld(BF16, const void* p, int64_t i) { return L::load_bf16(static_cast<const uint16_t*>(p) + i); }
template <class L> void st(F32, void* p, int64_t i, typename L::V v) { L::store_f32(static_cast<float*>(p) + i, v); }
template <class L> void st(F16, void* p, int64_t i, typename L::V v) { L::store_f16(static_cast<uint16_t*>(p) + i, v); }
template <class L> void st(BF16, void* p, int64_t i, typename L::V v) { L::store_bf16(static_cast<uint16_t*>(p) + i, v); }

// Calls f(tag) with the storage tag of `dtype`.
template <class Fn>
void with_storage(DType dtype, Fn&& f) {
  switch (dtype) {
    case DType::kFloat32: f(F32{}); break;
    case DType::kFloat16: f(F16{}); break;
    case DType::kBFloat16: f(BF16{}); break;
  }
}

// The overflow limit of each storage type: see Note [Finiteness from the pass that writes].
inline float limit_of(F32) { return ew::overflow_limit_f32(); }
inline float limit_of(F16) { return ew::overflow_limit_f16(); }
inline float limit_of(BF16) { return ew::overflow_limit_bf16(); }

// One element step of the average: read lane `i` of every buffer, sum in fp32, write the mean back.
// kCheck: also mark in `bad` the lanes whose written mean is not finite.
template <class L, class T, bool kCheck>
void average_step(void* const* bufs, int n, float fn, int64_t i, typename L::M& bad) {
  typename L::V acc = ld<L>(T{}, bufs[0], i);
  for (int k = 1; k < n; ++k) acc = acc + ld<L>(T{}, bufs[k], i);
  const typename L::V mean = ew::mean_of_sum(acc, fn);
  for (int k = 0; k < n; ++k) st<L>(T{}, bufs[k], i, mean);
  if (kCheck) bad = L::either(bad, L::nonfinite(mean, limit_of(T{})));
}

template <class L, class T, bool kCheck>
bool average_range_typed(void* const* bufs, int n, int64_t begin, int64_t end) {
  const float fn = static_cast<float>(n);
  typename L::M bad = L::no_flags();
  ScalarLane::M tail = ScalarLane::no_flags();
  int64_t i = begin;
  for (; i + L::W <= end; i += L::W) average_step<L, T, kCheck>(bufs, n, fn, i, bad);
  for (; i < end; ++i) average_step<ScalarLane, T, kCheck>(bufs, n, fn, i, tail);
  return L::any(bad) || ScalarLane::any(tail);
}

// nonfinite != nullptr: *nonfinite = whether a written mean is an inf/NaN (Note [Finiteness from the pass
// that writes]); the check is a separate instance of the loop, so the unchecked pass is unchanged.
template <class L>
void average_range(void* const* bufs, int n, DType dtype, int64_t begin, int64_t end, bool* nonfinite) {
  with_storage(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (nonfinite != nullptr) {
      *nonfinite = average_range_typed<L, T, true>(bufs, n, begin, end);
    } else {
      average_range_typed<L, T, false>(bufs, n, begin, end);
    }
  });
}

// One element step of the channel's sum: lane `i` of every source in order, summed in fp32, rounded to
// the storage type, then scaled (y = x * mul / div, Note [Pack scale modes]) and rounded again; written
// to out and, when given, out2. Rounding before scaling makes a fused average the same bits as a sum
// followed by the core's unpack scale. kCheck: the lanes whose written value is not finite are marked in
// `bad` (Note [Finiteness from the pass that writes]).
template <class L, class T, int kMode, bool kCheck>
void sum_step(void* out, void* out2, const void* const* srcs, int n, float mul, float div, int64_t i,
              typename L::M& bad) {
  typename L::V acc = ld<L>(T{}, srcs[0], i);
  for (int k = 1; k < n; ++k) acc = acc + ld<L>(T{}, srcs[k], i);
  if (kMode != ew::kPackCopy) {
    if (!IsF32<T>::value) {   // round to storage first: store and reload the lane
      alignas(64) float rounded[L::W];   // room for W lanes of any storage type
      st<L>(T{}, rounded, 0, acc);
      acc = ld<L>(T{}, rounded, 0);
    }
    acc = ew::pack_scale<kMode>(acc, mul, div);
  }
  st<L>(T{}, out, i, acc);
  if (out2 != nullptr) st<L>(T{}, out2, i, acc);
  if (kCheck) bad = L::either(bad, L::nonfinite(acc, limit_of(T{})));
}

template <class L, class T, int kMode, bool kCheck>
bool sum_range_mode(void* out, void* out2, const void* const* srcs, int n, float mul, float div, int64_t begin,
                    int64_t end) {
  typename L::M bad = L::no_flags();
  ScalarLane::M tail = ScalarLane::no_flags();
  int64_t i = begin;
  for (; i + L::W <= end; i += L::W) sum_step<L, T, kMode, kCheck>(out, out2, srcs, n, mul, div, i, bad);
  for (; i < end; ++i) sum_step<ScalarLane, T, kMode, kCheck>(out, out2, srcs, n, mul, div, i, tail);
  return L::any(bad) || ScalarLane::any(tail);
}

template <class L, class T, bool kCheck>
bool sum_range_typed(void* out, void* out2, const void* const* srcs, int n, float mul, float div, int64_t begin,
                     int64_t end) {
  switch (ew::pack_mode(mul, div)) {
    case ew::kPackCopy: return sum_range_mode<L, T, ew::kPackCopy, kCheck>(out, out2, srcs, n, mul, div, begin, end);
    case ew::kPackMul: return sum_range_mode<L, T, ew::kPackMul, kCheck>(out, out2, srcs, n, mul, div, begin, end);
    case ew::kPackDiv: return sum_range_mode<L, T, ew::kPackDiv, kCheck>(out, out2, srcs, n, mul, div, begin, end);
    default: return sum_range_mode<L, T, ew::kPackMulDiv, kCheck>(out, out2, srcs, n, mul, div, begin, end);
  }
}

// out[i] (and out2[i] unless null) = (srcs[0][i] + ... + srcs[n-1][i]) * mul / div over [begin, end): the
// shared-memory channel's reduction. out may be one of the sources (each lane is read before it is written).
// nonfinite != nullptr: *nonfinite = whether a written value is an inf/NaN.
template <class L>
void sum_range(void* out, void* out2, const void* const* srcs, int n, DType dtype, float mul, float div,
               int64_t begin, int64_t end, bool* nonfinite) {
  with_storage(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (nonfinite != nullptr) {
      *nonfinite = sum_range_typed<L, T, true>(out, out2, srcs, n, mul, div, begin, end);
    } else {
      sum_range_typed<L, T, false>(out, out2, srcs, n, mul, div, begin, end);
    }
  });
}

}  // namespace
}  // namespace cpu
}  // namespace ncclavg

// The table of one ISA, as a brace initializer. It must be a constant initializer: code run by a
// static constructor of the AVX-512 TU would itself be AVX-512 code and crash at import elsewhere.
#define NCCLAVG_KERNEL_TABLE(Lane, level) \
  { level, &average_range<Lane>, &sum_range<Lane> }
