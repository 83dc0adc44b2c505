// The optimizer kernels, written once over a lane type L (ScalarLane, Avx2Lane, Avx512Lane) and compiled
// once per ISA by optim_{scalar,avx2,avx512}.cpp. The element math is om::adam_update / om::sgd_update
// (csrc/common/optim_math.h) and the tower mean is optim_mean.h's; this file only moves data: it loads
// the tower gradients and the fp32 state with the lane type's loads, calls the math, stores the state
// and the optional copy-out. Vector body over blocks of 16 elements, scalar tail with ScalarLane and the
// same math.
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
#include "optim_mean.h"
#include "vec_scalar.h"

namespace ncclavg {
namespace cpu {
namespace {

// Note [Local copies of the kernel arguments]
// The lane types store through may_alias vector types (the intrinsics' definition), so after each store
// GCC must assume any memory changed, including slice and coefficient structs reached by reference: it
// would reload every pointer and scalar on every iteration. The loops therefore take them by value
// (locals whose address never escapes), and those stay in registers.

// Note [Software prefetch in the optimizer loops]
// A step streams 4-10 arrays at once. With one core per memory stream group, the hardware prefetchers
// and the out-of-order window alone keep too few cache lines in flight (the loop body is long: two
// divisions and a square root per lane), and a single core reaches ~85% of the bandwidth it gets with
// explicit prefetches a few KiB ahead (measured on a Sapphire Rapids Xeon: 16M params, one thread,
// 16.5 -> 15.0 ms; DeepSpeed's cpu_adam 15.5 ms; torch fused 17 ms). One prefetch per cache line and
// stream: a block of 16 elements is one line of fp32 state, half a line of 16-bit data (prefetched
// every other block). A prefetch per vector instead cost the AVX2 loop ~20% with 8 towers (each one is
// a load-port instruction). Prefetches never fault, so running past the end of an array is harmless.
// NCCLAVG_OPTIM_PREFETCH=0 at build time turns them off.
#ifndef NCCLAVG_OPTIM_PREFETCH
#define NCCLAVG_OPTIM_PREFETCH 1024
#endif
constexpr int64_t kPrefetchElems = NCCLAVG_OPTIM_PREFETCH;

template <class T>
constexpr int64_t storage_bytes() {
  return std::is_same_v<T, F32> ? 4 : 2;
}

// Whether the block at i starts a cache line's worth of T (16-bit streams: every other block).
template <class T>
NCCLAVG_OPT_INLINE bool line_start(int64_t i) {
  return storage_bytes<T>() == 4 || (i & kBlock) == 0;
}

// Prefetches element i + kPrefetchElems of every tower's gradient (reads), once per line.
template <class T>
NCCLAVG_OPT_INLINE void prefetch_grads(const GradSlice& g, int64_t i) {
  if constexpr (kPrefetchElems > 0) {
    if (!line_start<T>(i)) return;
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

template <class L>
struct LaneSqrt {
  NCCLAVG_OPT_INLINE typename L::V operator()(typename L::V x) const { return L::sqrt(x); }
};

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

// The copy-out of one element (tails) and of one block. BlockStore<L> is the generic block store; an ISA
// TU may specialise it (AVX2 packs two vectors of bfloat16 into one store).
template <class L, class O>
NCCLAVG_OPT_INLINE void store_out(const OutSlice& o, int64_t i, typename L::V p) {
  if constexpr (!std::is_same_v<O, NoOut>) st<L>(O{}, o.out, i, p);
}

template <class L>
struct BlockStore {
  template <class O>
  static NCCLAVG_OPT_INLINE void out(const OutSlice& o, int64_t i, const typename L::V (&p)[kBlock / L::W]) {
    for (int k = 0; k < kBlock / L::W; ++k) store_out<L, O>(o, i + k * L::W, p[k]);
  }
};

// ---- squared norm of the effective gradient. See Note [Norm reduction independent of the SIMD level].

// The accumulators of grad_sumsq: 16 doubles by (i - begin) % 16 in the vector body (K wide lanes),
// 16 more for the tail, added up in a fixed order.
template <class L>
struct NormAcc {
  static constexpr int K = kBlock / L::W;
  static_assert(K * L::W == kBlock, "lane width must divide 16");
  using WO = WideOps<L>;
  typename WO::T acc[K];
  double tail[kBlock] = {};
  NormAcc() {
    typename WO::T zero;
    WO::widen(L::set1(0.0f), zero);
    for (int k = 0; k < K; ++k) acc[k] = zero;
  }
  NCCLAVG_OPT_INLINE void add(int k, typename L::V g) {
    typename WO::T d;
    WO::widen(g, d);
    acc[k] = acc[k] + d * d;
  }
  NCCLAVG_OPT_INLINE void add_tail(int j, float g) {
    const double d = g;
    tail[j] = d * d;
  }
  NCCLAVG_OPT_INLINE double total() const {
    double t = 0.0;
    for (int q = 0; q < kBlock; ++q) t = t + (acc[q / L::W].lane(q % L::W) + tail[q]);
    return t;
  }
};

template <class L, class T, bool Multi>
double grad_sumsq_impl(const GradSlice g, const om::GradCoef gc, int64_t begin, int64_t end) {
  constexpr int K = kBlock / L::W;
  const MeanPlan mp(g.n, g.dtype, L::W > 1);
  NormAcc<L> na;
  int64_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {
    prefetch_grads<T>(g, i);
    typename L::V mean[K];
    block_mean<L, T, Multi>(g, mp, i, mean);
    for (int k = 0; k < K; ++k) na.add(k, om::scale_grad(mean[k], gc));
  }
  for (int j = 0; i < end; ++i, ++j) na.add_tail(j, om::scale_grad(tower_mean<ScalarLane, T, Multi>(g, mp, i), gc));
  return na.total();
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

// Note [Unit gradient scale in Adam]
// Without a loss scale or clipping (bfloat16 training), both factors of om::scale_grad are 1 and the
// Adam loop skips the two products (Unit). x * 1 is x for every float but a signalling NaN, which it
// quiets; Adam's gradient only ever enters arithmetic (g - m, (c*g)*g, g + l2*p), which quiets it the
// same way, so the stored bits cannot differ. SGD stores g itself as the first momentum buffer, so it
// keeps the products.

// Which adam update a loop runs: om::adam_update with the run-time flags, or om::adam_update_plain
// (Note [Adam's common configuration]) with or without the decoupled decay.
enum class AdamForm { kGeneral, kPlainDecay, kPlain };

// One element vector: the mean `mean` becomes the update's gradient, then the update of lanes
// [i, i + W). om::scale_grad in two steps: `t`, the unclipped gradient, is the norm's term (maximize's
// sign squares out).
template <class L, bool Unit, AdamForm F>
NCCLAVG_OPT_INLINE typename L::V adam_lanes(const AdamSlice& s, typename L::V mean, const om::AdamCoef& c,
                                            const om::GradCoef& gc, int64_t i, typename L::V& t) {
  using V = typename L::V;
  t = Unit ? mean : mean * gc.inv_scale;
  const V gv = Unit ? t : t * gc.clip;
  V p = L::load_f32(s.param + i);
  V m = L::load_f32(s.exp_avg + i);
  V v = L::load_f32(s.exp_avg_sq + i);
  if constexpr (F == AdamForm::kGeneral) {
    V vmax = c.amsgrad ? L::load_f32(s.max_exp_avg_sq + i) : v;
    om::adam_update(p, m, v, vmax, gv, c, LaneSqrt<L>{});
    if (c.amsgrad) L::store_f32(s.max_exp_avg_sq + i, vmax);
  } else {
    om::adam_update_plain<F == AdamForm::kPlainDecay>(p, m, v, gv, c, LaneSqrt<L>{});
  }
  L::store_f32(s.param + i, p);
  L::store_f32(s.exp_avg + i, m);
  L::store_f32(s.exp_avg_sq + i, v);
  return p;
}

// By-value parameters: see Note [Local copies of the kernel arguments]. The norm is a run-time choice
// (a predicted branch per vector); the rest is compiled in.
template <class L, class T, class O, bool Multi, bool Unit, AdamForm F>
void adam_loop(const AdamSlice s, const GradSlice g, const OutSlice o, const om::AdamCoef c, const om::GradCoef gc,
               int64_t begin, int64_t end, double* sumsq) {
  constexpr int K = kBlock / L::W;
  const MeanPlan mp(g.n, g.dtype, L::W > 1);
  const bool norm = sumsq != nullptr;
  NormAcc<L> na;
  int64_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {  // See Note [Software prefetch in the optimizer loops].
    prefetch_grads<T>(g, i);
    prefetch_rw(s.param, i);
    prefetch_rw(s.exp_avg, i);
    prefetch_rw(s.exp_avg_sq, i);
    if (F == AdamForm::kGeneral && c.amsgrad) prefetch_rw(s.max_exp_avg_sq, i);
    typename L::V mean[K], p[K];
    block_mean<L, T, Multi>(g, mp, i, mean);
    for (int k = 0; k < K; ++k) {
      typename L::V t;
      p[k] = adam_lanes<L, Unit, F>(s, mean[k], c, gc, i + k * L::W, t);
      if (norm) na.add(k, t);
    }
    BlockStore<L>::template out<O>(o, i, p);
  }
  for (int j = 0; i < end; ++i, ++j) {
    float t;
    const float p = adam_lanes<ScalarLane, Unit, F>(s, tower_mean<ScalarLane, T, Multi>(g, mp, i), c, gc, i, t);
    na.add_tail(j, t);
    store_out<ScalarLane, O>(o, i, p);
  }
  if (norm) *sumsq = na.total();
}

template <class L>
void adam_range(const AdamSlice& s, const GradSlice& g, const OutSlice& o, const om::AdamCoef& c,
                const om::GradCoef& gc, int64_t begin, int64_t end, double* sumsq) {
  with_grad(g, [&](auto tag, auto multi) {
    with_out(o, [&](auto otag) {
      using T = decltype(tag);
      using O = decltype(otag);
      constexpr bool M = decltype(multi)::value;
      if (!om::adam_is_plain(c)) {
        adam_loop<L, T, O, M, false, AdamForm::kGeneral>(s, g, o, c, gc, begin, end, sumsq);
        return;
      }
      // See Note [Unit gradient scale in Adam].
      const bool unit = gc.inv_scale == 1.0f && gc.clip == 1.0f;
      if (c.decoupled) {
        if (unit) adam_loop<L, T, O, M, true, AdamForm::kPlainDecay>(s, g, o, c, gc, begin, end, sumsq);
        else adam_loop<L, T, O, M, false, AdamForm::kPlainDecay>(s, g, o, c, gc, begin, end, sumsq);
      } else {
        if (unit) adam_loop<L, T, O, M, true, AdamForm::kPlain>(s, g, o, c, gc, begin, end, sumsq);
        else adam_loop<L, T, O, M, false, AdamForm::kPlain>(s, g, o, c, gc, begin, end, sumsq);
      }
    });
  });
}

// ---- SGD (momentum, dampening, Nesterov)

template <class L>
NCCLAVG_OPT_INLINE typename L::V sgd_lanes(const SgdSlice& s, typename L::V mean, const om::SgdCoef& c,
                                           const om::GradCoef& gc, int64_t i, typename L::V& t) {
  using V = typename L::V;
  t = mean * gc.inv_scale;  // om::scale_grad in two steps, as in adam_lanes
  const V gv = t * gc.clip;
  V p = L::load_f32(s.param + i);
  V b = (c.momentum_on && !c.first) ? L::load_f32(s.momentum_buffer + i) : gv;
  om::sgd_update(p, b, gv, c);
  L::store_f32(s.param + i, p);
  if (c.momentum_on) L::store_f32(s.momentum_buffer + i, b);
  return p;
}

// By-value parameters: see Note [Local copies of the kernel arguments].
template <class L, class T, class O, bool Multi>
void sgd_loop(const SgdSlice s, const GradSlice g, const OutSlice o, const om::SgdCoef c, const om::GradCoef gc,
              int64_t begin, int64_t end, double* sumsq) {
  constexpr int K = kBlock / L::W;
  const MeanPlan mp(g.n, g.dtype, L::W > 1);
  const bool norm = sumsq != nullptr;  // as in adam_loop
  NormAcc<L> na;
  int64_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {  // See Note [Software prefetch in the optimizer loops].
    prefetch_grads<T>(g, i);
    prefetch_rw(s.param, i);
    if (c.momentum_on && !c.first) prefetch_rw(s.momentum_buffer, i);
    typename L::V mean[K], p[K];
    block_mean<L, T, Multi>(g, mp, i, mean);
    for (int k = 0; k < K; ++k) {
      typename L::V t;
      p[k] = sgd_lanes<L>(s, mean[k], c, gc, i + k * L::W, t);
      if (norm) na.add(k, t);
    }
    BlockStore<L>::template out<O>(o, i, p);
  }
  for (int j = 0; i < end; ++i, ++j) {
    float t;
    const float p = sgd_lanes<ScalarLane>(s, tower_mean<ScalarLane, T, Multi>(g, mp, i), c, gc, i, t);
    na.add_tail(j, t);
    store_out<ScalarLane, O>(o, i, p);
  }
  if (norm) *sumsq = na.total();
}

template <class L>
void sgd_range(const SgdSlice& s, const GradSlice& g, const OutSlice& o, const om::SgdCoef& c,
               const om::GradCoef& gc, int64_t begin, int64_t end, double* sumsq) {
  with_grad(g, [&](auto tag, auto multi) {
    with_out(o, [&](auto otag) {
      using T = decltype(tag);
      using O = decltype(otag);
      sgd_loop<L, T, O, decltype(multi)::value>(s, g, o, c, gc, begin, end, sumsq);
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

// ---- the inf/NaN scan (see Note [The inf/NaN check as a scan] in optim.cpp)

// Nonzero iff one of x[begin, end) is an inf/NaN pattern (all exponent bits set, i.e. a sign-cleared
// pattern >= that of +inf): the sign-cleared pattern plus (top bit - inf) carries into the top bit
// exactly then. An OR-reduction of and/add, which GCC vectorises for any target, SSE2 included.
template <class U>
NCCLAVG_OPT_INLINE U inf_nan_bits(const U* x, int64_t begin, int64_t end, U inf) {
  constexpr U kMag = static_cast<U>(static_cast<U>(~U{0}) >> 1);  // (cast first: ~ promotes to int)
  constexpr U kTop = static_cast<U>(kMag + 1);
  const U bump = static_cast<U>(kTop - inf);
  U acc = 0;
  for (int64_t i = begin; i < end; ++i) acc |= static_cast<U>((x[i] & kMag) + bump);
  return static_cast<U>(acc & kTop);
}

template <class L, class U>
bool all_finite_typed(const GradSlice& g, int64_t begin, int64_t end, U inf) {
  // One cache line of every tower per step, each prefetched kPrefetchElems ahead, as the other loops
  // do (see Note [Software prefetch in the optimizer loops]): a run of lines per tower with a burst of
  // prefetches read ~25% slower. Generic vectors as wide as the level's register (16 bytes, SSE2, for
  // the scalar level): wider ones compile to stack traffic.
  constexpr int kBytes = L::W == 1 ? 16 : static_cast<int>(sizeof(typename L::V));
  typedef U Vec __attribute__((vector_size(kBytes)));
  constexpr int kPerLine = 64 / kBytes;
  constexpr int64_t kLine = 64 / sizeof(U);
  constexpr U kMag = static_cast<U>(static_cast<U>(~U{0}) >> 1);
  const U bump = static_cast<U>(kMag + 1 - inf);
  Vec acc = {};
  int64_t i = begin;
  for (; i + kLine <= end; i += kLine) {
    for (int k = 0; k < g.n; ++k) {
      const U* x = static_cast<const U*>(g.towers[k]) + i;
      if constexpr (kPrefetchElems > 0) __builtin_prefetch(x + kPrefetchElems, 0);
      for (int q = 0; q < kPerLine; ++q) {
        Vec v;
        __builtin_memcpy(&v, x + q * (kBytes / sizeof(U)), sizeof v);
        acc |= (v & kMag) + bump;
      }
    }
  }
  U any = 0;
  for (int q = 0; q < static_cast<int>(kBytes / sizeof(U)); ++q) any |= acc[q];
  for (int k = 0; k < g.n; ++k) any |= inf_nan_bits(static_cast<const U*>(g.towers[k]), i, end, inf);
  return (any & static_cast<U>(kMag + 1)) == 0;
}

template <class L>
bool all_finite_range(const GradSlice& g, int64_t begin, int64_t end) {
  switch (g.dtype) {
    case DType::kFloat32: return all_finite_typed<L, uint32_t>(g, begin, end, 0x7f800000u);
    case DType::kBFloat16: return all_finite_typed<L, uint16_t>(g, begin, end, 0x7f80u);
    case DType::kFloat16: return all_finite_typed<L, uint16_t>(g, begin, end, 0x7c00u);
  }
  return false;
}

}  // namespace
}  // namespace cpu
}  // namespace ncclavg

// The table of one ISA; a constant initializer (see the same remark in kernels_impl.h).
#define NCCLAVG_OPTIM_KERNEL_TABLE(Lane, level)                                                   \
  {                                                                                              \
    level, &grad_sumsq_range<Lane>, &adam_range<Lane>, &sgd_range<Lane>, &cast_range<Lane>,      \
        &all_finite_range<Lane>                                                                  \
  }
