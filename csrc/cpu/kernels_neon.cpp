// NEON (Advanced SIMD) instance of the CPU kernels. See Note [Run-time ISA dispatch]; Advanced SIMD is
// the aarch64 baseline, so no target pragma (and no Note [Internal linkage in ISA translation units]
// hazard for it: every aarch64 CPU runs its code).
#include "simd.h"

#include "vec_neon.h"
#include "kernels_impl.h"

namespace ncclavg {
namespace cpu {
constexpr KernelTable kNeonKernels = NCCLAVG_KERNEL_TABLE(NeonLane, SimdLevel::kNeon);
}  // namespace cpu
}  // namespace ncclavg
