// Scalar instance of the pack kernel: always compiled, runs everywhere, the reference for the others.
#include "pack.h"

#include "pack_impl.h"

namespace ncclavg {
namespace cpu {
constexpr PackKernelTable kScalarPackKernels = NCCLAVG_PACK_TABLE(ScalarLane, SimdLevel::kScalar);
}  // namespace cpu
}  // namespace ncclavg
