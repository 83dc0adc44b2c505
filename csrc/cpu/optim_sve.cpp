// The optimizer kernels of the SVE level: the NEON lanes. This family's 16-element blocks and their
// norm accumulators need a compile-time width (see Note [SVE kernels without a compile-time width] in
// sve_impl.h), and every SVE CPU has Advanced SIMD. No target pragma: the shared element math
// (common/optim_math.h, included by optim_kernels.h) is compiled for the baseline, and GCC refuses to
// inline the lanes of a wider target into it.
#include "optim_kernels.h"

#include "vec_neon.h"
#include "optim_impl.h"
#include "optim_neon.h"

namespace ncclavg {
namespace cpu {
constexpr OptimKernelTable kSveOptimKernels = NCCLAVG_OPTIM_KERNEL_TABLE(NeonLane, SimdLevel::kSve);
}  // namespace cpu
}  // namespace ncclavg
