// The optimizer kernels, written once over a lane type L (ScalarLane, Avx2Lane, Avx512Lane) and compiled
// once per ISA by optim_{scalar,avx2,avx512}.cpp. The element math is om::adam_update / om::sgd_update
// (csrc/common/optim_math.h); this file only moves data: it loads the tower gradients and the fp32
// state with the lane type's loads, calls the math, stores the state and the optional copy-out.
// Vector body over whole lanes, scalar tail with ScalarLane and the same math.
//
// See Note [Internal linkage in ISA translation units] and Note [OpenMP outside the ISA kernels] in
// kernels_impl.h: everything here has internal linkage and works on a slice [begin, end).
#pragma once
#include <cstdint>
#include <type_traits>

#include "../common/dtype.h"
#include "../common/optim_math.h"
#include "kernels_impl.h"
#include "optim_kernels.h"
#include "vec_scalar.h"

namespace ncclavg {
namespace cpu {
namespace {

#define NCCLAVG_OPT_INLINE inline __attribute__((always_inline))

// Note [Local copies of the kernel arguments]
// The lane types store through may_alias vector types (the intrinsics' definition), so after each store
// GCC must assume any memory changed, including slice and coefficient structs reached by reference: it
// would reload every pointer and scalar on every iteration. The loops therefore take them by value
// (locals whose address never escapes), and those stay in registers.

// Note [Software prefetch in the optimizer loops]
// A step streams 4-8 arrays at once. With one core per memory stream group, the hardware prefetchers
// and the out-of-order window alone keep too few cache lines in flight (the loop body is long: two
// divisions and a square root per lane), and a single core reaches ~85% of the bandwidth it gets with
// explicit prefetches a few KiB ahead (measured on a Sapphire Rapids Xeon: 16M params, one thread,
// 16.5 -> 15.0 ms; DeepSpeed's cpu_adam 15.5 ms; torch fused 17 ms). Prefetches never fault, so
// running past the end of an array is harmless. NCCLAVG_OPTIM_PREFETCH=0 at build time turns them off.
#ifndef NCCLAVG_OPTIM_PREFETCH
#define NCCLAVG_OPTIM_PREFETCH 1024
#endif
constexpr int64_t kPrefetchElems = NCCLAVG_OPTIM_PREFETCH;

template <class T>
constexpr int64_t storage_bytes() {
  return std::is_same_v<T, F32> ? 4 : 2;
}

// Prefetches element i + kPrefetchElems of every tower's gradient (reads).
template <class T>
NCCLAVG_OPT_INLINE void prefetch_grads(const GradSlice& g, int64_t i) {
  if constexpr (kPrefetchElems > 0) {
    const int64_t off = (i + kPrefetchElems) * storage_bytes<T>();
    for (int k = 0; k < g.n; ++k) __builtin_prefetch(static_cast<const char*>(g.towers[k]) + off, 0);
  }
}

// Prefetches element i + kPrefetchElems of fp32 state the loop reads and then writes.
NCCLAVG_OPT_INLINE void prefetch_rw(const float* p, int64_t i) {
  if constexpr (kPrefetchElems > 0) {
    if (p != nullptr) __builtin_prefetch(p + i + kPrefetchElems, 1);
  }
}

// Storage tag for "no copy-out".
struct NoOut {};

// WideOps<L>: a lane of doubles as wide as L's lane of floats (see Note [Exact tower mean]):
//   using T = ...;  static void widen(typename L::V v, T& out);  static typename L::V narrow(const T& w);
// T supports + * (T), * / (double) and lane(q). Defined here for ScalarLane; each SIMD TU specialises it
// with its ISA's conversion intrinsics (GCC's generic vectors wider than a register compile to stack
// shuffles). Passed by reference: by value, GCC notes an ABI change for vectors over 32 bytes.
template <class L>
struct WideOps;

struct WideScalar {
  double x;
  NCCLAVG_OPT_INLINE WideScalar operator+(const WideScalar& o) const { return {x + o.x}; }
  NCCLAVG_OPT_INLINE WideScalar operator*(const WideScalar& o) const { return {x * o.x}; }
  NCCLAVG_OPT_INLINE WideScalar operator*(double d) const { return {x * d}; }
  NCCLAVG_OPT_INLINE WideScalar operator/(double d) const { return {x / d}; }
  NCCLAVG_OPT_INLINE double lane(int) const { return x; }
};

// Two native double vectors holding the low and high halves of a float lane.
template <class D>
struct WidePair {
  D lo, hi;
  NCCLAVG_OPT_INLINE WidePair operator+(const WidePair& o) const { return {lo + o.lo, hi + o.hi}; }
  NCCLAVG_OPT_INLINE WidePair operator*(const WidePair& o) const { return {lo * o.lo, hi * o.hi}; }
  NCCLAVG_OPT_INLINE WidePair operator*(double d) const { return {lo * d, hi * d}; }
  NCCLAVG_OPT_INLINE WidePair operator/(double d) const { return {lo / d, hi / d}; }
  NCCLAVG_OPT_INLINE double lane(int q) const {
    constexpr int H = sizeof(D) / sizeof(double);
    return q < H ? lo[q] : hi[q - H];
  }
};

template <>
struct WideOps<ScalarLane> {
  using T = WideScalar;
  static NCCLAVG_OPT_INLINE void widen(float v, T& out) { out.x = static_cast<double>(v); }
  static NCCLAVG_OPT_INLINE float narrow(const T& w) { return static_cast<float>(w.x); }
};

template <class L>
struct LaneSqrt {
  NCCLAVG_OPT_INLINE typename L::V operator()(typename L::V x) const { return L::sqrt(x); }
};

// How the tower sum becomes the mean, decided once per slice: dividing by a power of two is multiplying
// by its exact inverse, and a multiply is ~10x cheaper than a double division.
struct MeanCoef {
  double n;
  double inv;
  bool pow2;
  explicit MeanCoef(int towers)
      : n(static_cast<double>(towers)), inv(1.0 / towers), pow2((towers & (towers - 1)) == 0) {}
};

// Mean of the towers' gradients at element i, rounded to float once. See Note [Exact tower mean].
template <class L, class T, bool Multi>
NCCLAVG_OPT_INLINE typename L::V tower_mean(const GradSlice& g, const MeanCoef& mc, int64_t i) {
  if constexpr (!Multi) {
    return ld<L>(T{}, g.towers[0], i);
  } else {
    using WO = WideOps<L>;
    typename WO::T acc, x;
    WO::widen(ld<L>(T{}, g.towers[0], i), acc);
    for (int k = 1; k < g.n; ++k) {
      WO::widen(ld<L>(T{}, g.towers[k], i), x);
      acc = acc + x;
    }
    return WO::narrow(mc.pow2 ? acc * mc.inv : acc / mc.n);
  }
}

template <class L, class T, bool Multi>
NCCLAVG_OPT_INLINE typename L::V effective_grad(const GradSlice& g, const MeanCoef& mc, const om::GradCoef& gc,
                                                int64_t i) {
  return om::scale_grad(tower_mean<L, T, Multi>(g, mc, i), gc);
}

// Calls f(tag, multi) with the storage tag of the gradients and whether several towers are averaged.
template <class Fn>
NCCLAVG_OPT_INLINE void with_grad(const GradSlice& g, Fn&& f) {
  with_storage(g.dtype, [&](auto tag) {
    if (g.n == 1) f(tag, std::false_type{});
    else f(tag, std::true_type{});
  });
}

template <class Fn>
NCCLAVG_OPT_INLINE void with_out(const OutSlice& o, Fn&& f) {
  if (o.out == nullptr) f(NoOut{});
  else with_storage(o.dtype, f);
}

template <class L, class O>
NCCLAVG_OPT_INLINE void store_out(const OutSlice& o, int64_t i, typename L::V p) {
  if constexpr (!std::is_same_v<O, NoOut>) st<L>(O{}, o.out, i, p);
}

// ---- squared norm of the effective gradient. See Note [Norm reduction independent of the SIMD level].

template <class L, class T, bool Multi>
double grad_sumsq_impl(const GradSlice g, const om::GradCoef gc, int64_t begin, int64_t end) {
  constexpr int K = 16 / L::W;
  static_assert(K * L::W == 16, "lane width must divide 16");
  using WO = WideOps<L>;
  using WV = typename WO::T;
  const MeanCoef mc(g.n);
  WV acc[K], zero;
  WO::widen(L::set1(0.0f), zero);
  for (int k = 0; k < K; ++k) acc[k] = zero;
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    prefetch_grads<T>(g, i);
    for (int k = 0; k < K; ++k) {
      WV d;
      WO::widen(effective_grad<L, T, Multi>(g, mc, gc, i + k * L::W), d);
      acc[k] = acc[k] + d * d;
    }
  }
  double tail[16] = {};
  for (int j = 0; i < end; ++i, ++j) {
    const double d = effective_grad<ScalarLane, T, Multi>(g, mc, gc, i);
    tail[j] = d * d;
  }
  double total = 0.0;
  for (int q = 0; q < 16; ++q) total = total + (acc[q / L::W].lane(q % L::W) + tail[q]);
  return total;
}

template <class L>
double grad_sumsq_range(const GradSlice& g, const om::GradCoef& gc, int64_t begin, int64_t end) {
  double r = 0.0;
  with_grad(g, [&](auto tag, auto multi) {
    r = grad_sumsq_impl<L, decltype(tag), decltype(multi)::value>(g, gc, begin, end);
  });
  return r;
}

// ---- Adam / AdamW

template <class L, class T, class O, bool Multi>
NCCLAVG_OPT_INLINE void adam_elem(const AdamSlice& s, const GradSlice& g, const MeanCoef& mc, const OutSlice& o,
                                  const om::AdamCoef& c, const om::GradCoef& gc, int64_t i) {
  using V = typename L::V;
  const V gv = effective_grad<L, T, Multi>(g, mc, gc, i);
  V p = L::load_f32(s.param + i);
  V m = L::load_f32(s.exp_avg + i);
  V v = L::load_f32(s.exp_avg_sq + i);
  V vmax = c.amsgrad ? L::load_f32(s.max_exp_avg_sq + i) : v;
  om::adam_update(p, m, v, vmax, gv, c, LaneSqrt<L>{});
  L::store_f32(s.param + i, p);
  L::store_f32(s.exp_avg + i, m);
  L::store_f32(s.exp_avg_sq + i, v);
  if (c.amsgrad) L::store_f32(s.max_exp_avg_sq + i, vmax);
  store_out<L, O>(o, i, p);
}

// By-value parameters: see Note [Local copies of the kernel arguments].
template <class L, class T, class O, bool Multi>
void adam_loop(const AdamSlice s, const GradSlice g, const OutSlice o, const om::AdamCoef c, const om::GradCoef gc,
              int64_t begin, int64_t end) {
  const MeanCoef mc(g.n);
  int64_t i = begin;
  for (; i + L::W <= end; i += L::W) {  // See Note [Software prefetch in the optimizer loops].
    prefetch_grads<T>(g, i);
    prefetch_rw(s.param, i);
    prefetch_rw(s.exp_avg, i);
    prefetch_rw(s.exp_avg_sq, i);
    if (c.amsgrad) prefetch_rw(s.max_exp_avg_sq, i);
    adam_elem<L, T, O, Multi>(s, g, mc, o, c, gc, i);
  }
  for (; i < end; ++i) adam_elem<ScalarLane, T, O, Multi>(s, g, mc, o, c, gc, i);
}

template <class L>
void adam_range(const AdamSlice& s, const GradSlice& g, const OutSlice& o, const om::AdamCoef& c,
                const om::GradCoef& gc, int64_t begin, int64_t end) {
  with_grad(g, [&](auto tag, auto multi) {
    with_out(o, [&](auto otag) {
      adam_loop<L, decltype(tag), decltype(otag), decltype(multi)::value>(s, g, o, c, gc, begin, end);
    });
  });
}

// ---- SGD (momentum, dampening, Nesterov)

template <class L, class T, class O, bool Multi>
NCCLAVG_OPT_INLINE void sgd_elem(const SgdSlice& s, const GradSlice& g, const MeanCoef& mc, const OutSlice& o,
                                 const om::SgdCoef& c, const om::GradCoef& gc, int64_t i) {
  using V = typename L::V;
  const V gv = effective_grad<L, T, Multi>(g, mc, gc, i);
  V p = L::load_f32(s.param + i);
  V b = (c.momentum_on && !c.first) ? L::load_f32(s.momentum_buffer + i) : gv;
  om::sgd_update(p, b, gv, c);
  L::store_f32(s.param + i, p);
  if (c.momentum_on) L::store_f32(s.momentum_buffer + i, b);
  store_out<L, O>(o, i, p);
}

// By-value parameters: see Note [Local copies of the kernel arguments].
template <class L, class T, class O, bool Multi>
void sgd_loop(const SgdSlice s, const GradSlice g, const OutSlice o, const om::SgdCoef c, const om::GradCoef gc,
             int64_t begin, int64_t end) {
  const MeanCoef mc(g.n);
  int64_t i = begin;
  for (; i + L::W <= end; i += L::W) {  // See Note [Software prefetch in the optimizer loops].
    prefetch_grads<T>(g, i);
    prefetch_rw(s.param, i);
    if (c.momentum_on && !c.first) prefetch_rw(s.momentum_buffer, i);
    sgd_elem<L, T, O, Multi>(s, g, mc, o, c, gc, i);
  }
  for (; i < end; ++i) sgd_elem<ScalarLane, T, O, Multi>(s, g, mc, o, c, gc, i);
}

template <class L>
void sgd_range(const SgdSlice& s, const GradSlice& g, const OutSlice& o, const om::SgdCoef& c,
               const om::GradCoef& gc, int64_t begin, int64_t end) {
  with_grad(g, [&](auto tag, auto multi) {
    with_out(o, [&](auto otag) {
      sgd_loop<L, decltype(tag), decltype(otag), decltype(multi)::value>(s, g, o, c, gc, begin, end);
    });
  });
}

// ---- fp32 -> storage dtype copy (the copy-out without an update)

template <class L>
void cast_range(const float* src, void* dst, DType dtype, int64_t begin, int64_t end) {
  with_storage(dtype, [&](auto tag) {
    using T = decltype(tag);
    int64_t i = begin;
    for (; i + L::W <= end; i += L::W) st<L>(T{}, dst, i, L::load_f32(src + i));
    for (; i < end; ++i) st<ScalarLane>(T{}, dst, i, ScalarLane::load_f32(src + i));
  });
}

#undef NCCLAVG_OPT_INLINE

}  // namespace
}  // namespace cpu
}  // namespace ncclavg

// The table of one ISA; a constant initializer (see the same remark in kernels_impl.h).
#define NCCLAVG_OPTIM_KERNEL_TABLE(Lane, level) \
  { level, &grad_sumsq_range<Lane>, &adam_range<Lane>, &sgd_range<Lane>, &cast_range<Lane> }
