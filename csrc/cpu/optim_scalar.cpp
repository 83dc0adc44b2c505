// Scalar instance of the optimizer kernels: always compiled, runs everywhere, the reference for the
// SIMD levels (tests compare them bit for bit).
#include "optim_kernels.h"

#include "optim_impl.h"

namespace ncclavg {
namespace cpu {
constexpr OptimKernelTable kScalarOptimKernels = NCCLAVG_OPTIM_KERNEL_TABLE(ScalarLane, SimdLevel::kScalar);
}  // namespace cpu
}  // namespace ncclavg
