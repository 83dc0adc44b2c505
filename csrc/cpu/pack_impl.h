// The pack kernel, written once over a lane type L and compiled once per ISA by
// pack_{scalar,avx2,avx512}.cpp. See Note [Internal linkage in ISA translation units] (kernels_impl.h):
// everything here is in an anonymous namespace.
#pragma once
#include <cstdint>

#include "../common/dtype.h"
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

template <class L, class S, class D, int kMode>
void convert_loop(const void* src, void* dst, int64_t n, float mul, float div) {
  int64_t i = 0;
  // Two vectors per iteration: independent load/convert chains hide the latency of the f16/bf16 casts.
  for (; i + 2 * L::W <= n; i += 2 * L::W) {
    const typename L::V a = pk_load<L>(S{}, src, i);
    const typename L::V b = pk_load<L>(S{}, src, i + L::W);
    pk_store<L>(D{}, dst, i, ew::pack_scale<kMode>(a, mul, div));
    pk_store<L>(D{}, dst, i + L::W, ew::pack_scale<kMode>(b, mul, div));
  }
  for (; i + L::W <= n; i += L::W) pk_store<L>(D{}, dst, i, ew::pack_scale<kMode>(pk_load<L>(S{}, src, i), mul, div));
  for (; i < n; ++i) {
    pk_store<ScalarLane>(D{}, dst, i, ew::pack_scale<kMode>(pk_load<ScalarLane>(S{}, src, i), mul, div));
  }
}

template <class L>
void pack_convert(const void* src, DType sdt, void* dst, DType ddt, int64_t n, float mul, float div) {
  if (n <= 0) return;
  const int mode = ew::pack_mode(mul, div);
  if (sdt == ddt && mode == ew::kPackCopy) {  // plain copy: the C library's memcpy is the fastest there is
    __builtin_memcpy(dst, src, static_cast<size_t>(n) * dtype_size(sdt));
    return;
  }
  pk_with_storage(sdt, [&](auto s) {
    pk_with_storage(ddt, [&](auto d) {
      using S = decltype(s);
      using D = decltype(d);
      switch (mode) {
        case ew::kPackCopy: convert_loop<L, S, D, ew::kPackCopy>(src, dst, n, mul, div); break;
        case ew::kPackMul: convert_loop<L, S, D, ew::kPackMul>(src, dst, n, mul, div); break;
        case ew::kPackDiv: convert_loop<L, S, D, ew::kPackDiv>(src, dst, n, mul, div); break;
        default: convert_loop<L, S, D, ew::kPackMulDiv>(src, dst, n, mul, div); break;
      }
    });
  });
}

}  // namespace
}  // namespace cpu
}  // namespace ncclavg

// Constant initializer (see the note on NCCLAVG_KERNEL_TABLE in kernels_impl.h).
#define NCCLAVG_PACK_TABLE(Lane, level) \
  { level, &pack_convert<Lane> }
