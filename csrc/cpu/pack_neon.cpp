// NEON (Advanced SIMD) instance of the pack kernel. See Note [Run-time ISA dispatch] and kernels_neon.cpp.
#include "pack.h"

#include "vec_neon.h"
#include "pack_impl.h"

namespace ncclavg {
namespace cpu {
constexpr PackKernelTable kNeonPackKernels = NCCLAVG_PACK_TABLE(NeonLane, SimdLevel::kNeon);
}  // namespace cpu
}  // namespace ncclavg
