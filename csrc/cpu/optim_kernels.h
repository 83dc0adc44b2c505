// The optimizer kernel family: one table per ISA (optim_{scalar,avx2,avx512}.cpp, all built from
// optim_impl.h), chosen at run time by the same SIMD level as the average kernels (see Note [Run-time ISA
// dispatch] in simd.h). Every entry works on the element slice [begin, end) of one tensor; the OpenMP
// loops live in the dispatcher optim.cpp (see Note [OpenMP outside the ISA kernels]).
#pragma once
#include <cstdint>

#include "../common/dtype.h"
#include "../common/optim_math.h"
#include "simd.h"

namespace ncclavg {
namespace cpu {

// The gradient of one tensor: `n` tower buffers of one dtype, averaged on the fly.
// See Note [Exact tower mean].
struct GradSlice {
  const void* const* towers;  // n base pointers (element 0 of the tensor in each tower)
  int n;
  DType dtype;
};

// Optional copy-out of the updated fp32 params (the H2D staging buffer); out == nullptr: none.
struct OutSlice {
  void* out;
  DType dtype;
};

struct AdamSlice {
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // amsgrad only, else nullptr
};

struct SgdSlice {
  float* param;
  float* momentum_buffer;  // nullptr when momentum == 0
};

// Note [Norm reduction independent of the SIMD level]
// grad_sumsq accumulates squares in double into 16 accumulators indexed by (i - begin) % 16, whatever the
// lane width (one 16-wide, two 8-wide or sixteen scalar accumulators; tail elements go to 16 more scalar
// ones), and adds them up in a fixed order. Slices start at multiples of 16, and the dispatcher adds the
// per-slice sums in slice order, so the norm -- and the clip factor derived from it -- is bit-identical
// at every SIMD level and for every thread count.
struct OptimKernelTable {
  SimdLevel level;
  // Sum over [begin, end) of g*g in double, g = scale_grad(mean of towers, gc) in float.
  double (*grad_sumsq)(const GradSlice& g, const om::GradCoef& gc, int64_t begin, int64_t end);
  // The updates. sumsq != nullptr: also the slice's grad_sumsq with gc.clip taken as 1, in the same
  // accumulation order (bit-identical; see Note [The inf/NaN check as a scan] in optim.cpp).
  void (*adam)(const AdamSlice& s, const GradSlice& g, const OutSlice& o, const om::AdamCoef& c,
               const om::GradCoef& gc, int64_t begin, int64_t end, double* sumsq);
  void (*sgd)(const SgdSlice& s, const GradSlice& g, const OutSlice& o, const om::SgdCoef& c,
              const om::GradCoef& gc, int64_t begin, int64_t end, double* sumsq);
  // dst[i] = src[i] rounded to dtype (round to nearest even; the rule of the fused copy-out).
  void (*cast)(const float* src, void* dst, DType dtype, int64_t begin, int64_t end);
  // Whether every tower's raw gradient over [begin, end) is finite (no inf/NaN bit pattern).
  bool (*all_finite)(const GradSlice& g, int64_t begin, int64_t end);
};

extern const OptimKernelTable kScalarOptimKernels;
#if defined(__x86_64__)
extern const OptimKernelTable kAvx2OptimKernels;
extern const OptimKernelTable kAvx512OptimKernels;
#elif defined(__aarch64__)
extern const OptimKernelTable kNeonOptimKernels;
extern const OptimKernelTable kSveOptimKernels;
#endif

// The table of the current SIMD level (NCCLAVG_SIMD / set_simd_level, as for the average kernels).
const OptimKernelTable& optim_kernels();

}  // namespace cpu
}  // namespace ncclavg
