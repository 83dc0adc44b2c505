// Scalar instance of the CPU kernels: always compiled, runs everywhere, the reference for the others.
#include "simd.h"

#include "kernels_impl.h"

namespace ncclavg {
namespace cpu {
constexpr KernelTable kScalarKernels = NCCLAVG_KERNEL_TABLE(ScalarLane, SimdLevel::kScalar);
}  // namespace cpu
}  // namespace ncclavg
