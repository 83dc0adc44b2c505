// NEON (Advanced SIMD) instance of the optimizer kernels. See Note [Run-time ISA dispatch] and
// kernels_neon.cpp.
#include "optim_kernels.h"

#include "vec_neon.h"
#include "optim_impl.h"
#include "optim_neon.h"

namespace ncclavg {
namespace cpu {
constexpr OptimKernelTable kNeonOptimKernels = NCCLAVG_OPTIM_KERNEL_TABLE(NeonLane, SimdLevel::kNeon);
}  // namespace cpu
}  // namespace ncclavg
