// Element math of the fused pack/unpack (copy + dtype cast + scale), shared by the CPU kernels (scalar
// and SIMD lanes) and the CUDA kernel, so the CPU tests exercise the arithmetic the GPU runs.
// See Note [Internal linkage in ISA translation units]: NCCLAVG_HD functions are `static` on the host.
#pragma once
#include "elementwise.h"

namespace ncclavg {
namespace ew {

// Note [Pack scale modes]
// y = x * mul / div, with each factor applied only when it is not 1. Averaging passes div = N rather
// than mul = 1/N: a division is correctly rounded for every N, so sum/N rounds once (1/N itself is
// inexact for N = 3, 5, 6, 7, ...). A loss-scale or clipping factor comes in as `mul`. The mode is a
// template parameter so the inner loops carry no branches; kPackMul | kPackDiv applies mul first.
enum PackMode : int { kPackCopy = 0, kPackMul = 1, kPackDiv = 2, kPackMulDiv = 3 };

template <int kMode, typename F>
NCCLAVG_HD F pack_scale(F x, float mul, float div) {
  if (kMode & kPackMul) x = x * mul;
  if (kMode & kPackDiv) x = x / div;
  return x;
}

NCCLAVG_HD int pack_mode(float mul, float div) {
  return (mul != 1.0f ? kPackMul : 0) | (div != 1.0f ? kPackDiv : 0);
}

}  // namespace ew
}  // namespace ncclavg
