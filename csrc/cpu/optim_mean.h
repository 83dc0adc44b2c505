// The mean of N tower gradients inside the optimizer kernels (see Note [Exact tower mean] in
// csrc/common/optim_math.h): the float64 path every level can take, and the float32 shortcut the SIMD
// levels take for 16-bit gradients whenever it gives the same bits. Included by optim_impl.h only; the
// ISA translation units specialise WideOps and RawOps (see optim_x86.h).
#pragma once
#include <cstdint>
#include <type_traits>

#include "../common/dtype.h"
#include "kernels_impl.h"
#include "optim_kernels.h"
#include "vec_scalar.h"

#ifndef NCCLAVG_OPT_INLINE
#define NCCLAVG_OPT_INLINE inline __attribute__((always_inline))
#endif

namespace ncclavg {
namespace cpu {
namespace {

// Elements per block of the vector loops: 16 floats are one cache line of fp32 state, one AVX-512
// vector, two AVX2 vectors. See Note [Norm reduction independent of the SIMD level] for why the norm
// accumulators are laid out by (i - begin) % 16 too.
constexpr int kBlock = 16;

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

// RawOps<L>: the float32 shortcut of Note [Float32 tower mean when it is exact] on one block of 16
// elements of 16-bit gradients. The scalar level has none (kFast = false): it is the reference, and
// the SIMD tails use it. optim_x86.h defines it for the AVX2 and AVX-512 lanes:
//   static bool mean16(Tag, const void* const* towers, int n, int64_t i, const MeanPlan&, L::V out[K]);
template <class L>
struct RawOps {
  static constexpr bool kFast = false;
};

// Note [Float32 tower mean when it is exact]
// Widening every tower's lanes to float64 and narrowing the mean back costs more than the whole AdamW
// update on AVX2 (the conversions run on few ports). For bfloat16 and float16 gradients a float32 sum
// is usually exact, and then it gives the float64 path's bits:
// - Every input is an integer multiple of U, the ulp of the smallest nonzero one, and every partial sum
//   P is smaller than n * 2^(e_max + 1) (e_max: exponent of the largest). With p significant bits per
//   input (8 for bfloat16, 11 for float16), |P| / U < n * 2^(e_max - e_min + p), where e_min is the
//   exponent of the smallest nonzero input (subnormals count as the smallest normal exponent: same
//   ulp). When e_max - e_min <= 24 - p - ceil(log2 n), |P| / U < 2^24: every partial sum, in any
//   order, is a float32 (no overflow either, given the cap on e_max below), so the float32 sum S is the
//   exact sum, which is also what the float64 sum gives.
// - The float64 path returns RN32(RN64(S / n)); the shortcut returns RN32(S / n) (a product by the exact
//   1/n when n is a power of two, a correctly rounded division otherwise). They differ only if
//   RN64(S / n) is a float32 midpoint m while S / n is not. But S - n*m is a multiple of 2^(E - 24),
//   E the exponent of S / n (m is a multiple of 2^(E - 24); S, at least as large, of 2^(E - 23)), so
//   when nonzero, |S / n - m| >= 2^(E - 24) / n, far more than float64's half ulp 2^(E - 53) for any
//   n <= 4096 (the tower limit). In the float32 subnormal range, m and S are multiples of 2^-150 and
//   the same argument holds.
// - Caps: e_max <= 254 - ceil(log2 n) for bfloat16 keeps n * 2^(e_max + 1) within float32's range;
//   e_max < all-ones excludes inf/NaN (their propagation would depend on operand order). For bfloat16,
//   e_min >= 8 (2^-119) keeps every nonzero partial sum and every input a normal float32, so flushing
//   subnormals (FTZ/DAZ, set by torch.set_flush_denormal) treats both paths alike.
// The check runs on the raw 16-bit lanes: the largest magnitude, and the smallest magnitude minus one
// (a zero wraps to 0xffff and drops out; a power of two reads one exponent lower, which only makes the
// check stricter). A block of 16 elements that fails it (an input more than ~2^13 times smaller than
// another at the same index, inf/NaN, tiny values) takes the float64 path: rare for real gradients,
// and correct either way.
struct MeanPlan {
  int n;
  double n_d;     // the float64 path: sum / n, or
  double inv_d;   // sum * (1/n) when n is a power of two (exact)
  bool pow2;
  float n_f;      // the float32 shortcut: the same with floats (1/n exact as a float for n <= 2^24)
  float inv_f;
  bool fast;      // the shortcut applies (16-bit dtype, a SIMD level, thresholds >= 0)
  uint16_t shift;      // exponent position in the 16-bit pattern: 7 (bfloat16) or 10 (float16)
  uint16_t max_spread; // 24 - p - ceil(log2 n)
  uint16_t max_exp;    // largest exponent field allowed
  uint16_t min_exp;    // smallest exponent field of a nonzero input allowed (bfloat16: 8)

  MeanPlan(int towers, DType dtype, bool simd) {
    n = towers;
    n_d = static_cast<double>(towers);
    inv_d = 1.0 / towers;
    pow2 = (towers & (towers - 1)) == 0;
    n_f = static_cast<float>(towers);
    inv_f = static_cast<float>(inv_d);
    int log2n = 0;
    while ((1 << log2n) < towers) ++log2n;
    const bool bf16 = dtype == DType::kBFloat16;
    const int spread = (bf16 ? 16 : 13) - log2n;
    fast = simd && towers > 1 && dtype != DType::kFloat32 && spread >= 0;
    shift = bf16 ? 7 : 10;
    max_spread = static_cast<uint16_t>(spread < 0 ? 0 : spread);
    max_exp = static_cast<uint16_t>(bf16 ? 254 - log2n : 30);
    min_exp = bf16 ? 8 : 0;
  }
};

// Mean of the towers' gradients at element i through float64, rounded to float once. See Note [Exact
// tower mean].
template <class L, class T, bool Multi>
NCCLAVG_OPT_INLINE typename L::V tower_mean(const GradSlice& g, const MeanPlan& mp, int64_t i) {
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
    return WO::narrow(mp.pow2 ? acc * mp.inv_d : acc / mp.n_d);
  }
}

// The mean of one block of kBlock elements at i, as kBlock / L::W vectors.
template <class L, class T, bool Multi>
NCCLAVG_OPT_INLINE void block_mean(const GradSlice& g, const MeanPlan& mp, int64_t i,
                                   typename L::V (&out)[kBlock / L::W]) {
  constexpr int K = kBlock / L::W;
  if constexpr (Multi && RawOps<L>::kFast && !std::is_same_v<T, F32>) {
    if (mp.fast && __builtin_expect(RawOps<L>::mean16(T{}, g.towers, g.n, i, mp, out), 1)) return;
  }
  for (int k = 0; k < K; ++k) out[k] = tower_mean<L, T, Multi>(g, mp, i + k * L::W);
}

}  // namespace
}  // namespace cpu
}  // namespace ncclavg
